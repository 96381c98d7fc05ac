"""Divergences between the target's stored top-k distribution and the draft's, per position.

Only the target's top-k probabilities are stored, so both distributions are compared on the
same k + 1 buckets: each of the k stored tokens, and "the rest" (the target's tail mass
1 - sum(top-k), the draft's mass outside those k tokens). A stored token the draft cannot
emit (outside a subset vocabulary) moves into the rest bucket for both. The buckets merge
tokens only in the tail, so every divergence here is a lower bound on the full-vocabulary one
and equals it when the tail is empty.

    kl   forward KL(p || q): the maximum-likelihood objective, mode-covering
    tv   total variation 1/2 sum |p - q|: 1 - TV is the acceptance rate alpha (Leviathan)
    jsd  Jensen-Shannon divergence (base e), bounded and symmetric

`alpha_lower_bound` is sum over the stored tokens of min(p, q): a lower bound on
alpha = sum_x min(p(x), q(x)) that differs from it by at most the tail mass.
"""

from __future__ import annotations

import torch

EPS = 1e-12


def buckets(logq: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, valid: torch.Tensor):
    """Bucketed distributions from draft log-probs `logq` [M, V], stored target `ids` [M, k]
    (indices into logq's columns; any value where not `valid`) and probs `p` [M, k].

    Returns (P, Q, logQ), each [M, k + 1]: the last column is the rest bucket."""
    logq_top = logq.gather(-1, ids.clamp(min=0)).masked_fill(~valid, float("-inf"))  # [M, k]
    q_top = logq_top.exp()
    p_top = p * valid
    p_rest = (1 - p_top.sum(-1, keepdim=True)).clamp(min=0)
    q_rest = (1 - q_top.sum(-1, keepdim=True)).clamp(min=0)
    P = torch.cat([p_top, p_rest], -1)
    Q = torch.cat([q_top, q_rest], -1)
    logQ = torch.cat([logq_top, q_rest.clamp(min=EPS).log()], -1)
    return P, Q, logQ


def _xlogy(x: torch.Tensor, y_log: torch.Tensor) -> torch.Tensor:
    """x * log y with 0 * log 0 = 0 (no NaN from 0 * -inf)."""
    return torch.where(x > 0, x * y_log, torch.zeros_like(x))


def divergence(name: str, P: torch.Tensor, Q: torch.Tensor, logQ: torch.Tensor) -> torch.Tensor:
    """[M] per-position divergence `name` ("kl", "tv" or "jsd") on bucketed P, Q [M, k + 1]."""
    if name == "kl":
        return (_xlogy(P, P.clamp(min=EPS).log()) - _xlogy(P, logQ)).sum(-1)
    if name == "tv":
        return 0.5 * (P - Q).abs().sum(-1)
    if name == "jsd":
        logM = (0.5 * (P + Q)).clamp(min=EPS).log()
        logP = P.clamp(min=EPS).log()
        return 0.5 * (_xlogy(P, logP) - _xlogy(P, logM) + _xlogy(Q, logQ) - _xlogy(Q, logM)).sum(-1)
    raise ValueError(f"unknown loss {name!r}")


def alpha_lower_bound(P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[M] sum of min(p, q) over the stored tokens (the rest bucket excluded)."""
    return torch.minimum(P[:, :-1], Q[:, :-1]).sum(-1)


def tv_distance(P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[M] total variation on the buckets (boost-tuning weights the next draft's data by it)."""
    return 0.5 * (P - Q).abs().sum(-1)
