"""Unigram / bigram count drafters: lossless by enumeration (1e-9) and by chi-square."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from treespec import BigramDrafter, SamplingConfig, SpeculativeDecoder, TreeConfig, UnigramDrafter
from treespec.drafters.counts import load_counts
from treespec.sampling import probs

from .conftest import tiny_llama
from .mc import PROMPT as MC_PROMPT
from .mc import V as MC_V
from .mc import chi2_pvalue, exact_joint
from .toy import TableModel, TableRunner, enumerate_outcomes, max_abs_diff

V, K = 3, 3
PROMPT = (1, 0)
SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.6-topk2": SamplingConfig(temperature=0.6, top_k=2),
    "T1.4-topp0.7": SamplingConfig(temperature=1.4, top_p=0.7),
}
UNIGRAM = np.array([5.0, 1.0, 2.0])
BIGRAM = np.array([[0.0, 4.0, 1.0], [3.0, 0.0, 0.0], [1.0, 1.0, 6.0]])  # zeros: the prior fills them


def drafters(width):
    return {
        "unigram": UnigramDrafter(UNIGRAM, width=width),
        "bigram": BigramDrafter(BIGRAM, width=width, smoothing=0.5),
    }


def enumerate_joint(drafter, tree, sampling, k=K):
    target = TableModel(V, seed=11)
    dec = SpeculativeDecoder(TableRunner(target), drafter=drafter)
    nodes = []

    def run(rng):
        out = dec.generate(list(PROMPT), k, tree=tree, sampling=sampling, rng=rng, ignore_eos=True)
        nodes.append(out.stats.tree_nodes)
        return tuple(out.token_ids)

    return enumerate_outcomes(run), target.joint(PROMPT, k, sampling), nodes


# (3, 2) only with top-k = 2: over all 3 tokens it takes 25 s to enumerate
SHAPE_CASES = [(w, d, s) for w, d in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)] for s in SAMPLINGS] + [
    (3, 2, "T0.6-topk2")
]


@pytest.mark.parametrize("kind", ["unigram", "bigram"])
@pytest.mark.parametrize("width,depth,sampling_name", SHAPE_CASES)
def test_count_drafters_are_lossless(kind, width, depth, sampling_name):
    got, want, nodes = enumerate_joint(
        drafters(width)[kind], TreeConfig(width, depth), SAMPLINGS[sampling_name]
    )
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, want) < 1e-9
    assert max(nodes) > 0


@pytest.mark.parametrize("kind", ["unigram", "bigram"])
def test_count_drafters_greedy_is_the_target_argmax_chain(kind):
    greedy = SamplingConfig(temperature=0)
    got, want, _ = enumerate_joint(drafters(2)[kind], TreeConfig(2, 2), greedy, k=4)
    assert len(got) == 1 and got == pytest.approx(want)


def test_q_is_the_sampling_transform_of_log_counts():
    s = SamplingConfig(temperature=0.7, top_k=2)
    uni = UnigramDrafter(UNIGRAM, smoothing=1.0)
    uni.start([0], s, None)
    assert torch.allclose(uni.q(2), probs(torch.log(torch.tensor(UNIGRAM + 1.0)), s))
    bi = BigramDrafter(BIGRAM, smoothing=2.0)
    bi.start([0], s, None)
    prior = 2.0 * (BIGRAM.sum(0) + 1) / (BIGRAM.sum(0) + 1).sum()
    assert torch.allclose(bi.q(0), probs(torch.log(torch.tensor(BIGRAM[0] + prior)), s))


def test_bundled_counts():
    f = load_counts()
    V_ = f["unigram"].size
    assert V_ == 8192 and f["bigram_indptr"].shape == (V_ + 1,)
    assert f["bigram_indptr"][-1] == f["bigram_counts"].size == f["bigram_indices"].size
    assert f["unigram"].sum() > 2_000_000  # the pair's 2.96M training tokens
    bi, uni = BigramDrafter(width=3), UnigramDrafter(width=3)
    for d in (bi, uni):
        d.start([0], SamplingConfig(temperature=1.0), __import__("treespec").TorchRng(0))
        tree = d.propose([0, 5, 9], 3).tree
        assert 1 < len(tree) <= 1 + 9 and tree.max_depth == 3


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError):
        UnigramDrafter(np.array([1.0, -1.0]))
    with pytest.raises(ValueError):
        BigramDrafter(np.ones((2, 3)))
    with pytest.raises(ValueError):
        UnigramDrafter(UNIGRAM, width=0)
    with pytest.raises(ValueError):
        UnigramDrafter(UNIGRAM, smoothing=0)


@pytest.mark.parametrize("kind,width", [("unigram", 2), ("bigram", 3)])
def test_count_drafters_chi_square(kind, width):
    """Seeded generations with a tiny real Llama; chi-square against the exact joint."""
    target = tiny_llama(3, hidden=32, vocab=MC_V)
    rng = np.random.default_rng(7)
    # counts shaped like the target's own statistics, so the drafts are often accepted
    uni = rng.integers(0, 20, MC_V).astype(float)
    bi = rng.integers(0, 6, (MC_V, MC_V)).astype(float)
    drafter = UnigramDrafter(uni, width=width) if kind == "unigram" else BigramDrafter(bi, width=width)
    sampling = SamplingConfig(temperature=1.0)
    dec = SpeculativeDecoder(target, drafter=drafter)
    counts, accepted, n = Counter(), 0, 1000
    for seed in range(n):
        out = dec.generate(
            MC_PROMPT, 3, tree=TreeConfig(width, 2), sampling=sampling, seed=seed, ignore_eos=True
        )
        counts[tuple(out.token_ids)] += 1
        accepted += out.sources.count("accepted")
    assert accepted > n // 10
    assert chi2_pvalue(counts, exact_joint(target, sampling), n) > 1e-3
    assert chi2_pvalue(counts, exact_joint(target, SamplingConfig(temperature=1.6)), n) < 1e-3


def test_counts_file_gives_the_drafters_of_its_counts(tmp_path):
    """A counts file in the bundled format (unigram + CSR bigram) makes the same drafters as
    the dense arrays it holds (experiments/alpha_table.py writes such files for other pairs)."""
    rows, cols = np.nonzero(BIGRAM)
    path = tmp_path / "counts.npz"
    np.savez(
        path,
        unigram=UNIGRAM,
        bigram_indptr=np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=V))]),
        bigram_indices=cols.astype(np.int32),
        bigram_counts=BIGRAM[rows, cols].astype(np.int32),
    )
    for prev in range(V):
        want = BigramDrafter(BIGRAM, unigram=UNIGRAM, smoothing=0.5).logits(prev)
        assert torch.allclose(BigramDrafter(counts_file=path, smoothing=0.5).logits(prev), want)
    assert torch.allclose(UnigramDrafter(counts_file=path).logits(0), UnigramDrafter(UNIGRAM).logits(0))
    with pytest.raises(ValueError, match="cannot read token counts"):
        UnigramDrafter(counts_file=tmp_path / "missing.npz")
