"""The automatic tree's plan (`Planner.plan`): for a temperature class, the shape with the most
expected tokens per unit of cost, or plain decoding; `planner_for` makes a decoder's planner."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import parallel
from ..config import AUTO_MAX_DEPTH, AUTO_MAX_NODES, SamplingConfig, TreeConfig, write_cache_json
from ..sequoia import TreeShape, by_level, optimal_shape, tree_expected_tokens
from . import cache as cost_cache
from .acceptance import LEVEL_MIN_VISITS, PRIOR, PRIOR_WEIGHT, AcceptanceCounts, IidLevels, temperature_class
from .cache import CostCache
from .costs import Costs

# a plan speculates only where its shape is expected this much faster than plain decoding: the
# cost model's error on a round (docs/performance.md), and at a near-tie plain decoding cannot
# lose to itself
PLAN_MARGIN = 0.05
DEPTH_MARGIN = 0.02  # a request leaves its depth for one expected this much faster, not less


def planner_for(
    measure: Callable[[], Costs], settings: dict | None, shipped=None, cache: CostCache | None = None
) -> Planner:
    """The `Planner` of a decoder whose costs `measure()` measures. `settings`: what its models
    were loaded from and how (paths, dtypes, compile, quantize), the key of the measured costs
    in `cache` (default: the process's, `cache.COSTS`) and of the acceptance its requests measured;
    None for models handed over as objects (measured once, nothing kept). `shipped`: the
    draft's acceptance.json vectors."""
    cache = cost_cache.COSTS if cache is None else cache

    def measured() -> Costs:
        # measured from clocks: tensor parallel, every rank measures (the forwards are
        # collective) and rank 0's numbers plan for all, so every rank draws the same trees
        return parallel.agree(measure())

    if settings is None:
        return Planner(measured, shipped, "shipped")
    costs = lambda: cache.get(settings, measured)  # noqa: E731
    if shipped is not None:
        return Planner(costs, shipped, "shipped")
    # the counts of this pair's requests, for the planners of later processes
    key = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:20]
    record = cache.root / f"acceptance-{key}.json"
    return Planner(costs, parallel.agree(Planner.remembered(record)), "measured", record)


@dataclass
class Plan:
    """What the automatic tree chose for a request, and why (`GenerationOutput.plan`)."""

    tree: TreeConfig | None  # a Sequoia shape or an i.i.d. tree; None: plain decoding
    # the positional acceptance it planned with, by level (an i.i.d. tree: one entry a level, the
    # chance that one of the level's children is accepted, `IidLevels.acceptance`)
    acceptance: tuple[tuple[float, ...], ...]
    expected_tokens: float  # per round, at the full shape (a chain: at its starting depth)
    speedup: float  # expected tokens per unit of cost, over plain decoding's 1
    costs: Costs | None  # None: nothing was planned (there is nothing to draft with)
    source: str  # where the acceptance came from: "shipped", "measured" or "prior"
    cls: str = "T1"  # the temperature class planned for ("T0": greedy)
    level_nodes: tuple[float, ...] = ()  # an i.i.d. tree: its expected distinct nodes at each level
    start: int = 0  # a planned chain: the depth its requests start at (cut deeper or shallower)
    # a drafter kind of the request's own (`config.DRAFTER_KINDS`) instead of the decoder's,
    # drafting `tree` as given (a constrained request's prompt lookup); None: the decoder's
    drafter: str | None = None
    drafter_options: tuple[tuple[str, int], ...] = ()  # that drafter's settings (`DrafterFactory`)

    @property
    def iid(self) -> bool:
        return bool(self.level_nodes)

    def round_cost(self, nodes: float, depth: int) -> float:
        return self.costs.round_cost(nodes, depth, self.cls)

    def describe(self) -> str:
        if self.costs is None:
            what = (
                "plain decoding" if self.tree is None else f"a chain of {self.tree.depth} by {self.drafter}"
            )
            return f"auto: {what} ({self.source})"
        if self.iid:
            a = "by level " + ", ".join(f"{v[0]:.2f}" for v in self.acceptance)
        else:
            a = ", ".join(f"{x:.2f}" for x in self.acceptance[0])
            deeper = ", ".join(f"{v[0]:.2f}" for v in self.acceptance[1:])
            a += f"; rank 0 deeper {deeper}" if deeper else ""
        why = (
            f"acceptance [{a}] ({self.source}); t(n)/t(1) {self.costs.verify[1]:.2f} (n=2) .. "
            f"{self.costs.verify[-1]:.2f} (n={len(self.costs.verify)}), c {self.costs.draft:.3f}, "
            f"per node +{self.costs.per_node(self.cls):.3f}, per round +{self.costs.overhead[self.cls]:.3f}, "
            f"plain round {self.costs.plain[self.cls]:.2f}"
        )
        if self.tree is None:
            return f"auto: plain decoding, no shape beats it by {PLAN_MARGIN:.0%} ({why})"
        if self.iid:
            shape = (
                f"{self.tree.width} i.i.d. sequences, depth {self.tree.depth} "
                f"({sum(self.level_nodes):.1f} draft nodes expected)"
            )
        elif self.start:
            shape = f"a chain of {self.start} (of up to {self.tree.shape.depth}, per request)"
        else:
            shape = f"{self.tree.shape.n_nodes} draft nodes, depth {self.tree.shape.depth}"
        return (
            f"auto: {shape}: {self.expected_tokens:.2f} tokens a round expected, {self.speedup:.2f}x plain "
            f"({why})"
        )


