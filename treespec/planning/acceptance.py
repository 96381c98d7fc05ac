"""A drafter's acceptance: positional counts (`AcceptanceCounts`, Sequoia's a[k] by rank, rank 0
also by level), i.i.d. trees level by level (`IidLevels`), what ships beside a draft
(`ACCEPTANCE_FILE`: `write_acceptance`, `load_acceptance`) and `PRIOR`, for a drafter nothing is
known of."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SamplingConfig, TreeConfig
from ..proposal import Walk
from ..sequoia import TreeShape, by_level
from ..tree import TokenTree

PRIOR = {"T0": (0.5, 0.1, 0.05), "T1": (0.4, 0.1, 0.05)}  # a drafter nothing is known of
PRIOR_WEIGHT = 16.0  # PRIOR weighs against the counts remembered from earlier processes as this many visits
LEVEL_MIN_VISITS = 50  # a level's own rank-0 counts plan only with this many visits
ACCEPTANCE_FILE = "acceptance.json"  # beside a draft: its measured positional acceptance
IID_WIDTHS = (2, 3, 4)  # i.i.d. trees (sequences a round) measured beside a draft and planned at T > 0
IID_DEPTH = 4  # their depth when measured (4 x 4 = AUTO_MAX_NODES); a plan cuts them shallower


def temperature_class(sampling: SamplingConfig) -> str:
    """ "T0" for greedy sampling, else "T1": the classes acceptance and costs are kept by."""
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
