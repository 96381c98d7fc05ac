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

That is the "token" rule. Two more rules accept whole paths and so accept more from the
same draft, at the same target cost (`verification=` in `SpeculativeDecoder.generate`; which
rule applies to which tree is `treespec.rules`'s decision):

    block      (chains; Sun et al. 2025) weights w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(x_i)/q_{i-1}(x_i));
               coins from the leaf back to the root: stop at the leaf w.p. w_n, at node i < n
               w.p. S_i / (S_i + 1 - w_i), S_i = sum max(w_i p_i - q_i, 0); accept x_1..x_tau and
               draw the last token from norm(max(w_tau p_tau - q_tau, 0)) (from p_n at the leaf).
    traversal  (trees whose siblings are distinct children drawn without replacement or
               deterministic; Weng et al. 2025) the same
               idea on a tree, visited leaves first (post-order): a node's measure m starts as
               min(1, m_parent(x)/q(x)) p_node; after a child and its whole subtree are rejected
               m <- max(m - q, 0) / (1 - sum m + sum max(m - q, 0)) (`weighted_residual`), q
               loses x if drawn without replacement; once its children are done the node is
               accepted, with its root path, w.p. sum m, the last token drawn from norm(m). On a
               chain this is block verification.

Both keep the invariant: averaged over the draft below a node, the walk passes through the
node with probability w (its measure's mass) and then emits its next token from w p, whatever
the shape of that subtree. So which nodes grow may depend on any draw (a beam); what must hold
is that each proposal was drawn as its group says and kept (never dropped after being seen),
and that each child has its own subtree (i.i.d. duplicates merged into one node do not). The
enumeration tests prove each rule lossless; every coin goes through `Rng`.

Greedy (temperature 0) follows the child whose token is argmax p, and emits argmax p where
no child matches: exactly the target's greedy output. Every rule reduces to it (one-hot p
gives weights 0 or 1), so all rules share the greedy walk.

Host syncs. The sampling transforms and softmax run once over all N rows on the model's
device. Greedy needs one transfer per round (argmax and a finiteness flag for every row).
The sampled walk needs one transfer per round for the input checks, one per visited node
with proposals (all its acceptance probabilities, computed on the device along the residual
chain "every earlier proposal rejected", go to `Rng.first_success` together), and one for
the final token: O(depth), never O(nodes). Block and traversal verification compute every
stopping probability on the device first (block: vectorised over the chain; traversal: one
pass over the nodes) and need two transfers per round: one `first_success`, one final token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingConfig
from .proposal import DraftTree, Draw, ProposalGroup, ProposalTrace, Walk, WalkTrace
from .rng import Rng
from .rules import check_rule
from .sampling import (
    PenaltyContext,
    check_finite,
    nonfinite_rows,
    one_hot,
    penalize,
    probs,
    remove_token,
    residual,
    row_max,
    tree_token_counts,
    weighted_mass,
    weighted_residual,
)


def verify(
    draft: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    rng: Rng,
    rule: str = "token",
    committed: PenaltyContext | None = None,
    trace: bool = False,
    check_structure: bool = True,
) -> Walk:
    """Walk `draft` given the target's logits at each node (`[N, V]`, row i = after node i),
    under verification `rule` ("token", "block" or "traversal"; see the module docstring).

    `committed` (the prompt + emitted tokens) is required when `sampling` has penalties: row
    i is penalised for the committed tokens plus node i's own path below the root. `trace=True`
    records every proposal's p, q, coin and outcome in `walk.trace` (`treespec.trace`); off, it
    costs nothing. `check_structure=False` skips checking that the tree has the structure
    `rule` needs (`check_rule`): for callers that decided the rule from how the tree is drawn
    (the engine does, for every built-in drafter)."""
    if target_logits.shape[0] != len(draft.tree):
        raise ValueError(f"{target_logits.shape[0]} logit rows for {len(draft.tree)} tree nodes")
    if check_structure:
        check_rule(draft, rule)
    counts = None
    if sampling.penalized:
        if committed is None:
            raise ValueError(
                "sampling has penalties: pass verify(..., committed=PenaltyContext(prompt + "
                "emitted, len(prompt)))"
            )
        counts = tree_token_counts(committed, draft.tree, target_logits.shape[-1], target_logits.device)
    if sampling.greedy:
        if counts is not None:  # penalised in probs()'s precision, so draft and target argmax agree
            target_logits = penalize(
                target_logits if target_logits.dtype == torch.float64 else target_logits.float(),
                sampling,
                counts,
            )
        return _verify_greedy(draft, target_logits, [] if trace else None)
    p = probs(target_logits, sampling, counts)  # [N, V] p at every node, one batched op
    _check_inputs(draft, target_logits)
    walk = {"token": _verify_token, "block": _verify_block, "traversal": _verify_traversal}[rule]
    return walk(draft, p, rng, [] if trace else None)