class Planner:
    """Plans the automatic tree of a decoder's requests from its costs (measured once, lazily)
    and its drafter's acceptance (fixed at creation: `acceptance` {"T0": a, "T1": a, "iid":
    (IidLevels, ...)}, a class it lacks planned with `PRIOR`, i.i.d. trees only where
    measured); `remember` keeps finished requests' counts in `record` for the planners of later
    processes."""

    def __init__(self, costs, acceptance=None, source: str = "prior", record: Path | None = None):
        self._costs = costs  # Costs, or a function that measures them on first use
        acceptance = acceptance or {}
        # {"T0": levels, "T1": levels}: one vector per level (`by_level`); "iid": IidLevels
        self.vectors = {cls: by_level(acceptance.get(cls) or PRIOR[cls]) for cls in PRIOR}
        self.sources = {cls: source if acceptance.get(cls) else "prior" for cls in PRIOR}
        self.iid: tuple[IidLevels, ...] = tuple(acceptance.get("iid", ()))  # measured i.i.d. trees (T > 0)
        self.iid_source = source
        self.record = record
        self._plans: dict[tuple[str, bool, bool], Plan] = {}  # fixed inputs: each plan made once

    @property
    def costs(self) -> Costs:
        if callable(self._costs):
            self._costs = self._costs()
        return self._costs

    def plan(self, sampling: SamplingConfig, chain_only: bool = False, iid: bool = True) -> Plan:
        """The shape with the most expected tokens per unit of cost for `sampling`, or plain
        decoding; `chain_only`: width 1 (a drafter of chains, or the block rule); `iid`: i.i.d.
        trees compete too (their siblings need the token rule), where they were measured."""
        key = (temperature_class(sampling), chain_only, iid and not chain_only)
        if key not in self._plans:
            self._plans[key] = self._plan(*key)
        return self._plans[key]

    def _plan(self, cls: str, chain_only: bool, iid: bool) -> Plan:
        acc, costs = self.vectors[cls], self.costs
        vector = tuple(v[:1] for v in acc) if chain_only else acc
        shape = optimal_shape(
            vector,
            AUTO_MAX_NODES,
            AUTO_MAX_DEPTH,
            costs.verify_with_nodes(cls),
            costs.level_draft / costs.plain[cls],
        )
        # the DP prices every shape as a tree; chains, walked by the block rule, compete at
        # their own cost
        best = (shape.expected_tokens / costs.round_cost(shape.n_nodes, shape.depth, cls), shape)
        chains = []  # (value, chain) at each depth
        for d in range(1, min(AUTO_MAX_DEPTH, AUTO_MAX_NODES) + 1):
            parents = tuple(range(-1, d))
            tokens = tree_expected_tokens(parents, vector)
            chains.append((tokens / costs.round_cost(d, d, cls), TreeShape(parents, tokens)))
            best = max(best, chains[-1], key=lambda b: b[0])
        # i.i.d. trees, cut at each depth they were measured to (at T=0 their draws are one chain)
        for levels in self.iid if iid and cls == "T1" else ():
            for d in range(1, min(len(levels.acceptance), AUTO_MAX_DEPTH) + 1):
                tokens, nodes = levels.cut(d)
                if nodes > AUTO_MAX_NODES:
                    break
                best = max(best, (tokens / costs.round_cost(nodes, d, cls), (levels, d)), key=lambda b: b[0])
        speedup, choice = best
        if speedup < 1.0 + PLAN_MARGIN or (isinstance(choice, TreeShape) and choice.n_nodes == 0):
            return Plan(None, vector, 1.0, 1.0, costs, self.sources[cls], cls)
        if isinstance(choice, TreeShape) and choice.n_nodes == choice.depth:
            # a chain is drafted as deep as plans go and cut per request (`AutoDepth`), from the
            # deepest depth within DEPTH_MARGIN of the best: a request learns the acceptance of
            # the levels it drafts only, so it cuts a start too deep but never finds one too shallow
            near = [(v, c) for v, c in chains if v * (1 + DEPTH_MARGIN) >= speedup]
            speedup, first = max(near, key=lambda b: b[1].depth, default=(speedup, choice))
            parents = tuple(range(-1, AUTO_MAX_DEPTH))
            deep = TreeShape(parents, tree_expected_tokens(parents, vector))
            tree = TreeConfig(strategy="sequoia", shape=deep, depth=deep.depth)
            source = self.sources[cls]
            return Plan(tree, vector, first.expected_tokens, speedup, costs, source, cls, start=first.depth)
        if isinstance(choice, TreeShape):
            tree = TreeConfig(strategy="sequoia", shape=choice, depth=choice.depth)
            return Plan(tree, vector, choice.expected_tokens, speedup, costs, self.sources[cls], cls)
        levels, d = choice
        tree = TreeConfig(width=levels.width, depth=d, strategy="iid")
        acceptance = tuple((a,) for a in levels.acceptance[:d])
        tokens = levels.cut(d)[0]
        return Plan(tree, acceptance, tokens, speedup, costs, self.iid_source, cls, levels.nodes[:d])

    def remember(self, plan: Plan, counts: AcceptanceCounts) -> None:
        """Add the positional counts of a finished request, planned by `plan`, to `record` (a
        later process plans with them; an i.i.d. tree's counts are not positional)."""
        if self.record is None or plan.iid or not counts.visits or not parallel.leader():
            return
        cls = plan.cls
        try:
            data = json.loads(self.record.read_text()) if self.record.is_file() else {}
        except (OSError, ValueError):
            data = {}
        old = AcceptanceCounts(*(data.get(cls) or ([], [])))
        old.add(counts)
        data[cls] = [old.hits, old.visits, old.level_hits, old.level_visits]
        write_cache_json(self.record, data)

    @staticmethod
    def remembered(record: Path | None) -> dict[str, tuple[tuple[float, ...], ...]]:
        """The vectors by level of the counts in `record`, for the temperature classes it has
        counts of (an unreadable record: none)."""
        try:
            data = json.loads(record.read_text())
            counts = {cls: AcceptanceCounts(*data[cls]) for cls in PRIOR if cls in data}
            return {
                cls: c.levels(PRIOR[cls], PRIOR_WEIGHT, LEVEL_MIN_VISITS)
                for cls, c in counts.items()
                if any(c.visits)
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}
