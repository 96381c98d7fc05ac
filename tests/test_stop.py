"""Stop strings and stop token ids (issue 11, item 2); the HF comparison is in test_bundled.py."""

from __future__ import annotations

import pytest

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.output import OutputBuilder, StopMatcher

from .conftest import tiny_llama


class CharTokenizer:
    """Token id i decodes to PIECES[i]: multi-character pieces test overhangs."""

    PIECES = (
        ["<s>", "</s>"] + list("abcdefgh \n") + ["ab", "cde", "\n\n\n", "fgh"] + [f"w{i}" for i in range(80)]
    )

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i < 2))

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.PIECES.index(c) for c in text]}


TOK = CharTokenizer()
ID = {p: i for i, p in enumerate(TOK.PIECES)}


def _emit(rounds, stop, max_new=100, eos=frozenset()):
    seen: list[int] = []
    out = OutputBuilder(max_new, eos, stop=stop)
    for r in rounds:
        if out.done:
            break
        seen.extend(out.add([ID[p] for p in r], "bonus"))
    assert seen == out.token_ids  # streaming never runs past the stop
    return "".join(TOK.PIECES[i] for i in out.token_ids), out


@pytest.mark.parametrize(
    "rounds,stop,text",
    [
        ([["a", "b"], ["c", "d", "e"]], "bcd", "abcd"),  # spans two rounds, cut inside a round
        ([["ab"], ["cde", "f"]], "bc", "abcde"),  # overhang: the completing token is kept whole
        ([["a", "\n\n\n", "b"]], "\n\n", "a\n\n\n"),  # stop "\n\n" completed by a "\n\n\n" token
        ([["a"], ["b"], ["c"]], "zz", "abc"),  # never matched
        ([["fgh", "a"], ["b"]], "gha", "fgha"),  # starts inside an earlier token
    ],
)
def test_stop_strings(rounds, stop, text):
    got, out = _emit(rounds, StopMatcher([stop], set(), TOK))
    assert got == text
    assert out.finish_reason == ("stop" if stop in text else None) and out.stop_match == (
        stop if stop in text else None
    )


def test_earliest_stop_wins_and_ids_stop_like_eos():
    got, out = _emit([["a", "b", "c", "d"]], StopMatcher(["cd", "b"], {ID["c"]}, TOK))
    assert got == "ab" and out.stop_match == "b"
    got, out = _emit([["a", "b"], ["c", "d"]], StopMatcher([], {ID["c"]}, TOK))
    assert got == "abc" and out.stop_match == ID["c"] and out.finish_reason == "stop"
    got, out = _emit([["a", "</s>", "c"]], StopMatcher(["c"], set(), TOK), eos=frozenset({ID["</s>"]}))
    assert got == "a</s>" and out.finish_reason == "eos"


def test_long_window_and_skipped_special_tokens():
    # many tokens that decode to nothing between the two halves of the stop string
    rounds = [["a"]] + [["<s>"]] * 40 + [["b"]]
    got, out = _emit(rounds, StopMatcher(["ab"], set(), TOK))
    assert out.finish_reason == "stop" and got.endswith("b")


@pytest.fixture(scope="module")
def dec():
    return SpeculativeDecoder(
        tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1), tokenizer=TOK
    )


@pytest.mark.parametrize("tree", [None, TreeConfig(1, 4), TreeConfig(3, 3)])
def test_generate_stops_at_a_stop_id_at_the_same_token_as_plain_decoding(dec, tree):
    sampling = SamplingConfig(temperature=0)
    full = dec.generate([3, 4, 5], 30, tree=tree, sampling=sampling, ignore_eos=True).token_ids
    target = full[10]
    out = dec.generate([3, 4, 5], 30, tree=tree, sampling=sampling, ignore_eos=True, stop=target)
    assert (
        out.token_ids == full[: full.index(target) + 1] and out.finish_reason == "stop" and out.stop == target
    )
    text = TOK.decode(full)
    stop = text[len(TOK.decode(full[:12])) - 3 :][:5]
    out = dec.generate([3, 4, 5], 30, tree=tree, sampling=sampling, ignore_eos=True, stop=[stop])
    assert stop in out.text and stop not in TOK.decode(out.token_ids[:-1]) and text.startswith(out.text)


