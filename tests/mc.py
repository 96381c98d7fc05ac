"""Shared by the chi-square tests: a tiny Llama pair over 8 tokens, the target's exact joint
distribution of K tokens, and the chi-square test against it."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from treespec import SamplingConfig
from treespec.sampling import probs

from .conftest import perturbed, tiny_llama

V, K, N = 8, 3, 1000


PROMPT = [2, 5, 3, 2, 5, 3, 2, 5]  # repetitive, so the n-gram drafter finds matches


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(3, hidden=32, vocab=V)
    return target, perturbed(target, noise=0.5, seed=4)


def exact_joint(model, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(x1..xK | prompt) under autoregressive sampling, from one batched forward."""
    seqs = list(itertools.product(range(V), repeat=K - 1))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(s) for s in seqs])).logits  # [V^(K-1), P+K-1, V]
    step = probs(logits[:, len(PROMPT) - 1 :], sampling)  # [.., K, V]: p(x_k | prompt, x_<k)
    joint = {}
    for i, s in enumerate(seqs):
        for x in range(V):
            seq = s + (x,)
            joint[seq] = float(torch.prod(torch.stack([step[i, k, seq[k]] for k in range(K)])))
    return joint


def chi2_pvalue(counts: Counter, joint: dict, n: int) -> float:
    """Chi-square goodness of fit, pooling cells expected below 5 into one."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, p in joint.items():
        if p * n >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
        else:
            pool_o, pool_e = pool_o + counts.get(cell, 0), pool_e + p * n
    pool_o += sum(c for cell, c in counts.items() if cell not in joint)
    if pool_e == 0 and pool_o > 0:
        return 0.0  # an impossible outcome was sampled
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]  # guard rounding in the totals
    return float(chisquare(obs, exp).pvalue)
