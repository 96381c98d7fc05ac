"""Whether and how deep each request drafts each round: the one place that decides it.

The engine asks its `RoundPolicy` once per round (`depths`) for every live request's draft depth
(0: a plain round) and reports the round back (`record`). The round policy composes, in order:

    load       `speculate_max_live=N`: with more live requests than N, every round is plain;
               `speculate_max_live="auto"`: a `GoodputSwitch` decides instead, by which kind of
               round has given more tokens per second at about this many live requests
    request    each request's own `DepthPolicy` (`depth_policy`), asked only where the round
               drafts: its depth, never deeper than the tokens it still wants
    node cap   `shared_tree_nodes=N`: in a round with other requests, a request whose tree
               holds more than N nodes decodes plainly, so that one client's large tree cannot
               slow every other request's rounds

A request's `DepthPolicy` is told each round's outcome (`update`, speculative rounds) and time
(`record`). Its depth follows `TreeConfig.adaptive`:

    None       the depth stays `TreeConfig.depth`
    "hf"       Hugging Face's heuristic: depth + 2 after a fully accepted round, - 1 otherwise
    "entropy"  EGAG-style: the EMA (factor `ema_beta`) of the draft's normalised entropy along
               the accepted path maps linearly onto [depth_min, depth_max] (confident: deeper)

    plain_fallback=True: the depth or 0, by which has given this request more tokens per second
    so far (a `GoodputSwitch` of its own). It combines with any depth policy.

The entropy comes from `Drafter.path_entropy(draft, walk)`; a drafter without a model
distribution returns None, and the policy falls back on the round's rejection rate,
1 - accepted / depth (an empty round counts as 1).

An automatic tree's request (`TreeConfig()`) runs `AutoDepth` instead: before each round, the
depth at which the planned shape, cut there, gives the most expected tokens per unit of cost
under the request's own acceptance so far (its counts on top of the plan's vector, weighted as
`PLAN_WEIGHT` pseudo-visits, so that a short request's few rounds cannot cut a plan that is
right); depth 0 is a plain round, and a request that stays plain probes one depth-1 round every
`PROBE_EVERY` rounds.

Every decision follows committed outcomes (and, for the goodput switches, past timings) only,
never a coming draw, so every round stays lossless (the enumeration tests cover each policy).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .. import parallel
from ..config import TreeConfig
from ..proposal import DepthStep, DraftTree, Walk
from ..sequoia import TreeShape, tree_expected_tokens
from .acceptance import AcceptanceCounts
from .planner import DEPTH_MARGIN, Plan

PLAN_WEIGHT = 64.0  # the plan's vector weighs against a request's own visits as this many
PROBE_EVERY = 8  # a request that decodes plainly drafts one depth-1 round this often


class RoundPolicy:
    """An engine's decision, each round, of every live request's draft depth (see the module
    docstring): `speculate_max_live` (None: no limit), `switch` (a `GoodputSwitch`: decides by
    measured goodput instead) and `shared_tree_nodes` (None: no cap)."""

    def __init__(
        self,
        speculate_max_live: int | None = None,
        switch: GoodputSwitch | None = None,
        shared_tree_nodes: int | None = None,
    ):
        self.speculate_max_live, self.switch = speculate_max_live, switch
        self.shared_tree_nodes = shared_tree_nodes
        self._switched, self._started = False, 0.0  # this round: the switch decided, when

    def depths(self, live: Sequence[tuple[DepthPolicy | None, TreeConfig | None, int]]) -> list[int]:
        """The draft depth (0: plain) of each live request this round, from its (depth policy,
        None where it has no drafter; tree; tokens it still wants). Asked once per round."""
        self._switched = self.switch is not None and any(policy is not None for policy, _, _ in live)
        if self._switched:
            self._started, speculate = self.switch.clock(), self.switch.speculate(len(live))
        else:
            speculate = self.speculate_max_live is None or len(live) <= self.speculate_max_live
        cap = self.shared_tree_nodes if len(live) > 1 else None
        return [self._depth(policy, tree, remaining, speculate, cap) for policy, tree, remaining in live]

    @staticmethod
    def _depth(policy, tree, remaining: int, speculate: bool, cap: int | None) -> int:
        """One request's depth: its policy's, never deeper than the tokens it still wants; 0 (a
        plain round) where the round is plain or its tree holds more than `cap` nodes."""
        if not (policy is not None and speculate):
            return 0
        depth = min(policy.next_depth(), remaining - 1)
        return 0 if cap is not None and tree.max_nodes > cap else depth

    def record(self, live: int, speculative: bool, tokens: int) -> None:
        """The round asked of last (`depths`) finished: `tokens` emitted by its `live` requests,
        some of which drafted where `speculative`."""
        if self._switched:
            self.switch.record(live, speculative, tokens, self.switch.clock() - self._started)


def depth_policy(tree: TreeConfig, plan: Plan | None = None) -> DepthPolicy:
    """A request's own depth policy: `AutoDepth` for a shape planned from costs (an automatic
    tree), else the `DepthPolicy` of `tree`."""
    return DepthPolicy(tree) if plan is None or plan.costs is None else AutoDepth(plan)


class DepthPolicy:
    """A request's own draft depth, round by round (`TreeConfig.adaptive`,
    `TreeConfig.plain_fallback`; see the module docstring)."""

    def __init__(self, config: TreeConfig):
        self.config = config
        self.depth = config.depth  # the depth of a speculative round (before the length cap)
        self.entropy_ema: float | None = None
        # plain_fallback: this request's own speculate-or-not switch, fed its own rounds
        self.switch = GoodputSwitch() if config.plain_fallback else None

    def next_depth(self) -> int:
        """The depth of the coming round (0: plain); asked once per round."""
        return self.depth if self.switch is None or self.switch.speculate(1) else 0

    def record(self, speculative: bool, tokens: int, seconds: float) -> None:
        """A finished round of this request: `tokens` emitted in `seconds`."""
        if self.switch is not None:
            self.switch.record(1, speculative, tokens, seconds)

    def update(self, drafter, draft: DraftTree, walk: Walk, round_depth: int) -> DepthStep:
        """Move the depth after a round drafted at `round_depth`; what was decided."""
        cfg = self.config
        entropy, from_drafter = None, False
        if cfg.adaptive == "hf":
            full = len(walk.path) - 1 >= round_depth
            self.depth += 2 if full else -1
        elif cfg.adaptive == "entropy":
            entropy = drafter.path_entropy(draft, walk)
            from_drafter = entropy is not None
            if entropy is None:
                entropy = 1.0 - (len(walk.path) - 1) / round_depth if len(draft.tree) > 1 else 1.0
            self.entropy_ema = (
                entropy
                if self.entropy_ema is None
                else cfg.ema_beta * self.entropy_ema + (1 - cfg.ema_beta) * entropy
            )
            self.depth = round(cfg.depth_max - self.entropy_ema * (cfg.depth_max - cfg.depth_min))
        if cfg.adaptive is not None:
            self.depth = max(cfg.depth_min, min(cfg.depth_max, self.depth))
        return DepthStep(round_depth, entropy, from_drafter, self.depth)


class GoodputSwitch:
    """`engine(speculate_max_live="auto")`: speculate or not, by which has given more tokens
    per second at about this many live requests on this machine.

    Where a batched target forward is bound by memory, speculation's extra rows are nearly
    free; where it is bound by compute (a CPU at batch 8), they cost about their full price
    and plain rounds win. The crossover depends on the hardware, the models, the sampling and
    the drafts' acceptance, so it is measured, not configured. Live counts are bucketed by
    powers of two (1, 2, 3-4, 5-8, ...). Each bucket runs one kind of round for `run_rounds`
    rounds at a time: the first run speculative, the second plain, then the kind with more
    tokens per second so far, except every `explore_every`-th run after those (every
    4 * `explore_every`-th where one kind is 1.25x faster), which takes the other kind so
    that a drift (acceptance, context length) is noticed. Tokens/s per bucket and kind is
    a ratio of sums decayed by `decay` per round: whole runs, so a speculative run pays for
    the draft's catch-up on the tokens a plain run emitted, and one noisy round (T=1, batch
    1) cannot flip a decision. Decisions depend on past timings and committed outcomes only,
    never on a coming draw, so every round stays exact; at temperature > 0 a request's output
    is then no longer reproducible from its seed alone (as with any `speculate_max_live`).
    """

    def __init__(
        self,
        run_rounds: int = 8,
        explore_every: int = 16,
        decay: float = 0.9,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.run_rounds, self.explore_every, self.decay, self.clock = run_rounds, explore_every, decay, clock
        # (bucket, speculative) -> decayed tokens, seconds
        self.sums: dict[tuple[int, bool], tuple[float, float]] = {}
        # bucket -> kind of its run, rounds left in it, runs begun
        self.runs: dict[int, tuple[bool, int, int]] = {}

    @staticmethod
    def bucket(live: int) -> int:
        return (live - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def speedup(self, live: int) -> float | None:
        """Measured tokens/s of speculative rounds over plain ones at `live` (None: not yet)."""
        b = self.bucket(live)
        if (b, True) not in self.sums or (b, False) not in self.sums:
            return None
        (ts, ss), (tp, sp) = self.sums[(b, True)], self.sums[(b, False)]
        return (ts / ss) / (tp / sp)

    def speculate(self, live: int) -> bool:
        """Whether the next round, with `live` requests, drafts."""
        b = self.bucket(live)
        speculative, left, runs = self.runs.get(b, (True, 0, 0))
        if left == 0:  # a new run: warm-up (speculative, then plain), then the faster kind, or explore
            runs += 1
            speedup = self.speedup(live)
            if speedup is None:
                speculative = (b, True) not in self.sums
            else:
                every = self.explore_every * (1 if 0.8 < speedup < 1.25 else 4)  # a wide gap: explore 4x less
                speculative = (speedup >= 1) != ((runs - 2) % every == 0)  # runs 1, 2: warm-up
            left = self.run_rounds
        self.runs[b] = (speculative, left - 1, runs)
        # decided from this process's clock: tensor parallel, rank 0 decides for every rank
        return parallel.agree(speculative)

    def record(self, live: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A finished round: `tokens` emitted by all `live` requests in `seconds`."""
        key = (self.bucket(live), speculative)
        t, s = self.sums.get(key, (0.0, 0.0))
        # a coarse clock may read 0
        self.sums[key] = (self.decay * t + tokens, self.decay * s + max(seconds, 1e-9))


