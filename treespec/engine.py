"""The decode loop, for one request or many: propose, score, verify, commit.

    admit waiting requests                    a lane each (a cache row) and their KV slots
    while requests are live:
        load prompts in pieces                under a per-step token budget (treespec.prefill)
        drafts = propose_many(live)           one draft forward per depth for all requests
        logits = score_many(live, drafts)     ONE target forward over every request's tree
        for each live request:
            walk = verify(draft, logits)      its own sampling, seed and verification rule
            commit(walk.path)                 its own cache row keeps its accepted path
            emit the round's tokens           its own length limit, EOS, stops, streaming
        finished and cancelled requests free their lanes; waiting requests are admitted

The engine takes requests as data (`treespec.request.Request`) and typed collaborators: the
target's and the draft's lanes (`Runner`s, one cache row each), a `DrafterFactory` and the
tokenizer (for stop strings and output text). It knows nothing of how they were loaded.
Nothing a request computes depends on the others: its draws come from its own `Rng` in the
same order as alone, and its forwards see only its own cache row (a batched forward packs
the requests' tokens, it does not mix them), so each request's output is the one it would
get alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .backends.base import Runner, score_many
from .config import TreeConfig, check_positive_int
from .constraints import (
    DRAFTER_MIN_SPEEDUP,
    FORCED_EXTRA,
    LOOKUP_DEPTH,
    LOOKUP_MIN_MATCH,
    GrammarVocabulary,
    TreeMatcher,
    drafted_walk,
)
from .drafters import DrafterFactory, check_draft, propose_many
from .engine_state import EngineStatus, RequestState, check_request
from .output import GenerationOutput, OutputBuilder, StopMatcher, TokenLogprobs
from .planning import AutoDepth, GoodputSwitch, Plan, Planner, RoundPolicy, depth_policy
from .prefill import DEFAULT_ROUND_TOKENS, PromptLoader
from .proposal import DraftTree
from .request import Request, make_request
from .rng import TorchRng
from .rules import Siblings, choose_rule, rule_fits
from .sampling import PenaltyContext
from .trace import RoundTrace
from .verify import verify


class Engine:
    """Continuous batching over lanes: requests are added, stepped, streamed and cancelled
    between rounds. Admission is limited by free lanes and by `max_kv_tokens`, the cache slots
    live requests may reserve together (each reserves `Request.slots`); a request beyond either
    limit waits, in order, and is admitted when a request finishes: nothing is dropped. A
    request that could never fit is refused by `add`.

    `targets[i]` and `drafts[i]` are lane i of the target and draft models (`Runner.lanes`);
    `drafts` may hold None where no draft model is loaded. `speculate_max_live`: with more
    live requests, rounds draft nothing (plain decoding); `switch` decides each round instead
    (`GoodputSwitch`). `planner` plans the requests whose tree is automatic (`TreeConfig()`,
    `treespec.planning`). `shared_tree_nodes`: in a round with other requests, a request whose
    tree holds more nodes than this decodes plainly, so that one client's large tree cannot
    slow every other request's rounds.

    `round_tokens`: the prompt tokens one step may prefill (in one forward beside the round's,
    which scores the live requests' trees): a long prompt loads in pieces over several steps
    while the live requests keep decoding (`treespec.prefill`); None prefills every admitted
    prompt whole in the step that admits it. `release_lanes`: a finished request's lanes
    forget its sequence and give back their cache memory (`Runner.release`); False keeps it
    cached (a decoder's own runners, which a chat's next turn or a caller may read).
    """

    def __init__(
        self,
        targets: Sequence[Runner],
        drafts: Sequence[Runner | None],
        drafter: DrafterFactory,
        tokenizer=None,
        eos_token_ids: frozenset[int] | None = None,
        max_kv_tokens: int | None = None,
        speculate_max_live: int | None = None,
        switch: GoodputSwitch | None = None,
        planner: Planner | None = None,
        shared_tree_nodes: int | None = None,
        round_tokens: int | None = DEFAULT_ROUND_TOKENS,
        release_lanes: bool = True,
    ):
        check_positive_int("round_tokens", round_tokens, none_ok=True)
        if len(targets) != len(drafts) or not targets:
            raise ValueError(
                f"need one draft lane (or None) per target lane, got {len(targets)} and {len(drafts)}"
            )
        self.targets, self.drafts, self.drafter = list(targets), list(drafts), drafter
        # the target layers the drafter reads: every target lane returns their features
        self.taps = drafter.taps(self.drafts[0])
        for target in self.targets:
            target.set_taps(self.taps)
        for runner in {id(r): r for r in (*self.targets, *self.drafts) if r is not None}.values():
            runner.load_graphs()  # kept compiled graphs load now, not during the first tokens
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(targets[0].eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.vocab_size = targets[0].vocab_size
        self.max_live, self.max_kv_tokens = len(self.targets), max_kv_tokens
        self.planner = planner
        # whether and how deep each request drafts each round (load, its own policy, node cap)
        self.rounds = RoundPolicy(speculate_max_live, switch, shared_tree_nodes)
        self.requests: dict[int, RequestState] = {}
        self.waiting: list[RequestState] = []  # admission order
        self.live: dict[int, RequestState] = {}  # lane -> request
        self._next_id = 0
        self._grammar_vocab: GrammarVocabulary | None = None  # the tokenizer as the grammars see it
        self._lock = threading.RLock()  # add / cancel / take from other threads; held while stepping
        self._stepping = False
        self.round_tokens, self.release_lanes = round_tokens, release_lanes
        self.loader = PromptLoader(self.targets, self.drafts, round_tokens)
        self._freed: list[int] = []  # lanes given up since their memory was last released

    @property
    def switch(self) -> GoodputSwitch | None:
        """The speculate-or-not switch of `speculate_max_live="auto"` (None: none), which the
        round policy asks each round; replaceable between rounds."""
        return self.rounds.switch

    @switch.setter
    def switch(self, switch: GoodputSwitch | None) -> None:
        self.rounds.switch = switch

    # ---- the public API -------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int | None = None, **settings) -> int:
        """Queue a request; its id. `prompt` is a `Request`, or text / a chat / token ids with
        the other `Request` fields as keywords (`stop` as a string, an id or a list). Bad input
        raises ValueError here, before anything runs; other requests are untouched. Safe to
        call from any thread."""
        if isinstance(prompt, Request):
            if settings or max_new_tokens is not None:
                raise ValueError("add(request) takes a Request alone; its settings are its fields")
            request = prompt
        else:
            if max_new_tokens is not None:
                settings["max_new_tokens"] = max_new_tokens
            request = make_request(prompt, self.tokenizer, **settings)
        with self._lock:
            state = self._state(request)
            self._next_id += 1
            self.requests[state.id] = state
            self.waiting.append(state)
        return state.id

    def cancel(self, request_id: int) -> GenerationOutput:
        """Stop a request now (a live one between rounds); its output so far (finish_reason
        "cancelled", or how it had already finished). The others go on. Safe from any thread."""
        with self._lock:
            state = self._get(request_id)
            if state.status == "waiting":
                self.waiting.remove(state)
            if state.status in ("waiting", "live"):
                self._finish(state, "cancelled")
            if not self._stepping:
                self._release()
            return state.output

    def step(self) -> dict[int, list[int]]:
        """Admit what fits, load prompt pieces under `round_tokens` (a request whose prompt is
        whole in its cache starts decoding), then one round for every decoding request; the
        tokens each emitted.

        A round is all-or-nothing per request. A request whose own work fails (its drafter,
        its logits, its streaming callback) ends alone with finish_reason "error". An
        exception that belongs to no request (a batched forward, KeyboardInterrupt) rolls the
        round back for every request not yet committed: their caches, drafters and random
        streams are as before the round, and the next step() redoes it identically; a request
        interrupted in the middle of its own commit ends with "error". Streaming callbacks run
        after every commit, so they cannot tear a round. One thread steps at a time. Loading
        fails alone too: a request whose prefill or drafter fails ends with "error"; an
        interrupt leaves the loading prompts as before the step's pieces."""
        with self._lock:
            if self._stepping:
                raise RuntimeError("Engine.step() is already running; one thread steps an engine")
            self._stepping = True
            try:
                self._admit()
                self._load()
                emitted = self._round() if any(not r.loading for r in self.live.values()) else {}
            finally:
                self._stepping = False
            self._stream()
            self._release()
            return emitted

    def run(self) -> dict[int, GenerationOutput]:
        """Step until every request is finished; the outputs by request id (the engine then
        forgets those requests, as `take` does)."""
        while self.waiting or self.live:
            self.step()
        with self._lock:
            return {i: self.take(i) for i in list(self.requests)}

    def output(self, request_id: int) -> GenerationOutput | None:
        """A finished or cancelled request's output (None while it runs)."""
        with self._lock:
            return self._get(request_id).output

    def take(self, request_id: int) -> GenerationOutput | None:
        """A finished request's output, after which the engine forgets it (so that a long-
        running engine's memory stays flat); None, and nothing forgotten, while it runs."""
        with self._lock:
            state = self._get(request_id)
            if state.output is not None:
                del self.requests[request_id]
            return state.output

    @property
    def kv_tokens(self) -> int:
        """Cache slots reserved by live requests."""
        return sum(r.request.slots for r in self.live.values())

    def status(self) -> EngineStatus:
        """What a front end may know of the engine (a server's metrics, its queue limit)."""
        with self._lock:
            return EngineStatus(
                live=tuple(r.id for r in self.live.values()),
                waiting=len(self.waiting),
                kv_tokens=self.kv_tokens,
                max_live=self.max_live,
                max_kv_tokens=self.max_kv_tokens,
                max_positions=getattr(self.targets[0], "max_positions", None),
                prefilling=sum(r.loading for r in self.live.values()),
                round_tokens=self.round_tokens,
            )

    # ---- a round ---------------------------------------------------------------------------
    def _round(self) -> dict[int, list[int]]:
        live = [r for r in self.live.values() if not r.loading]
        snapshots = {r.id: r.rng.snapshot() for r in live}  # to redraw identically after a rollback
        clock = time.perf_counter
        t0 = clock()
        try:
            # 1. propose: every request's tree, as deep as the round policy says (0: its root)
            asked = [(r.depth_policy, r.tree, r.builder.remaining) for r in live]
            depths = {r.id: depth for r, depth in zip(live, self.rounds.depths(asked))}
            proposing = [r for r in live if depths[r.id]]
            proposed = propose_many([(r.drafter, r.context, depths[r.id]) for r in proposing], True)
            drafts = {r.id: DraftTree.root_only(r.context[-1]) for r in live if not depths[r.id]}
            for r, draft in zip(proposing, proposed):
                if isinstance(draft, Exception):
                    self._fail(r, draft)
                    continue
                if self.drafter.custom:
                    try:
                        check_draft(draft, r.context[-1], self.vocab_size, self.drafter.name)
                    except ValueError as e:
                        self._fail(r, e)
                        continue
                drafts[r.id] = draft
            own = self._extend_forced(live, drafts)
            live = [r for r in live if r.id in drafts]
            t1 = clock()
            # 2. score every request's tree in one target forward
            scores = score_many([(self.targets[r.lane], drafts[r.id].tree) for r in live])
            # 3. verify each with its own sampling and coins
            walks = {}
            for r, rows in zip(live, scores):
                committed = PenaltyContext(r.context, len(r.request.prompt))
                try:
                    logits = rows.logits
                    if r.matcher is not None:  # the constrained target: p masked at every node
                        logits = r.matcher.mask_logits(logits, r.matcher.paths(drafts[r.id].tree))
                    walks[r.id] = verify(
                        drafts[r.id],
                        logits,
                        r.request.sampling,
                        r.rng,
                        r.rule,
                        committed,
                        r.rounds is not None,
                        check_structure=self.drafter.custom,
                    )
                except Exception as e:  # noqa: BLE001 - e.g. its own NaN logits: it ends alone
                    self._fail(r, e)
            rows_of = {r.id: rows for r, rows in zip(live, scores)}
            live = [r for r in live if r.id in walks]
            t2 = clock()
        except BaseException:
            self._rollback([r for r in live if r.status == "live"], snapshots)
            raise
        # 4. commit each request as one unit: cache rows, drafter, depth, stats, output
        emitted: dict[int, list[int]] = {}
        for k, r in enumerate(live):
            try:
                emitted[r.id] = self._commit(
                    r, drafts[r.id], walks[r.id], depths[r.id], t1 - t0, t2 - t1, rows_of[r.id], own.get(r.id)
                )
            except BaseException as e:
                self._fail(r, e)
                if not isinstance(e, Exception):  # an interrupt: the rest of the round is undone
                    self._rollback(live[k + 1 :], snapshots)
                    raise
        self.rounds.record(len(live), any(depths.values()), sum(map(len, emitted.values())))
        return emitted

    def _extend_forced(self, live: list[RequestState], drafts: dict[int, DraftTree]) -> dict[int, DraftTree]:
        """Extend the trees of constrained requests with the tokens their grammars force,
        drafted for free (not for plain decoding, `tree=None`); a request whose grammar fails
        ends alone. Returns each tree as its drafter drew it."""
        own = dict(drafts)
        for r in live:
            if r.matcher is None or r.request.tree is None or r.id not in drafts:
                continue
            room = (r.tree.max_depth if r.tree is not None else 0) + FORCED_EXTRA
            try:
                drafts[r.id] = r.matcher.extend_forced(drafts[r.id], min(r.builder.remaining - 1, room))
            except Exception as e:  # noqa: BLE001 - its own grammar's failure
                self._fail(r, e)
                del drafts[r.id]
        return own

    def _commit(self, r: RequestState, draft: DraftTree, walk, depth: int, draft_s, verify_s, rows, own=None):
        """Apply a verified round to request `r` (`rows`: its target scores, [nodes] rows;
        `own`: the tree as the drafter drew it, when forced tokens extended it): the tokens it
        emitted."""
        self.targets[r.lane].commit(walk.path)
        step = None
        if depth or (r.drafter is not None and r.drafter.taps):
            t = time.perf_counter()
            if depth:  # the drafter hears about its own tree (forced tokens: caught up next round)
                own, own_walk = (draft, walk) if own is None else (own, drafted_walk(walk, own, draft))
                r.drafter.observe(own, own_walk)
                step = r.depth_policy.update(r.drafter, own, own_walk, depth)
            if r.drafter.taps:  # the features of the path's positions, plain rounds too
                r.drafter.read_target(rows.rows(walk.path, logits=False))
            draft_s += time.perf_counter() - t
        r.stats.record_round(draft, walk, draft_seconds=draft_s, verify_seconds=verify_s)
        kept = r.builder.add(walk.emitted(draft), walk.kind)
        if r.depth_policy is not None:
            r.depth_policy.record(depth > 0, len(kept), draft_s + verify_s)
        if r.request.logprobs is not None and kept:  # token i came from the row of path[i]
            r.logprobs.append(
                TokenLogprobs.of(rows.logits[list(walk.path[: len(kept)])], kept, r.request.logprobs)
            )
        if r.rounds is not None:
            r.rounds.append(
                RoundTrace(
                    len(r.rounds),
                    draft.tree,
                    r.rule,
                    walk.trace.proposals,
                    walk.path,
                    walk.token,
                    walk.kind,
                    walk.trace.source,
                    tuple(kept),
                    step,
                )
            )
        if r.matcher is not None:
            forced, accepted = r.matcher.count_forced(draft.tree, walk.path, kept)
            r.stats.forced_tokens += forced
            r.stats.forced_accepted += accepted
            r.matcher.commit(kept)
        r.context += kept
        r.unstreamed += len(kept)
        if r.builder.done:
            self._finish(r, r.builder.finish_reason)
        elif r.matcher is not None and r.matcher.finished:  # complete, its end emitted (ignore_eos)
            self._finish(r, "stop")
        return kept

    def _rollback(self, states: list[RequestState], snapshots: dict) -> None:
        """Undo an abandoned round for `states`: pending tree slots dropped, coins rewound."""
        for r in states:
            for runner in (self.targets[r.lane], self.drafts[r.lane]):
                if runner is not None:
                    runner.discard_pending()
            if snapshots.get(r.id) is not None:
                r.rng.restore(snapshots[r.id])

    def _stream(self) -> None:
        """Hand each request's new tokens to its callbacks: `on_tokens`, then `on_logprobs` with
        the same tokens' log-probabilities, then `on_round` with the rounds that made them. A
        callback that raises ends its own request ("error"); an interrupt leaves the rest for
        the next step."""
        for r in list(self.requests.values()):
            request, n = r.request, r.unstreamed
            if not n or (
                request.on_tokens is None and request.on_logprobs is None and request.on_round is None
            ):
                continue
            ids, sources = r.builder.token_ids[-n:], r.builder.sources[-n:]
            rounds = [] if r.rounds is None else r.rounds[r.rounds_streamed :]
            r.unstreamed, r.rounds_streamed = 0, r.rounds_streamed + len(rounds)
            try:
                if request.on_tokens is not None:
                    request.on_tokens(ids, sources)
                if request.on_logprobs is not None:
                    request.on_logprobs(TokenLogprobs.tail(r.logprobs, n, request.logprobs))
                for round_ in rounds if request.on_round is not None else ():
                    request.on_round(round_)
            except Exception as e:  # noqa: BLE001 - a client's callback: its failure is its own
                with self._lock:
                    if r.status == "live":
                        self._fail(r, e)
                    elif r.output is not None and r.output.finish_reason != "error":
                        r.output.finish_reason, r.output.error, r.output.exception = "error", _describe(e), e

    # ---- checks, admission and release ----------------------------------------------------
    def _state(self, request: Request) -> RequestState:
        """What only the models can tell about `request`, checked; its state, waiting."""
        check_request(
            request, self.targets[0], self.drafts[0], self.drafter, self.tokenizer, self.max_kv_tokens
        )
        tree, V = request.tree, self.vocab_size
        rule = self._rule(tree, request)
        stop = None
        if request.stop_strings or request.stop_token_ids:
            stop = StopMatcher(list(request.stop_strings), set(request.stop_token_ids), self.tokenizer)
        # a constrained output ends at its grammar's end (EOS), ignore_eos or not
        eos = frozenset() if request.ignore_eos and request.constraint is None else self.eos_token_ids
        builder = OutputBuilder(request.max_new_tokens, eos, stop)
        rng = TorchRng(request.seed, self.targets[0].device) if request.rng is None else request.rng
        rounds = [] if request.trace else None
        matcher = None
        if request.constraint is not None:  # compiled now: an invalid one fails before any work
            if self._grammar_vocab is None:
                self._grammar_vocab = GrammarVocabulary.of(self.tokenizer, V, self.eos_token_ids)
            matcher = TreeMatcher(self._grammar_vocab, request.constraint)
        return RequestState(self._next_id, request, tree, rule, rng, builder, rounds=rounds, matcher=matcher)

    def _rule(self, tree: TreeConfig | None, request: Request, drafter: DrafterFactory | None = None) -> str:
        """The verification rule of `request` drafting `tree` with `drafter`'s kind (default:
        the engine's; an automatic tree is resolved when its plan is made). Plain decoding
        verifies no draft, so every rule is the same there: it walks a lone root by the
        cheapest ("token")."""
        siblings = (drafter or self.drafter).siblings(tree, request.verification)
        return choose_rule(siblings, request.verification)

    def _plan(self, request: Request) -> Plan:
        """An automatic tree's plan for `request`: plain decoding where there is nothing to
        draft with; a chain for drafters of chains and for the block rule."""
        if self.drafter.needs_draft_model and self.drafts[0] is None:
            return Plan(None, (), 1.0, 1.0, None, "no draft model")
        if self.planner is None:
            raise ValueError(
                "an automatic tree (TreeConfig()) needs the engine's planner; give a shape instead"
            )
        chain = self.drafter.siblings(request.tree, request.verification) is not Siblings.DISTINCT
        iid = rule_fits(Siblings.IID, request.verification)  # i.i.d. trees run the token rule only
        plan = self.planner.plan(request.sampling, chain_only=chain, iid=iid)
        if request.constraint is not None and plan.speedup < DRAFTER_MIN_SPEEDUP:  # plain decoding: 1.0
            match = LOOKUP_MIN_MATCH[plan.cls]
            best = "plain decoding" if plan.tree is None else f"the best shape's {plan.speedup:.2f}x"
            why = f"lookup from {match}-token matches, cut by the grammar, with forced tokens, beats {best}"
            lookup, options = TreeConfig(width=1, depth=LOOKUP_DEPTH), (("min_ngram", match),)
            return Plan(lookup, (), 1.0, 1.0, None, why, plan.cls, drafter="lookup", drafter_options=options)
        return plan

    def _factory(self, plan: Plan | None) -> DrafterFactory:
        """The drafters of a request with `plan`: the plan's own kind (a constrained request's
        prompt lookup), else the engine's."""
        if plan is None or plan.drafter is None:
            return self.drafter
        return DrafterFactory(plan.drafter, self.vocab_size, options=dict(plan.drafter_options))

    def _admit(self) -> None:
        """Give waiting requests lanes, in order, while lanes and `max_kv_tokens` allow; each
        starts loading its prompt (an automatic tree is planned first: plain decoding drafts,
        and loads, nothing)."""
        while self.waiting and len(self.live) < self.max_live:
            r = self.waiting[0]
            if self.max_kv_tokens is not None and self.kv_tokens + r.request.slots > self.max_kv_tokens:
                break  # in order: it waits for a finishing request to free slots
            self.waiting.pop(0)
            r.lane = next(i for i in range(self.max_live) if i not in self.live)
            self.live[r.lane] = r
            r.status, r.context, r.loading, r.drafters = "live", list(r.request.prompt), True, self.drafter
            r.started = time.perf_counter()
            try:
                if r.tree is not None and r.tree.auto:
                    t_plan = time.perf_counter()
                    r.plan = self._plan(r.request)
                    r.tree, r.drafters = r.plan.tree, self._factory(r.plan)
                    r.rule = self._rule(r.tree, r.request, r.drafters)  # a chain: block; plain: token
                    r.stats.plan_seconds = time.perf_counter() - t_plan
                # 0 unless prefix_reuse; with a head drafter, no more than the positions whose
                # features it still holds (the target recomputes the rest, features included)
                limit = self.drafter.reusable(self.drafts[r.lane], r.context) if self.taps else None
                draft = r.drafters.needs_draft_model and not self.taps and r.tree is not None
                self.loader.begin(r, limit, draft and self.drafts[r.lane] is not None)
            except Exception as e:  # noqa: BLE001 - its plan failed (the costs' measurement): it ends alone
                self._fail(r, e)
            except BaseException:
                self._unadmit([r])
                raise

    def _load(self) -> None:
        """One step's prompt pieces (`PromptLoader.feed`, at most `round_tokens` tokens in all);
        a request whose prompt is whole starts decoding."""
        loading = [r for r in self.live.values() if r.loading]  # admission order
        if not loading:
            return
        done, failed = self.loader.feed(loading, self.round_tokens)
        for r, e in failed:
            self._fail(r, e)
        for r in done:
            self._start(r)

    def _start(self, r: RequestState) -> None:
        """`r`'s prompt is in its cache: its drafter starts (reading the prompt's features, for
        a feature drafter) and it decodes from the next round on. A drafter that fails to start
        ends its request alone; an interrupt leaves it loaded, to start again next step."""
        t = time.perf_counter()
        try:
            if r.tree is not None:
                r.drafter = r.drafters.make(r.tree, self.drafts[r.lane])
                r.drafter.constrain(r.matcher)
                r.depth_policy = depth_policy(r.tree, r.plan)
                with self.loader.loaded(r):
                    r.drafter.start(r.request.prompt, r.request.sampling, r.rng)
                if r.drafter.taps:
                    for scores in r.prompt_scores:
                        r.drafter.read_target(scores)
                r.draft_forwards_before = sum(x.forwards for x in r.drafter.runners())
        except Exception as e:  # noqa: BLE001 - its drafter failed to start: it ends alone
            self._fail(r, e)
            return
        except BaseException:
            r.drafter, r.depth_policy = None, None
            raise
        r.loading, r.prompt_scores = False, []
        r.stats.prefill_seconds += time.perf_counter() - t

    def _release(self) -> None:
        """The lanes given up since the last call (finished, cancelled and failed requests)
        forget their sequences and give back their cache memory, unless the engine keeps them
        (`release_lanes`) or a lane reuses prefixes (a chat's next turn starts from it)."""
        freed, self._freed = self._freed, []
        if not self.release_lanes:
            return
        for lane in freed:
            if lane in self.live:  # taken again already
                continue
            for runner in (self.targets[lane], self.drafts[lane]):
                if runner is not None and not runner.prefix_reuse:
                    runner.release()

    def _unadmit(self, states: list[RequestState]) -> None:
        """Put requests whose admission was interrupted back at the head of the queue."""
        for r in states:
            del self.live[r.lane]
            r.status, r.lane, r.drafter, r.depth_policy, r.context = "waiting", None, None, None, []
            r.loading, r.plan, r.tree = False, None, r.request.tree  # planned again when admitted
            r.rule = self._rule(r.tree, r.request)
        self.waiting[:0] = states

    def _fail(self, state: RequestState, error: BaseException) -> None:
        """End `state` alone with finish_reason "error"; its lanes are dropped from the round."""
        for runner in (self.targets[state.lane], self.drafts[state.lane]):
            if runner is not None:
                runner.discard_pending()
        self._finish(state, "error")
        state.output.error, state.output.exception = _describe(error), error

    def _finish(self, state: RequestState, reason: str) -> None:
        stats, builder = state.stats, state.builder
        stats.tokens = len(builder.token_ids)
        if state.drafter is not None:
            stats.draft_forwards = (
                sum(x.forwards for x in state.drafter.runners()) - state.draft_forwards_before
            )
        stats.total_seconds = time.perf_counter() - state.started if state.started else 0.0
        ids = builder.token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
        k = state.request.logprobs
        state.output = GenerationOutput(
            ids, builder.sources, stats, text, reason, builder.stop_match, state.rule, state.rounds,
            logprobs=None if k is None else TokenLogprobs.cat(state.logprobs, k),
            plan=None if state.plan is None else state.plan.describe(),
        )  # fmt: skip
        if isinstance(state.depth_policy, AutoDepth) and self.planner is not None and state.matcher is None:
            self.planner.remember(state.plan, state.depth_policy.counts)
        if state.status == "live":
            del self.live[state.lane]
            self._freed.append(state.lane)  # its memory is given back after the round (`_release`)
        state.status = "finished" if reason != "cancelled" else "cancelled"

    def _get(self, request_id: int) -> RequestState:
        if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id not in self.requests:
            raise ValueError(f"no request with id {request_id!r} in this engine")
        return self.requests[request_id]


def _describe(error: BaseException) -> str:
    """One line for GenerationOutput.error."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
