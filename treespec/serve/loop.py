"""The engine thread: one thread steps the shared `Engine`; asyncio handlers talk to it.

    handler (asyncio)                         engine thread
    job = Job(request)        --- add --->    engine.add(request)  -> job.id (or ValueError)
    await job.queue.get()     <-- tokens --   on_tokens(ids) inside engine.step()
                              <-- done ----   engine.output(id) after the round: the output
    disconnect -> cancel(job) --- cancel ->   engine.cancel(id): its lane frees this round

Commands (add, cancel) are queued and applied by the engine thread between rounds, so the
engine is only ever touched by that thread, and requests join and leave between rounds. With
nothing to do the thread sleeps on a condition that `submit`, `cancel` and `stop` notify.
Results cross back with `loop.call_soon_threadsafe` into each request's asyncio queue.

The event loop never waits on the engine: the engine's lock is held for a whole step, so no
handler calls the engine. The thread publishes an `EngineStatus` snapshot (`status`) after
every step, which handlers read without a lock, and `_cond` is only ever held for a few
list operations on either side.

A request that fails inside the engine (its finish_reason "error") is answered alone. If a
round raises instead (an engine that cannot isolate the fault), every request that was live
in it fails with that error and the thread goes on with the others waiting.

Tensor parallel (`treespec.parallel`, torchrun): rank 0 serves; before each round it hands
what it applied (requests added, without their callbacks, and cancellations) to every rank
(`parallel.agree`), and the other ranks' `follow()` applies the same to their engines and
steps with it, so every rank runs the same rounds. Idle, rank 0 sends an empty list every
HEARTBEAT_S seconds, well inside the collectives' timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .. import parallel
from ..engine import Engine
from ..engine_state import EngineStatus
from ..output import GenerationOutput
from ..request import Request
from .metrics import Metrics

log = logging.getLogger("treespec.serve")

HEARTBEAT_S = 5.0  # tensor parallel: an idle rank 0 tells the others it is alive this often


@dataclass(eq=False)
class Job:
    """One request on its way through the engine, seen from both threads."""

    request: Request
    aloop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    fault: bool = False  # tests: make on_tokens raise inside the engine (TREESPEC_SERVE_FAULTS=1)
    id: int | None = None
    first: float | None = None  # perf_counter of the first emission
    last: float | None = None  # perf_counter of the latest emission
    error: str | None = None  # set when the request failed inside the engine
    added: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiter: asyncio.Future | None = None  # the handler's wait for `added` (cancelled by a cut)
    cut: bool = False  # answered by the server at a shutdown, without the engine (Server.cut)

    def push(self, item: tuple) -> None:
        """Hand `item` to the handler's queue (from the engine thread)."""
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Owns the thread that steps `engine`; `submit` and `cancel` are called from asyncio."""

    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._cond = threading.Condition()
        self._commands: deque[tuple[str, Job]] = deque()
        self._jobs: dict[int, Job] = {}  # id -> job, while the engine holds it (engine thread only)
        self._pending_adds = 0  # submitted, not yet added to the engine
        self._outstanding = 0  # submitted, not yet finished
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="treespec-engine", daemon=True)
        self.failure: BaseException | None = None  # what killed the thread, if anything did
        self._parallel = parallel.current() is not None  # rank 0 of a tensor-parallel group
        self._events: list[tuple] = []  # tensor parallel: what the other ranks must apply next
        # the engine as of its last step, for the asyncio side (read without a lock: the engine's
        # own is held while it steps); taken here before the thread runs, then by the thread
        self.status: EngineStatus = engine.status()

    # ---- called from the asyncio side --------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def outstanding(self) -> int:
        """Requests submitted and not finished (waiting, being added, or live)."""
        return self._outstanding

    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queue `job` for the engine; the future resolves to its id or the add's exception."""
        on_logprobs = None
        if job.request.logprobs is not None:
            on_logprobs = lambda lp: job.push(("logprobs", lp))  # noqa: E731 - after its ("tokens", ...)
        on_round = (lambda r: job.push(("round", r))) if job.request.trace else None  # noqa: E731
        request = dataclasses.replace(
            job.request, on_tokens=self._on_tokens(job), on_logprobs=on_logprobs, on_round=on_round
        )
        job.request = request
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._pending_adds += 1
            self._outstanding += 1
            self._commands.append(("add", job))
            self._cond.notify()
        return job.added

    def cancel(self, job: Job) -> None:
        """Stop `job` at the next round boundary (its client went away)."""
        with self._cond:
            self._commands.append(("cancel", job))
            self._cond.notify()

    def cancel_all(self) -> None:
        """Stop every request the engine holds or is about to add, at the next round boundary
        (the grace period of a shutdown is over): each ends with finish_reason "cancelled"."""
        with self._cond:
            self._commands.append(("cancel_all", None))
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> bool:
        """Cancel whatever the engine still holds and end the thread (at its next step
        boundary: between rounds, or between a prompt's chunks); whether it ended within
        `timeout` seconds."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the engine thread ---------------------------------------------------------------
    def _on_tokens(self, job: Job):
        metrics = self.metrics

        def on_tokens(ids: list[int], sources: list[str]) -> None:
            if job.fault:
                raise RuntimeError("fault injected by the request (treespec_fault)")
            now = time.perf_counter()
            first = now - job.arrival if job.first is None else None
            gap = None if job.last is None else now - job.last
            if job.first is None:
                job.first = now
            job.last = now
            metrics.tokens(len(ids), first, gap)
            job.push(("tokens", list(ids)))

        return on_tokens

    def _busy(self) -> bool:
        status = self.engine.status()
        return bool(status.live or status.waiting)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._busy() and not self._stopping:
                        self._publish()
                        if not self._cond.wait(HEARTBEAT_S if self._parallel else None):
                            break  # tensor parallel: time for a heartbeat
                    commands, self._commands = self._commands, deque()
                    stopping = self._stopping
                for kind, job in commands:
                    {"add": self._add, "cancel": self._cancel, "cancel_all": self._cancel_all}[kind](job)
                if stopping:
                    for rid in list(self._jobs):
                        self.engine.cancel(rid)
                    self._sweep()
                    self._publish()
                    if self._parallel:
                        parallel.agree([("stop",)])
                    return
                if self._parallel:  # every rank applies what this one did, then steps alike
                    events, self._events = self._events, []
                    parallel.agree(events)
                if self._busy():
                    self._step()
                self._publish()
        except BaseException as e:  # the loop itself broke: fail everything, say why
            self.failure = e
            log.exception("the engine thread stopped")
            with self._cond:
                self._stopping = True
                commands, self._commands = self._commands, deque()
            for kind, job in commands:
                if kind == "add" and not job.added.done():
                    job.added.set_exception(RuntimeError(f"the engine thread stopped: {e}"))
            for job in self._jobs.values():
                job.push(("done", None, f"the engine thread stopped: {type(e).__name__}: {e}"))
            raise

    def _add(self, job: Job) -> None:
        with self._cond:
            self._pending_adds -= 1
            if not job.added.set_running_or_notify_cancel():  # its handler stopped waiting (a cut)
                self._outstanding -= 1
                return
        try:
            rid = self.engine.add(job.request)
        except Exception as e:  # ValueError: bad input, answered 400 by the handler
            with self._cond:
                self._outstanding -= 1
            job.added.set_exception(e)
            return
        job.id = rid
        self._jobs[rid] = job
        if self._parallel:
            plain = dataclasses.replace(job.request, on_tokens=None, on_logprobs=None, on_round=None)
            self._events.append(("add", plain))
        self.metrics.prompt_tokens.inc(len(job.request.prompt))
        job.added.set_result(rid)

    def _cancel(self, job: Job) -> None:
        if job.id is not None and job.id in self._jobs:
            self._cancel_id(job.id)
            self._sweep()

    def _cancel_all(self, _=None) -> None:
        for rid in list(self._jobs):
            self._cancel_id(rid)
        self._sweep()

    def _cancel_id(self, rid: int) -> None:
        self.engine.cancel(rid)
        if self._parallel:
            self._events.append(("cancel", rid))

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as e:
            # the engine did not isolate the failure: every request live in this round fails
            message = f"{type(e).__name__}: {e}"
            live = self.engine.status().live
            log.error("a round failed; failing its %d live request(s): %s", len(live), message)
            for rid in live:
                job = self._jobs.get(rid)
                if job is not None:
                    job.error = message
                self.engine.cancel(rid)  # the other ranks' rounds raised alike and cancel alike
        self._sweep()

    def _sweep(self) -> None:
        """Hand every finished request's output to its handler and forget it."""
        engine = self.engine
        take = getattr(engine, "take", None)
        now = time.perf_counter()
        for rid, job in list(self._jobs.items()):
            out: GenerationOutput | None = engine.output(rid)
            if out is None:
                continue
            if take is not None:
                take(rid)
            del self._jobs[rid]
            with self._cond:
                self._outstanding -= 1
            if out.finish_reason == "error" and self._parallel:
                # failed here alone (its streaming callback, which only rank 0 runs): the
                # others end it before their next round
                self._events.append(("cancel", rid))
            error = job.error or (getattr(out, "error", None) if out.finish_reason == "error" else None)
            if out.finish_reason == "error" and error is None:
                error = "the request failed inside the engine"
            reason = "error" if error else out.finish_reason
            self.metrics.finish(reason, out.stats, now - job.arrival)
            job.push(("done", out, error))

    def _publish(self) -> None:
        status = self.status = self.engine.status()
        self.metrics.engine_state(len(status.live), status.waiting + self._pending_adds, status.kv_tokens)


def follow(engine: Engine) -> None:
    """A tensor-parallel rank other than 0: apply what rank 0's `EngineLoop` applied before each
    of its rounds and step alike, until rank 0 stops (or a collective fails: rank 0 died or hung)."""
    while True:
        events = parallel.agree(None)
        for event in events:
            if event[0] == "stop":
                return
            if event[0] == "add":
                engine.add(event[1])
            elif event[1] in engine.requests and engine.output(event[1]) is None:
                engine.cancel(event[1])
        status = engine.status()
        if not (status.live or status.waiting):
            continue
        try:
            engine.step()
        except Exception:  # noqa: BLE001 - rank 0's round raised alike: it cancels every live request
            for rid in engine.status().live:
                engine.cancel(rid)
        for rid in list(engine.requests):  # finished: nobody here reads them
            if engine.output(rid) is not None:
                engine.take(rid)
