"""`treespec serve` end to end: one server subprocess on 127.0.0.1 (the bundled pycode pair,
float32), driven by the official openai client and by raw HTTP.

What is checked: completions and chat, streamed and not, equal to each other and to
`SpeculativeDecoder.generate()` of the same prompt and settings; stop strings with OpenAI's
meaning; concurrent seeded streams each equal to its solo output; a dropped stream freeing its
lane; a full queue answering 429; every bad request answered 4xx with OpenAI's error body while
the server keeps serving; a request failing inside the engine answered 500 alone; SIGTERM
letting an in-flight stream finish and exiting 0. The server is module-scoped; the SIGTERM
test runs last and stops it.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig  # noqa: E402
from treespec.output import TextStream, stop_prefix_len  # noqa: E402
from treespec.zoo import ZOO  # noqa: E402

from .servers import MAX_LIVE, MAX_QUEUE, openai_client, start_server  # noqa: E402

PROMPT = "def quicksort(xs):"
PROMPTS = ["def quicksort(xs):", "import os\n", "class Stack:\n", "for i in range("]
GREEDY = {"temperature": 0}
MODEL = "pycode"


@pytest.fixture(scope="module")
def ref():
    """The same pair in this process: what the server must reproduce."""
    return SpeculativeDecoder.from_pretrained(
        target=ZOO / "pycode" / "target", draft=ZOO / "pycode" / "draft", dtype="float32"
    )


DEFAULT_TREE = TreeConfig()


def solo(ref, prompt, n, temperature=0.0, seed=None, tree=DEFAULT_TREE, **kw):
    return ref.generate(
        prompt, max_new_tokens=n, tree=tree, sampling=SamplingConfig(temperature=temperature), seed=seed, **kw
    )


def metric(server, name: str) -> float:
    text = httpx.get(server["base"] + "/metrics").text
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def read_stream(stream) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, treespec stats) of a streamed completion or chat completion."""
    text, finish, stats = [], None, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text.append((c.delta.content or "") if hasattr(c, "delta") else c.text)
        finish = c.finish_reason or finish
        stats = (chunk.model_extra or {}).get("treespec") or stats
    return "".join(text), finish, stats


# ---- the endpoints --------------------------------------------------------------------------------
def test_health_models_metrics(server, client):
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["pycode"]
    text = httpx.get(server["base"] + "/metrics").text
    for name in (
        "treespec_requests_running",
        "treespec_requests_waiting",
        "treespec_kv_slots_used",
        "treespec_generated_tokens_total",
        "treespec_time_to_first_token_seconds_bucket",
        "treespec_inter_token_latency_seconds_bucket",
        'treespec_requests_total{finish_reason="cancelled"}',
    ):
        assert name in text


def test_completion_greedy_equals_generate_streamed_or_not(server, client, ref):
    want = solo(ref, PROMPT, 16)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        len(ref.tokenizer(PROMPT).input_ids),
        16,
    )
    assert out.usage.total_tokens == out.usage.prompt_tokens + 16
    stats = out.model_extra["treespec"]
    assert stats["tokens_per_step"] == pytest.approx(want.stats.tokens_per_step)
    assert stats["acceptance_by_depth"] == pytest.approx(want.stats.acceptance_by_depth)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, finish, stats = read_stream(stream)
    assert (text, finish) == (want.text, "length") and stats["target_steps"] == want.stats.target_steps
    # plain decoding (tree null) gives the same greedy text in one token per target step
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, extra_body={"tree": None}, **GREEDY
    )
    assert plain.choices[0].text == want.text and plain.model_extra["treespec"]["tokens_per_step"] == 1.0


def test_chat_streamed_equals_non_streamed_equals_generate(client, ref):
    messages = [{"role": "system", "content": "Python."}, {"role": "user", "content": "Sort a list."}]
    want = solo(ref, "system: Python.\nuser: Sort a list.\nassistant:", 12)  # the pair has no template
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    assert out.choices[0].message.content == want.text and out.choices[0].message.role == "assistant"
    text, finish, _ = read_stream(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True, **GREEDY)
    )
    assert (text, finish) == (want.text, "length")


