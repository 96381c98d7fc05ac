"""Repetition, frequency and presence penalties stay lossless.

Each row of the tree (target p and draft q alike) is penalised for the committed sequence
plus its own root-to-node path, so siblings see different contexts. Proven by enumeration on
toy tables (against penalties written independently in `tests/toy.py`), tested by chi-square
on tiny Llamas, and at temperature 0 equal to Hugging Face's greedy
`generate(repetition_penalty=...)` token for token.
"""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch

from treespec import BigramDrafter, SamplingConfig, SpeculativeDecoder, TokenTree, TreeConfig
from treespec.sampling import PenaltyContext, TokenCounts, penalize, probs, tree_token_counts

from .conftest import perturbed, tiny_llama
from .llamas import PROMPTS, hf_greedy
from .toy import (
    LONG_PROMPT,
    PROMPT,
    TableModel,
    TableRunner,
    enumerate_decoder,
    enumerate_outcomes,
    max_abs_diff,
    pair,
    reference_penalties,
)

V, K = 3, 3
PENALTIES = {
    "rep1.5": SamplingConfig(temperature=1.0, repetition_penalty=1.5),
    "all-topk2": SamplingConfig(
        temperature=0.8, top_k=2, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3
    ),
    "encourage-topp": SamplingConfig(
        temperature=1.2, top_p=0.8, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.7
    ),
}
GREEDY_PENALTY = SamplingConfig(temperature=0, repetition_penalty=3.0, frequency_penalty=1.0)


# ---- the transform itself ---------------------------------------------------------------------
def test_repetition_penalty_equals_hugging_face_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g, dtype=torch.float64) * 3
    ids = [3, 7, 7, 12, 40, 3]
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ids]), logits.clone())
    cfg = SamplingConfig(repetition_penalty=1.3)
    counts = tree_token_counts(PenaltyContext(ids, 2), TokenTree([ids[-1]], [-1]), 50, "cpu")
    assert torch.equal(penalize(logits, cfg, counts), want)


def test_frequency_and_presence_count_generated_tokens_only():
    logits = torch.zeros(1, 6, dtype=torch.float64)
    cfg = SamplingConfig(frequency_penalty=0.5, presence_penalty=1.0)
    # prompt [4, 2], generated [2, 2, 5]: token 4 (prompt only) is not penalised
    counts = tree_token_counts(PenaltyContext([4, 2, 2, 2, 5], 2), TokenTree([5], [-1]), 6, "cpu")
    assert penalize(logits, cfg, counts)[0].tolist() == [0, 0, -2.0, 0, 0, -1.5]


def test_siblings_are_penalised_for_their_own_paths():
    #   root 0 ─┬─ 1 ── 2      rows: after each node
    #           └─ 2
    tree = TokenTree([0, 1, 2, 2], [-1, 0, 1, 0])
    counts = tree_token_counts(PenaltyContext([3, 0], 1), tree, 4, "cpu")  # prompt [3], generated [0]
    assert counts.generated.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 0]]
    assert counts.seen[:, 3].all()  # the prompt token, for every row
    rows = tree_token_counts(PenaltyContext([3, 0], 1), tree, 4, "cpu", rows=[3, 1])
    assert torch.equal(rows.generated, counts.generated[[3, 1]])


def test_probs_refuses_a_penalised_config_without_counts():
    with pytest.raises(ValueError, match="token counts"):
        probs(torch.zeros(3), SamplingConfig(repetition_penalty=1.2))
    assert isinstance(tree_token_counts(PenaltyContext([0], 1), TokenTree([0], [-1]), 3, "cpu"), TokenCounts)


def test_toy_reference_agrees_with_the_library_transform():
    logits = TableModel(5, seed=3).logits((1, 0, 4))
    cfg = PENALTIES["all-topk2"]
    counts = tree_token_counts(PenaltyContext([1, 0, 4, 4, 2], 3), TokenTree([2], [-1]), 5, "cpu")
    assert torch.allclose(
        penalize(logits[None], cfg, counts)[0], reference_penalties(logits, (1, 0, 4), (4, 2), cfg)
    )


