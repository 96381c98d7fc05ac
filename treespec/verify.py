"""The verification walk: descend the draft tree, accept or reject proposals, emit one more token.

Given the target's logits at every node (one forward), the walk starts at the root with the
running residual r = p_root and tries the node's proposals in order:

    i.i.d. token x from q:          accept w.p. min(1, r(x)/q(x)); else r <- norm(max(r - q, 0))
    without replacement, k-th draw: same, with q_k; then q_{k+1} = q_k without x, renormalised
    deterministic token x:          the i.i.d. rule with q one-hot on x

An accepted proposal moves the walk to its child, where r starts again from that child's p.
When every proposal at a node is rejected, the *correction* token is drawn from r; at a leaf
the *bonus* token is drawn from the leaf's own p. Either way the round ends, having emitted
the accepted tokens plus that one token, distributed exactly as the target would sample them
(SpecInfer's multi-step speculative sampling; Stratos, iterative speculative sampling).

Greedy (temperature 0) follows the child whose token is argmax p, and emits argmax p where
no child matches: exactly the target's greedy output.

Host syncs. The sampling transforms and softmax run once over all N rows on the model's
device. Greedy needs one transfer per round (argmax and a finiteness flag for every row).
The sampled walk needs one transfer per round for the input checks, one per visited node
with proposals (all its acceptance probabilities, computed on the device along the residual
chain "every earlier proposal rejected", go to `Rng.first_success` together), and one for
the final token: O(depth), never O(nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .config import SamplingConfig
from .proposal import DraftTree, Draw, ProposalGroup
from .rng import Rng
from .sampling import check_finite, probs, remove_token, residual


@dataclass(frozen=True)
class Walk:
    path: tuple[int, ...]  # accepted nodes, root first; path[1:] are accepted draft tokens
    token: int  # the correction or bonus token that ends the round
    kind: Literal["correction", "bonus"]  # correction: all proposals at path[-1] rejected

    def emitted(self, draft: DraftTree) -> list[int]:
        """Tokens this round appends to the sequence."""
        return [draft.tree.tokens[n] for n in self.path[1:]] + [self.token]


def verify(draft: DraftTree, target_logits: torch.Tensor, sampling: SamplingConfig, rng: Rng) -> Walk:
    """Walk `draft` given the target's logits at each node (`[N, V]`, row i = after node i)."""
    if target_logits.shape[0] != len(draft.tree):
        raise ValueError(f"{target_logits.shape[0]} logit rows for {len(draft.tree)} tree nodes")
    if sampling.greedy:
        return _verify_greedy(draft, target_logits)
    return _verify_sampled(draft, target_logits, sampling, rng)


def _verify_greedy(draft: DraftTree, logits: torch.Tensor) -> Walk:
    best, bad = torch.stack([logits.argmax(-1), _bad_rows(logits)]).tolist()  # [2, N]: the one transfer
    node, path = 0, [0]
    while True:
        if bad[node]:
            check_finite(logits[node], "target")  # raises the precise error
        child = next((c for g in draft.groups_at(node) for c, t in zip(g.children, g.tokens) if t == best[node]), None)
        if child is None:
            kind = "bonus" if draft.tree.is_leaf(node) else "correction"
            return Walk(tuple(path), best[node], kind)
        node = child
        path.append(child)


def _verify_sampled(draft: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, rng: Rng) -> Walk:
    p = probs(logits, sampling)  # [N, V] p at every node, one batched op
    _check_inputs(draft, logits)
    node, path = 0, [0]
    while True:
        r = p[node]  # [V] the running residual starts as p at this node
        groups = draft.groups_at(node)
        if groups:
            accept, r = _acceptance_chain(groups, r)
            i = rng.first_success(accept)
            if i is not None:
                node = [c for g in groups for c in g.children][i]
                path.append(node)
                continue
        kind = "bonus" if draft.tree.is_leaf(node) else "correction"
        return Walk(tuple(path), rng.categorical(r)[0], kind)


def _acceptance_chain(groups: list[ProposalGroup], r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance probabilities [k] of a node's k proposals in order, each given that every
    earlier one was rejected, and the residual after all k rejections. On the device."""
    accept = []
    for group in groups:
        q = None if group.q is None else group.q.to(r.dtype)
        drawn = torch.zeros_like(r, dtype=torch.bool)
        for x in group.tokens:
            if q is None:  # deterministic: q is one-hot on x
                accept.append(r[x].clamp(max=1.0))
                one_hot = torch.zeros_like(r)
                one_hot[x] = 1
                r = residual(r, one_hot)
                continue
            accept.append((r[x] / q[x]).clamp(max=1.0))
            r = residual(r, q)
            if group.draw is Draw.WITHOUT_REPLACEMENT:
                q = remove_token(q, x, drawn)
    return torch.stack(accept), r


def _bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows with NaN or +inf, or with no finite-or-allowed token (all -inf)."""
    return (logits.isnan() | logits.isposinf()).any(-1) | logits.isneginf().all(-1)


def _check_inputs(draft: DraftTree, logits: torch.Tensor) -> None:
    """Every row finite and every stochastic proposal drawn from a q that gives it mass:
    one host transfer for the whole tree."""
    qx = [g.q[list(g.tokens)].to(logits.device, logits.dtype) for g in draft.groups if g.q is not None]
    flags = [_bad_rows(logits).any()[None].to(logits.dtype)] + [(x <= 0).any()[None].to(logits.dtype) for x in qx]
    bad_row, *bad_q = torch.cat(flags).tolist()
    if bad_row:
        check_finite(logits, "target")
    for g, bad in zip((g for g in draft.groups if g.q is not None), bad_q):
        if bad:
            raise ValueError(f"a proposal among {list(g.tokens)} has draft probability 0: it was not drawn from the stored q")
