"""Tool calls on `treespec serve` (treespec.serve.tools), on the bundled pycode pair: a named
function's call streamed as OpenAI streams it (and reassembled by the openai client), "required"
with several tools, "auto" (free text or one call, the grammar checked on its own as well; the
call itself on the default pair, which makes one where the conversation shows calls), the call
read back alike whatever the text's cuts, and the 400s that remain."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("fastapi")

from treespec.constraints import GrammarVocabulary  # noqa: E402
from treespec.serve.protocol import DONE, sse_events  # noqa: E402
from treespec.serve.tools import (  # noqa: E402
    CLOSE,
    ToolPlan,
    call_prefix,
    special_markers,
    tool_plan,
    tool_stream,
)
from treespec.zoo import ZOO  # noqa: E402

MODEL = "pycode"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
QUERY = {
    "type": "object",
    "properties": {
        "q": {"type": "string", "maxLength": 8},
        "opts": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "additionalProperties": False},
    },
    "required": ["q"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "a forecast", "parameters": CITY}},
    {"type": "function", "function": {"name": "search", "parameters": QUERY}},
]
SCHEMAS = {"weather": CITY, "search": QUERY}
NAMED = {"type": "function", "function": {"name": "weather"}}
MESSAGES = [{"role": "user", "content": "the weather in Paris for 3 days"}]
TREES = {"plain": {"tree": None}, "speculative": {}}  # extra_body: plain decoding, the server's tree


def valid(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def read_calls(stream) -> dict:
    """A streamed chat answer reassembled as a client does: the chunks' deltas in order."""
    out = {"roles": [], "content": None, "calls": {}, "finish": None, "usage": None, "first": None}
    for chunk in stream:
        out["usage"] = chunk.usage or out["usage"]
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if out["first"] is None:
            out["first"] = c.delta
        if c.delta.role:
            out["roles"].append(c.delta.role)
        if c.delta.content is not None:
            out["content"] = (out["content"] or "") + c.delta.content
        for t in c.delta.tool_calls or []:
            call = out["calls"].setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = t.id or call["id"]
            call["name"] = (t.function.name if t.function else None) or call["name"]
            call["arguments"] += (t.function.arguments if t.function else None) or ""
        out["finish"] = c.finish_reason or out["finish"]
    return out


# ---- the grammar and the reader, alone --------------------------------------------------------
@pytest.fixture(scope="module")
def vocab():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ZOO / "pycode" / "target")
    return tok, GrammarVocabulary.of(tok, len(tok), (tok.eos_token_id,))


def takes(vocab, plan: ToolPlan, text: str) -> tuple[bool, bool]:
    """(whether the grammar takes `text`, whether it may end there)."""
    tok, v = vocab
    m = v.matcher(plan.constraint())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if m.try_consume_tokens(ids) != len(ids) or m.is_error():
        return False, False
    return True, bool(v.unpack(m.compute_bitmask())[tok.eos_token_id])


def call(name: str, arguments: str) -> str:
    return call_prefix(name) + arguments + CLOSE


def test_auto_grammar_takes_free_text_or_one_well_formed_call(vocab):
    auto, required = tool_plan(TOOLS, "auto"), tool_plan(TOOLS, "required")
    assert auto.free_text and not required.free_text and not required.named
    weather = call("weather", '{"city": "Paris", "days": 3}')
    search = call("search", '{"q": "x", "opts": {"n": 2}}')
    for text in ("Sunny.", "", "<tool", "<tool_callx", "a <tool_call> b", weather, search):
        assert takes(vocab, auto, text) == (True, True), text
    for text in (weather, search):
        assert takes(vocab, required, text) == (True, True), text
    for text in ("Sunny.", "<tool_call>\n", call_prefix("weather")):
        assert takes(vocab, required, text)[1] is False, text  # not an answer yet
    for text in (
        " <tool_call>",  # free text may not start a call, even after whitespace
        "\n<tool_call>",
        call_prefix("other"),  # no such function
        call("weather", '{"city":"Paris", "days": 3}'),  # JSON as json.dumps writes it
        call("weather", '{"city": "Paris", "days": 0}'),  # under the function's parameters
        call("search", '{"q": "x", "extra": 1}'),
        call("weather", '{"city": "Paris", "days": 3}') + " and more",
    ):
        assert takes(vocab, auto, text)[0] is False, text
        assert takes(vocab, required, text)[0] is False, text
    assert takes(vocab, required, "Sunny.")[0] is False


