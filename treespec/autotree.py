"""`TreeConfig()` means "auto": each request's tree, chosen for this machine and this drafter.

A round that drafts a shape of n nodes and depth d costs `t(n + 1) / t(1) + d * c` target
forwards (the verification of n nodes and the root, d draft forwards) and yields, in
expectation, Sequoia's positional value of the shape (`treespec.sequoia`): 1 + the sum over its
nodes of the product of the acceptance a[k] of each rank k on the node's path. Plain decoding
costs 1 and yields 1. The automatic tree is the shape with the most expected tokens per unit of
cost, and no speculation where none beats plain decoding.

    costs        t(n)/t(1) of the target for n = 1 .. AUTO_MAX_NODES + 1, and c: measured in a few
                 seconds (`measure_costs`), once per machine and model settings, kept on disk
                 (`CostCache`, under $TREESPEC_CACHE) and in memory
    acceptance   the drafter's positional acceptance a[k] (the k-th draw at a node is the one
                 accepted), one vector at temperature 0 and one above: measured on held-out
                 prompts and shipped beside a draft (acceptance.json, `measure_acceptance`), else
                 what the requests of earlier processes with the same models measured (kept
                 beside the costs), else `PRIOR`; fixed for a decoder's life, so that a batch's
                 outputs equal each request's alone
    plan         `Planner.plan`: the Sequoia-optimal shape for that acceptance and these costs
                 (chains and trees of every width compete; `optimal_shape`), or plain decoding
    per request  `AutoDepth`: before each round, the depth at which the planned shape, cut
                 there, gives the most expected tokens per unit of cost under the request's own
                 acceptance so far (its counts on top of the plan's vector, `PRIOR_WEIGHT`
                 pseudo-visits); depth 0 is a plain round. A request that stays plain probes one
                 depth-1 round every `PROBE_EVERY` rounds, so a text its draft predicts well is
                 noticed. Decisions follow committed outcomes only: given the same costs an
                 output is reproducible from its seed, and lossless (the depth of a round never
                 depends on its own draws).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import parallel
from .adaptive import DepthPolicy
from .config import AUTO_MAX_DEPTH, AUTO_MAX_NODES, SamplingConfig, TreeConfig
from .proposal import DepthStep, DraftTree, Walk
from .sequoia import TreeShape, optimal_shape, tree_expected_tokens
from .tree import TokenTree

COST_FEEDS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 17)  # target feed sizes timed (the rest interpolated)
COST_PREFIX = 128  # committed tokens before the timed feeds
COST_VERSION = 2  # bump when what is measured changes: older cache entries are ignored
PRIOR = {"T0": (0.5, 0.1, 0.05), "T1": (0.4, 0.1, 0.05)}  # a drafter nothing is known of
PRIOR_WEIGHT = 16.0  # a request's own visits weigh against the plan's vector as this many
PROBE_EVERY = 8  # a request that decodes plainly drafts one depth-1 round this often
ACCEPTANCE_FILE = "acceptance.json"  # beside a draft: its measured positional acceptance

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """What a round costs on this machine, in target forwards of one token."""

    verify: tuple[float, ...]  # verify[n] = t(n + 1 tokens) / t(1 token), n = 0 .. AUTO_MAX_NODES
    draft: float  # c: one draft forward of one row (a chain's level) / t(1)
    t1: float  # seconds of one target token, when measured
    measured: str = ""  # what and when: machine, settings, date
    node_draft: float = 0.0  # each further row of a tree level's draft forward / t(1)
    walk: dict = field(default_factory=lambda: {"T0": 0.0, "T1": 0.0})  # the walk per node / t(1), per class

    def round_cost(self, nodes: int, depth: int, cls: str = "T1") -> float:
        """A round of `nodes` draft nodes over `depth` levels, in plain rounds: scoring them,
        walking them under temperature class `cls`, and drafting each level."""
        if nodes == 0:
            return 1.0
        return (
            self.verify[min(nodes, len(self.verify) - 1)]
            + self.per_node(cls) * nodes
            + depth * self.level_draft
        )

    def per_node(self, cls: str) -> float:
        """What each node adds beyond its scoring: its walk under `cls` and its draft row."""
        return self.walk.get(cls, 0.0) + self.node_draft

    @property
    def level_draft(self) -> float:
        """A level's draft cost beyond its rows' (`node_draft` each): c less one row."""
        return max(0.0, self.draft - self.node_draft)

    def verify_with_nodes(self, cls: str) -> list[float]:
        """verify[n] plus the per-node costs of `cls`: the list Sequoia's DP plans with (beside
        `level_draft` per level)."""
        return [v + self.per_node(cls) * n for n, v in enumerate(self.verify)]

    def to_json(self) -> dict:
        return {
            "verify": list(self.verify), "draft": self.draft, "t1": self.t1, "measured": self.measured,
            "node_draft": self.node_draft, "walk": dict(self.walk),
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        verify = tuple(float(v) for v in d["verify"])
        if len(verify) != AUTO_MAX_NODES + 1 or not all(v > 0 for v in verify) or not float(d["draft"]) >= 0:
            raise ValueError("not a cost record of this version")
        walk = {k: float(d["walk"][k]) for k in ("T0", "T1")}
        return cls(
            verify,
            float(d["draft"]),
            float(d["t1"]),
            str(d.get("measured", "")),
            float(d["node_draft"]),
            walk,
        )


def median_seconds(run, repeats: int, warmup: int = 1) -> float:
    """The median wall time of `repeats` calls of `run()`, after `warmup` untimed ones."""
    times = []
    for _ in range(repeats + warmup):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def _lane(runner):
    """A lane of `runner` with a cache of its own, so that measuring leaves the runner's alone."""
    try:
        return runner.lanes(1)[0]
    except NotImplementedError:
        return runner


