"""What the engine holds for each request while it runs (`RequestState`), a snapshot of an
engine (`EngineStatus`), and the checks a request passes before it is queued (`check_request`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .backends.base import Runner, Scores
from .config import TreeConfig
from .constraints import TreeMatcher
from .drafters import Drafter, DrafterFactory
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
    drafters: DrafterFactory | None = None  # makes its drafter: its plan's kind, else the engine's
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
    # chunked prefill (treespec.prefill): while `loading` it holds a lane and its KV slots, its
    # prompt enters the cache piece by piece, and it has no rounds yet
    loading: bool = False
    loads_draft: bool = False  # the engine loads its draft model's lane too
    prompt_scores: list[Scores] = field(default_factory=list)  # the pieces' target features, in order


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot of an engine (`Engine.status()`)."""

    live: tuple[int, ...]  # ids of the requests holding a lane: decoding, or loading their prompts
    waiting: int  # requests queued for a lane
    kv_tokens: int  # cache slots the live requests reserve
    max_live: int  # lanes
    max_kv_tokens: int | None  # the engine's slot budget (None: no budget)
    max_positions: int | None  # the target's context length (None: unstated)
    prefilling: int = 0  # of the live requests, those still loading their prompts (no tokens yet)
    round_tokens: int | None = None  # prompt tokens one step may prefill (None: whole prompts)


def check_request(
    request: Request,
    target: Runner,
    draft: Runner | None,
    drafter: DrafterFactory,
    tokenizer,
    max_kv_tokens: int | None,
) -> None:
    """What only the models can tell about `request` (its ids in the vocabulary, its length
    within the models' positions and the KV budget, a draft model where it drafts with one):
    a ValueError naming what is wrong, before anything runs."""
    V = target.vocab_size
    for what, ids in (("prompt token ids", request.prompt), ("stop token ids", request.stop_token_ids)):
        bad = [t for t in ids if t >= V]
        if bad:
            raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {V})")
    if request.stop_strings and tokenizer is None:
        raise ValueError(
            "stop strings need a tokenizer to decode the output; pass tokenizer=... or stop token ids"
        )
    tree = request.tree
    auto = tree is not None and tree.auto  # planned at admission, where forwards may run
    uses_draft = tree is not None and drafter.needs_draft_model
    if auto:  # with nothing to draft with, an automatic tree decodes plainly
        uses_draft = uses_draft and draft is not None
    elif uses_draft and draft is None:
        raise ValueError(
            f"drafter={drafter.name} needs a draft model; pass draft=..., use drafter='ngram' or "
            f"'lookup', or tree=None for plain decoding"
        )
    for name, runner in (("target", target), ("draft", draft if uses_draft else None)):
        limit = getattr(runner, "max_positions", None)
        # no room for one token is the prompt's fault, not max_new_tokens'
        if limit is not None and len(request.prompt) >= limit:
            raise ValueError(
                f"the prompt ({len(request.prompt)} tokens) fills the {name} model's {limit} "
                f"positions; shorten it"
            )
        if limit is not None and len(request.prompt) + request.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(request.prompt)} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) exceeds "
                f"the {name} model's {limit} positions; shorten the prompt or lower max_new_tokens"
            )
    if max_kv_tokens is not None and request.slots > max_kv_tokens:
        raise ValueError(
            f"the request needs up to {request.slots} KV cache slots (prompt {len(request.prompt)} + "
            f"max_new_tokens {request.max_new_tokens} + tree depth), more than max_kv_tokens="
            f"{max_kv_tokens}; raise max_kv_tokens or shorten the request"
        )
    if request.logprobs is not None and request.logprobs > V:
        raise ValueError(f"logprobs={request.logprobs} asks for more tokens than the vocabulary's {V}")
