"""`TreeConfig()` means "auto": each request's tree, chosen for this machine and this drafter.

A round that drafts a shape of n nodes and depth d costs, in plain rounds, its forwards (the
verification of n nodes and the root, `t(n + 1) / t(1)`, and d draft forwards of c each), what
each node adds (its walk, a tree level's further draft rows) and a speculative round's fixed
cost (the draft's catch-up, both caches' bookkeeping); it yields, in expectation, Sequoia's
positional value of the shape (`treespec.sequoia`): 1 + the sum over its nodes of the product
of the acceptance a[k] of each rank k on the node's path. Plain decoding costs 1 and yields 1.
The automatic tree is the shape with the most expected tokens per unit of cost, and no
speculation where none is expected to beat plain decoding by `PLAN_MARGIN` (5 %: the cost
model's error on a round).

    costs        t(n)/t(1) of the target for n = 1 .. AUTO_MAX_NODES + 1, and c: measured in a few
                 seconds (`measure_costs`), once per machine and model settings, kept on disk
                 (`CostCache`, under $TREESPEC_CACHE) and in memory
    acceptance   the drafter's positional acceptance a[k] (the k-th draw at a node is the one
                 accepted; rank 0's by the level of the node, `treespec.sequoia.by_level`), one
                 set at temperature 0 and one above: measured on held-out
                 prompts and shipped beside a draft (acceptance.json, `measure_acceptance`), else
                 what the requests of earlier processes with the same models measured (kept
                 beside the costs), else `PRIOR`; fixed for a decoder's life, so that a batch's
                 outputs equal each request's alone
    plan         `Planner.plan`: the Sequoia-optimal shape for that acceptance and these costs
                 (chains and trees of every width compete; `optimal_shape`), at T > 0 also the
                 i.i.d. trees measured beside the draft (`IidLevels`: positional acceptance does
                 not describe i.i.d. siblings), or plain decoding
    per request  `AutoDepth`: before each round, the depth at which the planned shape, cut
                 there, gives the most expected tokens per unit of cost under the request's own
                 acceptance so far (its counts on top of the plan's vector, `PLAN_WEIGHT`
                 pseudo-visits: a short request's few rounds are too noisy to cut a plan
                 that is right, and a cut shape can only get shallower, never deeper, so
                 noise alone would cost depth); depth 0 is a plain round. A planned chain
                 is the chain of AUTO_MAX_DEPTH, started at the deepest depth near the best
                 (a request learns only the levels it drafts). A request that
                 stays plain probes one depth-1 round every `PROBE_EVERY` rounds, so a text
                 its draft predicts well is noticed. Decisions follow committed outcomes
                 only: given the same costs an output is reproducible from its seed, and
                 lossless (the depth of a round never depends on its own draws).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import parallel
from .adaptive import DepthPolicy
from .backends.cpu import machine_key
from .config import (
    AUTO_MAX_DEPTH,
    AUTO_MAX_NODES,
    SamplingConfig,
    TreeConfig,
    default_cache_dir,
    write_cache_json,
)
from .proposal import DepthStep, DraftTree, Walk
from .sequoia import TreeShape, by_level, optimal_shape, tree_expected_tokens
from .tree import TokenTree

COST_FEEDS = tuple(range(1, AUTO_MAX_NODES + 2))  # target feed sizes timed: every one a round may score
COST_PREFIX = 128  # committed tokens before the timed feeds
# tokens of each short generation whose rounds are timed, and timed runs of plain decoding and of
# chains of 1 and 4 (medians): 32 and 3 planned what 64 and 5 did in 3 measurements each, in 13.5 s
# where those took 30 (SmolLM2 int4 with its head, Zen 4: a chain starting at 1 or 2 at T=0,
# plain at T=1, expected speed-ups 1.06-1.08x either way)
COST_ROUND_TOKENS = 32
COST_RUNS = 3
MIN_PLAIN_ROUND = 0.25  # a plain round measured below this many t(1) is a broken clock, not a cost
COST_VERSION = 17  # bump when what is measured changes: older cache entries are ignored
PRIOR = {"T0": (0.5, 0.1, 0.05), "T1": (0.4, 0.1, 0.05)}  # a drafter nothing is known of
PRIOR_WEIGHT = 16.0  # PRIOR weighs against the counts remembered from earlier processes as this many visits
PLAN_WEIGHT = 64.0  # the plan's vector weighs against a request's own visits as this many
DEPTH_MARGIN = 0.02  # a request leaves its depth for one expected this much faster, not less
# a plan speculates only where its shape is expected this much faster than plain decoding: the
# cost model's round is off by 5-10 % on the measured grids (docs/performance.md), and at a
# near-tie plain decoding cannot lose to itself
PLAN_MARGIN = 0.05
LEVEL_MIN_VISITS = 50  # a level's own rank-0 counts plan only with this many visits
PROBE_EVERY = 8  # a request that decodes plainly drafts one depth-1 round this often
ACCEPTANCE_FILE = "acceptance.json"  # beside a draft: its measured positional acceptance
IID_WIDTHS = (2, 3, 4)  # i.i.d. trees (sequences a round) measured beside a draft and planned at T > 0
IID_DEPTH = 4  # their depth when measured (4 x 4 = AUTO_MAX_NODES); a plan cuts them shallower

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """What a round costs on this machine, in target forwards of one token (t(1)); `round_cost`
    turns a round into plain rounds."""

    verify: tuple[float, ...]  # verify[n] = t(n + 1 tokens) / t(1 token), n = 0 .. AUTO_MAX_NODES
    # (non-decreasing from n = 1; below 1 where one row costs more than a few)
    draft: float  # c: one draft forward of one row (a chain's level) / t(1)
    t1: float  # seconds of one target token, when measured
    measured: str = ""  # what and when: machine, settings, date
    node_draft: float = 0.0  # each further row of a tree level's draft forward / t(1)
    walk: dict = field(default_factory=lambda: {"T0": 0.0, "T1": 0.0})  # the walk per node / t(1), per class
    chain_walk: float = 0.0  # a chain's walk per node at T > 0 (the block rule) / t(1)
    plain: float = 1.0  # a plain round (forward, sampling, bookkeeping) / t(1); below 1 where
    # the tree's masks and walk make the scored t(1) dearer than a plain step
    overhead: float = 0.0  # a speculative round's time beyond its forwards, draws and walk / t(1)
    # chain[n] = t(a root and a chain of n tokens) / t(1), n = 0 .. AUTO_MAX_DEPTH: a chain is
    # scored under the causal pattern, a tree under a mask built per round (a 6-node tree took
    # 2.96 ms where a chain of 6 took 2.79, pycode); () prices chains as trees
    chain: tuple[float, ...] = ()

    def round_cost(self, nodes: float, depth: int, cls: str = "T1") -> float:
        """A round of `nodes` draft nodes over `depth` levels (nodes == depth: a chain), in plain
        rounds: scoring them, walking them under temperature class `cls`, drafting each level
        and the round's fixed cost. An i.i.d. tree's nodes are an expectation (equal draws share
        a node): its scoring is read between the whole counts around it."""
        if nodes == 0:
            return 1.0
        if nodes == depth and nodes < len(self.chain):
            scoring = self.chain[nodes]
        else:
            n = min(nodes, len(self.verify) - 1)
            low, high = int(n), min(int(n) + 1, len(self.verify) - 1)
            scoring = self.verify[low] + (n - low) * (self.verify[high] - self.verify[low])
        forwards = scoring + depth * self.level_draft
        return (forwards + self.per_node(cls, nodes == depth) * nodes + self.overhead) / self.plain

    def per_node(self, cls: str, chain: bool = False) -> float:
        """What each node adds beyond its scoring: its walk under `cls` (a chain's is the block
        rule's) and its draft row. A greedy walk (T=0) is the same walk without its sampling,
        so never dearer than at T > 0: its own measurement, a small difference of a tree's
        round times (0.0-0.04 t(1) a node), once priced a chain of 1 at T=0 7 % above the same
        chain at T=1 (SmolLM2 int4)."""
        # a tree's traversal walks node by node (a residual at each rejection) where the block
        # rule takes a chain whole: never cheaper a node. Its own measurement runs after random
        # tokens, where the walk stops at the root's children: 0.033 t(1) a node against the
        # chain's 0.059, where a 5-node tree's verification ran 0.18 t(1) dearer than a chain of
        # 4's (pycode T=1) and the tree, planned, ran 0.89x the chain
        sampled = self.chain_walk if chain else max(self.walk.get("T1", 0.0), self.chain_walk)
        walk = min(sampled, self.walk.get("T0", 0.0)) if cls == "T0" else sampled
        return walk + self.node_draft

    @property
    def level_draft(self) -> float:
        """A level's draft cost beyond its rows' (`node_draft` each): c less one row. Negative
        where a tree level's further row costs more than a chain's whole level (the pycode
        draft's sampling per node): a chain still costs c a level, a tree c a level plus
        `node_draft` a further row."""
        return self.draft - self.node_draft

    def verify_with_nodes(self, cls: str) -> list[float]:
        """The cost of a round of n nodes but its levels, in plain rounds (n = 0: a plain round):
        the list Sequoia's DP plans with, beside `level_draft / plain` per level."""
        return [1.0] + [self.round_cost(n, 0, cls) for n in range(1, len(self.verify))]

    def to_json(self) -> dict:
        return {
            "verify": list(self.verify), "draft": self.draft, "t1": self.t1, "measured": self.measured,
            "node_draft": self.node_draft, "walk": dict(self.walk), "chain_walk": self.chain_walk,
            "plain": self.plain, "overhead": self.overhead, "chain": list(self.chain),
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        verify = tuple(float(v) for v in d["verify"])
        valid = all(v > 0 for v in verify) and float(d["draft"]) >= 0 and float(d["plain"]) > 0
        if len(verify) != AUTO_MAX_NODES + 1 or not valid:
            raise ValueError("not a cost record of this version")
        walk = {k: float(d["walk"][k]) for k in ("T0", "T1")}
        return cls(
            verify,
            float(d["draft"]),
            float(d["t1"]),
            str(d.get("measured", "")),
            float(d["node_draft"]),
            walk,
            float(d["chain_walk"]),
            float(d["plain"]),
            float(d["overhead"]),
            tuple(float(v) for v in d["chain"]),
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


def _compile_every_feed_size(lane, tokens: list[int], prefix: int) -> None:
    """One forward of every feed size a measurement may meet (1 .. AUTO_MAX_NODES + 1 tokens)
    on `lane` (a compiled runner's, `_lane`), so that no graph compiles inside a timed run: a
    draft's catch-up size follows its acceptance, and a compile of tens of seconds in a timed
    round made a compiled pair's per-node costs 10x what they were."""
    room = (lane.max_positions or prefix + AUTO_MAX_NODES + 2) - AUTO_MAX_NODES - 2
    start = max(1, min(prefix, room))

    def feed(ids: list[int], parents: list[int]) -> None:
        """A feed of `ids`; a feature head's (`takes_hidden`) with a zero state per token."""
        hidden = torch.zeros(len(ids), lane.shape.hidden, dtype=lane.dtype) if lane.takes_hidden else None
        lane.extend(ids, parents, hidden)

    lane.reset()
    feed(tokens[:start], list(range(-1, start - 1)))
    lane.commit(list(range(start)))
    for n in range(1, AUTO_MAX_NODES + 2):
        feed(tokens[prefix : prefix + n], [-1] + [0] * (n - 1))
        lane.commit([])
    lane.reset()


def measure_costs(decoder, repeats: int = 5) -> Costs:
    """This machine's costs for `decoder`: t(n)/t(1) of its target for feeds of n = 1 ..
    AUTO_MAX_NODES + 1 tokens (a root and its children after COST_PREFIX tokens, on a lane of
    its own, the sizes interleaved, each one timed: kernels that work in blocks of rows make
    t(n) a staircase that interpolation misses), and for chains of up to AUTO_MAX_DEPTH nodes
    (scored under the causal pattern, without a tree's mask); then, from short generations after the same
    prefix, at temperature 1, as the drafter really runs them
    (forwards, sampling, bookkeeping): a plain round's time, c (what a further level adds to a
    chain of 4 over a chain of 1), a chain's walk per node and a speculative round's fixed
    cost; and the per-node costs of trees (a level's further draft rows, the walk per node at
    T=0 and T>0) from a Sequoia shape at both temperatures (all neutral where nothing is
    drafted by a model); the generations share the prompt's cache (`Runner.prefix_reuse`). ~14
    s on a 2-core CPU for SmolLM2-135M int4 with its head; under a compiler, each feed size
    compiles once."""
    target = decoder.target_runner
    room = (target.max_positions or COST_PREFIX + 64) - max(COST_FEEDS) - 1  # a short model's context
    prefix = max(1, min(COST_PREFIX, room))
    g = torch.Generator().manual_seed(0)
    lane = _lane(target)
    vocab = min(target.vocab_size, getattr(decoder.draft_runner, "vocab_size", None) or 1000, 1000)
    tokens = torch.randint(0, vocab, (prefix + AUTO_MAX_NODES + 1,), generator=g).tolist()
    for runner in (target, decoder.draft_runner):
        if getattr(runner, "compiled", None) is not None:  # under a compiler: every graph first
            _compile_every_feed_size(lane if runner is target else _lane(runner), tokens, prefix)
    lane.reset()
    lane.prefill(tokens[:prefix])
    # a root and its children (a tree's mask), and a root and a chain of 2+ (the causal pattern;
    # a root and one child is both)
    trees = {("tree", n): TokenTree(tokens[prefix : prefix + n], [-1] + [0] * (n - 1)) for n in COST_FEEDS}
    for n in range(3, AUTO_MAX_DEPTH + 2):
        trees["chain", n] = TokenTree(tokens[prefix : prefix + n], list(range(-1, n - 1)))
    rounds: list[dict[tuple, float]] = []
    for r in range(repeats + 2):  # interleaved, so that a slow stretch slows every size alike
        times = {}
        for k, tree in trees.items():
            t0 = time.perf_counter()
            lane.score(tree)
            lane.commit([])
            times[k] = time.perf_counter() - t0
        if r >= 2:  # the first two rounds of sizes warm the kernels and allocations
            rounds.append(times)
    lane.reset()
    t1 = statistics.median(row["tree", 1] for row in rounds)
    # each size over the one-token feed of its own round, medians: taken apart, the medians of
    # one tree timed twice differed by 8 % (SmolLM2 int4, t(2) 1.065 and 1.146 t(1))
    timed = {k: statistics.median(row[k] / row["tree", 1] for row in rounds) for k in trees}
    # more rows never cost less, from two rows on; a single row is the unit, not a floor: compiled,
    # one row scored through the tree's graph took 2.24 ms and 2 to 6 rows 2.0-2.1 (pycode bf16),
    # and a floor at t(1) flattened t(2) .. t(7) to 1.0 and hid the step at 7 rows (+0.3 ms) that
    # made a chain of 6 run 0.91x a chain of 5 at T=1
    verify = [1.0]
    for n in COST_FEEDS[1:]:
        verify.append(max(timed["tree", n], verify[-1] if n > 2 else 0.0))
    chain_scoring = verify[:2]
    for n in range(3, AUTO_MAX_DEPTH + 2):
        chain_scoring.append(max(timed["chain", n], chain_scoring[-1]))
    c, node_draft, walk, chain_walk, plain, overhead = 0.0, 0.0, {"T0": 0.0, "T1": 0.0}, 0.0, 1.0, 0.0
    if decoder.drafter.needs_draft_model and decoder.draft_runner is not None:
        engine = decoder.engine(max_live=1)  # lanes of its own: the decoder may be mid-generate()
        # every generation starts from the same prompt: its lanes keep the prompt's cache from
        # one to the next (the timings leave prefill out), where each prefilled the prompt anew
        for runner in (*engine.targets, *engine.drafts):
            if runner is not None:
                runner.prefix_reuse = True
        new_tokens = max(1, min(COST_ROUND_TOKENS, room))
        # the generations start after the prefix t(1) was timed after, where the model has room
        # for both: from an 8-token prompt a plain step ran 11 % faster than from 128 (compiled
        # bf16 SmolLM2), and a plain unit measured short priced every shape 10-15 % too dear
        start = prefix if target.max_positions is None else max(8, min(prefix, room - new_tokens))

        def generate(tree: TreeConfig | None, temperature: float):
            """The stats of one short generation (seed 0: every run of a tree decodes alike)."""
            i = engine.add(
                tokens[:start], new_tokens, tree=tree,
                sampling=SamplingConfig(temperature=temperature), seed=0, ignore_eos=True,
            )  # fmt: skip
            return engine.run()[i].stats

        def per_round(s, seconds: float) -> float:
            return seconds / s.target_steps / t1

        def scoring(s, table=verify) -> float:
            return table[min(round(s.tree_nodes / s.target_steps), len(table) - 1)]

        def median_run(stats: list):
            return sorted(stats, key=lambda s: s.total_seconds / s.target_steps)[len(stats) // 2]

        # plain decoding and chains of 1 and 4 levels at T=1, COST_RUNS runs each after one that
        # pays for allocations, interleaved so that a slow stretch of a shared machine slows each
        # alike: measured in blocks (and the chain of 4 once), a round's fixed cost once came out
        # at 0.36 t(1) where three more measurements gave 0.11-0.18 (SmolLM2 bf16 eager), and
        # the cache kept it
        trees = {"plain": None, "short": TreeConfig(width=1, depth=1), "chain": TreeConfig(width=1, depth=4)}
        runs: dict[str, list] = {k: [] for k in trees}
        for r in range(COST_RUNS + 1):
            for k, tree in trees.items():
                s = generate(tree, 1.0)
                if r:
                    runs[k].append(s)
        # a plain round skips the tree's masks and walk, so it may cost less than the scored t(1):
        # under a compiler 0.82 t(1) was measured, and a plain unit of 1 made every shape look
        # 1.2x better than it was
        plains = [per_round(s, s.total_seconds - s.prefill_seconds) for s in runs["plain"]]
        plain = max(MIN_PLAIN_ROUND, statistics.median(plains))
        short, chain = median_run(runs["short"]), median_run(runs["chain"])
        if short.draft_forwards and chain.draft_forwards:
            # chains of 1 and 4 levels: c is what a further level adds to the draft's time; a
            # chain's walk per node (the block rule at T>0) from its verification time; the rest
            # of a depth-1 round is `overhead` (the first level's catch-up on the accepted
            # tokens beyond c, both caches' bookkeeping)
            levels = max(2.0, chain.draft_forwards / chain.target_steps)
            further = per_round(chain, chain.draft_seconds) - per_round(short, short.draft_seconds)
            c = max(0.0, further / (levels - 1))
            # the walk's per-node cost is the slope of verification beyond scoring from the chain
            # of 1 to the chain of 4; what a round spends there whatever its nodes (the target's
            # sampling of its root, the mask) is `overhead`'s. Divided by the nodes instead, the
            # intercept made each level 0.1 t(1) dearer than measured (compiled pycode bf16)
            nodes, one = chain.tree_nodes / chain.target_steps, short.tree_nodes / short.target_steps
            unwalked = per_round(short, short.verify_seconds) - scoring(short)  # a chain of 1's
            chain_walk = max(
                0.0,
                (per_round(chain, chain.verify_seconds) - scoring(chain, chain_scoring) - unwalked)
                / max(nodes - one, 1.0),
            )
            # a chain of 1's round over the plain round run beside it, run by run (a slow stretch
            # slows both), times the plain round: with each one's median instead, one measurement
            # of three priced the round 1.13 plain rounds and another 1.31, where ten pairs in
            # one process ran 1.19-1.23 (SmolLM2 bf16 eager)
            paired = [
                per_round(s, s.total_seconds - s.prefill_seconds - s.plan_seconds) / p
                for s, p in zip(runs["short"], plains)
            ]
            whole = statistics.median(paired) * plain
            first = per_round(short, short.draft_seconds)  # a round's first level, catch-up included
            # a small difference of large times (the median of the runs, so that one slow
            # stretch does not make every plan shallow), but never below what the first level
            # costs beyond a further one, which the draft's own timer measures steadily
            overhead = max(0.0, first - c, whole - scoring(short) - chain_walk - c)
            # trees of the shapes plans are made of (children drawn without replacement): a round
            # of d levels and n nodes drafts in d x c + (n - d) x node_draft and walks n nodes in
            # n x walk[class] (the traversal rule at T>0, its sampling included)
            shape = TreeConfig(strategy="sequoia", shape=TreeShape((-1, 0, 0, 0, 0, 1, 2, 3, 4)), depth=2)
            intercept = max(0.0, unwalked - chain_walk * one)  # a round's, whatever its nodes
            for cls, temperature in (("T1", 1.0), ("T0", 0.0)):
                generate(shape, temperature)  # allocations
                s = generate(shape, temperature)
                if not (s.target_steps and s.draft_forwards and s.tree_nodes):
                    continue
                nodes, levels = s.tree_nodes / s.target_steps, s.draft_forwards / s.target_steps
                if cls == "T1" and nodes > levels:
                    chained = first + (levels - 1) * c  # a chain of as many levels
                    node_draft = max(0.0, (per_round(s, s.draft_seconds) - chained) / (nodes - levels))
                walk[cls] = max(0.0, (per_round(s, s.verify_seconds) - scoring(s) - intercept) / nodes)
    return Costs(
        tuple(verify),
        c,
        t1,
        node_draft=node_draft,
        walk=walk,
        chain_walk=chain_walk,
        plain=plain,
        overhead=overhead,
        chain=tuple(chain_scoring),
    )


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # files that hold a model's tensors


def model_file(f: Path) -> bool:
    """Whether `f` decides what a model computes: its weights, their index and its config.
    Everything else beside them (a README, acceptance.json, the tokenizer) may change
    without changing a forward's cost."""
    return f.name == "config.json" or f.name.endswith(WEIGHT_SUFFIXES + (".index.json",))


def files_key(path) -> list | None:
    """A model's identity on disk: the names, sizes and modification times of the files that
    decide what it computes (`model_file`; None: not a local path)."""
    if path is None:
        return None
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        return [str(path)]  # a hub id: the name is all there is
    files = sorted(f for f in p.rglob("*") if model_file(f)) if p.is_dir() else [p]
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
                if parallel.leader() and write_cache_json(path, record, replace=stale):
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


@dataclass(frozen=True)
class IidLevels:
    """An i.i.d. tree of `width` sequences (`TreeConfig(width, depth)` at T > 0, verified by the
    token rule), level by level: `acceptance[l]`, the chance that a walk standing at a node of
    level l accepts one of its children (the m sequences through the node are m trials);
    `nodes[l]`, the distinct draft nodes at level l + 1 (equal draws share a node, so a
    confident draft's tree is smaller than width x depth). Measured beside a draft
    (`measure_iid_levels`): positional acceptance does not describe i.i.d. siblings."""

    width: int
    acceptance: tuple[float, ...]
    nodes: tuple[float, ...]

    def cut(self, depth: int) -> tuple[float, float]:
        """The tree cut at `depth` levels: its expected tokens a round and draft nodes."""
        tokens, reach = 1.0, 1.0
        for a in self.acceptance[:depth]:
            reach *= a
            tokens += reach
        return tokens, sum(self.nodes[:depth])

    def to_json(self, visits: Sequence[float] = ()) -> dict:
        return {
            "width": self.width, "by_level": [round(a, 4) for a in self.acceptance],
            "level_visits": list(visits), "nodes": [round(n, 3) for n in self.nodes],
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> IidLevels:
        width, acceptance = int(d["width"]), _check_levels(d["by_level"])
        nodes = tuple(float(n) for n in d["nodes"])
        if width < 2 or len(nodes) != len(acceptance) or not all(1 <= n <= width for n in nodes):
            raise ValueError("not an i.i.d. tree's levels")
        return cls(width, acceptance, nodes)


def load_acceptance(directory) -> dict | None:
    """A draft's shipped acceptance (`ACCEPTANCE_FILE` in its directory: what `write_acceptance`
    measured), or None: "T0" and "T1", the positional acceptance, one vector per level
    (`by_level`); "iid", the `IidLevels` of i.i.d. trees at T=1 (none in files written before
    they were measured)."""
    if not isinstance(directory, (str, os.PathLike)):
        return None
    path = Path(directory) / ACCEPTANCE_FILE
    try:
        data = json.loads(path.read_text())
        out = {}
        for cls in ("T0", "T1"):
            pooled = _check_vector(data[cls]["acceptance"])
            firsts = data[cls].get("by_level") or [pooled[0]]
            out[cls] = by_level(tuple(_level_vector(a, pooled[1:]) for a in firsts))
        out["iid"] = tuple(IidLevels.from_json(d) for d in data["T1"].get("iid", ()))
        return out
    except (OSError, ValueError, KeyError, TypeError, IndexError):
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

    @property
    def iid(self) -> bool:
        return bool(self.level_nodes)

    def round_cost(self, nodes: float, depth: int) -> float:
        return self.costs.round_cost(nodes, depth, self.cls)

    def describe(self) -> str:
        if self.costs is None:
            return f"auto: plain decoding ({self.source})"
        if self.iid:
            a = "by level " + ", ".join(f"{v[0]:.2f}" for v in self.acceptance)
        else:
            a = ", ".join(f"{x:.2f}" for x in self.acceptance[0])
            deeper = ", ".join(f"{v[0]:.2f}" for v in self.acceptance[1:])
            a += f"; rank 0 deeper {deeper}" if deeper else ""
        why = (
            f"acceptance [{a}] ({self.source}); t(n)/t(1) {self.costs.verify[1]:.2f} (n=2) .. "
            f"{self.costs.verify[-1]:.2f} (n={len(self.costs.verify)}), c {self.costs.draft:.3f}, "
            f"per node +{self.costs.per_node(self.cls):.3f}, per round +{self.costs.overhead:.3f}, "
            f"plain round {self.costs.plain:.2f}"
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
            costs.level_draft / costs.plain,
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
            # the levels it drafts only, so it cuts a start too deep but never finds one too
            # shallow (pycode T=0: chains of 4 and 5 valued 1.672x alike, 4 planned, and every
            # request stayed at 4 where these prompts ran the chain of 5 13 % faster)
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


@dataclass
class AcceptanceCounts:
    """Positional acceptance counts: `visits[k]` walks stood at a node with a child of rank k,
    `hits[k]` of them accepted that child (Sequoia's a[k] = hits[k] / visits[k]); rank 0's
    also by the level of the node stood at (`level_visits[l]`, `level_hits[l]`; the root is
    level 0)."""

    hits: list[float] = field(default_factory=list)
    visits: list[float] = field(default_factory=list)
    level_hits: list[float] = field(default_factory=list)
    level_visits: list[float] = field(default_factory=list)

    def count(self, tree: TokenTree, walk: Walk) -> None:
        """The nodes a round's walk stood at in `tree`: which of their children, by rank, it
        accepted."""
        for i, u in enumerate(walk.path):  # path[i] stands at level i
            kids = tree.children(u)  # in draw order: rank 0 first
            if not kids:
                break
            taken = walk.path[i + 1] if i + 1 < len(walk.path) else None
            self._grow(len(kids), i + 1)
            for k, kid in enumerate(kids):
                self.visits[k] += 1
                self.hits[k] += kid == taken
            self.level_visits[i] += 1
            self.level_hits[i] += kids[0] == taken

    def count_levels(self, tree: TokenTree, walk: Walk) -> None:
        """A round of a tree whose siblings are i.i.d. trials: at each level the walk stood at
        a node with children, whether it accepted one of them (rank 0's counts by level; the
        ranks of i.i.d. draws mean nothing)."""
        for i, u in enumerate(walk.path):
            if not tree.children(u):
                break
            self._grow(0, i + 1)
            self.level_visits[i] += 1
            self.level_hits[i] += i + 1 < len(walk.path)

    def add(self, other: AcceptanceCounts) -> None:
        self._grow(len(other.visits), len(other.level_visits))
        for k, (h, v) in enumerate(zip(other.hits, other.visits)):
            self.hits[k] += h
            self.visits[k] += v
        for k, (h, v) in enumerate(zip(other.level_hits, other.level_visits)):
            self.level_hits[k] += h
            self.level_visits[k] += v

    def vector(self, prior: Sequence[float] = (), weight: float = 0.0) -> tuple[float, ...]:
        """a[k], the counts on top of `prior` weighted as `weight` visits."""
        out = []
        for k in range(max(len(prior), len(self.visits))):
            p = prior[k] if k < len(prior) else 0.0
            h, v = (self.hits[k], self.visits[k]) if k < len(self.visits) else (0.0, 0.0)
            out.append((p * weight + h) / (weight + v) if weight + v else 0.0)
        return _check_vector(out)

    def levels(self, prior=(), weight: float = 0.0, min_visits: float = 0.0) -> tuple[tuple[float, ...], ...]:
        """One vector per level (`treespec.sequoia.by_level`), the counts on top of `prior` (a
        vector or one per level) weighted as `weight` visits: rank 0 from its counts at that
        level, the other ranks from all levels' (scaled down where they would sum past 1).
        Levels with fewer than `min_visits` of their own share the level above's vector."""
        prior = by_level(prior) if prior else ((),)
        pooled = [self.vector(p, weight) for p in prior]
        out = []
        for level in range(max(len(prior), len(self.level_visits), 1)):
            rest = pooled[min(level, len(pooled) - 1)]
            v = self.level_visits[level] if level < len(self.level_visits) else 0
            if out and v < min_visits and level >= len(prior):
                break  # too few walks stood this deep: the level above's vector serves
            first = self.rank0(prior, weight, level)
            if first is None:  # neither counts nor a prior's weight: the pooled ranks' first
                first = rest[0] if rest else 0.0
            out.append(_level_vector(first, rest[1:]))
        return tuple(out)

    def rank0(self, prior: Sequence[Sequence[float]], weight: float, level: int) -> float | None:
        """Rank 0's acceptance at `level` (unclipped): its counts there on top of the rank 0
        of `prior`'s vector for that level (one vector per level, the last for deeper ones)
        weighted as `weight` visits; None with neither counts nor weight."""
        p = prior[min(level, len(prior) - 1)]
        counted = level < len(self.level_visits)
        h, v = (self.level_hits[level], self.level_visits[level]) if counted else (0, 0)
        if not weight + v:
            return None
        p0 = p[0] if p else 0.0
        return (p0 * weight + h) / (weight + v)

    def _grow(self, ranks: int, levels: int = 0) -> None:
        while len(self.visits) < ranks:
            self.visits.append(0.0)
            self.hits.append(0.0)
        while len(self.level_visits) < levels:
            self.level_visits.append(0.0)
            self.level_hits.append(0.0)


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


def _check_levels(a: Sequence[float]) -> tuple[float, ...]:
    """Acceptance by level, each clipped to [0, 1] (at least one level)."""
    if not a:
        raise ValueError("no levels")
    return _clipped(a)


def _clipped(a: Sequence[float]) -> tuple[float, ...]:
    return tuple(min(1.0, max(0.0, float(x))) for x in a)


def _check_vector(a: Sequence[float]) -> tuple[float, ...]:
    """Probabilities of disjoint events: clipped to [0, 1], scaled down if they sum past 1."""
    a = _clipped(a)
    total = sum(a)
    return tuple(x / total for x in a) if total > 1 else a


def _level_vector(first: float, rest: Sequence[float]) -> tuple[float, ...]:
    """(first, *rest) as probabilities of disjoint events: `first` kept (clipped to [0, 1]), the
    other ranks scaled down to what it leaves."""
    first = min(1.0, max(0.0, float(first)))
    rest = _check_vector(rest)
    room = 1.0 - first
    return (first, *(x * room / sum(rest) for x in rest)) if sum(rest) > room else (first, *rest)


def measure_acceptance(decoder, prompts, sampling: SamplingConfig, max_new_tokens: int = 64, seed: int = 0):
    """The positional acceptance of `decoder`'s drafter on `prompts` (token ids, text or chats)
    under `sampling`: each decoded with a wide and deep Sequoia shape (4 children of the root,
    the first with a chain of 4 below it, the others with one child each, so that rank 0 is
    counted along a path as deep as the plans go, where a draft that got one token right often
    gets the next), every round counted (`AcceptanceCounts`). Returns the counts."""
    shape = TreeShape((-1, 0, 0, 0, 0, 1, 5, 6, 7, 2, 3, 4))
    tree = TreeConfig(strategy="sequoia", shape=shape, depth=5)
    counts = AcceptanceCounts()
    outs = decoder.generate_batch(
        prompts, max_new_tokens=max_new_tokens, tree=tree, sampling=sampling,
        seeds=[seed + i for i in range(len(prompts))], trace=True,
    )  # fmt: skip
    for out in outs:
        for r in out.trace:
            counts.count(r.tree, Walk(r.path, r.token, r.kind))
    return counts


def measure_iid_levels(
    decoder, prompts, width: int, max_new_tokens: int = 64, seed: int = 0
) -> tuple[IidLevels, AcceptanceCounts]:
    """The `IidLevels` of `decoder`'s drafter drafting `width` i.i.d. sequences of `IID_DEPTH`
    tokens on `prompts` at temperature 1 (every round drafted that deep counted: the walk's
    acceptance at each level and the distinct nodes there), and their counts. A level with fewer
    than `LEVEL_MIN_VISITS` walks shares the level above's acceptance."""
    tree = TreeConfig(width=width, depth=IID_DEPTH, strategy="iid")
    counts, nodes, rounds = AcceptanceCounts(), [0.0] * IID_DEPTH, 0
    outs = decoder.generate_batch(
        prompts, max_new_tokens=max_new_tokens, tree=tree, sampling=SamplingConfig(temperature=1.0),
        seeds=[seed + i for i in range(len(prompts))], trace=True, verification="token",
    )  # fmt: skip
    for out in outs:
        for r in out.trace:
            depths = r.tree.depths
            if max(depths) < IID_DEPTH:
                continue  # drafted shallower: the length left cut it
            rounds += 1
            counts.count_levels(r.tree, Walk(r.path, r.token, r.kind))
            for d in depths[1:]:
                nodes[d - 1] += 1
    if not rounds:
        raise ValueError(f"no round drafted {IID_DEPTH} levels deep: give longer generations")
    acceptance = [v[0] for v in counts.levels(min_visits=LEVEL_MIN_VISITS)]
    acceptance += acceptance[-1:] * (IID_DEPTH - len(acceptance))  # levels too few walks reached
    return IidLevels(width, _check_levels(acceptance), tuple(n / rounds for n in nodes)), counts


def write_acceptance(decoder, prompts, directory, max_new_tokens: int = 64) -> dict:
    """Measure `decoder`'s drafter on held-out `prompts` at temperature 0 and 1
    (`measure_acceptance`; at T=1 also i.i.d. trees of `IID_WIDTHS` sequences,
    `measure_iid_levels`) and write `ACCEPTANCE_FILE` into `directory` (the draft's), where
    `from_pretrained` finds it: what automatic trees plan with ("by_level": rank 0's acceptance
    at each level of the node the walk stood at, where enough walks stood)."""
    record = {"prompts": len(prompts), "max_new_tokens": max_new_tokens}
    for cls, sampling in (("T0", SamplingConfig(temperature=0)), ("T1", SamplingConfig(temperature=1.0))):
        counts = measure_acceptance(decoder, prompts, sampling, max_new_tokens)
        levels = counts.levels(min_visits=LEVEL_MIN_VISITS)
        record[cls] = {
            "acceptance": [round(a, 4) for a in counts.vector()], "visits": counts.visits,
            "by_level": [round(v[0], 4) for v in levels], "level_visits": counts.level_visits[: len(levels)],
        }  # fmt: skip
    record["T1"]["iid"] = []
    for width in IID_WIDTHS if max_new_tokens > IID_DEPTH else ():  # else no round drafts that deep
        levels, counts = measure_iid_levels(decoder, prompts, width, max_new_tokens)
        record["T1"]["iid"].append(levels.to_json(counts.level_visits))
    Path(directory, ACCEPTANCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record