def test_logprobs_are_generates_in_openais_shapes_streamed_or_not(client, ref):
    """Greedy chat with logprobs + top_logprobs, and a completion with logprobs: the official
    client parses them, and tokens and values are `generate(logprobs=k)`'s on the same prompt."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    want = solo(ref, "user: def add(a, b):\nassistant:", 12, logprobs=3)  # the pair has no template
    decode = lambda t: ref.tokenizer.decode([t])  # noqa: E731

    def check(entries):
        assert [e.token for e in entries] == [decode(t) for t in want.token_ids]
        assert [e.logprob for e in entries] == pytest.approx(want.logprobs.token.tolist(), abs=1e-4)
        assert [[t.token for t in e.top_logprobs] for e in entries] == [
            [decode(t) for t in row] for row in want.logprobs.top_ids.tolist()
        ]
        assert all(e.bytes == list(e.token.encode()) for e in entries)

    kw = dict(model=MODEL, messages=messages, max_tokens=12, logprobs=True, top_logprobs=3, **GREEDY)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == want.text
    check(r.choices[0].logprobs.content)
    entries = [
        e
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    check(entries)
    want = solo(ref, PROMPT, 8, logprobs=2)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=2, **GREEDY).choices[0]
    assert c.logprobs.tokens == [decode(t) for t in want.token_ids]
    assert c.logprobs.token_logprobs == pytest.approx(want.logprobs.token.tolist(), abs=1e-4)
    assert c.logprobs.text_offset == [sum(map(len, c.logprobs.tokens[:i])) for i in range(8)]
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)


def test_stop_strings_end_before_the_stop_and_never_stream_it(client, ref):
    full = solo(ref, PROMPT, 24).text
    stop = full[full.index("the") : full.index("the") + 8]  # a stop string inside the greedy text
    want = full[: full.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop, "zzz"], **GREEDY)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop, stream=True, **GREEDY
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == want
    shown = ""
    for p in pieces:  # no prefix of the stop string was ever shown and then taken back
        shown += p
        assert stop not in shown


def test_text_stream_decodes_multibyte_characters_and_holds_back_stops(ref):
    tok = ref.tokenizer
    text = "naïve café: 日本語 → ok"
    ids = tok(text, add_special_tokens=False).input_ids
    s = TextStream(tok)
    pieces = [s.feed([t]) for t in ids]
    assert "".join(pieces) + s.finish(ids) == text and not any("\ufffd" in p for p in pieces)
    s = TextStream(tok, ["日本"])
    pieces = [s.feed([t]) for t in ids] + [s.finish(ids)]
    assert "".join(pieces) == "naïve café: " and s.text == "naïve café: "
    assert stop_prefix_len("abc\n\n", ["\n\n\n"]) == 2 and stop_prefix_len("abc", ["xy"]) == 0


def test_concurrent_seeded_streams_each_equal_their_solo_output(server, client, ref):
    settings = [
        {"temperature": 0.8, "seed": 1},
        {"temperature": 0.8, "seed": 2, "extra_body": {"tree": {"width": 2, "depth": 3}}},
        {"temperature": 1.0, "seed": 3, "extra_body": {"tree": None}},
        {"temperature": 0, "extra_body": {"tree": {"width": 2, "depth": 4, "strategy": "topk"}}},
    ]
    results: dict[int, tuple] = {}

    def run(i):
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=16, stream=True, **settings[i]
        )
        results[i] = read_stream(stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(settings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    trees = [TreeConfig(), TreeConfig(2, 3), None, TreeConfig(2, 4, "topk")]
    for i, s in enumerate(settings):
        want = solo(ref, PROMPTS[i], 16, s["temperature"], s.get("seed"), trees[i])
        assert results[i][0] == want.text, f"request {i}"
    assert metric(server, "treespec_requests_running") == 0


# A second server, bf16: with -m slow. The default run keeps the property on the engine
# the server drives (tests/test_batch.py: deterministic outputs independent of batch-mates, in
# bf16 and fp32) and concurrent seeded streams == solo output through the server (above).
@pytest.mark.cpu
@pytest.mark.slow
def test_deterministic_server_8_concurrent_bf16_streams_each_equal_their_solo_output(tmp_path_factory):
    """`--deterministic` in bf16: 8 seeded streams at once (sampled, trees and chains), each
    the text its own `generate()` gives alone, whatever its batch-mates were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server (--threads 1): the same products, the same rounding
    ref = SpeculativeDecoder.from_pretrained(
        target=ZOO / "pycode" / "target", draft=ZOO / "pycode" / "draft", dtype="bfloat16"
    )
    n, trees = 8, [TreeConfig(), TreeConfig(2, 3)]
    gen = start_server(tmp_path_factory, "bfloat16", "--deterministic", "--max-live", str(n))
    server = next(gen)
    results: dict[int, str] = {}
    try:
        with openai_client(server, 120) as c:

            def run(i):
                tree = trees[i % 2]
                stream = c.completions.create(
                    model=MODEL,
                    prompt=PROMPTS[i % len(PROMPTS)],
                    max_tokens=24,
                    temperature=1.0,
                    seed=i,
                    stream=True,
                    extra_body={"tree": {"width": tree.width, "depth": tree.depth}},
                )
                results[i] = read_stream(stream)[0]

            workers = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in workers:
                t.start()
            for t in workers:
                t.join(120)
    finally:
        next(gen, None)
    wants = [solo(ref, PROMPTS[i % len(PROMPTS)], 24, 1.0, i, trees[i % 2]).text for i in range(n)]
    torch.set_num_threads(threads)
    assert [results.get(i) for i in range(n)] == wants


