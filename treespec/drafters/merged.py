"""Several drafters, one tree: SpecInfer's merge-based construction.

Each drafter proposes its own tree; identical token paths become one node. Every drafter's
proposal groups are kept as they were, only re-pointed at the merged nodes, so a node can
hold groups of different kinds and different q (a draft model's i.i.d. samples next to an
n-gram's deterministic guess). Verification tries them one after another with the running
residual, which keeps the walk exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import SamplingConfig
from ..proposal import DraftTree, ProposalGroup, Walk
from ..rng import Rng
from ..tree import TreeBuilder
from .base import Drafter, ProposeSteps


class MergedDrafter(Drafter):
    def __init__(self, drafters: Sequence[Drafter]):
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = list(drafters)

    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        for d in self.drafters:
            d.start(prompt, sampling, rng)

    def propose(self, context: Sequence[int], depth: int) -> ProposeSteps:
        builder = TreeBuilder(context[-1])
        groups: list[ProposalGroup] = []
        self._parts: list[tuple[DraftTree, list[int]]] = []
        for drafter in self.drafters:
            part = drafter.propose(context, depth)
            if not isinstance(part, DraftTree):  # a drafter with draft forwards: run them
                part = yield from part
            to_merged = [0]  # part node -> merged node
            for i in range(1, len(part.tree)):
                to_merged.append(builder.add(to_merged[part.tree.parents[i]], part.tree.tokens[i]))
            groups += [
                ProposalGroup(
                    to_merged[g.parent], g.draw, g.tokens, tuple(to_merged[c] for c in g.children), g.q
                )
                for g in part.groups
            ]
            self._parts.append((part, to_merged))
        return DraftTree(builder.build(), tuple(groups))

    def constrain(self, matcher) -> None:
        """Every part drafts under `matcher`."""
        self.constraint = matcher
        for d in self.drafters:
            d.constrain(matcher)

    def runners(self):
        """Every part's draft models, each once (two parts may share one runner)."""
        out = []
        for d in self.drafters:
            out += [r for r in d.runners() if all(r is not o for o in out)]
        return out

    def observe(self, draft: DraftTree, walk: Walk) -> None:
        """Each drafter hears the accepted path projected onto its own tree."""
        for drafter, (part, part_walk) in zip(self.drafters, self._projected(walk)):
            drafter.observe(part, part_walk)

    def path_entropy(self, draft: DraftTree, walk: Walk) -> float | None:
        """The mean over the parts that measure one (None if none does)."""
        hs = [d.path_entropy(part, w) for d, (part, w) in zip(self.drafters, self._projected(walk))]
        hs = [h for h in hs if h is not None]
        return sum(hs) / len(hs) if hs else None

    def _projected(self, walk: Walk) -> list[tuple[DraftTree, Walk]]:
        """Each part's tree and the accepted path projected onto it."""
        out = []
        for part, to_merged in self._parts:
            from_merged = {m: i for i, m in enumerate(to_merged)}
            path = [0]
            for n in walk.path[1:]:
                if n not in from_merged:
                    break
                path.append(from_merged[n])
            out.append((part, Walk(tuple(path), walk.token, walk.kind)))
        return out
