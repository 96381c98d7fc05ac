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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .config import SamplingConfig
from .proposal import DraftTree, Draw
from .rng import Rng
from .sampling import check_finite, one_hot, probs, remove_token, residual


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
    node, path = 0, [0]
    while True:
        check_finite(logits[node], "target")
        best = int(logits[node].argmax())
        child = next((c for g in draft.groups_at(node) for c, t in zip(g.children, g.tokens) if t == best), None)
        if child is None:
            kind = "bonus" if draft.tree.is_leaf(node) else "correction"
            return Walk(tuple(path), best, kind)
        node = child
        path.append(child)


def _verify_sampled(draft: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, rng: Rng) -> Walk:
    node, path = 0, [0]
    while True:
        check_finite(logits[node], "target")
        r = probs(logits[node], sampling)  # [V] p at this node; shrinks into the residual
        child = _try_groups(draft, node, r, rng)
        if child is None:
            kind = "bonus" if draft.tree.is_leaf(node) else "correction"
            return Walk(tuple(path), rng.categorical(r)[0], kind)
        node = child
        path.append(child)


def _try_groups(draft: DraftTree, node: int, r: torch.Tensor, rng: Rng) -> int | None:
    """Try every proposal at `node`; return the accepted child, or None with `r` the residual."""
    for group in draft.groups_at(node):
        q = None if group.q is None else group.q.to(r.dtype)
        drawn = torch.zeros_like(r, dtype=torch.bool)
        for x, child in zip(group.tokens, group.children):
            qx = 1.0 if q is None else float(q[x])
            if qx <= 0:
                raise ValueError(f"proposal {x} has draft probability 0: it was not drawn from the stored q")
            if rng.bernoulli(min(1.0, float(r[x]) / qx)):
                return child
            r.copy_(residual(r, one_hot(x, r) if q is None else q))
            if group.draw is Draw.WITHOUT_REPLACEMENT:
                drawn[x] = True
                q = remove_token(q, x, drawn)
    return None