# ---- faults ---------------------------------------------------------------------------------------
def test_dropped_stream_frees_its_lane(server, client):
    before = metric(server, 'treespec_requests_total{finish_reason="cancelled"}')
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    next(iter(stream))
    assert metric(server, "treespec_requests_running") == 1
    stream.close()
    wait_for(lambda: metric(server, "treespec_requests_running") == 0, what="the lane to free")
    assert metric(server, 'treespec_requests_total{finish_reason="cancelled"}') == before + 1


def test_non_streaming_client_that_goes_away_is_cancelled(server):
    before = metric(server, 'treespec_requests_total{finish_reason="cancelled"}')
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: metric(server, "treespec_requests_running") == 0, what="the lane to free")
    assert metric(server, 'treespec_requests_total{finish_reason="cancelled"}') == before + 1


def test_full_queue_answers_429(server):
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=server["base"], timeout=30) as http:
        streams = []
        try:
            for _ in range(MAX_LIVE + MAX_QUEUE):
                cm = http.stream("POST", "/v1/completions", json=body)
                r = cm.__enter__()
                streams.append(cm)
                assert r.status_code == 200
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)
    wait_for(lambda: metric(server, "treespec_requests_running") == 0, what="the lanes to free")
    wait_for(lambda: metric(server, "treespec_requests_waiting") == 0, what="the queue to empty")


BAD = [
    ("/v1/completions", b'{"prompt": "x", ', 400, None),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "tree": {"width": 0}}, 400, "tree.width"),
    ("/v1/completions", {"prompt": "x", "tree": {"leaves": 3}}, 400, "tree.leaves"),
    ("/v1/completions", {"prompt": "x", "tree": {"width": 2, "strategy": "magic"}}, 400, "tree.strategy"),
    ("/v1/completions", {"prompt": "x", "tree": {"width": 2}, "verification": "block"}, 400, "verification"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", b"", 400, None),  # "the request body must be a JSON object", not "None is required"
    ("/v1/completions", b"[]", 400, None),
    # a prompt with no room left for one token is the prompt's fault, not max_tokens'
    ("/v1/completions", {"prompt": list(range(3, 515))}, 400, "prompt"),
    # wrong JSON types are refused, never converted
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4.0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": "1"}, 400, "seed"),
    # over the server's --max-tree-nodes (64 by default): one client's tree slows every round
    ("/v1/completions", {"prompt": "x", "tree": {"width": 16, "depth": 8}}, 400, "tree"),
    ("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413, None),  # over --max-body-mb
    # issue 60: the last 500s and silent ignores (more in tests/test_serve_load.py)
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x\\udc00"}]}',
        400,
        "messages[0].content",
    ),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 400, None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
        400,
        "messages[0].content[0].text",
    ),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "functions": [{}]},
        400,
        "functions",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
        400,
        "tool_choice",
    ),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}, 400, "stop"),
]