def _verify_greedy(draft: DraftTree, logits: torch.Tensor, trace: list[ProposalTrace] | None = None) -> Walk:
    # one reduction gives each row's argmax (the first maximum, as argmax) and its max, which is
    # finite iff the row is (`nonfinite_rows`)
    top, best = row_max(logits)  # [N] each
    best, bad = torch.stack([best, ~torch.isfinite(top)]).tolist()  # [2, N]: the one transfer
    node, path = 0, [0]
    while True:
        if bad[node]:
            check_finite(logits[node], "target")  # raises the precise error
        child = next(
            (c for g in draft.groups_at(node) for c, t in zip(g.children, g.tokens) if t == best[node]), None
        )
        if trace is not None:
            for g in draft.groups_at(node):
                for x, c in zip(g.tokens, g.children):
                    hit = float(x == best[node])
                    q = 1.0 if g.q is None else float(g.q[x])
                    trace.append(
                        ProposalTrace(
                            c, node, x, g.draw.value, hit, q, hit, "accepted" if c == child else "rejected"
                        )
                    )
        if child is None:
            kind = "bonus" if draft.tree.is_leaf(node) else "correction"
            return Walk(tuple(path), best[node], kind, _walk_trace(trace, f"argmax p at node {node}"))
        node = child
        path.append(child)


def _verify_token(
    draft: DraftTree, p: torch.Tensor, rng: Rng, trace: list[ProposalTrace] | None = None
) -> Walk:
    """Token by token from the root: accept a child or move on to the next proposal."""
    node, path = 0, [0]
    while True:
        r = p[node]  # [V] the running residual starts as p at this node
        groups = draft.groups_at(node)
        if groups:
            chain = _acceptance_chain(groups, r)
            i = rng.first_success(chain.accept)
            r = chain.residual
            if trace is not None:
                tried = [(g, x, c) for g in groups for x, c in zip(g.tokens, g.children)]
                px = p[node][[x for _, x, _ in tried]].tolist()
                for j, ((g, x, c), pj, qj, coin) in enumerate(
                    zip(tried, px, chain.q.tolist(), chain.accept.tolist())
                ):
                    outcome = "rejected" if i is None or j < i else "accepted" if j == i else "untried"
                    trace.append(ProposalTrace(c, node, x, g.draw.value, pj, qj, coin, outcome))
            if i is not None:
                node = [c for g in groups for c in g.children][i]
                path.append(node)
                continue
        kind = "bonus" if draft.tree.is_leaf(node) else "correction"
        source = f"p at leaf {node}" if kind == "bonus" else f"residual at node {node}"
        return Walk(tuple(path), rng.categorical(r)[0], kind, _walk_trace(trace, source))


@dataclass(frozen=True)
class _Chain:
    accept: torch.Tensor  # [k] acceptance probability of each proposal, earlier ones rejected
    q: torch.Tensor  # [k] the draft probability each proposal was tried with
    residual: torch.Tensor  # [V] the residual after all k rejections