@pytest.mark.parametrize("special", [False, True], ids=["added", "special"])
def test_call_markers_that_are_tokens_of_their_own(special):
    """Qwen 2.5's and Hermes' tokenizers hold "<tool_call>" and "</tool_call>" as added tokens,
    which the grammar engine reads as special tokens, not as their text: the grammar names them
    by id, so that the tokenizer's own tokens of a call (what such a model writes) are taken, and
    the answer's text shows them (a special token's text is left out otherwise), read back as
    the call. Without the markers' ids, "required" forced the marker's token and then rejected
    it, and "auto" forbade it."""
    from transformers import AutoTokenizer

    from treespec.output import TextStream
    from treespec.serve.tools import END_MARKER, MARKER

    tok = AutoTokenizer.from_pretrained(ZOO / "pycode" / "target")
    tok.add_tokens([MARKER, END_MARKER], special_tokens=special)
    ids_of = dict(special_markers(tok))
    assert set(ids_of) == {MARKER, END_MARKER} and min(ids_of.values()) >= 8192
    v = GrammarVocabulary.of(tok, len(tok), (tok.eos_token_id,))
    text = call("weather", '{"city": "Paris", "days": 3}')
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == ids_of[MARKER] and ids[-1] == ids_of[END_MARKER]  # one token each
    for choice in ("required", "auto"):
        for plan, works in ((tool_plan(TOOLS, choice, tok), True), (tool_plan(TOOLS, choice), False)):
            m = v.matcher(plan.constraint())
            first = v.unpack(m.compute_bitmask())
            taken = m.try_consume_tokens(ids)
            assert (taken == len(ids) and m.is_accepting()) is works, (choice, works)
            if works:
                assert first[ids_of[MARKER]]
                shown = TextStream(tok, (), plan.special_text).finish(ids)
                assert shown == text
                message, finish = plan.answer(shown, "stop")
                assert finish == "tool_calls" and message.content is None
                assert message.tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'
    assert TextStream(tok).finish(ids) == (
        text if not special else text.replace(MARKER, "").replace(END_MARKER, "")
    )
    assert special_markers(AutoTokenizer.from_pretrained(ZOO / "pycode" / "target")) == ()


def merged(deltas: list[dict]) -> dict:
    out = {"roles": 0, "content": None, "name": None, "arguments": None}
    for d in deltas:
        out["roles"] += "role" in d
        if "content" in d:
            out["content"] = (out["content"] or "") + d["content"]
        for t in d.get("tool_calls", ()):
            out["name"] = t["function"].get("name", out["name"])
            out["arguments"] = (out["arguments"] or "") + t["function"]["arguments"]
    return out


