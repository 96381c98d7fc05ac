"""The token prefix tree: nodes in topological order, everything derived from parent pointers.

Node 0 is the root: the last committed token, not yet in the target's KV cache. Its children
propose the next position. A chain (`parent[i] = i - 1`) is linear speculation.

    tokens   = [t0, t1, t2, t3, t4]
    parents  = [-1,  0,  0,  1,  1]        t0 ─┬─ t1 ─┬─ t3
    depth    = [ 0,  1,  1,  2,  2]            │      └─ t4
                                               └─ t2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # token id of each node; tokens[0] is the root
    parents: tuple[int, ...]  # parent node of each node; parents[0] == -1, parents[i] < i
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __init__(self, tokens: Sequence[int], parents: Sequence[int], vocab_size: int | None = None):
        tokens, parents = tuple(int(t) for t in tokens), tuple(int(p) for p in parents)
        if not tokens:
            raise ValueError("a TokenTree needs at least the root node")
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parent pointers")
        if parents[0] != -1:
            raise ValueError(f"node 0 is the root and must have parent -1, got {parents[0]}")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(
                    f"node {i} has parent {p}: nodes must be in topological order "
                    f"(0 <= parent < node), which also rules out cycles"
                )
        for i, t in enumerate(tokens):
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"node {i} has token id {t}, outside [0, {vocab_size or 'inf'})")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        children: list[list[int]] = [[] for _ in tokens]
        for i, p in enumerate(parents[1:], start=1):
            children[p].append(i)
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        """A linear chain: tokens[0] is the root, each node the child of the one before."""
        return cls(tokens, [-1] + list(range(len(tokens) - 1)))

    @classmethod
    def from_choices(
        cls, root: int, choices: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]]
    ) -> TokenTree:
        """Medusa/vLLM-style construction from index paths.

        `choices` lists paths of ranks from the root, e.g. `[[0], [1], [0, 0]]`; a path's prefix
        must come before it. `candidates[d][k]` is the rank-k token proposed at depth d+1, so
        the node at path `(.., k)` of length d+1 carries `candidates[d][k]`.
        Example: root 7, choices [[0], [1], [0, 0]], candidates [[3, 5], [9]] gives
        7 ─┬─ 3 ── 9
           └─ 5
        """
        index: dict[tuple[int, ...], int] = {(): 0}
        tokens, parents = [int(root)], [-1]
        for j, raw in enumerate(choices):
            path = tuple(int(c) for c in raw)
            if not path:
                raise ValueError(f"choice {j} is empty; the root is implicit")
            if path in index:
                raise ValueError(f"choice {j}: path {list(path)} appears twice")
            if path[:-1] not in index:
                raise ValueError(f"choice {j}: path {list(path)} comes before its prefix {list(path[:-1])}")
            d, k = len(path) - 1, path[-1]
            if d >= len(candidates) or not 0 <= k < len(candidates[d]):
                raise ValueError(f"choice {j}: no candidate of rank {k} at depth {d + 1}")
            index[path] = len(tokens)
            tokens.append(int(candidates[d][k]))
            parents.append(index[path[:-1]])
        return cls(tokens, parents)

    # ---- derived structure --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self)
        for i in range(1, len(self)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Position ids: the root sits at `prefix_len`, siblings share a position."""
        return torch.tensor(self.depths, dtype=torch.long) + prefix_len  # [N]

    def children(self, node: int) -> tuple[int, ...]:
        return self._children[node]

    def is_leaf(self, node: int) -> bool:
        return not self._children[node]

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """Bool [N, N]: mask[i, j] is True iff j is i or an ancestor of i."""
        return ancestor_rows(torch.tensor(self.parents), 0, self.max_depth)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, inclusive."""
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if self.is_leaf(i)]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def to_networkx(self):
        """A `networkx.DiGraph` with parent -> child edges; node attributes token and depth."""
        import networkx as nx

        g = nx.DiGraph()
        for i, (tok, d) in enumerate(zip(self.tokens, self.depths)):
            g.add_node(i, token=tok, depth=d)
            if i:
                g.add_edge(self.parents[i], i)
        return g


def ancestor_rows(parents: torch.Tensor, start: int, max_depth: int) -> torch.Tensor:
    """Bool `[P - start, P]`: row i marks node `start + i` and all its ancestors.

    `parents` `[P]` (long, any device) holds parent pointers with -1 for top-level nodes;
    `max_depth` bounds the depth of nodes `start..P-1` (top level = 0). The mask is built
    where `parents` lives by pointer jumping, one gather and one scatter per level, with no
    host round trip: the tree mask of a forward is made on the model's device.
    """
    p = parents.numel()
    up = torch.cat(
        [torch.where(parents < 0, p, parents), parents.new_full((1,), p)]
    )  # [P + 1]; -1 -> sentinel p
    cur = torch.arange(start, p, device=parents.device)  # [n] the node each row has reached
    rows = torch.arange(p - start, device=parents.device)
    mask = torch.zeros(p - start, p + 1, dtype=torch.bool, device=parents.device)  # column p: the sentinel
    for _ in range(max_depth + 1):
        mask[rows, cur] = True
        cur = up[cur]
    return mask[:, :p]


class TreeBuilder:
    """A prefix tree grown one node at a time: one node per distinct (parent, token), in the
    order first added. Merging token paths (`DraftTree.from_paths`) and merging several
    drafters' trees (`MergedDrafter`) both build their trees with it."""

    def __init__(self, root: int):
        self.tokens, self.parents = [int(root)], [-1]
        self.kids: dict[int, list[int]] = {}  # node -> its children, in the order first added
        self._node: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def add(self, parent: int, token: int) -> int:
        """The child of `parent` carrying `token`, made if it is new."""
        key = (parent, int(token))
        if key not in self._node:
            self._node[key] = len(self.tokens)
            self.tokens.append(key[1])
            self.parents.append(parent)
            self.kids.setdefault(parent, []).append(self._node[key])
        return self._node[key]

    def add_path(self, path: Sequence[int], start: int = 0) -> int:
        """Every token of `path` below node `start`; the last node."""
        node = start
        for token in path:
            node = self.add(node, token)
        return node

    def build(self) -> TokenTree:
        return TokenTree(self.tokens, self.parents)