# ---- enumeration ------------------------------------------------------------------------------
ENUM_CASES = [  # (strategy, width, depth, sampling): chains and trees whose siblings see different paths
    (strategy, w, d, name)
    for strategy in ("iid", "without_replacement", "topk", "dynamic")
    for (w, d) in ((1, 2), (2, 2), (3, 1))
    for name in PENALTIES
    if not (
        strategy == "without_replacement" and (w, d) == (2, 2) and name != "all-topk2"
    )  # 10 s each: one is enough
]


@pytest.mark.parametrize("strategy,width,depth,sampling_name", ENUM_CASES)
def test_penalised_model_drafter_is_lossless(strategy, width, depth, sampling_name):
    sampling = PENALTIES[sampling_name]
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_decoder(decoder, TreeConfig(width=width, depth=depth, strategy=strategy), sampling)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, target.joint(PROMPT, K, sampling)) < 1e-9


@pytest.mark.parametrize("verification", ["token", "traversal"])
def test_penalised_beam_under_each_rule(verification):
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    tree = TreeConfig(2, 2, "without_replacement")
    sampling = PENALTIES["all-topk2"]

    def run(rng):
        out = decoder.generate(
            list(PROMPT), K, tree=tree, sampling=sampling, rng=rng, ignore_eos=True, verification=verification
        )
        return tuple(out.token_ids)

    assert max_abs_diff(enumerate_outcomes(run), target.joint(PROMPT, K, sampling)) < 1e-9


# bigram (~10 s) with -m slow: model-free drafters stay penalised here with n-gram and lookup,
# and the bigram drafter is lossless by enumeration in tests/test_count_drafters.py.
@pytest.mark.parametrize(
    "drafter", ["ngram", "lookup", "merged", pytest.param("bigram", marks=pytest.mark.slow), "plain"]
)
def test_penalised_other_drafters_are_lossless(drafter):
    target, draft = pair()
    sampling = PENALTIES["rep1.5"]
    if drafter == "bigram":
        decoder = SpeculativeDecoder(
            TableRunner(target), drafter=BigramDrafter(torch.ones(V, V) + torch.eye(V), width=2)
        )
    else:
        decoder = SpeculativeDecoder(
            TableRunner(target), TableRunner(draft), drafter="model" if drafter == "plain" else drafter
        )
    tree = None if drafter == "plain" else TreeConfig(2, 2)

    def run(rng):
        out = decoder.generate(list(LONG_PROMPT), K, tree=tree, sampling=sampling, rng=rng, ignore_eos=True)
        return tuple(out.token_ids)

    assert max_abs_diff(enumerate_outcomes(run), target.joint(LONG_PROMPT, K, sampling)) < 1e-9


@pytest.mark.parametrize(
    "tree", [TreeConfig(2, 2), TreeConfig(3, 2, "without_replacement"), TreeConfig(2, 3, "dynamic", budget=4)]
)
def test_penalised_greedy_is_the_penalised_argmax_chain(tree):
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_decoder(decoder, tree, GREEDY_PENALTY, k=5)
    assert got == pytest.approx(target.joint(PROMPT, 5, GREEDY_PENALTY))
    assert got != pytest.approx(
        target.joint(PROMPT, 5, SamplingConfig(temperature=0))
    )  # the penalty matters here


def test_enumeration_detects_penalties_that_ignore_the_path(monkeypatch):
    """The tests above can fail: penalise every target row for the committed tokens only
    (as if the round's own draft tokens were not in the context) and the output is not p."""
    verify_mod = importlib.import_module("treespec.verify")
    real = verify_mod.tree_token_counts

    def committed_only(committed, tree, vocab_size, device, rows=None):
        counts = real(committed, TokenTree([tree.tokens[0]], [-1]), vocab_size, device)  # [1, V]
        n = len(tree) if rows is None else len(rows)
        return TokenCounts(counts.seen.expand(n, -1), counts.generated.expand(n, -1))

    monkeypatch.setattr(verify_mod, "tree_token_counts", committed_only)
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_decoder(decoder, TreeConfig(2, 2), PENALTIES["rep1.5"])
    assert max_abs_diff(got, target.joint(PROMPT, K, PENALTIES["rep1.5"])) > 1e-3