class AutoDepth(DepthPolicy):
    """The per-request policy of an automatic tree: the depth at which the planned shape is cut
    each round, from the request's own acceptance (see the module docstring)."""

    def __init__(self, plan: Plan):
        super().__init__(plan.tree)
        self.plan, self.counts, self.plain_rounds = plan, AcceptanceCounts(), 0
        # (depth, parents, cost in plain rounds) of the shape cut at each depth; an i.i.d. tree
        # cut at d keeps its first d levels, their expected nodes
        if plan.iid:
            nodes = [sum(plan.level_nodes[:d]) for d in range(1, plan.tree.depth + 1)]
            self.cuts = [(d, None, plan.round_cost(n, d)) for d, n in enumerate(nodes, start=1)]
        else:
            self.cuts = [(d, parents, plan.round_cost(n, d)) for d, n, parents in _cuts(plan.tree.shape)]
        # a chain's cuts, and an i.i.d. tree's, are valued by one acceptance a level
        self.by_level = plan.iid or plan.tree.shape.n_nodes == plan.tree.shape.depth
        self.depth = plan.start or self._best_depth()

    def _expected_tokens(self) -> list[float]:
        """Expected tokens of each cut under the request's acceptance so far. Asked every round:
        a chain's (and an i.i.d. tree's) come from its rank-0 acceptance by level in one pass,
        for a chain the same products in the same order as `tree_expected_tokens` over
        `AcceptanceCounts.levels` (so the same values and decisions), without building every
        rank's vector per level."""
        if not self.by_level:
            acc = self.counts.levels(self.plan.acceptance, PLAN_WEIGHT)
            return [tree_expected_tokens(parents, acc) for _, parents, _ in self.cuts]
        prior, counts = self.plan.acceptance, self.counts
        levels = max(len(prior), len(counts.level_visits), 1)  # deeper levels share the last one's
        out, reach, total = [], 1.0, 1.0
        for level in range(len(self.cuts)):
            reach *= min(1.0, max(0.0, float(counts.rank0(prior, PLAN_WEIGHT, min(level, levels - 1)))))
            total += reach
            out.append(total)
        return out

    def _best_depth(self, current: int | None = None) -> int:
        values = {0: 1.0}  # plain decoding: one token for one forward
        best, best_value = 0, 1.0
        for (depth, _, cost), tokens in zip(self.cuts, self._expected_tokens()):
            values[depth] = value = tokens / cost
            if value > best_value * (1 + 1e-9):
                best, best_value = depth, value
        if current is not None and values.get(current, 0.0) * (1 + DEPTH_MARGIN) >= best_value:
            return current  # near-ties stay put: noise would move them either way
        return best

    def next_depth(self) -> int:
        if self.depth == 0:
            self.plain_rounds += 1
            if self.plain_rounds % PROBE_EVERY == 0:
                return 1  # a probe: this text may suit the draft better than planned
        return self.depth

    def update(self, drafter, draft: DraftTree, walk: Walk, round_depth: int) -> DepthStep:
        if self.plan.iid:
            self.counts.count_levels(draft.tree, walk)
        else:
            self.counts.count(draft.tree, walk)
        self.depth = self._best_depth(self.depth)
        return DepthStep(round_depth, None, False, self.depth)


def _cuts(shape: TreeShape) -> list[tuple[int, int, list[int]]]:
    """The shape cut at each depth 1 .. its depth: (depth, draft nodes, parents of the cut)."""
    depth = [0] * len(shape.parents)
    for i, p in enumerate(shape.parents[1:], start=1):
        depth[i] = depth[p] + 1
    out = []
    for d in range(1, max(depth) + 1):
        keep = [i for i in range(len(shape.parents)) if depth[i] <= d]
        new = {old: j for j, old in enumerate(keep)}
        parents = [-1] + [new[shape.parents[i]] for i in keep[1:]]
        out.append((d, len(keep) - 1, parents))
    return out