@pytest.mark.parametrize(
    "choice,text,finish,want",
    [
        ("auto", "Sunny, 20 degrees.", "stop", ("Sunny, 20 degrees.", None, None, "stop")),
        ("auto", "", "stop", ("", None, None, "stop")),
        ("auto", "<tool_c", "length", ("<tool_c", None, None, "length")),  # cut before a call began
        ("auto", call_prefix("wea"), "length", (call_prefix("wea"), None, None, "length")),
        ("auto", call("search", '{"q": "}"}'), "stop", (None, "search", '{"q": "}"}', "tool_calls")),
        ("required", call("search", '{"q": "a", "opts": {"b": {}}}'), "stop",
         (None, "search", '{"q": "a", "opts": {"b": {}}}', "tool_calls")),
        ("required", call("weather", '{"city": "P')[: -len(CLOSE)], "length",
         (None, "weather", '{"city": "P', "length")),  # cut inside the arguments
        ("required", call("search", '{"q": "a", "opts": {}}')[:-6], "length",
         (None, "search", '{"q": "a", "opts": {}}', "length")),  # cut inside the closing tag
        ("required", call("search", '{"q": "a", "opts": {}')[: -len(CLOSE) + 1], "length",
         (None, "search", '{"q": "a", "opts": {}}', "length")),  # the brace is the arguments'
        (NAMED, '{"city": "Paris", "days": 3}', "stop", (None, "weather", '{"city": "Paris", "days": 3}',
                                                         "tool_calls")),
        (NAMED, '{"city": "Pa', "length", (None, "weather", '{"city": "Pa', "length")),
    ],
    ids=["text", "empty", "cut-in-marker", "cut-in-name", "brace-in-string", "nested", "cut-in-arguments",
         "cut-in-close", "brace-of-arguments", "named", "named-cut"],
)  # fmt: skip
def test_the_reader_reads_a_text_alike_however_it_is_cut(choice, text, finish, want):
    plan = tool_plan(TOOLS, choice)
    message, reason = plan.answer(text, finish)
    fn = message.tool_calls[0]["function"] if message.tool_calls else {"name": None, "arguments": None}
    assert (message.content, fn["name"], fn["arguments"], reason) == want
    cuts = [list(c) for n in (1, 2) for c in itertools.combinations(range(1, len(text)), n)] + [
        list(range(1, len(text)))
    ]
    for cut in cuts:
        pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
        reader = plan.reader()
        deltas = reader.start() + [d for p in pieces for d in reader.feed(p)]
        rest, reason = reader.finish(finish)
        m = merged(deltas + rest)
        assert m["roles"] == 1 and (m["content"], m["name"], m["arguments"], reason) == want, pieces


