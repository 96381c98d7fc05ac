"""Drafting with a feature head (EAGLE-3): a `ModelDrafter` whose draft model reads the target.

The target's forwards return the features of every row they compute (`Drafter.taps`); the
engine hands this drafter those of each newly committed position (`read_target`). Head slot
t pairs the target's features at position t with the committed token t+1, so after a round
every committed position but the root has its slot's inputs:

    forward #1   the slots of the positions committed since the last round, fed with fc(f):
                 its last row (the slot before the root) gives the root's children
    forward #d   every frontier node, fed with its parent's output state (no target
                 features exist below the root yet), under the tree mask

Only forward #1's slots are kept after verification: drafted nodes were fed the head's own
states, and the accepted ones come back next round with the target's features. Every tree
strategy, sampling setting and verification rule of `ModelDrafter` applies unchanged, and
each proposal still carries the exact q it was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.base import Scores
from ..backends.head import HeadRunner
from ..config import SamplingConfig, TreeConfig
from ..proposal import DraftTree, Walk
from ..rng import Rng
from .base import DraftForward
from .model import DraftNode, ModelDrafter


class HeadDrafter(ModelDrafter):
    """`runner`: a head (`HeadRunner`, or any runner that `takes_hidden` with `target_taps` and
    `project(features)`)."""

    def __init__(self, runner: HeadRunner, tree: TreeConfig, vocab_size: int | None = None):
        super().__init__(runner, tree, vocab_size=vocab_size)
        self.taps = runner.target_taps

    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        self.sampling, self.rng = sampling, rng
        self.prompt_len = len(prompt)
        self.runner.keep_prefix(prompt[1:])  # a reset, unless the runner reuses prefixes
        self._features: list[torch.Tensor] = []  # target features of positions the head has not fed
        self._consumed = 0

    def read_target(self, scores: Scores) -> None:
        if scores.features is None:
            raise RuntimeError("the target returned no features; it needs set_taps(drafter.taps)")
        self._features.append(scores.features)

    def _catch_up(self, context: Sequence[int]) -> DraftForward | None:
        run = self.runner
        features = torch.cat(self._features) if len(self._features) > 1 else (self._features or [None])[0]
        n = 0 if features is None else features.shape[0]
        if run.n_committed > len(context) - 1 - n:  # a reused prefix longer than the target kept
            run.keep_prefix(context[1 : len(context) - n])
        c = run.n_committed  # head slots 0 .. c-1 hold positions 0 .. c-1 (tokens 1 .. c)
        if c + n != len(context) - 1 or list(context[1 : c + 1]) != run.committed:
            raise RuntimeError(
                f"feature head out of sync: {c} slots + {n} new features for {len(context)} committed tokens"
            )
        if n == 0:
            return None  # a one-token prompt: nothing to read until the target has scored it
        self._consumed = len(self._features)  # dropped once the round commits (a rollback redoes it)
        tokens = list(context[c + 1 :])  # slot t reads token t + 1
        return DraftForward(run, tokens, list(range(-1, n - 1)), run.project(features))

    def _level(self, nodes: list[DraftNode], frontier: list[int]) -> DraftForward:
        ask = super()._level(nodes, frontier)
        hidden = torch.stack([nodes[nodes[n].parent].state for n in frontier])  # [n, H]
        return DraftForward(ask.runner, ask.tokens, ask.parents, hidden)

    def observe(self, draft: DraftTree, walk: Walk) -> None:
        self.runner.commit(self._chain)  # the target-fed slots; drafted nodes come back with features
        del self._features[: self._consumed]
        self._consumed = 0


FeatureDrafter = HeadDrafter  # deprecated: the former name of `HeadDrafter`
