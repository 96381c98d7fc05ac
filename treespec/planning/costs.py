"""What a round costs on this machine (`Costs`), and measuring it (`measure_costs`) from the
runners it times and short generations on an engine of their own."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import AUTO_MAX_DEPTH, AUTO_MAX_NODES, SamplingConfig, TreeConfig
from ..sequoia import TreeShape
from ..tree import TokenTree

COST_FEEDS = tuple(range(1, AUTO_MAX_NODES + 2))  # target feed sizes timed: every one a round may score
COST_PREFIX = 128  # committed tokens before the timed feeds
COST_ROUND_TOKENS = 32  # tokens of each short generation whose rounds are timed (shorter ones bias
# the round's costs: 24 planned plain where chains of 1-2 ran 1.12-1.14x, AVX2 T=1)
COST_RUNS = 2  # timed runs of plain decoding and of chains of 1 and 4 (medians; all but 4 at T=0 too)
# tokens of each generation of `COST_TREE` (its per-node costs, read per step): at 16 they measured
# as at 32, within their spread (a chain of 4's walk did not: 0.00-0.03 t(1) at 32, 0.12-0.17 at 16)
COST_TREE_TOKENS = 16
COST_WARM_TOKENS = 8  # tokens of the untimed generation before each tree's timed ones
COST_WARM_ROUNDS = 1  # untimed rounds of the feeds before their timed ones
TEMPERATURES = {"T1": 1.0, "T0": 0.0}  # a temperature of each class the rounds are timed at
MIN_PLAIN_ROUND = 0.25  # a plain round measured below this many t(1) is a broken clock, not a cost
# the Sequoia shape whose rounds price a tree's further draft rows and its walk per node
COST_TREE = TreeShape((-1, 0, 0, 0, 0, 1, 2, 3, 4))


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
    # per temperature class (a T=0 round takes argmaxes where a T=1 round samples and runs the
    # block rule): a plain round (forward, sampling, bookkeeping) / t(1), below 1 where the
    # tree's masks and walk make the scored t(1) dearer than a plain step; and a speculative
    # round's time beyond its forwards, draws and walk / t(1)
    plain: dict = field(default_factory=lambda: {"T0": 1.0, "T1": 1.0})
    overhead: dict = field(default_factory=lambda: {"T0": 0.0, "T1": 0.0})
    # chain[n] = t(a root and a chain of n tokens) / t(1), n = 0 .. AUTO_MAX_DEPTH: a chain is
    # scored under the causal pattern, a tree under a mask built per round; () prices chains as trees
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
        return (forwards + self.per_node(cls, nodes == depth) * nodes + self.overhead[cls]) / self.plain[cls]

    def per_node(self, cls: str, chain: bool = False) -> float:
        """What each node adds beyond its scoring: its walk under `cls` (a chain's is the block
        rule's) and its draft row. A greedy walk (T=0) is the same walk without its sampling,
        so it is priced at most at the sampled walk's cost."""
        # a tree's traversal walks node by node (a residual at each rejection) where the block
        # rule takes a chain whole: a tree's node is never priced below a chain's
        sampled = self.chain_walk if chain else max(self.walk.get("T1", 0.0), self.chain_walk)
        walk = min(sampled, self.walk.get("T0", 0.0)) if cls == "T0" else sampled
        return walk + self.node_draft

    @property
    def level_draft(self) -> float:
        """A level's draft cost beyond its rows' (`node_draft` each): c less one row. Negative
        where a tree level's further row costs more than a chain's whole level: a chain still
        costs c a level, a tree c a level plus `node_draft` a further row."""
        return self.draft - self.node_draft

    def verify_with_nodes(self, cls: str) -> list[float]:
        """The cost of a round of n nodes but its levels, in plain rounds (n = 0: a plain round):
        the list Sequoia's DP plans with, beside `level_draft / plain` per level."""
        return [1.0] + [self.round_cost(n, 0, cls) for n in range(1, len(self.verify))]

    def to_json(self) -> dict:
        return {
            "verify": list(self.verify), "draft": self.draft, "t1": self.t1, "measured": self.measured,
            "node_draft": self.node_draft, "walk": dict(self.walk), "chain_walk": self.chain_walk,
            "plain": dict(self.plain), "overhead": dict(self.overhead), "chain": list(self.chain),
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        verify = tuple(float(v) for v in d["verify"])
        if not all(isinstance(d[f], dict) for f in ("walk", "plain", "overhead")):
            raise ValueError("not a cost record of this version: one value where each class has its own")
        per_class = ({k: float(d[f][k]) for k in TEMPERATURES} for f in ("walk", "plain", "overhead"))
        walk, plain, overhead = per_class
        valid = all(v > 0 for v in (*verify, *plain.values())) and float(d["draft"]) >= 0
        if len(verify) != AUTO_MAX_NODES + 1 or not valid:
            raise ValueError("not a cost record of this version")
        return cls(
            verify,
            float(d["draft"]),
            float(d["t1"]),
            str(d.get("measured", "")),
            float(d["node_draft"]),
            walk,
            float(d["chain_walk"]),
            plain,
            overhead,
            tuple(float(v) for v in d["chain"]),
        )


def measure_costs(target, draft=None, engine: Callable[[], object] | None = None, repeats: int = 2) -> Costs:
    """This machine's costs for the runners `target` and `draft` (None: no draft model).

    1. `time_feeds`: t(n)/t(1) of the target for feeds of n = 1 .. AUTO_MAX_NODES + 1 tokens
       (a root and its children after COST_PREFIX tokens, on a lane of its own, the sizes
       interleaved and each one timed: kernels that work in blocks of rows make t(n) a
       staircase that interpolation misses), and for chains of up to AUTO_MAX_DEPTH nodes
       (scored under the causal pattern, without a tree's mask).
    2. `time_rounds`, where `engine` is given (a function returning a new engine of one lane of
       its own whose drafter drafts with `draft`; None where nothing is drafted by a model, and
       the round costs stay neutral): from short generations after the same prefix, as the
       drafter really runs them (forwards, sampling, bookkeeping), a plain round's time, c,
       a chain's walk per node, a speculative round's fixed cost and the per-node costs of
       trees at both temperatures.

    Under a compiler every feed size is compiled first, so that no timed run compiles."""
    room = (target.max_positions or COST_PREFIX + 64) - max(COST_FEEDS) - 1  # a short model's context
    prefix = max(1, min(COST_PREFIX, room))
    g = torch.Generator().manual_seed(0)
    lane = _lane(target)
    vocab = min(target.vocab_size, getattr(draft, "vocab_size", None) or 1000, 1000)
    tokens = torch.randint(0, vocab, (prefix + AUTO_MAX_NODES + 1,), generator=g).tolist()
    for runner in (target, draft):
        if getattr(runner, "compiled", None) is not None:  # under a compiler: every graph first
            compile_every_feed_size(lane if runner is target else _lane(runner), tokens, prefix)
    t1, verify, chain_scoring = time_feeds(lane, tokens, prefix, repeats)
    rounds = RoundCosts()
    if engine is not None:
        new_tokens = max(1, min(COST_ROUND_TOKENS, room))
        # the generations start after the prefix t(1) was timed after, where the model has room
        # for both: a plain step runs faster after a shorter prompt
        start = prefix if target.max_positions is None else max(8, min(prefix, room - new_tokens))
        timer = RoundTimer(engine(), tokens[:start], new_tokens, t1)
        rounds = time_rounds(timer, verify, chain_scoring)
    return Costs(
        tuple(verify),
        rounds.draft,
        t1,
        node_draft=rounds.node_draft,
        walk=rounds.walk,
        chain_walk=rounds.chain_walk,
        plain=rounds.plain,
        overhead=rounds.overhead,
        chain=tuple(chain_scoring),
    )


def _lane(runner):
    """A lane of `runner` with a cache of its own, so that measuring leaves the runner's alone."""
    try:
        return runner.lanes(1)[0]
    except NotImplementedError:
        return runner


def compile_every_feed_size(lane, tokens: list[int], prefix: int) -> None:
    """One forward of every feed size a measurement may meet (1 .. AUTO_MAX_NODES + 1 tokens)
    on `lane` (a compiled runner's, `_lane`), so that no graph compiles inside a timed run (a
    draft's catch-up size follows its acceptance)."""
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


def time_feeds(lane, tokens: list[int], prefix: int, repeats: int) -> tuple[float, list[float], list[float]]:
    """t(1) in seconds, t(n)/t(1) of a root and n - 1 children (n = 1 .. AUTO_MAX_NODES + 1,
    under a tree's mask) and of a root and a chain (n = 1 .. AUTO_MAX_DEPTH + 1, the causal
    pattern; a root and one child is both) on `lane` after `prefix` of `tokens`: every size
    scored once a round, `repeats` rounds after COST_WARM_ROUNDS that warm the kernels and
    allocations, each size over the one-token feed of its own round (medians)."""
    lane.reset()
    lane.prefill(tokens[:prefix])
    trees = {("tree", n): TokenTree(tokens[prefix : prefix + n], [-1] + [0] * (n - 1)) for n in COST_FEEDS}
    for n in range(3, AUTO_MAX_DEPTH + 2):
        trees["chain", n] = TokenTree(tokens[prefix : prefix + n], list(range(-1, n - 1)))
    rounds: list[dict[tuple, float]] = []
    for r in range(repeats + COST_WARM_ROUNDS):  # interleaved: a slow stretch slows every size alike
        times = {}
        for k, tree in trees.items():
            t0 = time.perf_counter()
            lane.score(tree)
            lane.commit([])
            times[k] = time.perf_counter() - t0
        if r >= COST_WARM_ROUNDS:
            rounds.append(times)
    lane.reset()
    t1 = statistics.median(row["tree", 1] for row in rounds)
    timed = {k: statistics.median(row[k] / row["tree", 1] for row in rounds) for k in trees}
    # more rows never cost less, from two rows on; a single row is the unit, not a floor (a
    # compiled tree graph may score one row slower than a few)
    verify = [1.0]
    for n in COST_FEEDS[1:]:
        verify.append(max(timed["tree", n], verify[-1] if n > 2 else 0.0))
    chain_scoring = verify[:2]
    for n in range(3, AUTO_MAX_DEPTH + 2):
        chain_scoring.append(max(timed["chain", n], chain_scoring[-1]))
    return t1, verify, chain_scoring


@dataclass
class RoundTimer:
    """Short generations of `new_tokens` after `prompt` on a one-lane `engine` (seed 0: every
    run of a tree decodes alike), their times priced in t(1) (`t1` seconds) per target step.
    Every generation starts from the same prompt: the engine's lanes keep the prompt's cache
    from one to the next (`Runner.prefix_reuse`), so the timings leave prefill out."""

    engine: object
    prompt: list[int]
    new_tokens: int
    t1: float

    def __post_init__(self):
        for runner in (*self.engine.targets, *self.engine.drafts):
            if runner is not None:
                runner.prefix_reuse = True

    def generate(
        self, tree: TreeConfig | None, temperature: float, warm: bool = False, tokens: int | None = None
    ):
        """The stats of one short generation of `tokens` (default `new_tokens`; `warm`: an
        untimed one of COST_WARM_TOKENS, which pays for allocations and first calls)."""
        tokens = min(COST_WARM_TOKENS if warm else tokens or self.new_tokens, self.new_tokens)
        i = self.engine.add(
            self.prompt, tokens, tree=tree,
            sampling=SamplingConfig(temperature=temperature), seed=0, ignore_eos=True,
        )  # fmt: skip
        return self.engine.run()[i].stats

    def per_round(self, s, seconds: float) -> float:
        """`seconds` of the generation `s` per target step, in t(1)."""
        return seconds / s.target_steps / self.t1


@dataclass
class RoundCosts:
    """What `time_rounds` measures, in t(1) (the `Costs` fields of the same names); neutral
    where nothing is drafted by a model."""

    draft: float = 0.0
    node_draft: float = 0.0
    walk: dict = field(default_factory=lambda: {"T0": 0.0, "T1": 0.0})
    chain_walk: float = 0.0
    plain: dict = field(default_factory=lambda: {"T0": 1.0, "T1": 1.0})
    overhead: dict = field(default_factory=lambda: {"T0": 0.0, "T1": 0.0})

    def chain_node_walk(self, cls: str) -> float:
        """A chain's walk per node under `cls`, as `Costs.per_node` prices it."""
        return min(self.chain_walk, self.walk["T0"]) if cls == "T0" else self.chain_walk


def _scoring(s, table: list[float]) -> float:
    """The scoring cost of the generation `s`'s mean tree, read from `table` (t(n)/t(1))."""
    return table[min(round(s.tree_nodes / s.target_steps), len(table) - 1)]


def _median_run(stats: list):
    """The run of median seconds per target step."""
    return sorted(stats, key=lambda s: s.total_seconds / s.target_steps)[len(stats) // 2]


def time_rounds(timer: RoundTimer, verify: list[float], chain_scoring: list[float]) -> RoundCosts:
    """A round's costs from short generations: plain decoding and a chain of 1 level at each
    temperature class, a chain of 4 levels at T=1, COST_RUNS runs each after one that pays for
    allocations, interleaved so that a slow stretch of a shared machine slows each alike
    (`time_chains`); then a tree's per-node costs (`time_tree_nodes`) and each class's fixed
    cost of a round (`time_overhead`)."""
    trees = {"plain": None, "short": TreeConfig(width=1, depth=1), "chain": TreeConfig(width=1, depth=4)}
    kinds = [(k, cls) for cls in TEMPERATURES for k in trees if cls == "T1" or k != "chain"]
    runs: dict[tuple, list] = {kind: [] for kind in kinds}
    for r in range(COST_RUNS + 1):
        for k, cls in kinds:
            s = timer.generate(trees[k], TEMPERATURES[cls], warm=not r)
            if r:
                runs[k, cls].append(s)
    # a plain round skips the tree's masks and walk, so it may cost less than the scored t(1)
    plains = {
        cls: [timer.per_round(s, s.total_seconds - s.prefill_seconds) for s in runs["plain", cls]]
        for cls in TEMPERATURES
    }
    out = RoundCosts(plain={cls: max(MIN_PLAIN_ROUND, statistics.median(p)) for cls, p in plains.items()})
    shorts = {cls: _median_run(runs["short", cls]) for cls in TEMPERATURES}
    chain = _median_run(runs["chain", "T1"])
    if all(s.draft_forwards for s in shorts.values()) and chain.draft_forwards:
        time_chains(timer, out, shorts["T1"], chain, verify, chain_scoring)
        time_tree_nodes(timer, out, shorts, verify)
        for cls in TEMPERATURES:
            time_overhead(timer, out, cls, runs["short", cls], plains[cls], verify)
    return out


def time_chains(timer: RoundTimer, out: RoundCosts, short, chain, verify, chain_scoring) -> None:
    """From chains of 1 and 4 levels at T=1 (`short`, `chain`: their median runs), into `out`:
    c, what a further level adds to the draft's time; and a chain's walk per node (the block
    rule) from its verification time."""
    per_round = timer.per_round
    levels = max(2.0, chain.draft_forwards / chain.target_steps)
    further = per_round(chain, chain.draft_seconds) - per_round(short, short.draft_seconds)
    out.draft = max(0.0, further / (levels - 1))
    # the walk's per-node cost is the slope of verification beyond scoring from the chain of 1
    # to the chain of 4; what a round spends there whatever its nodes (the target's sampling of
    # its root, the mask) is `overhead`'s
    nodes, one = chain.tree_nodes / chain.target_steps, short.tree_nodes / short.target_steps
    unwalked = per_round(short, short.verify_seconds) - _scoring(short, verify)  # a chain of 1's
    verified = per_round(chain, chain.verify_seconds) - _scoring(chain, chain_scoring)
    out.chain_walk = max(0.0, (verified - unwalked) / max(nodes - one, 1.0))


def time_overhead(timer: RoundTimer, out: RoundCosts, cls: str, shorts, plains, verify) -> None:
    """Into `out.overhead[cls]`: the rest of a depth-1 round at `cls` (the first level's
    catch-up on the accepted tokens beyond c, both caches' bookkeeping, the root's sampling),
    from every run of the chain of 1 at `cls` (`shorts`) and the plain round of each run beside
    it (`plains`)."""
    per_round, c = timer.per_round, out.draft
    # a chain of 1's round over the plain round run beside it, run by run (a slow stretch slows
    # both), times the plain round
    paired = [
        per_round(s, s.total_seconds - s.prefill_seconds - s.plan_seconds) / p for s, p in zip(shorts, plains)
    ]
    whole = statistics.median(paired) * out.plain[cls]
    short = _median_run(shorts)
    first = per_round(short, short.draft_seconds)  # a round's first level, catch-up included
    # a small difference of large times, but never below what the first level costs beyond a
    # further one, which the draft's own timer measures steadily
    walked = whole - _scoring(short, verify) - out.chain_node_walk(cls) - c
    out.overhead[cls] = max(0.0, first - c, walked)


def time_tree_nodes(timer: RoundTimer, out: RoundCosts, shorts: dict, verify: list[float]) -> None:
    """Into `out`, from rounds of `COST_TREE` (children drawn without replacement) at T=1 and
    T=0: a round of d levels and n nodes drafts in d x c + (n - d) x node_draft and walks n
    nodes in n x walk[class] (the traversal rule at T>0, its sampling included). `shorts`: the
    chain of 1's median run at each class (`time_rounds`)."""
    per_round = timer.per_round
    shape = TreeConfig(strategy="sequoia", shape=COST_TREE, depth=2)
    first = per_round(shorts["T1"], shorts["T1"].draft_seconds)
    timer.generate(shape, 1.0, warm=True)  # allocations
    for cls, temperature in TEMPERATURES.items():
        s = timer.generate(shape, temperature, tokens=COST_TREE_TOKENS)
        if not (s.target_steps and s.draft_forwards and s.tree_nodes):
            continue
        short = shorts[cls]
        one = short.tree_nodes / short.target_steps
        unwalked = per_round(short, short.verify_seconds) - _scoring(short, verify)
        intercept = max(0.0, unwalked - out.chain_walk * one)  # a round's, whatever its nodes
        nodes, levels = s.tree_nodes / s.target_steps, s.draft_forwards / s.target_steps
        if cls == "T1" and nodes > levels:
            chained = first + (levels - 1) * out.draft  # a chain of as many levels
            out.node_draft = max(0.0, (per_round(s, s.draft_seconds) - chained) / (nodes - levels))
        out.walk[cls] = max(0.0, (per_round(s, s.verify_seconds) - _scoring(s, verify) - intercept) / nodes)