def test_the_stream_is_reshaped_chunk_by_chunk_and_the_rest_passes_through():
    def event(delta=None, finish=None, logprobs=None, **extra):
        choice = {"index": 0, "delta": delta or {}, **({"finish_reason": finish} if finish else {})}
        choice.update({"logprobs": logprobs} if logprobs else {})
        return {"id": "c", "choices": [choice], **extra}

    text = call("search", '{"q": "x"}')
    events = [event({"role": "assistant", "content": ""}), {"choices": [], "u": 1}]
    events += [event({"content": text[i : i + 5]}, logprobs={"content": [i]}) for i in range(0, len(text), 5)]
    events += [event(finish="stop", treespec={"steps": 1}), DONE]

    async def source():
        for e in events:
            yield e

    async def run():
        reshaped = tool_stream(source(), tool_plan(TOOLS, "required").reader())
        return [e async for e in sse_events(reshaped)]

    out = asyncio.run(run())
    assert json.loads(out[0][6:]) == events[1] and out[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in out)
    chunks = [json.loads(e[6:]) for e in out[1:-1]]
    logprobs = [c["choices"][0]["logprobs"]["content"][0] for c in chunks if "logprobs" in c["choices"][0]]
    assert logprobs == list(range(0, len(text), 5))  # each round's, once
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}  # the call not yet named
    header = next(c["choices"][0]["delta"] for c in chunks if "id" in str(c["choices"][0]["delta"]))
    assert header["tool_calls"][0]["function"] == {"name": "search", "arguments": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
    assert chunks[-1]["treespec"] == {"steps": 1}


class FakeServer:
    """What `ToolPlan.prompt` reads of the app's Server."""

    def __init__(self, tokenizer, prompt):
        self.tokenizer, self.prompt = tokenizer, prompt

    def chat_prompt(self, body):
        return self.prompt


def test_the_prompt_shows_the_tools_in_the_system_message_or_through_the_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ZOO / "smollm2" / "draft")  # its template ignores tools
    chat = [{"role": "user", "content": "hi"}]
    prompt = tool_plan(TOOLS, "auto").prompt(FakeServer(tok, chat), None)
    assert prompt[0]["role"] == "system" and prompt[1:] == chat
    assert '"name": "weather"' in prompt[0]["content"] and "<tool_call>" in prompt[0]["content"]
    assert "Otherwise, answer in plain text." in prompt[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *chat]
    prompt = tool_plan(TOOLS, "required").prompt(FakeServer(tok, system), None)
    assert prompt[0]["content"].startswith("Be brief.\n\n# Tools") and "must call" in prompt[0]["content"]
    text = tool_plan(TOOLS, "auto").prompt(FakeServer(tok, "user: hi\nassistant:"), None)  # no template
    assert text.startswith("system: # Tools") and text.endswith("user: hi\nassistant:")
    assert tool_plan(TOOLS, NAMED).prompt(FakeServer(tok, chat), None) is chat  # a named call: as it is
    tok.chat_template = (  # a template that renders tools in the Hermes format: its rendering
        "{% if tools %}{% for t in tools %}<tools>{{ t.function.name }}</tools>{% endfor %}<tool_call>"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    ids = tool_plan(TOOLS, "auto").prompt(FakeServer(tok, chat), None)
    assert tok.decode(ids) == "<tools>weather</tools><tools>search</tools><tool_call>hi"


# ---- the server -------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_streamed_named_call_reassembles_and_equals_the_whole_answer(client, temperature, tree):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64,
              temperature=temperature, seed=7, extra_body=TREES[tree])  # fmt: skip
    got = read_calls(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    first = got["first"]
    assert first.role == "assistant" and got["roles"] == ["assistant"] and got["content"] is None
    head = first.tool_calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "weather" and head.function.arguments == ""
    (c,) = got["calls"].values()
    assert got["finish"] == "tool_calls" and valid("weather", c["arguments"]), c
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert whole.choices[0].message.tool_calls[0].function.arguments == c["arguments"]
    assert got["usage"].completion_tokens == whole.usage.completion_tokens


def test_a_streamed_call_cut_by_max_tokens_ends_with_length(client):
    for choice in (NAMED, "required"):
        got = read_calls(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=3, temperature=0,
            stream=True,
        ))  # fmt: skip
        assert got["finish"] == "length" and got["roles"] == ["assistant"]
        if choice == NAMED:  # the call is named from the start: its arguments, cut
            assert got["calls"][0]["name"] == "weather" and not valid("weather", got["calls"][0]["arguments"])
        else:  # cut before the text named a function: the text as content
            assert got["calls"] == {} and got["content"].startswith("<tool")
            assert any(call_prefix(name).startswith(got["content"]) for name in SCHEMAS)