def _acceptance_chain(groups: list[ProposalGroup], r: torch.Tensor) -> _Chain:
    """The acceptance chain of a node's k proposals in order, on the device."""
    accept, qx = [], []
    for group in groups:
        q = None if group.q is None else group.q.to(r.dtype)
        drawn = torch.zeros_like(r, dtype=torch.bool)
        for x in group.tokens:
            if q is None:  # deterministic: q is one-hot on x
                accept.append(r[x].clamp(max=1.0))
                qx.append(torch.ones_like(r[x]))
                r = residual(r, one_hot(x, r))
                continue
            accept.append((r[x] / q[x]).clamp(max=1.0))
            qx.append(q[x])
            r = residual(r, q)
            if group.draw is Draw.WITHOUT_REPLACEMENT:
                q = remove_token(q, x, drawn)
    return _Chain(torch.stack(accept), torch.stack(qx), r)


def _verify_block(
    draft: DraftTree, p: torch.Tensor, rng: Rng, trace: list[ProposalTrace] | None = None
) -> Walk:
    """Block verification of a chain root -> ... -> leaf, vectorised over the chain on the
    device; the coins run from the leaf back to the root. Only the stopping masses are needed
    for every node (`weighted_residual`'s, S / reach): a deterministic proposal's is
    w (sum p - p(x)) from two numbers (max(w p - one-hot, 0) is w p off x and 0 at x), a
    drawn one's a pass over its q; the measure itself only where the walk stops."""
    chain = _chain(draft)
    n = len(chain) - 1
    # [n + 1, V] p after each chain node (nodes are in topological order: a chain ending at node n is 0..n)
    rows = p[: n + 1] if chain[-1] == n else p[chain]
    if n == 0:
        return Walk((0,), rng.categorical(rows[0])[0], "bonus", _walk_trace(trace, "p at leaf 0"))
    groups = [draft.groups_at(u)[0] for u in chain[:-1]]
    xs = [draft.tree.tokens[c] for c in chain[1:]]
    q = [None if g.q is None else g.q.to(rows.device, rows.dtype) for g in groups]  # [V] each, or one-hot
    drawn = [i for i, q_i in enumerate(q) if q_i is not None]
    px = rows[:-1].gather(1, torch.tensor(xs, device=p.device)[:, None])[:, 0]  # [n] p_i(x_{i+1})
    qx = torch.ones_like(px)
    if drawn:
        qx[drawn] = torch.stack([q[i][xs[i]] for i in drawn])
    ratio = px / qx
    log_w = torch.cat([ratio.new_zeros(1), ratio.log().cumsum(0)])
    w = (log_w - log_w.cummax(0).values).exp()  # [n + 1]: w_i = min(1, w_{i-1} ratio_i), w_0 = 1
    mass = rows[:-1].sum(-1)  # [n] sum p_i (1 up to rounding)
    left = w[:-1] * (mass - px)  # [n] sum max(w_i p_i - q_i, 0), deterministic q_i
    if drawn:  # in one [V] buffer: a [k, V] temporary costs page faults on a CPU
        buf = torch.empty_like(rows[0])
        left[drawn] = torch.stack(
            [torch.mul(rows[i], w[i], out=buf).sub_(q[i]).clamp_(min=0).sum() for i in drawn]
        )
    stops = weighted_mass(w[:-1] * mass, left)  # [n] the measure left at node i when x_{i+1} is rejected
    stop = torch.cat([ratio.new_ones(1), stops[1:], w[-1:]])  # node 0 always stops: its mass is 1
    i = rng.first_success(stop.flip(0))
    tau = n - (i if i is not None else n)
    if trace is not None:  # the proposal at chain[k] (k >= 1) with its node's stopping coin
        for k, (g, x_k, pk, qk, coin) in enumerate(
            zip(groups, xs, px.tolist(), qx.tolist(), stop[1:].tolist()), start=1
        ):
            outcome = "accepted" if k <= tau else "rejected"
            trace.append(ProposalTrace(chain[k], chain[k - 1], x_k, g.draw.value, pk, qk, coin, outcome))
    if tau == n:
        return Walk(
            tuple(chain), rng.categorical(rows[n])[0], "bonus", _walk_trace(trace, f"p at leaf {chain[n]}")
        )
    q_tau = one_hot(xs[tau], rows[tau]) if q[tau] is None else q[tau]
    return Walk(
        tuple(chain[: tau + 1]),
        rng.categorical(weighted_residual(w[tau] * rows[tau], q_tau))[0],
        "correction",
        _walk_trace(trace, f"weighted residual at node {chain[tau]}"),
    )