def measure_costs(decoder, repeats: int = 5) -> Costs:
    """This machine's costs for `decoder`: t(n)/t(1) of its target for feeds of n = 1 ..
    AUTO_MAX_NODES + 1 tokens (a root and its children after COST_PREFIX tokens, on a lane of
    its own; the sizes between COST_FEEDS interpolated); c, a draft forward's share of a round
    as its drafter really spends it (the forward, sampling, bookkeeping), from a short
    chain-drafted generation at temperature 1; and the per-node costs (a tree level's further
    draft rows, the walk per node at T=0 and T>0) from two short tree-drafted ones (all 0 where
    nothing is drafted by a model). About 4 s on a 2-core CPU for SmolLM2-135M with its head;
    under a compiler, each feed size compiles once."""
    from .tree import TokenTree

    target = decoder.target_runner
    room = (target.max_positions or COST_PREFIX + 64) - max(COST_FEEDS) - 1  # a short model's context
    prefix = max(1, min(COST_PREFIX, room))
    g = torch.Generator().manual_seed(0)
    lane = _lane(target)
    tokens = torch.randint(0, min(target.vocab_size, 1000), (prefix + max(COST_FEEDS),), generator=g).tolist()
    lane.reset()
    lane.prefill(tokens[:prefix])
    timed = {}
    for n in COST_FEEDS:
        tree = TokenTree(tokens[prefix : prefix + n], [-1] + [0] * (n - 1))

        def score(tree=tree) -> None:
            lane.score(tree)
            lane.commit([])

        timed[n] = median_seconds(score, repeats)
    lane.reset()
    t1 = timed[1]
    sizes = sorted(timed)
    verify: list[float] = []
    for n in range(1, AUTO_MAX_NODES + 2):  # linear between the timed sizes
        hi = next(s for s in sizes if s >= n)
        lo = max(s for s in sizes if s <= n)
        t = timed[lo] if hi == lo else timed[lo] + (timed[hi] - timed[lo]) * (n - lo) / (hi - lo)
        verify.append(max(1.0, t / t1, verify[-1] if verify else 1.0))  # more rows never cost less
    c, node_draft, walk = 0.0, 0.0, {"T0": 0.0, "T1": 0.0}
    if decoder.drafter.needs_draft_model and decoder.draft_runner is not None:
        engine = decoder.engine(max_live=1)  # lanes of its own: the decoder may be mid-generate()

        def rounds(tree: TreeConfig, temperature: float):
            for _ in range(2):  # the first pays for allocations
                i = engine.add(
                    tokens[:8], max(1, min(8 * repeats, room)), tree=tree,
                    sampling=SamplingConfig(temperature=temperature), seed=0, ignore_eos=True,
                )  # fmt: skip
                stats = engine.run()[i].stats
            return stats

        chain = rounds(TreeConfig(width=1, depth=4), 1.0)
        if chain.draft_forwards:
            c = chain.draft_seconds / chain.draft_forwards / t1
            # trees: a level of k rows drafts in c + (k - 1) x node_draft; verifying n nodes
            # costs verify[n] (scoring) + n x walk[class] (the walk, sampling included)
            for cls, tree, temperature in (
                ("T1", TreeConfig(width=4, depth=2), 1.0),
                ("T0", TreeConfig(width=4, depth=2, strategy="topk"), 0.0),
            ):
                s = rounds(tree, temperature)
                if not (s.target_steps and s.draft_forwards and s.tree_nodes):
                    continue
                nodes = s.tree_nodes / s.target_steps
                rows = s.tree_nodes / s.draft_forwards  # per level
                if cls == "T1" and rows > 1:
                    level = s.draft_seconds / s.draft_forwards / t1
                    node_draft = max(0.0, (level - c) / (rows - 1))
                scoring = verify[min(round(nodes), AUTO_MAX_NODES)]
                walk[cls] = max(0.0, (s.verify_seconds / s.target_steps / t1 - scoring) / nodes)
    return Costs(tuple(verify), c, t1, node_draft=node_draft, walk=walk)


