"""The decode loop, for one request or many: propose, score, verify, commit.

    admit waiting requests                    a lane each (a cache row); prompts prefilled
    while requests are live:
        drafts = propose_many(live)           one draft forward per depth for all requests
        logits = score_many(live, drafts)     ONE target forward over every request's tree
        for each live request:
            walk = verify(draft, logits)      its own sampling, seed and verification rule
            commit(walk.path)                 its own cache row keeps its accepted path
            emit the round's tokens           its own length limit, EOS, stops, streaming
        finished and cancelled requests free their lanes; waiting requests are admitted

`SpeculativeDecoder.generate()` is this loop with one request and the decoder's own runners;
`generate_batch()` and `SpeculativeDecoder.engine()` (continuous batching: add, step,
stream, cancel between rounds) run it over `Runner.lanes` of the target and draft models.
Nothing a request computes depends on the others: its draws come from its own `Rng` in the
same order as alone, and its forwards see only its own cache row (a batched forward packs
the requests' tokens, it does not mix them), so each request's output is the one it would
get alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from .adaptive import DepthPolicy, GoodputSwitch
from .backends.base import Runner, prefill_many, score_many
from .config import SamplingConfig, TreeConfig
from .drafters import Drafter, propose_many
from .proposal import DraftTree
from .rng import Rng
from .sampling import PenaltyContext
from .stats import GenerationOutput, GenerationStats, OutputBuilder
from .trace import RoundTrace
from .verify import verify

Status = Literal["waiting", "live", "finished", "cancelled"]


@dataclass
class Request:
    """One sequence and everything that is its own: settings, randomness, output, statistics."""

    id: int
    prompt: list[int]  # token ids, validated
    tree: TreeConfig | None  # None: plain decoding (one token per round)
    sampling: SamplingConfig
    rule: str  # verification rule
    rng: Rng
    out: OutputBuilder  # length limit, EOS, stops, streaming
    slots: int  # cache slots it may need: prompt + max_new_tokens + deepest tree
    status: Status = "waiting"
    stats: GenerationStats = field(default_factory=GenerationStats)
    lane: int | None = None  # index of its target (and draft) runner while live
    drafter: Drafter | None = None
    depth: DepthPolicy | None = None  # decides each round's draft depth (TreeConfig.adaptive)
    trace: list[RoundTrace] | None = None  # one entry per round when generate(trace=True)
    context: list[int] = field(default_factory=list)  # prompt + emitted tokens
    output: GenerationOutput | None = None  # once finished or cancelled
    _draft_forwards0: int = 0
    _t_start: float = 0.0


class Engine:
    """Continuous batching over `max_live` lanes: requests are added, stepped, streamed and
    cancelled between rounds. Admission is limited by free lanes and by `max_kv_tokens`, the
    cache slots live requests may reserve together (each reserves prompt + max_new_tokens +
    its deepest tree); a request beyond either limit waits, in order, and is admitted when a
    request finishes: nothing is dropped. A request that could never fit is refused by `add`.

    Made by `SpeculativeDecoder.engine()`; `add()` takes `generate()`'s arguments.
    """

    def __init__(
        self, decoder, targets: list[Runner], drafts: list[Runner | None], max_kv_tokens: int | None = None,
        speculate_max_live: int | None = None, switch: GoodputSwitch | None = None,
    ):
        self.decoder, self.targets, self.drafts = decoder, targets, drafts
        self.max_live, self.max_kv_tokens = len(targets), max_kv_tokens
        self.speculate_max_live = speculate_max_live  # more live requests: plain rounds
        self.switch = switch  # speculate_max_live="auto": each round decided by measured tokens/s
        self.requests: dict[int, Request] = {}
        self.waiting: list[Request] = []  # admission order
        self.live: dict[int, Request] = {}  # lane -> request
        self._next_id = 0

    # ---- the public API -------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int = 128, **settings) -> int:
        """Queue a request (`generate()`'s arguments); its id. Bad input raises ValueError
        here, before anything runs; other requests are untouched."""
        return self._submit(self.decoder._request(self._next_id, prompt, max_new_tokens, **settings))

    def _submit(self, request: Request) -> int:
        """Queue a checked request built for this engine (its id is the next one)."""
        if request.id != self._next_id:
            raise RuntimeError(f"request id {request.id} is not this engine's next id {self._next_id}")
        if self.max_kv_tokens is not None and request.slots > self.max_kv_tokens:
            raise ValueError(
                f"the request needs up to {request.slots} KV cache slots (prompt {len(request.prompt)} + max_new_tokens "
                f"{request.out.max_new_tokens} + tree depth), more than max_kv_tokens={self.max_kv_tokens}; "
                f"raise max_kv_tokens or shorten the request"
            )
        self._next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> GenerationOutput:
        """Stop a request now; its output so far (finish_reason "cancelled"). The others go on."""
        request = self._get(request_id)
        if request.status in ("waiting", "live"):
            if request.status == "waiting":
                self.waiting.remove(request)
            self._finish(request, "cancelled")
        return request.output

    def step(self) -> dict[int, list[int]]:
        """Admit what fits, then one round for every live request; the tokens each emitted."""
        self._admit()
        if not self.live:
            return {}
        live = list(self.live.values())
        clock = time.perf_counter
        t0 = clock()
        # 1. propose: every request's tree, never deeper than the tokens it still wants; none
        # (depth 0: the tree is its root) with more than speculate_max_live requests live, or
        # when the switch ("auto") has measured plain rounds faster at this many
        switched = self.switch is not None and any(r.drafter is not None for r in live)
        if switched:
            t_round, speculate = self.switch.clock(), self.switch.speculate(len(live))
        else:
            speculate = self.speculate_max_live is None or len(live) <= self.speculate_max_live
        depths = [0 if r.drafter is None or not speculate else min(r.depth.depth, r.out.remaining - 1) for r in live]
        drafted = propose_many([r.drafter.propose_steps(r.context, d) for r, d in zip(live, depths) if d])
        drafts, it = [], iter(drafted)
        for r, d in zip(live, depths):
            drafts.append(next(it) if d else DraftTree.root_only(r.context[-1]))
            if d:
                self.decoder._check_draft(drafts[-1], r.context, r.drafter)
        t1 = clock()
        # 2. score every request's tree in one target forward
        logits = score_many([(self.targets[r.lane], draft.tree) for r, draft in zip(live, drafts)])
        emitted: dict[int, list[int]] = {}
        walks = []
        for r, draft, rows in zip(live, drafts, logits):
            # 3. verify with the request's own sampling and coins; 4. commit its accepted path
            walk = verify(draft, rows, r.sampling, r.rng, r.rule, PenaltyContext(r.context, len(r.prompt)), r.trace is not None)
            self.targets[r.lane].commit(walk.path)
            walks.append(walk)
        t2 = clock()
        steps = []
        for r, draft, walk, d in zip(live, drafts, walks, depths):
            steps.append(None)
            if d:
                r.drafter.observe(draft, walk)
                steps[-1] = r.depth.update(r.drafter, draft, walk, d)
        t3 = clock()
        for r, draft, walk, step in zip(live, drafts, walks, steps):
            r.stats.record_round(draft, walk, draft_seconds=(t1 - t0) + (t3 - t2), verify_seconds=t2 - t1)
            emitted[r.id] = r.out.add(walk.emitted(draft), walk.kind)
            if r.trace is not None:
                r.trace.append(RoundTrace(len(r.trace), draft.tree, r.rule, walk.trace.proposals, walk.path, walk.token,
                                          walk.kind, walk.trace.source, tuple(emitted[r.id]), step))
            r.context += emitted[r.id]
            if r.out.done:
                self._finish(r, r.out.finish_reason)
        if switched:
            self.switch.record(len(live), any(depths), sum(map(len, emitted.values())), self.switch.clock() - t_round)
        return emitted

    def run(self) -> dict[int, GenerationOutput]:
        """Step until every request is finished; outputs by request id."""
        while self.waiting or self.live:
            self.step()
        return {i: r.output for i, r in self.requests.items()}

    def output(self, request_id: int) -> GenerationOutput | None:
        """A finished or cancelled request's output (None while it runs)."""
        return self._get(request_id).output

    @property
    def kv_tokens(self) -> int:
        """Cache slots reserved by live requests."""
        return sum(r.slots for r in self.live.values())

    # ---- admission and release ------------------------------------------------------------
    def _admit(self) -> None:
        admitted = []
        while self.waiting and len(self.live) < self.max_live:
            request = self.waiting[0]
            if self.max_kv_tokens is not None and self.kv_tokens + request.slots > self.max_kv_tokens:
                break  # in order: it waits for a finishing request to free slots
            self.waiting.pop(0)
            request.lane = next(i for i in range(self.max_live) if i not in self.live)
            self.live[request.lane] = request
            admitted.append(request)
        if not admitted:
            return
        t0 = time.perf_counter()
        for r in admitted:
            r._t_start = t0
            r.status, r.context = "live", list(r.prompt)
            self.targets[r.lane].reset()
        # the target holds all but the last prompt token (the root of the first tree)
        prefill_many([(self.targets[r.lane], r.prompt[:-1]) for r in admitted])
        for r in admitted:
            if r.tree is not None:
                r.drafter = self.decoder._drafter(r.tree, self.drafts[r.lane])
                r.depth = DepthPolicy(r.tree)
                r.drafter.start(r.prompt, r.sampling, r.rng)
                r._draft_forwards0 = sum(x.forwards for x in r.drafter.runners())
        t1 = time.perf_counter()
        for r in admitted:
            r.stats.prefill_seconds = t1 - t0

    def _finish(self, request: Request, reason: str) -> None:
        stats, out = request.stats, request.out
        stats.tokens = len(out.token_ids)
        if request.drafter is not None:
            stats.draft_forwards = sum(x.forwards for x in request.drafter.runners()) - request._draft_forwards0
        stats.total_seconds = time.perf_counter() - request._t_start if request._t_start else 0.0
        tokenizer = self.decoder.tokenizer
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True) if tokenizer is not None else None
        request.output = GenerationOutput(out.token_ids, out.sources, stats, text, reason, out.stop_match, request.rule, request.trace)
        if request.status == "live":
            del self.live[request.lane]  # the lane's cache is reset when the next request takes it
        request.status = "finished" if reason != "cancelled" else "cancelled"

    def _get(self, request_id: int) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"no request with id {request_id!r} in this engine")
        return self.requests[request_id]
