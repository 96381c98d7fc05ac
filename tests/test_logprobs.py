"""`logprobs=k`: the target's own distribution at every generated position.

Each row must equal log_softmax of the target's logits (Hugging Face's forward over prompt +
output, float64) at the position that produced the token, whichever way the token came:
accepted from a draft, a correction, a bonus, a plain step; before temperature, top-p and
penalties; cut with the output at a stop; the same in a batch as alone.
"""

from __future__ import annotations

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TokenLogprobs, TreeConfig

from .conftest import VOCAB, perturbed

PROMPT = [0, 5, 9, 17, 3]
K = 4


def reference(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log p of the target at the positions that produced `out`: [len(out), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].double(), -1)


def check(lp: TokenLogprobs, ref: torch.Tensor, out: list[int], k: int) -> None:
    assert lp.token.shape == (len(out),) and lp.top_ids.shape == lp.top.shape == (len(out), k)
    chosen = ref.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(lp.token.double(), chosen, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.top.double(), ref.topk(k, -1).values, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        ref.gather(1, lp.top_ids), lp.top.double(), atol=1e-5, rtol=0
    )  # ids match values
    assert bool((lp.top[:, :-1] >= lp.top[:, 1:]).all())  # most likely first


@pytest.mark.parametrize(
    "tree, sampling",
    [
        (None, SamplingConfig(temperature=0)),
        (None, SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.3)),
        (TreeConfig(1, 4), SamplingConfig(temperature=0)),
        (TreeConfig(2, 3), SamplingConfig(temperature=1.0)),
        (TreeConfig(3, 2, strategy="iid"), SamplingConfig(temperature=0.8, top_k=20, repetition_penalty=1.2)),
    ],
)
def test_logprobs_are_the_targets_raw_distribution(target64, tree, sampling):
    dec = SpeculativeDecoder(target64, perturbed(target64, 0.02, 0))  # a draft often accepted
    out = dec.generate(PROMPT, 24, tree=tree, sampling=sampling, seed=3, ignore_eos=True, logprobs=K)
    check(out.logprobs, reference(target64, PROMPT, out.token_ids), out.token_ids, K)
    if tree is not None:  # the tokens came every way a round emits them
        assert "accepted" in out.sources
    plain = dec.generate(PROMPT, 24, tree=tree, sampling=sampling, seed=3, ignore_eos=True)
    assert plain.token_ids == out.token_ids and plain.logprobs is None  # asking changes nothing


def test_logprobs_end_with_the_output_at_a_stop_and_match_in_a_batch(target64, draft64):
    dec = SpeculativeDecoder(target64, draft64)
    sampling = SamplingConfig(temperature=1.0)
    full = dec.generate(PROMPT, 30, tree=TreeConfig(1, 4), sampling=sampling, seed=1, ignore_eos=True)
    stop = full.token_ids[9]
    cut = dec.generate(PROMPT, 30, tree=TreeConfig(1, 4), sampling=sampling, seed=1, ignore_eos=True,
                       stop=[stop], logprobs=0)  # fmt: skip
    assert cut.finish_reason == "stop" and cut.logprobs.top.shape == (len(cut.token_ids), 0)
    check(cut.logprobs, reference(target64, PROMPT, cut.token_ids), cut.token_ids, 0)

    prompts = [PROMPT, [0, 7, 7, 2], [0, 40]]
    batch = dec.generate_batch(prompts, 16, tree=TreeConfig(2, 2), sampling=sampling, seeds=[5, 6, 7],
                               ignore_eos=True, logprobs=K)  # fmt: skip
    for p, seed, got in zip(prompts, [5, 6, 7], batch):
        alone = dec.generate(
            p, 16, tree=TreeConfig(2, 2), sampling=sampling, seed=seed, ignore_eos=True, logprobs=K
        )
        assert got.token_ids == alone.token_ids
        for f in ("token", "top_ids", "top"):
            torch.testing.assert_close(getattr(got.logprobs, f), getattr(alone.logprobs, f))


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, VOCAB + 1])
def test_bad_logprobs_are_one_line_errors(target64, bad):
    dec = SpeculativeDecoder(target64, None)
    with pytest.raises(ValueError, match="logprobs"):
        dec.generate(PROMPT, 4, tree=None, logprobs=bad)


def test_on_logprobs_streams_each_rounds_rows_after_its_tokens(target64, draft64):
    """`Request.on_logprobs` gets, after each `on_tokens`, the same tokens' rows: together they
    are the output's logprobs, a stop's cut included."""
    dec = SpeculativeDecoder(target64, draft64)
    eng = dec.engine(max_live=2)
    events = []
    sampling = SamplingConfig(temperature=1.0)
    rid = eng.add(PROMPT, 24, tree=TreeConfig(2, 3), sampling=sampling, seed=3, ignore_eos=True, logprobs=K,
                  on_tokens=lambda ids, _: events.append(("tokens", len(ids))),
                  on_logprobs=lambda lp: events.append(("logprobs", lp)))  # fmt: skip
    out = eng.run()[rid]
    assert [e[0] for e in events] == ["tokens", "logprobs"] * (len(events) // 2)
    assert [n for kind, n in events[::2]] == [len(lp.token) for kind, lp in events[1::2]]
    streamed = TokenLogprobs.cat([lp for _, lp in events[1::2]], K)
    for f in ("token", "top_ids", "top"):
        assert torch.equal(getattr(streamed, f), getattr(out.logprobs, f))
    with pytest.raises(ValueError, match="needs logprobs"):
        eng.add(PROMPT, 4, on_logprobs=print)
