"""The drafter interface: propose a tree of continuations, hear back what was accepted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from ..backends.base import Runner
from ..config import SamplingConfig
from ..proposal import DraftTree
from ..rng import Rng
from ..verify import Walk


class Drafter(ABC):
    """Proposes a `DraftTree` each round.

    The decoder calls `start()` once per sequence, then per round `propose()` followed by
    `observe()` with the verification walk of that very proposal. Randomness must come from
    the `Rng` given to `start()`, and every stochastic proposal must carry the exact
    distribution it was drawn from (after `sampling`), or verification is not lossless.
    """

    @abstractmethod
    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        """Begin a new sequence whose committed tokens are `prompt`."""

    @abstractmethod
    def propose(self, context: Sequence[int], depth: int) -> DraftTree:
        """A tree rooted at `context[-1]` (the last committed token), at most `depth` deep."""

    def observe(self, draft: DraftTree, walk: Walk) -> None:
        """Feedback after verification of `draft` (keep caches in sync, adapt). Optional."""

    def runners(self) -> list[Runner]:
        """The draft models this drafter runs (their forward passes are counted in
        `GenerationStats.draft_forwards`): its `runner` attribute if it has one, else none.
        Override to report others."""
        runner = getattr(self, "runner", None)
        return [runner] if isinstance(runner, Runner) else []