def test_the_openai_stream_helpers_parse_the_call(client):
    class Lookup(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        kind: str = pydantic.Field(pattern="^(a|b)$")

    tool = openai.pydantic_function_tool(Lookup)
    streams = [client.chat.completions.stream]
    if hasattr(getattr(client.beta, "chat", None), "completions"):
        streams.append(client.beta.chat.completions.stream)
    for stream, choice in zip(streams, [{"type": "function", "function": {"name": "Lookup"}}, "required"]):
        with stream(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice=choice, max_tokens=64,
                    temperature=0) as s:  # fmt: skip
            kinds = {event.type for event in s}
            final = s.get_final_completion()
        assert "tool_calls.function.arguments.done" in kinds
        parsed = final.choices[0].message.tool_calls[0].function.parsed_arguments
        assert isinstance(parsed, Lookup) and final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tree", TREES)
def test_required_with_two_tools_calls_one_of_them_streamed_or_not(client, tree):
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=128,
                  temperature=temperature, seed=seed, extra_body=TREES[tree])  # fmt: skip
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in SCHEMAS and valid(call.function.name, call.function.arguments)
        got = read_calls(client.chat.completions.create(**kw, stream=True))
        assert got["finish"] == "tool_calls" and got["roles"] == ["assistant"] and got["content"] is None
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
            (call.function.name, call.function.arguments)
        ]


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_answers_free_text_or_one_well_formed_call(client, choice):
    kinds = set()
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=temperature,
                  seed=seed, **({} if choice is None else {"tool_choice": choice}))  # fmt: skip
        r = client.chat.completions.create(**kw)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        got = read_calls(client.chat.completions.create(**kw, stream=True))
        assert got["roles"] == ["assistant"] and got["finish"] == finish
        if m.tool_calls:  # the model chose to call
            kinds.add("call")
            (call,) = m.tool_calls
            assert finish == "tool_calls" and valid(call.function.name, call.function.arguments)
            assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
                (call.function.name, call.function.arguments)
            ]
        else:
            kinds.add("text")
            assert finish in ("stop", "length") and not m.content.lstrip().startswith("<tool_call>")
            assert got["content"] == m.content and got["calls"] == {}
    assert kinds  # (the pycode pair writes Python: it answers in text)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
         "tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_what_cannot_be_called_is_a_400_in_openais_shape(server, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, **extra}
    for stream in (False, True):
        r = httpx.post(server["base"] + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_tool_choice_none_answers_text(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def running(server) -> float:
    for line in httpx.get(server["base"] + "/metrics").text.splitlines():
        if line.startswith("treespec_requests_running "):
            return float(line.split()[-1])
    raise AssertionError("no treespec_requests_running in /metrics")


def test_a_dropped_tool_stream_frees_its_lane(server, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    assert running(server) == 1
    stream.close()
    deadline = time.time() + 15
    while running(server) != 0:
        assert time.time() < deadline, "the lane was not freed"
        time.sleep(0.1)


def weather_call(city: str, days: int) -> str:
    return call("weather", json.dumps({"city": city, "days": days}))


# three calls in the conversation: the default pair then answers the fourth question with a call
FEW_SHOT = [
    m
    for city, days in (("London", 2), ("Rome", 5), ("Oslo", 1))
    for m in (
        {"role": "user", "content": f"What will the weather be in {city} for the next {days} days?"},
        {"role": "assistant", "content": weather_call(city, days)},
    )
] + [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def default_pair_client():
    """The official client of an in-process app around the default pair (SmolLM2 and its head)."""
    from fastapi.testclient import TestClient

    from treespec import SpeculativeDecoder, TreeConfig
    from treespec.serve.app import ServeSettings, create_app

    with pytest.MonkeyPatch.context() as m:  # the real default, not the tests' pycode
        m.delenv("TREESPEC_PAIR", raising=False)
        m.setenv("HF_HUB_OFFLINE", "1")
        dec = SpeculativeDecoder.from_pretrained(compile=False)
    app = create_app(dec.engine(max_live=2), dec.tokenizer, "smollm2", ServeSettings(tree=TreeConfig(1, 1)))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=http)


@pytest.mark.parametrize("tree", TREES)
def test_auto_answers_with_a_call_where_the_model_makes_one(default_pair_client, tree):
    """The other branch of "auto": a model that chooses to call gets `tool_calls`, whole and
    streamed alike, its arguments valid (the pycode pair above always answers in text)."""
    client = default_pair_client
    for temperature, seed in ((0.0, 0), (1.0, 1)):
        kw = dict(model="smollm2", messages=FEW_SHOT, tools=TOOLS[:1], tool_choice="auto", max_tokens=64,
                  temperature=temperature, seed=seed, extra_body=TREES[tree])  # fmt: skip
        r = client.chat.completions.create(**kw)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        assert finish == "tool_calls" and m.content is None, (m, finish)
        (got_call,) = m.tool_calls
        assert got_call.function.name == "weather" and valid("weather", got_call.function.arguments)
        streamed = read_calls(client.chat.completions.create(**kw, stream=True))
        assert streamed["finish"] == "tool_calls" and streamed["content"] is None
        assert streamed["roles"] == ["assistant"]
        assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
            ("weather", got_call.function.arguments)
        ]
