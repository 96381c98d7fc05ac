"""What the engine holds for each request while it runs (`RequestState`), and a snapshot of
an engine (`EngineStatus`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .config import TreeConfig
from .constraints import TreeMatcher
from .drafters import Drafter
from .output import GenerationOutput, OutputBuilder, TokenLogprobs
from .planning import DepthPolicy, Plan
from .request import Request
from .rng import Rng
from .stats import GenerationStats
from .trace import RoundTrace

Status = Literal["waiting", "live", "finished", "cancelled"]


@dataclass
class RequestState:
    """One request while the engine holds it: its randomness, output so far and statistics."""

    id: int
    request: Request
    tree: TreeConfig | None  # the tree it drafts (an automatic tree: the planned shape, or None)
    rule: str  # the verification rule it runs
    rng: Rng
    builder: OutputBuilder  # length limit, EOS, stops, streaming
    plan: Plan | None = None  # an automatic tree: what was chosen and why
    status: Status = "waiting"
    stats: GenerationStats = field(default_factory=GenerationStats)
    lane: int | None = None  # index of its target (and draft) lane while live
    drafter: Drafter | None = None
    depth_policy: DepthPolicy | None = None  # decides each round's draft depth (TreeConfig.adaptive)
    rounds: list[RoundTrace] | None = None  # one entry per round when request.trace
    context: list[int] = field(default_factory=list)  # prompt + emitted tokens
    output: GenerationOutput | None = None  # once finished or cancelled
    unstreamed: int = 0  # emitted tokens not yet handed to the request's on_tokens
    rounds_streamed: int = 0  # rounds already handed to the request's on_round
    draft_forwards_before: int = 0  # the draft lane's forward count when it was admitted
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per round, when request.logprobs
    started: float = 0.0  # perf_counter at admission
    matcher: TreeMatcher | None = None  # its grammar state, when the request is constrained


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot of an engine (`Engine.status()`)."""

    live: tuple[int, ...]  # ids of the requests decoding now
    waiting: int  # requests queued for a lane
    kv_tokens: int  # cache slots the live requests reserve
    max_live: int  # lanes
    max_kv_tokens: int | None  # the engine's slot budget (None: no budget)
    max_positions: int | None  # the target's context length (None: unstated)