# ---- real models --------------------------------------------------------------------------------
MC_CASES = {
    "iid-w3-rep": ("model", TreeConfig(3, 2), SamplingConfig(temperature=1.0, repetition_penalty=1.8)),
    "wr-w2-freq-pres": (
        "model",
        TreeConfig(2, 2, "without_replacement"),
        SamplingConfig(temperature=0.9, frequency_penalty=1.0, presence_penalty=0.5),
    ),
}


# One chi-square with penalties in the default run (repetition); frequency and presence
# penalties (~11 s) with -m slow: the default enumeration proves them exactly ("all-topk2",
# "encourage-topp").
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "wr-w2-freq-pres" else c for c in MC_CASES]
)
def test_penalised_sampling_matches_target_joint(case):
    from .mc import PROMPT as MPROMPT
    from .mc import K as MK
    from .mc import N, chi2_pvalue
    from .mc import V as MV

    target = tiny_llama(3, hidden=32, vocab=MV)
    draft = perturbed(target, noise=0.5, seed=4)
    drafter, tree, sampling = MC_CASES[case]
    dec = SpeculativeDecoder(target, draft, drafter=drafter, backend="native")
    counts, accepted = Counter(), 0
    for seed in range(N):
        out = dec.generate(MPROMPT, MK, tree=tree, sampling=sampling, seed=seed, ignore_eos=True)
        counts[tuple(out.token_ids)] += 1
        accepted += out.sources.count("accepted")
    assert accepted > N // 10
    assert chi2_pvalue(counts, penalised_joint(target, MPROMPT, MK, MV, sampling), N) > 1e-3
    # power: the same samples are clearly not the unpenalised target
    plain = SamplingConfig(temperature=sampling.temperature)
    assert chi2_pvalue(counts, penalised_joint(target, MPROMPT, MK, MV, plain), N) < 1e-3


def penalised_joint(
    model, prompt: list[int], k: int, vocab: int, sampling: SamplingConfig
) -> dict[tuple[int, ...], float]:
    """P(x1..xk | prompt) under autoregressive sampling with penalties, one forward per prefix."""
    plain = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    out = {(): 1.0}
    for _ in range(k):
        nxt = {}
        seqs = list(out)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]  # [n, V]
        for seq, row in zip(seqs, logits):
            p = probs(reference_penalties(row, tuple(prompt), seq, sampling), plain)
            for x in range(vocab):
                nxt[seq + (x,)] = out[seq] * float(p[x])
        out = nxt
    return out


@pytest.fixture(scope="module")
def parity_pair():
    target = tiny_llama(0)
    return target, perturbed(target, noise=0.3, seed=1)


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize(
    "tree",
    [
        None,
        TreeConfig(1, 4),
        TreeConfig(3, 3),
        TreeConfig(3, 3, "without_replacement"),
        TreeConfig(3, 4, "dynamic", budget=8),
    ],
    ids=["plain", "chain", "iid", "beam", "dynamic"],
)
def test_greedy_repetition_penalty_equals_hf_generate(parity_pair, tree, backend):
    target, draft = parity_pair
    dec = SpeculativeDecoder(target, draft, backend=backend)
    sampling = SamplingConfig(temperature=0, repetition_penalty=1.3)
    accepted = differs = 0
    for prompt in PROMPTS[:6]:
        with torch.no_grad():
            want = target.generate(
                torch.tensor([prompt]),
                max_new_tokens=30,
                do_sample=False,
                repetition_penalty=1.3,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()
        out = dec.generate(prompt, 30, tree=tree, sampling=sampling, ignore_eos=True)
        assert out.token_ids == want, f"prompt {prompt}"
        accepted += out.sources.count("accepted")
        differs += want != hf_greedy(target, prompt, 30, stop_at_eos=False)
    assert differs > 0  # the penalty changed the output
    if tree is not None:
        assert accepted > 0