def machine_key() -> dict:
    """What a cost measurement depends on besides the models: the processor and torch's setup."""
    from .backends.cpu import cpu_bf16_flags, cpu_model

    return {
        "cpu": cpu_model(),
        "bf16": sorted(cpu_bf16_flags()),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),  # oneDNN capped (the AVX2 emulation)
    }


def files_key(path) -> list | None:
    """A model's identity on disk: its files' names, sizes and modification times (None: not a
    local path)."""
    if path is None:
        return None
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        return [str(path)]  # a hub id: the name is all there is
    files = sorted(p.rglob("*")) if p.is_dir() else [p]
    return [str(p.resolve())] + [
        [f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files if f.is_file()
    ]


class CostCache:
    """Measured `Costs` on disk, one JSON file per key (machine + model settings), under
    `$TREESPEC_CACHE/costs` (default ~/.cache/treespec/costs). The first measurement of a key
    wins: processes that measure at once all keep the one written first, so that every process
    on a machine plans alike. A missing, unreadable or stale entry is measured again, never an
    error."""

    def __init__(self, root: Path | None = None):
        from .loading.gguf import default_cache_dir

        self.root = Path(root) if root is not None else default_cache_dir() / "costs"
        self.memory: dict[str, Costs] = {}

    @staticmethod
    def key(settings: dict) -> str:
        blob = json.dumps(
            {"version": COST_VERSION, "machine": machine_key(), **settings}, sort_keys=True, default=str
        )
        return hashlib.sha1(blob.encode()).hexdigest()[:20]

    def get(self, settings: dict | None, measure) -> Costs:
        """The costs for `settings` (None: not cacheable on disk, e.g. models given as objects):
        from memory, from disk, or `measure()`d and stored. Tensor parallel, rank 0's cache
        decides for every rank (`measure` must return the same costs on every rank)."""
        if settings is None:
            return measure()
        key = self.key(settings)
        if key not in self.memory:
            path = self.root / f"{key}.json"
            # tensor parallel: rank 0's cache decides whether every rank measures (together:
            # the measurement runs forwards), and rank 0's measurement is every rank's
            costs = parallel.agree(self._read(path) if parallel.leader() else None)
            if costs is None:
                stale = path.exists()  # corrupt, or another version's: replaced
                log.info(
                    "measuring this machine's costs for the automatic tree (once; kept in %s)", self.root
                )
                costs = measure()
                record = {**costs.to_json(), "settings": settings, "machine": machine_key()}
                if parallel.leader() and _write_json(path, record, replace=stale):
                    costs = self._read(path) or costs  # another process's, if it wrote first
                costs = parallel.agree(costs)
            self.memory[key] = costs
        return self.memory[key]

    @staticmethod
    def _read(path: Path) -> Costs | None:
        try:
            return Costs.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, corrupt or from another version


# ---- acceptance ---------------------------------------------------------------------------------
def temperature_class(sampling: SamplingConfig) -> str:
    return "T0" if sampling.greedy else "T1"


def load_acceptance(directory) -> dict[str, tuple[float, ...]] | None:
    """A draft's shipped positional acceptance (`ACCEPTANCE_FILE` in its directory: the
    vectors `measure_acceptance` gives at T=0 and T=1), or None."""
    if not isinstance(directory, (str, os.PathLike)):
        return None
    path = Path(directory) / ACCEPTANCE_FILE
    try:
        data = json.loads(path.read_text())
        return {k: tuple(float(a) for a in data[k]["acceptance"]) for k in ("T0", "T1")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


COSTS = CostCache()  # the process's cost cache (on disk under $TREESPEC_CACHE/costs)


def planner_for(decoder, settings: dict | None, shipped=None) -> Planner:
    """The `Planner` of `decoder`. `settings`: what its models were loaded from and how (paths,
    dtypes, compile, quantize), the key of the measured costs on disk and of the acceptance its
    requests measured; None for models handed over as objects (measured once per decoder,
    nothing kept). `shipped`: the draft's acceptance.json vectors."""

    def measure() -> Costs:
        # measured from clocks: tensor parallel, every rank measures (the forwards are
        # collective) and rank 0's numbers plan for all, so every rank draws the same trees
        return parallel.agree(measure_costs(decoder))

    if settings is None:
        return Planner(measure, shipped, "shipped")
    costs = lambda: COSTS.get(settings, measure)  # noqa: E731
    if shipped is not None:
        return Planner(costs, shipped, "shipped")
    # the counts of this pair's requests, for the planners of later processes
    key = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:20]
    record = COSTS.root / f"acceptance-{key}.json"
    return Planner(costs, parallel.agree(Planner.remembered(record)), "measured", record)


@dataclass
class Plan:
    """What the automatic tree chose for a request, and why (`GenerationOutput.plan`)."""

    tree: TreeConfig | None  # a Sequoia shape; None: plain decoding
    acceptance: tuple[float, ...]  # the positional acceptance it planned with
    expected_tokens: float  # per round, at the full shape
    speedup: float  # expected tokens per unit of cost, over plain decoding's 1
    costs: Costs | None  # None: nothing was planned (there is nothing to draft with)
    source: str  # where the acceptance came from: "shipped", "measured" or "prior"
    cls: str = "T1"  # the temperature class planned for ("T0": greedy)

    def round_cost(self, nodes: int, depth: int) -> float:
        return self.costs.round_cost(nodes, depth, self.cls)

    def describe(self) -> str:
        if self.costs is None:
            return f"auto: plain decoding ({self.source})"
        a = ", ".join(f"{x:.2f}" for x in self.acceptance)
        why = (
            f"acceptance [{a}] ({self.source}); t(n)/t(1) {self.costs.verify[1]:.2f} (n=2) .. "
            f"{self.costs.verify[-1]:.2f} (n={len(self.costs.verify)}), c {self.costs.draft:.3f}, "
            f"per node +{self.costs.per_node(self.cls):.3f}"
        )
        if self.tree is None:
            return f"auto: plain decoding, no shape beats it ({why})"
        s = self.tree.shape
        return (
            f"auto: {s.n_nodes} draft nodes, depth {s.depth}: {self.expected_tokens:.2f} tokens a round "
            f"expected, {self.speedup:.2f}x plain ({why})"
        )


class Planner:
    """Plans the automatic tree of a decoder's requests from its costs (measured once, lazily)
    and its drafter's acceptance (fixed at creation: `acceptance` {"T0": a, "T1": a}, a class
    it lacks planned with `PRIOR`); `remember` keeps finished requests' counts in `record` for
    the planners of later processes."""

    def __init__(self, costs, acceptance=None, source: str = "prior", record: Path | None = None):
        self._costs = costs  # Costs, or a function that measures them on first use
        acceptance = acceptance or {}
        self.vectors = {cls: acceptance.get(cls) or PRIOR[cls] for cls in PRIOR}  # {"T0": a, "T1": a}
        self.sources = {cls: source if acceptance.get(cls) else "prior" for cls in PRIOR}
        self.record = record
        self._plans: dict[tuple[str, bool], Plan] = {}  # fixed inputs: each plan made once

    @property
    def costs(self) -> Costs:
        if callable(self._costs):
            self._costs = self._costs()
        return self._costs

    def plan(self, sampling: SamplingConfig, chain_only: bool = False) -> Plan:
        """The shape with the most expected tokens per unit of cost for `sampling`, or plain
        decoding; `chain_only`: width 1 (a drafter of chains, or the block rule)."""
        cls = temperature_class(sampling)
        if (cls, chain_only) not in self._plans:
            self._plans[cls, chain_only] = self._plan(cls, chain_only)
        return self._plans[cls, chain_only]

    def _plan(self, cls: str, chain_only: bool) -> Plan:
        acc, costs = self.vectors[cls], self.costs
        vector = _check_vector(acc[:1] if chain_only else acc)
        shape = optimal_shape(
            vector, AUTO_MAX_NODES, AUTO_MAX_DEPTH, costs.verify_with_nodes(cls), costs.level_draft
        )
        if shape.n_nodes == 0:
            return Plan(None, vector, 1.0, 1.0, costs, self.sources[cls], cls)
        speedup = shape.expected_tokens / costs.round_cost(shape.n_nodes, shape.depth, cls)
        tree = TreeConfig(strategy="sequoia", shape=shape, depth=shape.depth)
        return Plan(tree, vector, shape.expected_tokens, speedup, costs, self.sources[cls], cls)

    def remember(self, sampling: SamplingConfig, counts: AcceptanceCounts) -> None:
        """Add a finished request's counts to `record` (a later process plans with them)."""
        if self.record is None or not counts.visits or not parallel.leader():
            return
        cls = temperature_class(sampling)
        try:
            data = json.loads(self.record.read_text()) if self.record.is_file() else {}
        except (OSError, ValueError):
            data = {}
        old = AcceptanceCounts(*(data.get(cls) or ([], [])))
        old.add(counts)
        data[cls] = [old.hits, old.visits]
        _write_json(self.record, data)

    @staticmethod
    def remembered(record: Path | None) -> dict[str, tuple[float, ...]]:
        """The vectors of the counts in `record`, for the temperature classes it has counts of
        (an unreadable record: none)."""
        try:
            data = json.loads(record.read_text())
            counts = {cls: AcceptanceCounts(*data[cls]) for cls in PRIOR if cls in data}
            return {cls: c.vector(PRIOR[cls], PRIOR_WEIGHT) for cls, c in counts.items() if any(c.visits)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}


@dataclass
class AcceptanceCounts:
    """Positional acceptance counts: `visits[k]` walks stood at a node with a child of rank k,
    `hits[k]` of them accepted that child (Sequoia's a[k] = hits[k] / visits[k])."""

    hits: list[float] = field(default_factory=list)
    visits: list[float] = field(default_factory=list)

    def count(self, tree: TokenTree, walk: Walk) -> None:
        """The nodes a round's walk stood at in `tree`: which of their children, by rank, it
        accepted."""
        for i, u in enumerate(walk.path):
            kids = tree.children(u)  # in draw order: rank 0 first
            if not kids:
                break
            taken = walk.path[i + 1] if i + 1 < len(walk.path) else None
            self._grow(len(kids))
            for k, kid in enumerate(kids):
                self.visits[k] += 1
                self.hits[k] += kid == taken

    def add(self, other: AcceptanceCounts) -> None:
        self._grow(len(other.visits))
        for k, (h, v) in enumerate(zip(other.hits, other.visits)):
            self.hits[k] += h
            self.visits[k] += v

    def vector(self, prior: Sequence[float] = (), weight: float = 0.0) -> tuple[float, ...]:
        """a[k], the counts on top of `prior` weighted as `weight` visits."""
        out = []
        for k in range(max(len(prior), len(self.visits))):
            p = prior[k] if k < len(prior) else 0.0
            h, v = (self.hits[k], self.visits[k]) if k < len(self.visits) else (0.0, 0.0)
            out.append((p * weight + h) / (weight + v) if weight + v else 0.0)
        return _check_vector(out)

    def _grow(self, n: int) -> None:
        while len(self.visits) < n:
            self.visits.append(0.0)
            self.hits.append(0.0)


class AutoDepth(DepthPolicy):
    """The per-request policy of an automatic tree: the depth at which the planned shape is cut
    each round, from the request's own acceptance (see the module docstring)."""

    def __init__(self, plan: Plan):
        super().__init__(plan.tree)
        self.plan, self.counts, self.plain_rounds = plan, AcceptanceCounts(), 0
        self.cuts = _cuts(plan.tree.shape)  # (depth, nodes, parents) of the shape cut at each depth
        self.depth = self._best_depth()

    def _best_depth(self) -> int:
        acc = self.counts.vector(self.plan.acceptance, PRIOR_WEIGHT)
        best, best_value = 0, 1.0  # plain decoding: one token for one forward
        for depth, nodes, parents in self.cuts:
            value = tree_expected_tokens(parents, acc) / self.plan.round_cost(nodes, depth)
            if value > best_value * (1 + 1e-9):
                best, best_value = depth, value
        return best

    def next_depth(self) -> int:
        if self.depth == 0:
            self.plain_rounds += 1
            if self.plain_rounds % PROBE_EVERY == 0:
                return 1  # a probe: this text may suit the draft better than planned
        return self.depth

    def update(self, drafter, draft: DraftTree, walk: Walk, round_depth: int) -> DepthStep:
        self.counts.count(draft.tree, walk)
        self.depth = self._best_depth()
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


def _check_vector(a: Sequence[float]) -> tuple[float, ...]:
    """Probabilities of disjoint events: clipped to [0, 1], scaled down if they sum past 1."""
    a = tuple(min(1.0, max(0.0, float(x))) for x in a)
    total = sum(a)
    return tuple(x / total for x in a) if total > 1 else a


def _write_json(path: Path, data, replace: bool = True) -> bool:
    """Write `data` to `path` whole (a temporary file, then a rename; `replace=False`: only if
    no file is there, so a concurrent first writer wins). Whether the cache is writable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, default=str)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails where another process wrote first
            except FileExistsError:
                pass
            os.unlink(tmp)
        return True
    except OSError:
        return False  # a read-only cache: nothing kept


def measure_acceptance(decoder, prompts, sampling: SamplingConfig, max_new_tokens: int = 64, seed: int = 0):
    """The positional acceptance of `decoder`'s drafter on `prompts` (token ids, text or chats)
    under `sampling`: each decoded with a wide Sequoia shape (4 children of the root, each with
    one child), every round counted (`AcceptanceCounts`). Returns the counts."""
    shape = TreeShape((-1, 0, 0, 0, 0, 1, 2, 3, 4))
    tree = TreeConfig(strategy="sequoia", shape=shape, depth=2)
    counts = AcceptanceCounts()
    outs = decoder.generate_batch(
        prompts, max_new_tokens=max_new_tokens, tree=tree, sampling=sampling,
        seeds=[seed + i for i in range(len(prompts))], trace=True,
    )  # fmt: skip
    for out in outs:
        for r in out.trace:
            counts.count(r.tree, Walk(r.path, r.token, r.kind))
    return counts


def write_acceptance(decoder, prompts, directory, max_new_tokens: int = 64) -> dict:
    """Measure `decoder`'s drafter on held-out `prompts` at temperature 0 and 1
    (`measure_acceptance`) and write `ACCEPTANCE_FILE` into `directory` (the draft's), where
    `from_pretrained` finds it: the vectors automatic trees plan with."""
    record = {"prompts": len(prompts), "max_new_tokens": max_new_tokens}
    for cls, sampling in (("T0", SamplingConfig(temperature=0)), ("T1", SamplingConfig(temperature=1.0))):
        counts = measure_acceptance(decoder, prompts, sampling, max_new_tokens)
        record[cls] = {"acceptance": [round(a, 4) for a in counts.vector()], "visits": counts.visits}
    Path(directory, ACCEPTANCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record
