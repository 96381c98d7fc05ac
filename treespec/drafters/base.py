"""The drafter interface: propose a tree of continuations, hear back what was accepted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from ..backends.base import Runner, Scores, extend_many
from ..config import SamplingConfig
from ..proposal import DraftTree, Walk
from ..rng import Rng


@dataclass(frozen=True)
class DraftForward:
    """A draft forward a drafter asks for: `runner.extend(tokens, parents, hidden)`."""

    runner: Runner
    tokens: list[int]
    parents: list[int]
    hidden: torch.Tensor | None = None  # [n, H], for a runner that `takes_hidden` (a feature head)


# a drafter with draft forwards proposes one forward at a time: a generator that yields each
# DraftForward, is sent its `Scores` (logits [n, V], and a head's output states) and returns
# the tree, so that a batch of requests runs each depth's draft forward once (`propose_many`)
ProposeSteps = Generator[DraftForward, Scores, DraftTree]


class Drafter(ABC):
    """Proposes a `DraftTree` each round.

    The decoder calls `start()` once per sequence, then per round `propose()` (through
    `propose_many`) followed by `observe()` with the verification walk of that very proposal.
    Randomness must come from the `Rng` given to `start()`, and every stochastic proposal must
    carry the exact distribution it was drawn from (after `sampling`), or verification is not
    lossless.

    A drafter that reads the target's hidden states (a feature head) names the layers in
    `taps`; the target then returns their features with every forward, at no extra forward,
    and `read_target()` hands the drafter those of every committed position, in order.
    """

    # target layers whose input hidden states this drafter reads (`Runner.taps`); () = none,
    # and the target computes none
    taps: tuple[int, ...] = ()
    # a constrained request's grammar state (`treespec.constraints.TreeMatcher`), set by the
    # engine through `constrain()`: a drafter that draws from a distribution masks its logits
    # with it (`TreeMatcher.mask_logits`) before the sampling transforms, so q is the
    # distribution the proposal was drawn from and never proposes a forbidden token
    constraint = None

    def constrain(self, matcher) -> None:
        """Draft under `matcher` (None: unconstrained) from the next round on."""
        self.constraint = matcher

    def allowed_paths(self, paths: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """Deterministic paths (below the last committed token), each cut before the first
        token the constraint forbids (a node the constrained target never reaches); the empty
        ones left out."""
        if self.constraint is not None:
            paths = [p[: self.constraint.taken(p)] for p in paths]
        return [p for p in paths if p]

    @abstractmethod
    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        """Begin a new sequence whose committed tokens are `prompt`."""

    @abstractmethod
    def propose(self, context: Sequence[int], depth: int) -> DraftTree | ProposeSteps:
        """A tree rooted at `context[-1]` (the last committed token), at most `depth` deep; or,
        for a drafter that runs draft forwards, a generator that yields each `DraftForward`,
        is sent its `Scores` and returns the tree (`ProposeSteps`), so that the requests of a
        batch share each depth's forward. `draft_tree()` runs either to its tree."""

    def observe(self, draft: DraftTree, walk: Walk) -> None:
        """Feedback after verification of `draft` (keep caches in sync). Optional."""

    def read_target(self, scores: Scores) -> None:
        """For drafters with `taps`: the target's `Scores` of newly committed positions, in
        sequence order, their features (no logits): after `start()`, those of the prompt but
        its last token; after each round, plain rounds included, those of the walk's path (the
        positions whose next token the round settled)."""

    def path_entropy(self, draft: DraftTree, walk: Walk) -> float | None:
        """The draft's uncertainty along the accepted path, in [0, 1] (normalised entropy),
        for `TreeConfig(adaptive="entropy")`; None (the default) if this drafter has no
        distribution to measure, and the depth policy falls back on the rejection rate
        (`treespec.planning.policy`)."""
        return None

    def runners(self) -> list[Runner]:
        """The draft models this drafter runs (their forward passes are counted in
        `GenerationStats.draft_forwards`): its `runner` attribute if it has one, else none.
        Override to report others."""
        runner = getattr(self, "runner", None)
        return [runner] if isinstance(runner, Runner) else []


def check_draft(draft: DraftTree, root: int, vocab_size: int, name: str) -> None:
    """A custom drafter's tree must fit the target: rooted at the last committed token `root`,
    token ids and q inside the target's vocabulary."""
    tokens = draft.tree.tokens
    if tokens[0] != root:
        raise ValueError(
            f"{name} proposed a tree rooted at token {tokens[0]}, not at the last committed token {root}"
        )
    if max(tokens) >= vocab_size:
        bad = sorted({t for t in tokens if t >= vocab_size})
        raise ValueError(
            f"{name} proposed token ids {bad[:5]} outside the target's vocabulary [0, {vocab_size})"
        )
    for g in draft.groups:
        if g.q is not None and g.q.shape[-1] != vocab_size:
            raise ValueError(
                f"{name} proposed from a q over {g.q.shape[-1]} tokens, but the target's "
                f"vocabulary has {vocab_size}; "
                f"give q one entry per target token id"
            )


def propose_many(
    asks: Sequence[tuple[Drafter, Sequence[int], int]], catch: bool = False
) -> list[DraftTree | Exception]:
    """The trees of several (drafter, context, depth) proposals: drafters that run draft
    forwards advance together, each round of their pending forwards going through
    `extend_many`, so lanes of one batched runner share ONE forward. `catch=True`: a drafter
    that raises gets its exception in its slot, the others go on."""
    trees: list[DraftTree | Exception | None] = [None] * len(asks)
    steps: dict[int, ProposeSteps] = {}
    pending: dict[int, DraftForward] = {}

    def advance(i: int, scores: Scores | None) -> None:
        try:
            if i not in steps:
                drafter, context, depth = asks[i]
                proposal = drafter.propose(context, depth)
                if isinstance(proposal, DraftTree):
                    trees[i] = proposal
                    return
                steps[i] = proposal
            pending[i] = steps[i].send(scores)
        except StopIteration as done:
            trees[i] = done.value
        except Exception as e:
            if not catch:
                raise
            trees[i] = e

    for i in range(len(asks)):
        advance(i, None)
    while pending:
        batch, pending = list(pending.items()), {}
        jobs = [(a.runner, a.tokens, a.parents, a.hidden) for _, a in batch]
        for (i, _), scores in zip(batch, extend_many(jobs)):
            advance(i, scores)
    return trees


def draft_tree(drafter: Drafter, context: Sequence[int], depth: int) -> DraftTree:
    """`drafter`'s proposal after `context`, its draft forwards (if any) run alone."""
    return propose_many([(drafter, context, depth)])[0]