def test_bad_requests_answer_4xx_with_an_openai_error_body(server, client):
    with httpx.Client(base_url=server["base"], timeout=30) as http:
        for path, body, status, param in BAD:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
            assert error["param"] == param, (body, error)
        assert http.get("/v1/nowhere").status_code == 404 and "error" in http.get("/v1/nowhere").json()
        empty = http.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
        assert "must be a JSON object" in empty.json()["error"]["message"]  # not "None is required"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=-0.5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # still serving
    assert (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY).choices[0].finish_reason
        == "length"
    )
    assert httpx.get(server["base"] + "/health").status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "def f(x): return x\n" * 190_000},
        {"prompt": [5] * 1_000_000},
        {"messages": [{"role": "user", "content": "a"}] * 120_000},
    ],
    ids=["3.6 MB of text", "1M token ids", "120k messages"],
)
def test_a_huge_prompt_is_refused_before_tokenizing_and_stalls_no_one(server, body):
    """3-4 MB prompts (under the body limit) for a 512-position model: refused from their size
    alone, without seconds of tokenizing or validating on the event loop (before: text 6.4 s
    with /health waiting; 1.25M ids 2.0 s, /health 0.4 s)."""
    lat, done = [], {}
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    field = "messages" if "messages" in body else "prompt"

    def big():
        t0 = time.perf_counter()
        r = httpx.post(server["base"] + route, json=body, timeout=60)
        done["status"], done["s"], done["param"] = (
            r.status_code,
            time.perf_counter() - t0,
            r.json()["error"]["param"],
        )

    t = threading.Thread(target=big)
    t.start()
    while t.is_alive():
        t0 = time.perf_counter()
        httpx.get(server["base"] + "/health", timeout=60)
        lat.append(time.perf_counter() - t0)
    t.join()
    assert done["status"] == 400 and done["param"] == field and done["s"] < 1.0, done
    assert max(lat) < 1.0, lat


def test_a_request_failing_in_the_engine_fails_alone(server, client, ref):
    want = solo(ref, PROMPTS[1], 40, ignore_eos=True)
    result = {}

    def run():
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
        result["out"] = read_stream(stream)

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: metric(server, "treespec_requests_running") >= 1, what="the stream to start")
    r = httpx.post(
        server["base"] + "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "treespec_fault": "callback"},
        timeout=30,
    )
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError):
        read_stream(
            client.completions.create(
                model=MODEL, prompt="x", max_tokens=4, stream=True, extra_body={"treespec_fault": "callback"}
            )
        )
    t.join(60)
    assert result["out"][0] == want.text  # the others went on, untouched
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY).choices[0].text


# ---- last: SIGTERM stops the module's server ---------------------------------------------------------
def test_sigterm_finishes_in_flight_streams_and_exits_0(server, client, ref):
    want = solo(ref, PROMPTS[2], 24, ignore_eos=True)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    it = iter(stream)
    first = next(it)
    server["proc"].send_signal(signal.SIGTERM)
    text, finish, _ = read_stream(it)
    assert (first.choices[0].text + text, finish) == (want.text, "length")
    assert server["proc"].wait(30) == 0, server["log"].read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(server["base"] + "/health", timeout=2)


