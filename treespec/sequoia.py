"""Sequoia-optimal tree shapes: a dynamic program over (size, depth).

Model (Sequoia, Chen et al. 2024, positional acceptance): when the walk stands at a node,
its k-th child (drafted k-th, without replacement) is the accepted one with probability
`acceptance[k]`, whatever the node. A shape's expected tokens per step is then

    1 + sum over draft nodes v of  prod over the edges (u -> child of rank k) on v's path  acceptance[k]

(the 1 is the correction/bonus token). The acceptance may also depend on how deep the node
stands: one vector per level of the node (the root's children are drawn at level 0; the last
vector serves every deeper level), since a draft that got one token right often gets the next
(pasted code, a quoted name). `optimal_shape` finds the shape with at most `n_nodes`
draft nodes and depth <= `max_depth` that maximises it, or, given measured costs, the one that
maximises expected tokens per unit of time. Shapes are data (`TreeShape.save/load`, JSON),
never literals in code; `TreeConfig(strategy="sequoia", shape=...)` drafts along one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .tree import TokenTree


@dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]  # parent of each node, root first (parents[0] == -1); rank = sibling order
    expected_tokens: float | None = None  # model value: tokens per target step
    meta: tuple[tuple[str, object], ...] = ()  # provenance (acceptance vector, costs, ...)

    def __post_init__(self) -> None:
        TokenTree([0] * len(self.parents), self.parents)  # validates topological order

    @property
    def n_nodes(self) -> int:
        """Draft nodes (root excluded)."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        return TokenTree([0] * len(self.parents), self.parents).max_depth

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps(
                {
                    "parents": list(self.parents),
                    "expected_tokens": self.expected_tokens,
                    "meta": dict(self.meta),
                },
                indent=1,
            )
        )

    @classmethod
    def load(cls, path: str | Path) -> TreeShape:
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                tuple(int(p) for p in data["parents"]),
                data.get("expected_tokens"),
                tuple(sorted(data.get("meta", {}).items())),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read a tree shape from {path}: {e}") from e


def by_level(acceptance) -> tuple[tuple[float, ...], ...]:
    """`acceptance` as one vector per level: a vector (the same at every level) or a sequence of
    vectors (level 0, 1, ...; the last for deeper levels), each of probabilities summing to <= 1."""
    out = tuple(tuple(float(a) for a in v) for v in _levels(acceptance))
    if not out or any(not v or any(not 0 <= a <= 1 for a in v) or sum(v) > 1 + 1e-9 for v in out):
        raise ValueError("acceptance must be probabilities of the k-th child being accepted, summing to <= 1")
    return out


def _levels(acceptance) -> Sequence[Sequence[float]]:
    """`acceptance` as a sequence of vectors, unchecked (`by_level` checks)."""
    return acceptance if acceptance and isinstance(acceptance[0], Sequence) else (acceptance,)


def tree_expected_tokens(parents: Sequence[int], acceptance) -> float:
    """Tokens per step of a shape under the positional acceptance model (`acceptance`: a vector,
    or one per level, see `by_level`)."""
    levels = _levels(acceptance)  # evaluated, not checked: planners call it every round
    reach, depth = [1.0] * len(parents), [0] * len(parents)
    rank_count = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        k = rank_count[p]
        rank_count[p] += 1
        depth[i] = depth[p] + 1
        acc = levels[min(depth[p], len(levels) - 1)]
        reach[i] = reach[p] * (acc[k] if k < len(acc) else 0.0)
    return sum(reach)


def optimal_shape(
    acceptance,
    n_nodes: int,
    max_depth: int,
    verify_cost: Sequence[float] | None = None,
    draft_cost: float = 0.0,
) -> TreeShape:
    """The best shape with at most `n_nodes` draft nodes and depth <= `max_depth` under
    `acceptance` (a vector, or one per level: `by_level`).

    Without costs: maximal expected tokens/step (uses all `n_nodes` when acceptance > 0).
    With `verify_cost[n]` = t(n + 1 nodes) / t(1 node) for n = 0..n_nodes and `draft_cost` =
    t_draft / t_target per depth: maximal expected tokens / (verify_cost[n] + depth * draft_cost).
    """
    levels = by_level(acceptance)
    top = len(levels) - 1
    if n_nodes < 0 or max_depth < 0:
        raise ValueError("n_nodes and max_depth must be >= 0")
    if verify_cost is not None and len(verify_cost) < n_nodes + 1:
        raise ValueError(f"verify_cost needs entries for 0..{n_nodes} draft nodes")

    @cache
    def subtree(n: int, level: int, d: int) -> tuple[float, tuple]:
        """Best value of a subtree of exactly n nodes (its root counted 1, standing at `level`;
        levels past the last vector's share it) with <= d levels below."""
        if n == 1:
            return 1.0, ()
        if d == 0:
            return float("-inf"), ()
        v, alloc = children(n - 1, 0, level, d - 1)
        return 1.0 + v, alloc

    @cache
    def children(m: int, k: int, level: int, d: int) -> tuple[float, tuple]:
        """Best way to spend m nodes on children of rank k, k+1, ... of a node at `level` (each
        subtree depth <= d)."""
        acc = levels[level]
        if m == 0:
            return 0.0, ()
        if k >= len(acc):
            return float("-inf"), ()
        below = min(level + 1, top)
        best = (float("-inf"), ())
        for s in range(1, m + 1):
            head, rest = subtree(s, below, d)[0], children(m - s, k + 1, level, d)
            value = acc[k] * head + rest[0]
            if value > best[0] + 1e-15:
                best = (value, ((s, below, d),) + rest[1])
        return best

    def build(n: int, level: int, d: int, parent: int, parents: list[int]) -> None:
        for s, lv, dd in subtree(n, level, d)[1]:
            parents.append(parent)
            build(s, lv, dd, len(parents) - 1, parents)

    candidates = []
    for depth in range(0, max_depth + 1):
        for n in range(0, n_nodes + 1):
            value = subtree(n + 1, 0, depth)[0]
            if value == float("-inf"):
                continue
            cost = 1.0 if verify_cost is None else verify_cost[n] + depth * draft_cost
            candidates.append((value / cost, -n, -depth, n, depth, value))
    _, _, _, n, depth, value = max(candidates)
    parents = [-1]
    build(n + 1, 0, depth, 0, parents)
    meta = (
        ("acceptance", [list(v) for v in levels] if len(levels) > 1 else list(levels[0])),
        ("draft_cost", draft_cost),
        ("max_depth", max_depth),
        ("n_nodes", n_nodes),
    )
    return TreeShape(tuple(parents), value, meta)
