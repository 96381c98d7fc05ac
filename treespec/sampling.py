"""Sampling transforms and the distribution algebra of verification.

`probs()` turns logits into the distribution actually sampled from. It is applied to the
target's logits (giving p) and to the draft's logits (giving q) with the same
`SamplingConfig`, and the q stored with a proposal is exactly the tensor it was drawn from.
"""

from __future__ import annotations

import torch

from .config import SamplingConfig

EPS = 1e-12  # a residual with less mass than this had (numerically) zero probability


def check_finite(logits: torch.Tensor, who: str) -> None:
    """NaN or +inf logits are an error, never a silently sampled token.

    -inf is allowed for individual tokens (a model may forbid tokens that way) but not for
    a whole row, which leaves nothing to sample.
    """
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ValueError(
            f"the {who} model produced NaN or +inf logits; check its dtype (fp16 overflow?), "
            f"its weights and its inputs"
        )
    if torch.isneginf(logits).all(dim=-1).any():
        raise ValueError(f"the {who} model produced a row of all -inf logits: no token can be sampled")


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after temperature, top-k and top-p.

    Greedy configs (temperature 0) give the one-hot argmax. float64 logits stay float64
    (exactness tests); anything else is computed in float32.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    x = x / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).indices
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, kth, True)
        x = x.masked_fill(~keep, float("-inf"))
    out = torch.softmax(x, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(out, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= cfg.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        out = out.masked_fill(drop, 0.0)
        out = out / out.sum(-1, keepdim=True)
    return out


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(r - q, 0)): the target mass not yet covered after rejecting a draw from q.

    If that mass is ~0 the rejection had probability ~0 and `r` is returned unchanged. Works
    on `[..., V]` rows and never syncs with the host (the branch is a `torch.where`).
    """
    diff = torch.clamp(r - q, min=0)
    mass = diff.sum(-1, keepdim=True)
    return torch.where(mass > EPS, diff / mass.clamp_min(EPS), r)


def weighted_residual(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target measure still to cover at a node after a proposal drawn from q, with its
    whole subtree, is rejected (block and traversal verification).

    `m` is the unnormalised target measure at the node: weight w = sum(m) times the target's
    next-token distribution. Accepting the proposal x (through its subtree) has covered
    min(m, q); what is left, max(m - q, 0), must come from the remaining options, which are
    reached with probability 1 - w + sum(max(m - q, 0)). The result, normalised by that,
    has mass S / (1 - w + S) <= 1: the next weight. With w = 1 it is `residual(m, q)`.
    If that probability is ~0 the rejection could not happen and `m` is returned unchanged.
    Works on `[..., V]` rows, no host sync.
    """
    left = torch.clamp(m - q, min=0)
    reach = 1 - m.sum(-1, keepdim=True) + left.sum(-1, keepdim=True)
    return torch.where(reach > EPS, left / reach.clamp_min(EPS), m)


def remove_token(q: torch.Tensor, x: int, drawn: torch.Tensor | None = None) -> torch.Tensor:
    """q with token x removed, renormalised: the next draw of a without-replacement sequence.

    If nothing is left, the next draw is uniform over the tokens not yet drawn (`drawn` marks
    the ones already drawn; x is added to it in place). No host sync.
    """
    if drawn is None:
        drawn = torch.zeros_like(q, dtype=torch.bool)
    drawn[x] = True
    out = q.masked_fill(drawn, 0)
    mass = out.sum()
    alive = (~drawn).to(q.dtype)
    return torch.where(mass > EPS, out / mass.clamp_min(EPS), alive / alive.sum())


def one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[x] = 1
    return out
