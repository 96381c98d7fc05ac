"""Losslessness, tested statistically on real (tiny) transformer models.

Many seeded generations of K tokens; chi-square of the emitted K-grams against the target's
exact joint distribution, computed by running the target on every prefix. Seeds are fixed,
so the test is deterministic; the threshold is p < 1e-3.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.rng import TorchRng
from treespec.sequoia import TreeShape

from .mc import PROMPT, K, N, V, chi2_pvalue, exact_joint, models  # noqa: F401 (fixture)

CASES = {  # name: (drafter, tree, sampling)
    "linear-T1": ("model", TreeConfig(1, 2), SamplingConfig(temperature=1.0)),
    "iid-w3-topp": ("model", TreeConfig(3, 2), SamplingConfig(temperature=0.9, top_p=0.9)),
    "wr-w3-topk": (
        "model",
        TreeConfig(3, 2, "without_replacement"),
        SamplingConfig(temperature=1.2, top_k=5),
    ),
    "topk-w2": ("model", TreeConfig(2, 2, "topk"), SamplingConfig(temperature=0.7)),
    "ngram-w2": ("ngram", TreeConfig(2, 2), SamplingConfig(temperature=1.0)),
    "merged-w2": ("merged", TreeConfig(2, 2), SamplingConfig(temperature=0.8, top_p=0.95)),
    "lookup-w2": ("lookup", TreeConfig(2, 2), SamplingConfig(temperature=1.0)),
    "dynamic-b4": ("model", TreeConfig(2, 2, "dynamic", budget=4), SamplingConfig(temperature=0.8)),
    "sequoia": (
        "model",
        TreeConfig(depth=2, strategy="sequoia", shape=TreeShape((-1, 0, 0, 1))),
        SamplingConfig(temperature=1.0),
    ),
    "adaptive-hf": (
        "model",
        TreeConfig(2, 1, adaptive="hf", depth_min=1, depth_max=2),
        SamplingConfig(temperature=1.0, top_k=6),
    ),
}


# The HF backend runs the same decoder, drafters and walk; it differs only in the runner, whose
# logits and caches test_runner.py checks against sequential decoding (and greedy parity,
# batches == alone and penalties run on it in the default run): its chi-square cases (an i.i.d.
# tree with top-p, ~10 s; a chain, draws without replacement, the merged drafter) run with
# -m slow.
HF_CASES = ("linear-T1", "iid-w3-topp", "wr-w3-topk", "merged-w2")
# The default run keeps a chain, an i.i.d. tree (the real runner's tree forwards) and the
# model-free drafters. Draws without replacement, top-k, budgeted, adaptive, Sequoia and merged
# trees are lossless by exact enumeration in the default run (tests/test_exact_enumeration.py,
# tests/test_verification.py), and the Rng's draws without replacement are sequential sampling
# by chi-square (below); their chi-square here (~5-8 s each) runs with -m slow.
SLOW_NATIVE = ("wr-w3-topk", "topk-w2", "merged-w2", "dynamic-b4", "sequoia", "adaptive-hf")
BACKEND_CASES = [
    pytest.param(case, "native", id=f"{case}-native", marks=pytest.mark.slow if case in SLOW_NATIVE else ())
    for case in CASES
] + [pytest.param(case, "hf", id=f"{case}-hf", marks=pytest.mark.slow) for case in HF_CASES]


@pytest.mark.parametrize("case,backend", BACKEND_CASES)
def test_sampled_output_matches_target_joint(models, case, backend):
    target, draft = models
    drafter, tree, sampling = CASES[case]
    dec = SpeculativeDecoder(target, draft, drafter=drafter, backend=backend)
    counts, accepted = Counter(), 0
    for seed in range(N):
        out = dec.generate(PROMPT, K, tree=tree, sampling=sampling, seed=seed, ignore_eos=True)
        counts[tuple(out.token_ids)] += 1
        accepted += out.sources.count("accepted")
    assert accepted > N // 10  # the drafts were really used
    joint = exact_joint(target, sampling)
    assert chi2_pvalue(counts, joint, N) > 1e-3
    # power check: the same samples are clearly NOT the target at another temperature
    other = SamplingConfig(temperature=sampling.temperature * 1.6, top_k=sampling.top_k, top_p=sampling.top_p)
    assert chi2_pvalue(counts, exact_joint(target, other), N) < 1e-3


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_rng_without_replacement_is_sequential_sampling(k, dtype):
    q = torch.tensor([0.45, 0.0, 0.25, 0.15, 0.1, 0.05, 0.0], dtype=dtype)  # zeros: never drawn
    support = [i for i, p in enumerate(q.tolist()) if p > 0]
    exact = {}
    for seq in itertools.permutations(support, k):
        prob, left = 1.0, 1.0
        for x in seq:
            prob, left = prob * float(q[x]) / left, left - float(q[x])
        exact[seq] = prob
    rng, n = TorchRng(0), 8000
    counts = Counter(tuple(rng.without_replacement(q, k)) for _ in range(n))
    assert set(counts) <= set(exact)
    assert chi2_pvalue(counts, exact, n) > 1e-3
    # power: the same draws are clearly not i.i.d. tokens from q (k > 1) / not from a flatter q
    wrong = (
        {seq: math.prod(float(q[x]) for x in seq) for seq in itertools.product(support, repeat=k)}
        if k > 1
        else {(x,): 1 / len(support) for x in support}
    )
    assert chi2_pvalue(counts, wrong, n) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_rng_categorical_draws_from_probs(dtype):
    q = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0], dtype=dtype)  # zeros inside and at the end
    rng, n = TorchRng(1), 8000
    draws = rng.categorical(q, n // 2) + [t for _ in range(n // 2) for t in rng.categorical(q)]
    counts = Counter((t,) for t in draws)
    assert not {0, 2, 6} & {t for (t,) in counts}  # zero probability: never drawn
    assert chi2_pvalue(counts, {(i,): float(p) for i, p in enumerate(q) if p > 0}, n) > 1e-3
    assert chi2_pvalue(counts, {(1,): 0.4, (3,): 0.4, (4,): 0.15, (5,): 0.05}, n) < 1e-3  # power