def test_past_the_grace_period_each_request_is_answered_and_ctrl_c_exits_0(tmp_path_factory):
    """--grace-period 0.5 and Ctrl-C while three streams and a non-streaming request run far
    longer (and one more waits for a lane): each stream ends with finish_reason "cancelled" and
    [DONE], the others get a 503 body, the log has no traceback, the exit code is 0 within the
    grace period + 5 s (before: cut streams, a plain-text 500, CancelledError tracebacks, exit
    130; under long prompts, 1 stream of 6 answered and exit after 30 s)."""
    gen = start_server(tmp_path_factory, "float32", "--grace-period", "0.5")
    srv = next(gen)
    # plain decoding, one token a round: seconds for 480 tokens, so none ends by itself
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "tree": None, **GREEDY}
    answers, streams = [], [[] for _ in range(MAX_LIVE - 1)]

    def plain():
        r = httpx.post(srv["base"] + "/v1/completions", json=body, timeout=60)
        answers.append((r.status_code, r.json()["error"]["code"]))

    def stream(events, started):
        with httpx.stream(
            "POST", srv["base"] + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    started = [threading.Event() for _ in streams]
    threads = [threading.Thread(target=stream, args=a) for a in zip(streams, started)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)  # running
    threads += [threading.Thread(target=plain) for _ in range(2)]  # one runs, one waits for a lane
    for t in threads[-2:]:
        t.start()
    wait_for(lambda: metric(srv, "treespec_requests_waiting") == 1, what="the last to wait for a lane")
    t0 = time.time()
    srv["proc"].send_signal(signal.SIGINT)
    for t in threads:
        t.join(60)
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "cancelled"
    assert answers == [(503, "shutting_down")] * 2
    assert srv["proc"].wait(30) == 0
    assert time.time() - t0 < 0.5 + 5
    assert "Traceback" not in srv["log"].read_text(), srv["log"].read_text()


# A second server, a head written for the pycode target: with -m slow. The default run
# keeps a head's batched rounds == each request alone (tests/test_head.py) and the server ==
# generate() with a draft model (above).
@pytest.mark.slow
def test_a_server_drafting_with_a_feature_head_serves_what_generate_gives(tmp_path_factory):
    """`treespec serve --draft HEAD`: an EAGLE-3 head (random, written by the test for the pycode
    target) drafts for the server's requests, greedy and seeded, as `generate()` does alone."""
    from transformers import AutoModelForCausalLM

    from treespec.backends.head import HeadConfig, head_weight_shapes, save_head

    target_dir = ZOO / "pycode" / "target"
    config = AutoModelForCausalLM.from_pretrained(target_dir).config
    H, V = config.hidden_size, config.vocab_size
    cfg = HeadConfig(
        hidden_size=H, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=H // config.num_attention_heads,
        intermediate_size=2 * H, vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
        taps=(0, config.num_hidden_layers), rms_norm_eps=config.rms_norm_eps,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    weights = {n: 0.05 * torch.randn(shape, generator=g) for n, shape in head_weight_shapes(cfg).items()}
    weights["d2t"], weights["t2d"] = torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
    head = save_head(tmp_path_factory.mktemp("head") / "head", cfg, weights)
    local = SpeculativeDecoder.from_pretrained(target=target_dir, draft=head, dtype="float32")
    gen = start_server(
        tmp_path_factory, "float32", models=("--target", str(target_dir), "--draft", str(head))
    )
    server = next(gen)
    try:
        with openai_client(server) as c:
            for temperature, seed in ((0.0, None), (1.0, 5)):
                got = c.completions.create(
                    model=c.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=16,
                    temperature=temperature, seed=seed, extra_body={"tree": {"width": 2, "depth": 2}},
                )  # fmt: skip
                want = solo(local, PROMPTS[0], 16, temperature, seed, TreeConfig(2, 2))
                assert got.choices[0].text == want.text and want.stats.draft_forwards > 0
    finally:
        next(gen, None)


def test_serve_without_its_packages_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Installed with --no-deps, `treespec serve` says what to install (the packages are in the
    base install: `pip install .` serves)."""
    import sys

    from treespec.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    assert main(["serve", "--pair", "pycode"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "treespec: error: treespec serve needs uvicorn: pip install fastapi uvicorn prometheus_client\n"
    )
