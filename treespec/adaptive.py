"""Each round's draft depth, decided by the decode loop for every drafter (`TreeConfig.adaptive`).

The loop owns one `DepthPolicy` per request: it asks `policy.depth` before drafting, passes
it to `drafter.propose(context, depth)`, and after verification calls `policy.update(...)`
with the round's draft and walk. Any drafter therefore adapts, model-based or not.

    None       the depth stays `TreeConfig.depth`
    "hf"       Hugging Face's heuristic: depth + 2 after a fully accepted round, - 1 otherwise
    "entropy"  EGAG-style: the EMA (factor `ema_beta`) of the draft's normalised entropy along
               the accepted path maps linearly onto [depth_min, depth_max] (confident: deeper)

The entropy comes from `Drafter.path_entropy(draft, walk)`: the model drafter averages the
normalised entropy (entropy / log V) of its distributions at the fed nodes of the accepted
path. A drafter without a model distribution (n-gram, prompt lookup, custom) returns None,
and the policy falls back on the round's rejection rate, 1 - accepted / depth, as the
uncertainty signal (0 when the whole depth was accepted, 1 when nothing was); an empty round
(nothing proposed) counts as 1. Either way depth never depends on anything but committed
outcomes, so the output law is unchanged (the enumeration tests cover both).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import TreeConfig
from .proposal import DraftTree
from .verify import Walk


@dataclass(frozen=True)
class DepthStep:
    """One round's depth decision, as recorded in the trace."""

    depth: int  # the depth this round was drafted at
    entropy: float | None  # the uncertainty signal it produced ("entropy" mode), None otherwise
    from_drafter: bool  # the entropy came from the drafter's distribution (else the fallback)
    next_depth: int  # the depth chosen for the next round


class DepthPolicy:
    def __init__(self, config: TreeConfig):
        self.config = config
        self.depth = config.depth  # the depth of the next round (before the length cap)
        self.entropy_ema: float | None = None

    def update(self, drafter, draft: DraftTree, walk: Walk, round_depth: int) -> DepthStep:
        """Move the depth after a round drafted at `round_depth`; what was decided."""
        cfg = self.config
        entropy, from_drafter = None, False
        if cfg.adaptive == "hf":
            full = len(walk.path) - 1 >= round_depth
            self.depth += 2 if full else -1
        elif cfg.adaptive == "entropy":
            entropy = drafter.path_entropy(draft, walk)
            from_drafter = entropy is not None
            if entropy is None:
                entropy = 1.0 - (len(walk.path) - 1) / round_depth if len(draft.tree) > 1 else 1.0
            self.entropy_ema = entropy if self.entropy_ema is None else cfg.ema_beta * self.entropy_ema + (1 - cfg.ema_beta) * entropy
            self.depth = round(cfg.depth_max - self.entropy_ema * (cfg.depth_max - cfg.depth_min))
        self.depth = max(cfg.depth_min, min(cfg.depth_max, self.depth)) if cfg.adaptive else cfg.depth
        return DepthStep(round_depth, entropy, from_drafter, self.depth)
