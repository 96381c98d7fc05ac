"""Each round's draft depth, decided by the decode loop for every drafter (`TreeConfig.adaptive`),
and whether a round drafts at all: per request (`TreeConfig.plain_fallback`) or per batch by
load (`GoodputSwitch` of the engine, `speculate_max_live="auto"`).

The loop owns one `DepthPolicy` per request: it asks `policy.next_depth()` before drafting
(0: a plain round), passes it to `drafter.propose(context, depth)`, after verification calls
`policy.update(...)` with the round's draft and walk (speculative rounds), and reports every
round's tokens and seconds to `policy.record(...)`. Any drafter therefore adapts, model-based
or not.

    None       the depth stays `TreeConfig.depth`
    "hf"       Hugging Face's heuristic: depth + 2 after a fully accepted round, - 1 otherwise
    "entropy"  EGAG-style: the EMA (factor `ema_beta`) of the draft's normalised entropy along
               the accepted path maps linearly onto [depth_min, depth_max] (confident: deeper)

    plain_fallback=True: the depth or 0, by which has given this request more tokens per second
    so far (a `GoodputSwitch` of its own): speculation where the draft pays on this request's
    text, sampling and hardware, plain decoding where it does not. It combines with any depth
    policy.

The entropy comes from `Drafter.path_entropy(draft, walk)`: the model drafter averages the
normalised entropy (entropy / log V) of its distributions at the fed nodes of the accepted
path. A drafter without a model distribution (n-gram, prompt lookup, custom) returns None,
and the policy falls back on the round's rejection rate, 1 - accepted / depth, as the
uncertainty signal (0 when the whole depth was accepted, 1 when nothing was); an empty round
(nothing proposed) counts as 1. Either way depth never depends on anything but committed
outcomes (and plain_fallback on past timings too), so the output law is unchanged (the enumeration
tests cover every policy).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from . import parallel
from .config import TreeConfig
from .proposal import DepthStep, DraftTree, Walk


class DepthPolicy:
    def __init__(self, config: TreeConfig):
        self.config = config
        self.depth = config.depth  # the depth of a speculative round (before the length cap)
        self.entropy_ema: float | None = None
        # plain_fallback: this request's own speculate-or-not switch, fed its own rounds
        self.switch = GoodputSwitch() if config.plain_fallback else None

    def next_depth(self) -> int:
        """The depth of the coming round (0: plain); asked once per round."""
        return self.depth if self.switch is None or self.switch.speculate(1) else 0

    def record(self, speculative: bool, tokens: int, seconds: float) -> None:
        """A finished round of this request: `tokens` emitted in `seconds`."""
        if self.switch is not None:
            self.switch.record(1, speculative, tokens, seconds)

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
            self.entropy_ema = (
                entropy
                if self.entropy_ema is None
                else cfg.ema_beta * self.entropy_ema + (1 - cfg.ema_beta) * entropy
            )
            self.depth = round(cfg.depth_max - self.entropy_ema * (cfg.depth_max - cfg.depth_min))
        if cfg.adaptive is not None:
            self.depth = max(cfg.depth_min, min(cfg.depth_max, self.depth))
        return DepthStep(round_depth, entropy, from_drafter, self.depth)


class GoodputSwitch:
    """`engine(speculate_max_live="auto")`: speculate or not, by which has given more tokens
    per second at about this many live requests on this machine.

    Where a batched target forward is bound by memory, speculation's extra rows are nearly
    free; where it is bound by compute (a CPU at batch 8), they cost about their full price
    and plain rounds win. The crossover depends on the hardware, the models, the sampling and
    the drafts' acceptance, so it is measured, not configured. Live counts are bucketed by
    powers of two (1, 2, 3-4, 5-8, ...). Each bucket runs one kind of round for `run_rounds`
    rounds at a time: the first run speculative, the second plain, then the kind with more
    tokens per second so far, except every `explore_every`-th run after those (every
    4 * `explore_every`-th where one kind is 1.25x faster), which takes the other kind so
    that a drift (acceptance, context length) is noticed. Tokens/s per bucket and kind is
    a ratio of sums decayed by `decay` per round: whole runs, so a speculative run pays for
    the draft's catch-up on the tokens a plain run emitted, and one noisy round (T=1, batch
    1) cannot flip a decision. Decisions depend on past timings and committed outcomes only,
    never on a coming draw, so every round stays exact; at temperature > 0 a request's output
    is then no longer reproducible from its seed alone (as with any `speculate_max_live`).
    """

    def __init__(
        self,
        run_rounds: int = 8,
        explore_every: int = 16,
        decay: float = 0.9,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.run_rounds, self.explore_every, self.decay, self.clock = run_rounds, explore_every, decay, clock
        self.sums: dict[
            tuple[int, bool], tuple[float, float]
        ] = {}  # (bucket, speculative) -> decayed tokens, seconds
        self.runs: dict[
            int, tuple[bool, int, int]
        ] = {}  # bucket -> kind of its run, rounds left in it, runs begun

    @staticmethod
    def bucket(live: int) -> int:
        return (live - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def speedup(self, live: int) -> float | None:
        """Measured tokens/s of speculative rounds over plain ones at `live` (None: not yet)."""
        b = self.bucket(live)
        if (b, True) not in self.sums or (b, False) not in self.sums:
            return None
        (ts, ss), (tp, sp) = self.sums[(b, True)], self.sums[(b, False)]
        return (ts / ss) / (tp / sp)

    def speculate(self, live: int) -> bool:
        """Whether the next round, with `live` requests, drafts."""
        b = self.bucket(live)
        speculative, left, runs = self.runs.get(b, (True, 0, 0))
        if left == 0:  # a new run: warm-up (speculative, then plain), then the faster kind, or explore
            runs += 1
            speedup = self.speedup(live)
            if speedup is None:
                speculative = (b, True) not in self.sums
            else:
                every = self.explore_every * (1 if 0.8 < speedup < 1.25 else 4)  # a wide gap: explore 4x less
                speculative = (speedup >= 1) != ((runs - 2) % every == 0)  # runs 1, 2: warm-up
            left = self.run_rounds
        self.runs[b] = (speculative, left - 1, runs)
        # decided from this process's clock: tensor parallel, rank 0 decides for every rank
        return parallel.agree(speculative)

    def record(self, live: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A finished round: `tokens` emitted by all `live` requests in `seconds`."""
        key = (self.bucket(live), speculative)
        t, s = self.sums.get(key, (0.0, 0.0))
        self.sums[key] = (
            self.decay * t + tokens,
            self.decay * s + max(seconds, 1e-9),
        )  # a coarse clock may read 0
