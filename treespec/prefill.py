"""Chunked prefill: how an engine loads prompts into their lanes under a per-round token budget.

As vLLM and SGLang schedule it, a prompt no longer enters its cache whole in the step that
admits it; each `Engine.step()` is

    admit       waiting requests get a lane and reserve their KV slots (no forward yet)
    load        the prompts being loaded feed pieces, shortest remaining first,
                `round_tokens` tokens in all, in ONE packed prefill forward (the round's
                forward is another)
    start       a request whose prompt is now in its cache starts its drafter
    round       every request that decodes: propose, score, verify, commit

so a decode keeps getting a round every step while long prompts load, and a request that is
cancelled, or an engine that stops, stops between pieces. A piece is fed causally after the
cached slots with positions continuing, so a prompt fed in pieces leaves the cache one prefill
would (up to rounding: a product over fewer rows), and the drafter sees the same: a draft
model's lane is loaded beside the target's (the draft's prefill in pieces too), and a feature
drafter reads the target features of every piece, in order, as one prefill's.

A lane that must compute as `generate()` alone (`Runner.batch_invariant`) cuts its prompt at
fixed positions (multiples of `round_tokens`), whatever else is loading: its numbers then never
depend on the load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .backends.base import Runner, prefill_many
from .engine_state import RequestState

# prompt tokens one step feeds: on the default pair on a 2-core Zen 4, a 16-token request sent
# while six ~3k-token prompts load finishes in 2.3 s at 32 (4.5-5.3 s at 64, 11.6 at 128, 20.8
# at 256), while the six take 1.06x their loads one after another (0.99-1.04x at 64-256;
# docs/serving.md, "Long prompts", experiments/serve_stress.py)
DEFAULT_ROUND_TOKENS = 32


def piece_sizes(
    loads: Sequence[tuple[int, int, bool]], budget: int | None, round_tokens: int | None
) -> list[int]:
    """How many prompt tokens each loading request feeds this step (in the order of `loads`).

    `loads`: (fed, total, aligned) per request, in admission order: prompt tokens already in
    its cache, those it needs there, and whether its pieces end at fixed positions (multiples
    of `round_tokens`). `budget`: the tokens this step may feed (None: every prompt whole, the
    unchunked engine). Shortest remaining prompt first (ties: admission order), as a
    scheduler that minimises waiting does: a short request that arrives behind long prompts
    starts decoding in the next step instead of after all of them. A request feeds what is
    left of the budget; an aligned piece that does not fit waits for the next step, unless
    nothing was fed before it (so prompts always progress), and the requests after it in that
    order wait too."""
    if budget is None:
        return [total - fed for fed, total, _ in loads]
    sizes = [0] * len(loads)
    left = budget
    for i in sorted(range(len(loads)), key=lambda i: (loads[i][1] - loads[i][0], i)):
        fed, total, aligned = loads[i]
        remaining = total - fed
        k = min(remaining, left)
        if aligned and round_tokens is not None:
            k = min(remaining, round_tokens - fed % round_tokens)
            if k > left and left < budget:
                k = 0
        if remaining and not k:
            break
        sizes[i] = k
        left = max(0, left - k)
    return sizes


class PromptLoader:
    """Feeds the prompts of an engine's loading requests into their lanes (`targets[i]`, and
    `drafts[i]` where the engine loads a draft model's lane too), piece by piece. A request's
    progress is what its lanes hold: `Runner.n_committed`."""

    def __init__(self, targets: Sequence[Runner], drafts: Sequence[Runner | None], round_tokens: int | None):
        self.targets, self.drafts, self.round_tokens = targets, drafts, round_tokens

    def begin(self, r: RequestState, limit: int | None, draft: bool) -> None:
        """Start loading `r` (its lane assigned): its lanes keep what they may of their caches
        (`Runner.keep_prefix`: nothing unless prefix_reuse; for the target no more than `limit`
        positions, a feature drafter's); `draft`: load the draft model's lane beside it."""
        prompt = r.context[:-1]  # the target holds all but the last prompt token (the first root)
        self.targets[r.lane].keep_prefix(prompt[:limit])
        r.prompt_scores, r.loads_draft = [], draft
        if draft:
            self.drafts[r.lane].keep_prefix(prompt)

    def fed(self, r: RequestState) -> int:
        """Prompt tokens in both of `r`'s loaded lanes."""
        fed = self.targets[r.lane].n_committed
        return min(fed, self.drafts[r.lane].n_committed) if r.loads_draft else fed

    def feed(
        self, loading: Sequence[RequestState], budget: int | None
    ) -> tuple[list[RequestState], list[tuple[RequestState, Exception]]]:
        """One step's pieces for `loading` (admission order) in one packed prefill forward:
        the requests whose prompts are now whole in their lanes, and those whose own prefill
        failed with the error (e.g. a cache that cannot grow): after a packed forward fails,
        each request's piece is fed alone, so that only the one at fault fails. An interrupt
        leaves every lane as before the step's pieces (the next step feeds them again)."""
        loads = [(self.fed(r), len(r.context) - 1, self.targets[r.lane].batch_invariant) for r in loading]
        sizes = piece_sizes(loads, budget, self.round_tokens)
        pieces = [(r, fed + k) for r, (fed, _, _), k in zip(loading, loads, sizes) if k]
        failed: list[tuple[RequestState, Exception]] = []
        if pieces:
            try:
                self._feed(pieces)
            except Exception:  # noqa: BLE001 - some request's prefill failed: find it
                failed = self._feed_alone(pieces)
        gone = {id(r) for r, _ in failed}
        done = [r for r in loading if id(r) not in gone and self.fed(r) == len(r.context) - 1]
        return done, failed

    def _jobs(self, r: RequestState, end: int) -> list[tuple[Runner, list[int]]]:
        """`r`'s prefill jobs up to prompt position `end` (its target's, and its draft's)."""
        runners = [self.targets[r.lane]] + ([self.drafts[r.lane]] if r.loads_draft else [])
        return [(runner, r.context[runner.n_committed : end]) for runner in runners]

    def _feed(self, pieces: list[tuple[RequestState, int]]) -> None:
        """Feed every piece (request, prompt position it ends at) in one `prefill_many`; the
        target's features of each kept on the request, the forward's seconds added to each one's
        prefill time. A failure leaves the lanes as before."""
        jobs = [(r, job) for r, end in pieces for job in self._jobs(r, end)]
        t0 = time.perf_counter()
        try:
            scores = prefill_many([job for _, job in jobs])
        except BaseException:
            for _, (runner, _) in jobs:
                runner.discard_pending()  # a forward may have written slots past the committed ones
            raise
        seconds = time.perf_counter() - t0
        for (r, (runner, _)), s in zip(jobs, scores):
            if runner is self.targets[r.lane] and s is not None and s.features is not None:
                r.prompt_scores.append(s)
        for r, _ in pieces:
            r.stats.prefill_seconds += seconds

    def _feed_alone(self, pieces: list[tuple[RequestState, int]]) -> list[tuple[RequestState, Exception]]:
        """After a packed prefill failed: each piece fed on its own; the requests whose own
        piece fails, with their errors (their lanes reset)."""
        failed = []
        for r, end in pieces:
            try:
                self._feed([(r, end)])
            except Exception as e:  # noqa: BLE001 - this request's own failure
                for runner, _ in self._jobs(r, end):
                    runner.reset()
                failed.append((r, e))
        return failed

    @contextmanager
    def loaded(self, r: RequestState) -> Iterator[None]:
        """Within: `r`'s draft lane keeps the prompt the engine loaded when its drafter starts
        (`Drafter.start` prefills the draft itself after `keep_prefix`, which then keeps it all)."""
        draft = self.drafts[r.lane] if r.loads_draft else None
        if draft is None:
            yield
            return
        reuse, draft.prefix_reuse = draft.prefix_reuse, True
        try:
            yield
        finally:
            draft.prefix_reuse = reuse
