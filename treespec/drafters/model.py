"""Drafting with a (small) causal LM, level by level: one draft forward per depth.

Round structure, for depth D:

    forward #1   the committed tokens the draft has not seen yet, ending with the root
                 (a chain: usually just the root, plus a leaf accepted last round)
    forward #d   every frontier node of depth d-1 that will be expanded, in ONE call under
                 the tree mask (d = 2 .. D)

The leaves (depth D) are never fed. After verification, `observe()` keeps the draft cache
slots of the accepted path and drops the rest, exactly as the target does; accepted tokens
the draft never fed are fed at the start of the next round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends.base import Runner, Scores
from ..config import SamplingConfig, TreeConfig
from ..proposal import DraftTree, Draw, ProposalGroup, Walk
from ..rng import Rng
from ..sampling import PenaltyContext, argmax, check_finite, penalize, probs, tree_token_counts
from ..tree import TokenTree
from ..vocab import fit_logits
from .base import Drafter, DraftForward, ProposeSteps


@dataclass
class DraftNode:
    """A node of the tree being drafted, with what the draft computed there."""

    token: int
    parent: int  # node index, -1 for the root
    log_score: float  # draft log-probability of the path from the root (for ranking)
    count: int = 1  # i.i.d. strategy: sampled sequences passing through this node
    pending: int | None = None  # pending index in the draft runner, once fed
    q: torch.Tensor | None = None  # [V] sampling distribution at this node, once fed
    score: torch.Tensor | None = None  # [V] probabilities used to rank children, once fed
    shape_id: int = 0  # "sequoia": the node of the TreeShape this node stands for
    state: torch.Tensor | None = None  # [H] a feature head's output state here, once fed


class ModelDrafter(Drafter):
    def __init__(
        self, runner: Runner, tree: TreeConfig, vocab_size: int | None = None, support: int | None = None
    ):
        """`vocab_size`: the length of q (the target's output rows; default the draft's);
        `support`: q puts mass only on ids below it (tokenizer padding; default all)."""
        self.runner = runner
        self.config = tree
        self.vocab_size = runner.vocab_size if vocab_size is None else vocab_size
        self.support = min(self.vocab_size, runner.vocab_size) if support is None else support
        self._shape_children = tree.shape.children() if tree.shape is not None else None

    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        self.sampling, self.rng = sampling, rng
        self.prompt_len = len(prompt)
        kept = self.runner.keep_prefix(prompt[:-1])  # 0 (a reset) unless the runner reuses prefixes
        self.runner.prefill(list(prompt[kept:-1]))

    def propose(self, context: Sequence[int], depth: int) -> ProposeSteps:
        run = self.runner
        # 1. catch up on committed tokens the draft never fed; the last one is the root
        ask = self._catch_up(context)
        if ask is None:  # nothing to draft from yet (a feature head before its first features)
            self._chain, self._nodes = [], []
            return DraftTree.root_only(context[-1])
        scores = yield ask
        self._chain = list(range(len(ask.tokens)))  # pending nodes 0 .. len-1
        self._committed = PenaltyContext(context, self.prompt_len)
        nodes = [DraftNode(token=context[-1], parent=-1, log_score=0.0)]
        self._attach(nodes, [0], self._chain[-1], scores, last=True)

        groups: list[ProposalGroup] = []
        frontier = [0]
        for d in range(1, depth + 1):
            # 2. propose children for every frontier node, then pick the next frontier
            frontier = self._expand(nodes, frontier, groups)
            if d == depth or not frontier:
                break
            # 3. one draft forward over the whole next frontier
            first = run.n_pending
            scores = yield self._level(nodes, frontier)
            self._attach(nodes, frontier, first, scores)

        if self.config.strategy == "dynamic":
            nodes, groups = self._prune(nodes, groups, self.config.effective_budget)
        self._nodes = nodes
        tree = TokenTree([n.token for n in nodes], [n.parent for n in nodes], vocab_size=self.vocab_size)
        return DraftTree(tree, tuple(groups))

    def _expand(self, nodes: list[DraftNode], frontier: list[int], groups: list[ProposalGroup]) -> list[int]:
        """Propose children for every frontier node as `TreeConfig.strategy` says; the next frontier."""
        expand = {
            "iid": self._expand_iid,
            "without_replacement": self._expand_without_replacement,
            "topk": self._expand_topk,
            "dynamic": self._expand_dynamic,
            "sequoia": self._expand_sequoia,
        }[self.config.strategy]
        return expand(nodes, frontier, groups)

    def _catch_up(self, context: Sequence[int]) -> DraftForward | None:
        """Draft forward #1: the committed tokens the draft has not fed, ending with the root."""
        run = self.runner
        if list(context[: run.n_committed]) != run.committed:
            raise RuntimeError("draft cache is out of sync with the committed tokens")
        chain = list(context[run.n_committed :])
        if max(chain) >= run.vocab_size:
            raise ValueError(
                f"the target emitted token id {max(chain)}, a padding id beyond the draft model's "
                f"{run.vocab_size} rows; "
                "this draft cannot continue the sequence (use drafter='ngram' or a draft with the "
                "target's rows)"
            )
        return DraftForward(run, chain, list(range(-1, len(chain) - 1)))

    def _level(self, nodes: list[DraftNode], frontier: list[int]) -> DraftForward:
        """Draft forward #d: every frontier node, under the tree mask."""
        tokens = [nodes[n].token for n in frontier]
        return DraftForward(self.runner, tokens, [nodes[nodes[n].parent].pending for n in frontier])

    def observe(self, draft: DraftTree, walk: Walk) -> None:
        keep = list(self._chain)
        for n in walk.path[1:]:
            if n >= len(self._nodes) or self._nodes[n].pending is None:
                break  # an accepted leaf the draft never fed: caught up next round
            keep.append(self._nodes[n].pending)
        self.runner.commit(keep)

    def path_entropy(self, draft: DraftTree, walk: Walk) -> float:
        """Mean normalised entropy of the draft's distributions at the fed nodes of the
        accepted path (at temperature 0, of its plain softmax)."""
        fed = [self._nodes[n].score for n in walk.path if self._nodes[n].score is not None]
        return sum(_normalised_entropy(s) for s in fed) / len(fed)

    # ---- helpers ---------------------------------------------------------------------------
    def _attach(
        self, nodes: list[DraftNode], fed: list[int], first: int, scores: Scores, last: bool = False
    ) -> None:
        """Give the nodes `fed` of one draft forward (pending indices first, first+1, ...)
        their q and ranking scores: one batched transform over the logits [n, V] (`last`: of
        the forward's last row only). With penalties, each row is penalised for the committed
        tokens plus its own path. A head's output states go with them (`DraftNode.state`)."""
        logits, states = scores.logits, scores.features
        if last:
            logits, states = logits[-1:], None if states is None else states[-1:]
        check_finite(logits, "draft")
        logits = fit_logits(logits, self.vocab_size, self.support)  # q: no mass on padding ids
        if self.constraint is not None:  # q masked as the constrained target's p is
            logits = self.constraint.mask_logits(logits, [_path(nodes, n) for n in fed], draft=True)
        counts = None
        if self.sampling.penalized:
            drafted = TokenTree([n.token for n in nodes], [n.parent for n in nodes])
            counts = tree_token_counts(
                self._committed, drafted, self.vocab_size, logits.device, rows=fed
            )  # [n, V]
        x = logits if logits.dtype == torch.float64 else logits.float()  # q's precision, converted once
        q = probs(x, self.sampling, counts)  # [n, V]
        # rank by the sampling distribution; at temperature 0 (one-hot q) by the plain softmax
        score = torch.softmax(penalize(x, self.sampling, counts), -1) if self.sampling.greedy else q
        for i, n in enumerate(fed):
            nodes[n].pending, nodes[n].q, nodes[n].score = first + i, q[i], score[i]
            nodes[n].state = None if states is None else states[i]

    @staticmethod
    def _add(nodes: list[DraftNode], parent: int, token: int) -> int:
        p = nodes[parent]
        nodes.append(DraftNode(token, parent, p.log_score + math.log(max(float(p.score[token]), 1e-300))))
        return len(nodes) - 1

    def _best(self, nodes: list[DraftNode], candidates: list[int]) -> list[int]:
        """The `width` candidates with the highest draft path probability (ties: first)."""
        ranked = sorted(candidates, key=lambda n: -nodes[n].log_score)
        return sorted(ranked[: self.config.width])

    def _top_tokens(self, node: DraftNode, k: int) -> list[int]:
        if k == 1:  # a chain's node (every level of a greedy chain): no count over V, no sort
            top = int(argmax(node.score))
            return [top] if node.score[top] > 0 else []
        k = min(k, int((node.score > 0).sum()))
        return torch.topk(node.score, k).indices.tolist()

    def _expand_iid(
        self, nodes: list[DraftNode], frontier: list[int], groups: list[ProposalGroup]
    ) -> list[int]:
        """Each of the m sequences through u draws its next token from q_u independently."""
        width = self.config.width
        new: list[int] = []
        for u in frontier:
            m = width if u == 0 else nodes[u].count
            # at temperature 0 q is one-hot: every draw is its argmax (no coin, no cumsum over V)
            draws = (
                [int(argmax(nodes[u].q))] * m if self.sampling.greedy else self.rng.categorical(nodes[u].q, m)
            )
            child_of: dict[int, int] = {}
            for x in draws:
                if x in child_of:
                    nodes[child_of[x]].count += 1
                else:
                    child_of[x] = self._add(nodes, u, x)
                    new.append(child_of[x])
            groups.append(
                ProposalGroup(u, Draw.IID, tuple(draws), tuple(child_of[x] for x in draws), nodes[u].q)
            )
        return new  # every sampled sequence continues

    def _expand_without_replacement(self, nodes, frontier, groups) -> list[int]:
        """`width` distinct children per node (Gumbel-top-k); expand the best `width` next."""
        new: list[int] = []
        for u in frontier:
            group = self._draw_distinct(nodes, u, self.config.width)
            groups.append(group)
            new.extend(group.children)
        return self._best(nodes, new)

    def _draw_distinct(self, nodes: list[DraftNode], u: int, k: int) -> ProposalGroup:
        """Up to k distinct children of u drawn without replacement from q (Gumbel-top-k);
        at temperature 0 its zero-temperature limit, the draft's top-k tokens."""
        node = nodes[u]
        if self.sampling.greedy:
            tokens, draw, q = self._top_tokens(node, k), Draw.DETERMINISTIC, None
        else:
            if k > 1:  # one draw always finds mass: no count over V for a chain's node
                k = min(k, int((node.q > 0).sum()))
            tokens, draw, q = self.rng.without_replacement(node.q, k), Draw.WITHOUT_REPLACEMENT, node.q
        children = [self._add(nodes, u, x) for x in tokens]
        return ProposalGroup(u, draw, tuple(tokens), tuple(children), q)

    def _expand_sequoia(self, nodes, frontier, groups) -> list[int]:
        """Follow the shape: c shape children -> c draws without replacement, k-th draw to rank k."""
        shape_children = self._shape_children
        new: list[int] = []
        for u in frontier:
            kids = shape_children[nodes[u].shape_id]
            group = self._draw_distinct(nodes, u, len(kids))
            for c, sid in zip(group.children, kids):
                nodes[c].shape_id = sid
            groups.append(group)
            new.extend(c for c in group.children if shape_children[nodes[c].shape_id])
        return new

    def _expand_dynamic(self, nodes, frontier, groups) -> list[int]:
        """EAGLE-2: top-`width` children for every frontier node; expand the best `width`."""
        new: list[int] = []
        for u in frontier:
            tokens = self._top_tokens(nodes[u], self.config.width)
            children = [self._add(nodes, u, x) for x in tokens]
            if children:
                groups.append(ProposalGroup(u, Draw.DETERMINISTIC, tuple(tokens), tuple(children)))
            new.extend(children)
        return self._best(nodes, new)

    @staticmethod
    def _prune(nodes: list[DraftNode], groups: list[ProposalGroup], budget: int):
        """Keep the `budget` most probable draft nodes (and their ancestors); renumber."""
        ranked = sorted(range(1, len(nodes)), key=lambda n: (-nodes[n].log_score, n))
        keep = {0}
        for n in ranked[:budget]:
            while n not in keep:  # path probabilities only shrink downwards: usually a no-op
                keep.add(n)
                n = nodes[n].parent
        order = sorted(keep)
        new_id = {old: i for i, old in enumerate(order)}
        kept = []
        for old in order:
            node = nodes[old]
            node.parent = new_id.get(node.parent, -1)
            kept.append(node)
        new_groups = []
        for g in groups:
            assert g.draw is Draw.DETERMINISTIC, "only deterministic proposals may be pruned after drawing"
            pairs = [(t, new_id[c]) for t, c in zip(g.tokens, g.children) if c in new_id]
            if pairs and g.parent in new_id:
                new_groups.append(
                    ProposalGroup(
                        new_id[g.parent], g.draw, tuple(t for t, _ in pairs), tuple(c for _, c in pairs)
                    )
                )
        return kept, new_groups

    def _expand_topk(self, nodes, frontier, groups) -> list[int]:
        """Deterministic beam: the `width` best (parent, token) pairs by path probability."""
        cands = [(u, x) for u in frontier for x in self._top_tokens(nodes[u], self.config.width)]
        scored = sorted(
            cands, key=lambda c: -(nodes[c[0]].log_score + math.log(float(nodes[c[0]].score[c[1]])))
        )
        keep = sorted(scored[: self.config.width], key=cands.index)
        new: list[int] = []
        for u in frontier:
            tokens = [x for (v, x) in keep if v == u]
            if tokens:
                children = [self._add(nodes, u, x) for x in tokens]
                groups.append(ProposalGroup(u, Draw.DETERMINISTIC, tuple(tokens), tuple(children)))
                new.extend(children)
        return new


def _path(nodes: list[DraftNode], n: int) -> tuple[int, ...]:
    """The tokens of node n's path below the root."""
    out = []
    while nodes[n].parent >= 0:
        out.append(nodes[n].token)
        n = nodes[n].parent
    return tuple(reversed(out))


def _normalised_entropy(p: torch.Tensor) -> float:
    """Entropy of p divided by log V: 0 for one-hot, 1 for uniform."""
    p = p.double()
    nz = p[p > 0]
    return float(-(nz * nz.log()).sum() / math.log(p.numel()))