@pytest.mark.parametrize(
    "stop,match",
    [
        ("", "must not be empty"),
        ([3.5], "stop entries must be strings or int token ids"),
        ([True], "stop entries must be strings or int token ids"),
        ([10**6], "outside the vocabulary"),
        (object(), "stop must be a string, a token id or a list"),
        (b"\n", "stop is bytes"),
    ],
)
def test_bad_stop(dec, stop, match):
    with pytest.raises(ValueError, match=match):
        dec.generate([3, 4], 4, stop=stop)


def test_stop_strings_need_a_tokenizer():
    d = SpeculativeDecoder(tiny_llama(0))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        d.generate([3, 4], 4, tree=None, stop=["x"])
    assert d.generate([3, 4], 4, tree=None, stop=[5], ignore_eos=True).finish_reason in ("stop", "length")


def test_text_stream_never_shows_half_a_character():
    """What the CLI and the server stream: byte tokens of emoji and CJK characters are held
    back until the character is whole; the pieces concatenate to the decoded text."""
    from transformers import AutoTokenizer

    from treespec.output import TextStream
    from treespec.zoo import pair

    tok = AutoTokenizer.from_pretrained(pair("pycode")[0])
    text = "def f():  # 日本語 🙂 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens here
    stream = TextStream(tok)
    pieces = [stream.feed([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish(ids) == tok.decode(ids) == text


def _first_stop_brute(text, stops):
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _prefix_len_brute(text, stops):
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_one_automaton_finds_what_every_string_alone_finds():
    """`StopSet` (a trie regex and a sorted list) against each stop string checked alone, on
    random texts over a small alphabet with regex metacharacters, shared prefixes and stops
    that are prefixes of others."""
    import random

    from treespec.output import first_stop, stop_prefix_len

    rng = random.Random(0)
    for _ in range(3000):
        alphabet = "ab.*\\(\n"[: rng.randint(2, 7)]
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 12)))
        assert first_stop(text, stops) == _first_stop_brute(text, stops), (text, stops)
        assert stop_prefix_len(text, stops) == _prefix_len_brute(text, stops), (text, stops)


def test_many_stop_strings_match_in_the_callers_order():
    stops = [f"w{i}" for i in range(70, 80)] + ["cd", "b"]
    got, out = _emit([["a", "b", "c", "d"]], StopMatcher(stops, set(), TOK))
    assert got == "ab" and out.stop_match == "b"
    got, out = _emit([["w7", "w71"]], StopMatcher(stops, set(), TOK))  # "w7w71" completes "w71"
    assert out.stop_match == "w71"
    # a token completing two stops at once reports the first of the caller's list
    got, out = _emit([["a"], ["cde"]], StopMatcher(["e", "cde"], set(), TOK))
    assert got == "acde" and out.stop_match == "e"


def test_stop_strings_are_capped_in_every_front_end(dec):
    from treespec.request import MAX_STOP_LENGTH, MAX_STOP_STRINGS, Request, make_request

    ok = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert make_request([3, 4], TOK, stop=ok).stop_strings == tuple(ok)
    assert make_request([3, 4], TOK, stop=["x" * MAX_STOP_LENGTH]).stop_strings
    for bad, match in (
        (ok + ["one more"], f"more than the {MAX_STOP_STRINGS} a request may give"),
        ([f"s{i}" for i in range(100_000)], "100000 stop strings"),
        (["x" * (MAX_STOP_LENGTH + 1)], f"more than the {MAX_STOP_LENGTH} a stop string may have"),
    ):
        with pytest.raises(ValueError, match=match):
            make_request([3, 4], TOK, stop=bad)
        with pytest.raises(ValueError, match=match):
            Request((3, 4), stop_strings=tuple(bad))
        with pytest.raises(ValueError, match=match):
            dec.generate([3, 4], 4, stop=bad)
