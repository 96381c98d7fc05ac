"""Sampling transforms and the distribution algebra of verification.

`probs()` turns logits into the distribution actually sampled from. It is applied to the
target's logits (giving p) and to the draft's logits (giving q) with the same
`SamplingConfig`, and the q stored with a proposal is exactly the tensor it was drawn from.

Penalties (repetition, frequency, presence) make a row's distribution depend on the context
it is sampled after. In a tree that context is the committed sequence plus the row's own
root-to-node path, so `tree_token_counts` gives every row its own counts (one matmul of the
ancestor mask with the one-hot node tokens, on the device) and `probs(..., counts)` applies
them: the target's rows in verification and the drafters' rows, level by level, go through
this same code, so p and q are penalised identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .config import SamplingConfig
from .tree import TokenTree

EPS = 1e-12  # a residual with less mass than this had (numerically) zero probability


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] -> (values [...], indices [...] int64): each row's maximum and its first index,
    as `torch.max(x, -1)` (a NaN counts as the maximum). CPU float32 and bfloat16 rows go
    through `kernels.reduce`'s one vectorised pass where the kernels are built (values then
    float32): torch's CPU max over a dim is scalar, 44 us for one row of 49,152."""
    return _kernel_row_max(x) if _row_max_runs_on(x) else x.max(-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: each row's first maximum, as `torch.argmax` (a NaN counts as
    the maximum): `row_max`'s kernel where it runs, else numpy's vectorised argmax for CPU
    float32 (torch's CPU argmax is scalar: 43 us against 7 us for one row of 49,152)."""
    if _row_max_runs_on(x):
        return _kernel_row_max(x)[1]
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.as_tensor(np.argmax(x.numpy(), axis=-1))
    return x.argmax(-1)


_row_max_runs: list[bool] = []  # [True] once `kernels.reduce` answered that it runs


def _kernel_row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_max` by `kernels.reduce` (where `_row_max_runs_on(x)`)."""
    values, indices = torch.ops.treespec.row_max(x.reshape(-1, x.shape[-1]))
    return values.view(x.shape[:-1]), indices.view(x.shape[:-1])


def _row_max_runs_on(x: torch.Tensor) -> bool:
    """Whether `kernels.reduce.row_max` takes `x`: CPU float32 or bfloat16 rows, no autograd,
    the kernels built on an AVX512 core (asked until they are: a process may build them later)."""
    rows = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    if not rows or not x.numel() or x.requires_grad:
        return False
    if not _row_max_runs:
        from .backends.kernels import reduce

        if not reduce.available():
            return False
        _row_max_runs.append(True)
    return True


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] bool: rows with a NaN or +inf, or with every token at -inf. One
    reduction: a row's max is finite iff none of these holds (amax propagates NaN)."""
    return ~torch.isfinite(logits.amax(dim=-1))


def check_finite(logits: torch.Tensor, who: str) -> None:
    """NaN or +inf logits are an error, never a silently sampled token.

    -inf is allowed for individual tokens (a model may forbid tokens that way) but not for
    a whole row, which leaves nothing to sample. Fine logits cost one reduction and one host
    read (`nonfinite_rows`); the precise diagnosis runs only on a failure.
    """
    if not bool(nonfinite_rows(logits).any()):
        return
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ValueError(
            f"the {who} model produced NaN or +inf logits; check its dtype (fp16 overflow?), "
            f"its weights and its inputs"
        )
    if torch.isneginf(logits).all(dim=-1).any():
        raise ValueError(f"the {who} model produced a row of all -inf logits: no token can be sampled")


@dataclass(frozen=True)
class PenaltyContext:
    """The committed sequence the penalties look back on: prompt + emitted tokens."""

    tokens: Sequence[int]
    prompt_len: int  # tokens[:prompt_len] is the prompt (frequency / presence skip it)


@dataclass(frozen=True)
class TokenCounts:
    """What the penalties read for each row: row i belongs to logits row i."""

    seen: torch.Tensor  # [N, V] bool: in the prompt, the generated tokens or the row's path
    generated: torch.Tensor  # [N, V] float: occurrences among generated tokens + the row's path


def tree_token_counts(
    committed: PenaltyContext,
    tree: TokenTree,
    vocab_size: int,
    device: torch.device | str,
    rows: Sequence[int] | None = None,
) -> TokenCounts:
    """Token counts of the context after each node of `tree` (all nodes, or `rows`): the
    committed sequence (whose last token is the root) plus the node's path below the root."""
    ctx = torch.tensor(list(committed.tokens), dtype=torch.long, device=device)  # [L]
    generated = torch.bincount(ctx[committed.prompt_len :], minlength=vocab_size).float()  # [V]
    prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    prompt[ctx[: committed.prompt_len]] = True  # [V]
    on_path = tree.ancestor_mask.to(device)[:, 1:]  # [N, N-1]: node j (j >= 1) is on row i's path
    if rows is not None:
        on_path = on_path[torch.tensor(list(rows), dtype=torch.long, device=device)]  # [n, N-1]
    below_root = torch.tensor(tree.tokens[1:], dtype=torch.long, device=device)  # [N-1]
    # path[i, token of node j] += 1 for every node j on row i's path: a scatter-add, so no
    # [N, V] one-hot is built (128k-token vocabularies)
    path = torch.zeros(on_path.shape[0], vocab_size, device=device).scatter_add_(
        1, below_root.expand(on_path.shape[0], -1), on_path.float()
    )  # [n, V]
    counts = generated + path  # [n, V]
    return TokenCounts(seen=prompt | (counts > 0), generated=counts)


def penalize(logits: torch.Tensor, cfg: SamplingConfig, counts: TokenCounts | None) -> torch.Tensor:
    """[N, V] logits with the repetition, frequency and presence penalties of `cfg` applied
    (row i with counts row i); unchanged when no penalty is on or `counts` is None."""
    if counts is None or not cfg.penalized:
        return logits
    x = logits
    if cfg.repetition_penalty != 1:
        rp = cfg.repetition_penalty
        x = torch.where(counts.seen, torch.where(x < 0, x * rp, x / rp), x)
    if cfg.frequency_penalty != 0 or cfg.presence_penalty != 0:
        n = counts.generated.to(x.dtype)
        x = x - cfg.frequency_penalty * n - cfg.presence_penalty * (n > 0).to(x.dtype)
    return x


def probs(logits: torch.Tensor, cfg: SamplingConfig, counts: TokenCounts | None = None) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after the penalties (given the rows'
    `counts`; see `SamplingConfig`), temperature, top-k and top-p.

    Greedy configs (temperature 0) give the one-hot argmax of the penalised logits. float64
    logits stay float64 (exactness tests); anything else is computed in float32.
    """
    if cfg.penalized and counts is None:
        raise ValueError("this SamplingConfig has penalties: pass the rows' token counts (tree_token_counts)")
    x = penalize(logits if logits.dtype == torch.float64 else logits.float(), cfg, counts)
    if cfg.greedy:
        return torch.zeros_like(x).scatter_(-1, argmax(x).unsqueeze(-1), 1.0)  # one-hot argmax
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


def weighted_mass(mass: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """The mass of `weighted_residual(m, q)` from two numbers per row: `mass` = sum(m) and
    `left` = sum(max(m - q, 0)); S / (1 - w + S) as there (w where the rejection could not
    happen). Block verification needs only these for the nodes it does not stop at."""
    reach = 1 - mass + left
    return torch.where(reach > EPS, left / reach.clamp_min(EPS), mass)


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
