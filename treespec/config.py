"""User-facing configuration: how to sample, and what shape of draft tree to build.

Both dataclasses validate themselves on construction, so a bad value fails at the call
site with a message that says what to change, never deep inside a decode loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["iid", "without_replacement", "topk"]
STRATEGIES: tuple[str, ...] = ("iid", "without_replacement", "topk")


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling transforms, applied identically to the target (p) and the draft (q)."""

    temperature: float = 1.0  # 0 = greedy (argmax of the raw logits); > 0 divides the logits
    top_k: int | None = None  # keep the k most likely tokens; None or 0 = keep all
    top_p: float = 1.0  # nucleus: smallest set whose mass reaches top_p, in (0, 1]

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
            )
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0
        ):
            raise ValueError(f"top_k must be None or an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree proposed each round.

    `width=1` is linear speculative decoding (Leviathan et al. 2023, Algorithm 1) for every
    strategy. Per strategy:

    - "iid": `width` draft sequences of `depth` tokens, each sampled independently from
      the draft model, merged into a prefix tree. The m sequences through a node are m
      i.i.d. proposals there (duplicates are kept as separate trials). At most
      `width * depth` nodes.
    - "without_replacement": stochastic beam. Each expanded node gets `width` distinct
      children drawn without replacement from q (Gumbel-top-k); at each depth the `width`
      frontier nodes with the highest draft path probability are expanded further.
      At most `width + (depth - 1) * width**2` nodes.
    - "topk": deterministic beam. Each expanded node proposes its `width` most likely draft
      tokens; at each depth the `width` children with the highest draft path probability
      are kept (best-first by path probability). At most `width * depth` nodes.

    At temperature 0 the draft is read greedily: "iid" proposes the draft's argmax chain
    (its samples would all be equal), "without_replacement" takes the draft's top tokens
    in order (the zero-temperature limit of Gumbel-top-k), "topk" is unchanged.
    """

    width: int = 1  # branching: sequences ("iid") or children per node / beam size
    depth: int = 4  # draft tokens per branch; a round emits between 1 and depth + 1 tokens
    strategy: Strategy = "iid"  # see the class docstring

    def __post_init__(self) -> None:
        for name in ("width", "depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TreeConfig.{name} must be an integer >= 1, got {v!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"TreeConfig.strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}"
            )
