"""A round's data: what a drafter proposes, and what verification makes of it.

    DraftTree      a token tree plus how each child was proposed (its `ProposalGroup`s)
    Walk           verification's answer: the accepted path and the token that ends the round
    WalkTrace      (trace=True) every proposal's p, q, coin and outcome (`ProposalTrace`)
    DepthStep      the depth decision taken after the round (`treespec.planning.policy`)

A *proposal group* is a set of sibling proposals that share one parent and one draw scheme.
Verification tries the groups of a node in list order and the proposals of a group in draw
order, so the order never depends on the drawn values. Drafters, the depth policy and the
trace import these types, never the verifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import torch

from .tree import TokenTree, TreeBuilder


class Draw(str, Enum):
    """How one proposal group was drawn (a whole tree's guarantee is `treespec.rules.Siblings`)."""

    IID = "iid"  # each proposal drawn independently from q (duplicates are separate trials)
    WITHOUT_REPLACEMENT = "without_replacement"  # sequential draws from q minus earlier draws
    DETERMINISTIC = "deterministic"  # q is one-hot on the proposed token (top-k, n-gram, lookup)


@dataclass(frozen=True)
class ProposalGroup:
    parent: int  # node the proposals continue
    draw: Draw
    tokens: tuple[int, ...]  # proposed tokens in draw order (i.i.d. groups may repeat one)
    children: tuple[int, ...]  # node carrying each proposal; children[j] has token tokens[j]
    q: torch.Tensor | None = None  # [V] distribution the tokens were drawn from; None iff deterministic

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.children) or not self.tokens:
            raise ValueError("a proposal group needs one child node per proposed token, at least one")
        if (self.q is None) != (self.draw is Draw.DETERMINISTIC):
            raise ValueError(
                f"{self.draw.value} proposals {'need' if self.q is None else 'take no'} a q distribution"
            )


@dataclass(frozen=True)
class DraftTree:
    tree: TokenTree
    groups: tuple[ProposalGroup, ...] = ()
    _by_parent: dict[int, tuple[ProposalGroup, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_parent: dict[int, list[ProposalGroup]] = {}
        claimed = set()
        for g in self.groups:
            for tok, child in zip(g.tokens, g.children):
                if not 0 < child < len(self.tree) or self.tree.parents[child] != g.parent:
                    raise ValueError(f"proposal node {child} is not a child of node {g.parent}")
                if self.tree.tokens[child] != tok:
                    raise ValueError(
                        f"proposal token {tok} differs from node {child}'s token {self.tree.tokens[child]}"
                    )
                claimed.add(child)
            by_parent.setdefault(g.parent, []).append(g)
        if len(claimed) != len(self.tree) - 1:
            raise ValueError("every non-root node must carry at least one proposal")
        object.__setattr__(self, "_by_parent", {k: tuple(v) for k, v in by_parent.items()})

    @classmethod
    def root_only(cls, token: int) -> DraftTree:
        """No proposals: the target samples one token (plain autoregressive step)."""
        return cls(TokenTree([token], [-1]))

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> DraftTree:
        """Deterministic proposals given as token paths below `root`, merged into a prefix tree.

        Each distinct token under a node becomes one deterministic proposal, in the order the
        paths first propose it (so list the preferred path first).
        """
        builder = TreeBuilder(root)
        for path in paths:
            builder.add_path(path)
        tokens = builder.tokens
        groups = tuple(
            ProposalGroup(u, Draw.DETERMINISTIC, tuple(tokens[c] for c in cs), tuple(cs))
            for u, cs in builder.kids.items()
        )
        return cls(builder.build(), groups)

    def groups_at(self, node: int) -> Sequence[ProposalGroup]:
        return self._by_parent.get(node, ())


Outcome = Literal["accepted", "rejected", "untried"]


@dataclass(frozen=True)
class ProposalTrace:
    node: int  # the child node carrying the proposal
    parent: int
    token: int
    draw: str  # "iid", "without_replacement" or "deterministic"
    p: float  # target probability of `token` after the parent (after the sampling transforms)
    q: float  # draft probability the proposal was tried with
    coin: float  # probability of the coin flipped for it (see the module docstring)
    outcome: Outcome  # accepted: on the accepted path; untried: the walk stopped before it


@dataclass(frozen=True)
class WalkTrace:
    """What `verify(..., trace=True)` records next to the `Walk`."""

    proposals: tuple[ProposalTrace, ...]  # in the order the rule considered them
    source: str  # where the final token's distribution came from, e.g. "residual at node 2"


@dataclass(frozen=True)
class Walk:
    path: tuple[int, ...]  # accepted nodes, root first; path[1:] are accepted draft tokens
    token: int  # the correction or bonus token that ends the round
    kind: Literal["correction", "bonus"]  # correction: all proposals at path[-1] rejected
    trace: WalkTrace | None = field(default=None, compare=False, repr=False)  # verify(..., trace=True)

    def emitted(self, draft: DraftTree) -> list[int]:
        """Tokens this round appends to the sequence."""
        return [draft.tree.tokens[n] for n in self.path[1:]] + [self.token]


@dataclass(frozen=True)
class DepthStep:
    """One round's depth decision, as recorded in the trace."""

    depth: int  # the depth this round was drafted at
    entropy: float | None  # the uncertainty signal it produced ("entropy" mode), None otherwise
    from_drafter: bool  # the entropy came from the drafter's distribution (else the fallback)
    next_depth: int  # the depth chosen for the next round