def _verify_traversal(
    draft: DraftTree, p: torch.Tensor, rng: Rng, trace: list[ProposalTrace] | None = None
) -> Walk:
    """Traversal verification: visit the tree leaves first (post-order, siblings in draw
    order), each node's stopping probability given that every earlier node was rejected;
    accept the first node that stops, with its whole root path."""
    order: list[int] = []
    stop: list[torch.Tensor] = []
    left: list[torch.Tensor] = []
    tried: dict[int, tuple[ProposalGroup, torch.Tensor]] = {}  # child -> its group and q(x) (traced only)

    def visit(u: int, m: torch.Tensor) -> None:  # m: target measure at u, mass = u's weight
        for g in draft.groups_at(u):
            q, drawn = (
                None if g.q is None else g.q.to(m.device, m.dtype),
                torch.zeros_like(m, dtype=torch.bool),
            )
            for x, c in zip(g.tokens, g.children):
                qx = one_hot(x, m) if q is None else q
                if trace is not None:
                    tried[c] = (g, qx[x])
                visit(c, (m[x] / qx[x]).clamp(max=1.0) * p[c])
                m = weighted_residual(m, qx)
                if g.draw is Draw.WITHOUT_REPLACEMENT:
                    q = remove_token(q, x, drawn)
        order.append(u)
        stop.append(m.sum())
        left.append(m)

    visit(0, p[0])
    stop[-1] = torch.ones_like(stop[-1])  # the root (last in post-order) has mass 1: it always stops
    i = rng.first_success(torch.stack(stop))
    i = len(order) - 1 if i is None else i
    node = order[i]
    kind = "bonus" if draft.tree.is_leaf(node) else "correction"
    path = tuple(draft.tree.path_to(node))
    if trace is not None and tried:  # in post-order, each node's proposal with its stopping coin
        tree, coins, kids = draft.tree, torch.stack(stop).tolist(), list(tried)
        qx = dict(zip(kids, torch.stack([v for _, v in tried.values()]).tolist()))
        px = dict(zip(kids, p[[tree.parents[c] for c in kids], [tree.tokens[c] for c in kids]].tolist()))
        for j, u in enumerate(order[:-1]):
            outcome = "accepted" if u in path else "rejected" if j < i else "untried"
            trace.append(
                ProposalTrace(
                    u,
                    tree.parents[u],
                    tree.tokens[u],
                    tried[u][0].draw.value,
                    px[u],
                    qx[u],
                    coins[j],
                    outcome,
                )
            )
    source = f"p at leaf {node}" if kind == "bonus" else f"weighted residual at node {node}"
    return Walk(path, rng.categorical(left[i])[0], kind, _walk_trace(trace, source))


def _walk_trace(trace: list[ProposalTrace] | None, source: str) -> WalkTrace | None:
    return None if trace is None else WalkTrace(tuple(trace), source)


def _chain(draft: DraftTree) -> list[int]:
    """The nodes of a chain draft, root first."""
    chain = [0]
    while draft.tree.children(chain[-1]):
        chain.append(draft.tree.children(chain[-1])[0])
    return chain


def _check_inputs(draft: DraftTree, logits: torch.Tensor) -> None:
    """Every row finite and every stochastic proposal drawn from a q that gives it mass:
    one host transfer for the whole tree."""
    qx = [g.q[list(g.tokens)].to(logits.device, logits.dtype) for g in draft.groups if g.q is not None]
    flags = [nonfinite_rows(logits).any()[None].to(logits.dtype)] + [
        (x <= 0).any()[None].to(logits.dtype) for x in qx
    ]
    bad_row, *bad_q = torch.cat(flags).tolist()
    if bad_row:
        check_finite(logits, "target")
    for g, bad in zip((g for g in draft.groups if g.q is not None), bad_q):
        if bad:
            raise ValueError(
                f"a proposal among {list(g.tokens)} has draft probability 0: it was not drawn from "
                "the stored q"
            )
