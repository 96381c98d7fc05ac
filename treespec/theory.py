"""Closed forms of speculative decoding, as the papers state them.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding":
  alpha = E[beta], beta = sum_x min(p(x), q(x))                        (Cor. 3.6, Def. 3.2)
  E[tokens per target step] = (1 - a^(g+1)) / (1 - a)                  (Eq. 1)
  walltime improvement      = (1 - a^(g+1)) / ((1 - a)(g c + 1))       (Thm. 3.8)
  arithmetic operations     = (1 - a)(g c_hat + g + 1) / (1 - a^(g+1))  (Thm. 3.11)
  if a > c, gamma = 1 already improves by at least (1 + a)/(1 + c)    (Cor. 3.9)
  the optimal gamma is the integer maximising the improvement           (Sec. 3.5, Fig. 3)
with a = alpha, g = gamma (draft tokens per step), c = t_draft / t_target per forward and
c_hat = draft / target arithmetic operations per token.

Stratos' notes on iterative speculative sampling: with per-position acceptance probabilities
beta_1..beta_T (the draft token at position t is accepted given that positions < t were),
the accepted length L (the final correction/bonus token counted) has
  E[L] = 1 + sum_{t=1..T} prod_{s<=t} beta_s,
which is (1 - b^(T+1)) / (1 - b) for a constant b (4.5705 for b = 0.8, T = 10).

Trees (Sequoia, Chen et al. 2024): expected tokens per step of a tree shape from a positional
acceptance vector is `treespec.sequoia.tree_expected_tokens`, re-exported here, with helpers
that build chains and k-ary trees to compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sequoia import tree_expected_tokens

__all__ = [
    "alpha",
    "chain_parents",
    "expected_accepted_length",
    "chain_expected_tokens",
    "improvement_lower_bound",
    "kary_parents",
    "multidraft_acceptance",
    "operations_factor",
    "optimal_gamma",
    "tree_expected_tokens",
    "walltime_improvement",
]


def _check_alpha(alpha: float) -> float:
    a = float(alpha)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    return a


def _geometric(a: float, gamma: int) -> float:
    """1 + a + ... + a^gamma = (1 - a^(gamma+1)) / (1 - a), continuous at a = 1."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}")
    return float(gamma + 1) if a == 1.0 else (1.0 - a ** (gamma + 1)) / (1.0 - a)


def chain_expected_tokens(alpha: float, gamma: int) -> float:
    """Leviathan Eq. 1: expected tokens per target step with gamma draft tokens."""
    return _geometric(_check_alpha(alpha), gamma)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Leviathan Thm. 3.8: expected walltime improvement factor over plain decoding."""
    if c < 0:
        raise ValueError(f"c (draft/target cost ratio) must be >= 0, got {c!r}")
    return chain_expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def operations_factor(alpha: float, gamma: int, c_hat: float = 0.0) -> float:
    """Leviathan Thm. 3.11: expected factor of increase in arithmetic operations."""
    if c_hat < 0:
        raise ValueError(f"c_hat must be >= 0, got {c_hat!r}")
    return (gamma * c_hat + gamma + 1.0) / chain_expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 1000, min_gamma: int = 1) -> int:
    """Leviathan Sec. 3.5: the integer gamma in [min_gamma, max_gamma] maximising Thm. 3.8.

    The improvement is unimodal in gamma, so the scan stops once it decreases. Pass
    min_gamma=0 to allow "do not speculate" (improvement 1) when drafting does not pay.
    """
    best_g, best = min_gamma, walltime_improvement(alpha, min_gamma, c)
    for g in range(min_gamma + 1, max_gamma + 1):
        v = walltime_improvement(alpha, g, c)
        if v > best:
            best_g, best = g, v
        elif v < best:
            break
    return best_g


def improvement_lower_bound(alpha: float, c: float) -> float:
    """Leviathan Cor. 3.9: if alpha > c, some gamma improves walltime by >= (1 + alpha)/(1 + c)
    (gamma = 1 attains it); returns that bound (meaningful when alpha > c)."""
    return (1.0 + _check_alpha(alpha)) / (1.0 + c)


def alpha(p, q) -> float:
    """Leviathan Cor. 3.6: beta = sum_x min(p(x), q(x)), averaged over leading dimensions.

    `p`, `q`: probability vectors or [..., V] arrays/tensors of them (numpy or torch).
    """
    try:
        import torch

        if isinstance(p, torch.Tensor) or isinstance(q, torch.Tensor):
            p, q = torch.as_tensor(p, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
            return float(torch.minimum(p, q).sum(-1).mean())
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    import numpy as np

    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return float(np.minimum(p, q).sum(-1).mean())


def expected_accepted_length(beta: float | Sequence[float], T: int | None = None) -> float:
    """Stratos: E[L] for per-position acceptance beta_1..beta_T, the final token counted.

    `beta` is a constant (then `T` is required) or the sequence beta_1..beta_T.
    E[L] = 1 + sum_t prod_{s<=t} beta_s; constant beta: (1 - beta^(T+1)) / (1 - beta).
    """
    if isinstance(beta, (int, float)):
        if T is None:
            raise ValueError("a constant beta needs T (the number of draft positions)")
        betas = [float(beta)] * int(T)
    else:
        betas = [float(b) for b in beta]
        if T is not None and T != len(betas):
            raise ValueError(f"T={T} but {len(betas)} acceptance probabilities given")
    total, reach = 1.0, 1.0
    for b in betas:
        _check_alpha(b)
        reach *= b
        total += reach
    return total


def multidraft_acceptance(beta: float, k: int) -> float:
    """Per-position acceptance with k drafts that would each be accepted w.p. beta, if the k
    trials were independent: 1 - (1 - beta)^k. (Iterative speculative sampling with i.i.d.
    drafts does at least as well as one draft; this independence form is the textbook
    approximation used for the multi-draft E[L]: expected_accepted_length(multidraft_acceptance(b, k), T).)"""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    return 1.0 - (1.0 - _check_alpha(beta)) ** k


def chain_parents(depth: int) -> tuple[int, ...]:
    """Parent pointers of a chain of `depth` draft nodes (linear speculation)."""
    return (-1,) + tuple(range(depth))


def kary_parents(k: int, depth: int) -> tuple[int, ...]:
    """Parent pointers of the complete k-ary tree of the given depth (k + k^2 + ... nodes),
    breadth first, so children of a node are listed in rank order."""
    if k < 1 or depth < 0:
        raise ValueError("kary_parents needs k >= 1 and depth >= 0")
    parents, frontier = [-1], [0]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            for _ in range(k):
                parents.append(u)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return tuple(parents)
