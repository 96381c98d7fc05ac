"""The FastAPI app: OpenAI-compatible endpoints over one continuous-batching `Engine`.

    POST /v1/completions         text (or token ids) in, text out; `stream: true` for SSE
    POST /v1/chat/completions    messages in, an assistant message out; `stream: true` for SSE
    GET  /v1/models              the one model served
    GET  /                       a chat page that draws each round's draft tree (page.html)
    GET  /health                 200 while the engine thread runs, 503 otherwise
    GET  /metrics                Prometheus text format (treespec.serve.metrics)

`create_app(engine, tokenizer, model_name)` builds it around an engine it does not own the
models of; the engine thread (`treespec.serve.loop`) starts and stops with the app's lifespan.
The routes (treespec.serve.routes) call the app's `Server`, which builds a treespec `Request`
from a body, runs it and shapes the answer. Every error is answered with OpenAI's body,
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.requests import Request as HTTPRequest
from fastapi.responses import JSONResponse

from ..config import SamplingConfig, TreeConfig
from ..engine import Engine
from ..output import GenerationOutput, TextStream, TokenLogprobs, stop_set
from ..request import Request, check_chat, encode_prompt, make_request
from ..trace import round_to_json
from . import routes
from .body import content_text, parse_body
from .errors import ERROR_HANDLERS, bad_request
from .guard import Guard
from .loop import EngineLoop, Job
from .metrics import Metrics
from .protocol import (
    DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    CommonFields,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ServeError,
    TokenLogprob,
    TopLogprob,
    TreespecStats,
    Usage,
    error_body,
    openai_finish_reason,
)
from .structured import check_compiles, constraint_of

PAGE = Path(__file__).with_name("page.html")
log = logging.getLogger("treespec.serve")
DEFAULT_CONTEXT = 4096  # the context assumed for a model that does not state its positions
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
# a request's tree costs every live request its round (t(n)/t(1) grows with the nodes): the
# largest a request may ask for
DEFAULT_MAX_TREE_NODES = 64
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
TEXT_SLACK = 2  # a normalizer may shorten a text before it is split: refuse only twice past the bound
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is ~0.5 MB of text, ~1 MB of token ids
DEFAULT_READ_TIMEOUT_S = 30.0  # headers (from the connection or the last response) and then a body
# shutdown: once the grace period is over, the engine cancels what runs at its next step
# boundary; whatever it has not answered CUT_S later is answered by the server itself
CUT_S = 1.0
STOP_WAIT_S = 2.0  # then the engine thread has this long to leave its step (treespec.serve.cli)


@dataclass(frozen=True)
class ServeSettings:
    """What the server decides when a request does not say."""

    max_queue: int | None = 64  # requests beyond max_live + max_queue are answered 429
    tree: TreeConfig | None = TreeConfig()  # the default draft tree; None = plain decoding
    verification: str | None = None  # the default rule; None = the best that applies
    max_positions: int | None = None  # the context length (default: the target runner's)
    faults: bool = False  # honour `treespec_fault` (tests); default from TREESPEC_SERVE_FAULTS=1
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES  # the largest tree a request may ask for (draft nodes)
    api_keys: tuple[str, ...] = ()  # Bearer keys the /v1 routes want; () = open (treespec.serve.guard)
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES  # larger bodies are answered 413; None: no limit
    allowed_origins: tuple[str, ...] = ()  # origins browsers may call from (CORS); () = none
    read_timeout: float | None = DEFAULT_READ_TIMEOUT_S  # a body not in by then: 408; None: wait


class Server:
    """The app's state: the engine loop, the tokenizer, metrics and settings."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, settings: ServeSettings):
        if tokenizer is None:
            raise ValueError("treespec serve needs a tokenizer (text in, text out)")
        self.engine, self.tokenizer, self.model_name, self.settings = engine, tokenizer, model_name, settings
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.created = int(time.time())
        self.draining = False
        self.jobs: set[Job] = set()  # submitted and not yet answered (event loop only)
        self.aloop: asyncio.AbstractEventLoop | None = None  # the event loop (set at startup)
        positions = settings.max_positions or self.loop.status.max_positions
        self.max_positions: int | None = positions
        # requests are tokenized and checked here, one at a time, never on the event loop: a
        # long prompt takes seconds to tokenize, and /health and every stream would wait
        self.prepare = ThreadPoolExecutor(1, thread_name_prefix="treespec-prepare")
        # no token spells more than this many bytes of text: a longer text than
        # TEXT_SLACK x this x the context cannot fit, and is refused before it is tokenized
        self.token_bytes = max((len(t.encode()) for t in tokenizer.get_vocab()), default=1)

    def shut_down(self, grace_period: float) -> None:
        """A shutdown began (SIGTERM, Ctrl-C): new requests get 503; after `grace_period`
        seconds whatever still runs is cancelled, so that each open request is answered (streams:
        finish_reason "cancelled" and [DONE]; others: a 503 body) before the server stops."""
        if self.draining:
            return
        self.draining = True
        _after(grace_period, self.grace_over)

    def grace_over(self) -> None:
        """(a timer's thread) The grace period is over: the engine cancels every request at its
        next step boundary and answers them; `cut` answers CUT_S later what it has not."""
        self.loop.cancel_all()
        if self.aloop is not None:
            _after(CUT_S, _call_soon, self.aloop, self.cut)

    def cut(self) -> None:
        """(event loop) End every request still open without waiting for the engine (busy in a
        long step): streams with finish_reason "cancelled" and [DONE], the others 503."""
        for job in list(self.jobs):
            job.cut = True
            if job.waiter is not None and not job.waiter.done():
                job.waiter.cancel()  # not yet added: the engine thread will skip it
            job.queue.put_nowait(("done", None, None))

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the preparing thread; its exceptions (ServeError) raise here."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare, fn, *args)

    # ---- building a treespec Request from a body --------------------------------------------
    def check_common(self, body: CommonFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ServeError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )
        if body.n is not None and body.n != 1:
            raise ServeError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")

    @staticmethod
    def top_k_of(body) -> int | None:
        """How many likeliest tokens a body asks log-probabilities for; None: none asked."""
        if isinstance(body, ChatCompletionRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise ServeError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            k, name = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
        else:
            k, name = body.logprobs, "logprobs"
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ServeError(400, f"{name} must be in 0..{MAX_TOP_LOGPROBS}, got {k}", param=name)
        return k

    def build(self, body: CommonFields, prompt, max_tokens: int | None, field: str, tool=None) -> Request:
        """A treespec `Request` from a body; bad values raise ServeError 400 naming the field.
        `tool`: the calls the answer may make (`tools.tool_plan`)."""
        self.check_text_size(prompt, field)
        logprobs = self.top_k_of(body)
        constraint = constraint_of(body, tool)
        check_compiles(constraint, self.tokenizer, self.engine)
        try:
            ids = encode_prompt(prompt, self.tokenizer)
            sampling = SamplingConfig(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k,
                top_p=1.0 if body.top_p is None else body.top_p,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                frequency_penalty=body.frequency_penalty or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
            )
            tree = self.settings.tree
            if "tree" in body.model_fields_set:
                if body.tree is None:
                    tree = None
                else:
                    given = body.tree.model_dump(exclude_none=True)
                    # fields on top of the server's fixed tree; on an automatic one, a tree of their own
                    fixed = tree is not None and not tree.auto
                    tree = dataclasses.replace(tree, **given) if fixed else TreeConfig(**given)
                    if tree.max_nodes > self.settings.max_tree_nodes:
                        raise ServeError(
                            400,
                            f"tree: up to {tree.max_nodes} draft nodes a round; this server allows "
                            f"{self.settings.max_tree_nodes} (--max-tree-nodes): lower width or depth",
                            param="tree",
                        )
            if max_tokens is None:  # as much as the context (and the KV budget) leaves
                max_tokens = self.room(len(ids), tree)
            given = "verification" in body.model_fields_set
            verification = body.verification if given else self.settings.verification
            stop = [body.stop] if isinstance(body.stop, str) else body.stop
            request = make_request(
                ids,
                self.tokenizer,
                stop=stop or None,
                max_new_tokens=max_tokens,
                tree=tree,
                sampling=sampling,
                seed=body.seed,
                verification=verification,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                trace=body.trace and body.stream,
                constraint=constraint,
            )
        except ValueError as e:
            raise bad_request(e, field) from None
        if request.stop_strings:  # their automaton, built here rather than on the event loop
            stop_set(request.stop_strings)
        return request

    def check_text_size(self, prompt, field: str) -> None:
        """Refuse a text (or chat) far beyond the context before tokenizing it: its bytes over
        the longest token's are fewer tokens than it has, whatever the tokenizer does."""
        if self.max_positions is None:
            return
        texts = (
            [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt if isinstance(m, dict)]
        )
        size = sum(len(t.encode("utf-8", "replace")) for t in texts if isinstance(t, str))
        most = TEXT_SLACK * self.token_bytes * self.max_positions
        if size > most:
            raise ServeError(
                400,
                f"{field}: {size} bytes of text, more than the model's {self.max_positions} "
                f"positions can hold (at most {most} bytes); shorten it",
                param=field,
            )

    def parse(self, raw: bytes, model):
        """A request body as `model` (a pydantic class); 400s as `treespec.serve.body` says."""
        return parse_body(raw, model, self.max_positions)

    def room(self, prompt_len: int, tree: TreeConfig | None) -> int:
        """The default max_tokens: what the context and `max_kv_tokens` leave after the prompt."""
        context = self.max_positions or DEFAULT_CONTEXT
        room = context - prompt_len
        budget = self.loop.status.max_kv_tokens
        if budget is not None:  # a request reserves prompt + max_tokens + its deepest tree
            room = min(room, budget - prompt_len - (0 if tree is None else tree.max_depth))
        if room < 1:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) leaves no room to generate in the model's {context} "
                f"positions" + (f" and max_kv_tokens={budget}" if budget is not None else "")
            )
        return room

    def chat_prompt(self, body: ChatCompletionRequest):
        """The prompt of a chat: the messages, rendered by the chat template when the tokenizer
        has one, else as "role: content" lines ending with "assistant:"."""
        if not body.messages:
            raise ServeError(400, "messages is empty; give at least one message", param="messages")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                content = content_text(content, i)
            if not isinstance(content, str):
                raise ServeError(400, f"messages[{i}].content must be text", param=f"messages[{i}].content")
            messages.append({"role": m.role, "content": content})
        try:
            check_chat(messages)  # the roles, as treespec.request checks every chat
        except ValueError as e:
            raise bad_request(e, "messages") from None
        if getattr(self.tokenizer, "chat_template", None):
            return messages
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    # ---- running a request -----------------------------------------------------------------
    async def submit(self, request: Request, arrival: float, body: CommonFields, field: str) -> Job:
        if self.draining or not self.loop.alive:
            self.metrics.reject(503)
            raise ServeError(503, "the server is shutting down", type="unavailable", code="shutting_down")
        limit, lanes = self.settings.max_queue, self.loop.status.max_live
        if limit is not None and self.loop.outstanding >= lanes + limit:
            self.metrics.reject(429)
            raise ServeError(
                429,
                f"the queue is full ({limit} requests waiting for {lanes} lanes); retry later",
                type="rate_limit_exceeded",
                code="queue_full",
            )
        fault = self.settings.faults and body.treespec_fault == "callback"
        job = Job(request, asyncio.get_running_loop(), arrival=arrival, fault=fault)
        try:
            job.waiter = asyncio.wrap_future(self.loop.submit(job))
            self.jobs.add(job)
            await job.waiter
        except ValueError as e:
            self.jobs.discard(job)
            raise bad_request(e, field) from None
        except RuntimeError as e:
            self.jobs.discard(job)
            self.metrics.reject(503)
            raise ServeError(503, str(e), type="unavailable") from None
        except asyncio.CancelledError:
            self.jobs.discard(job)
            if not job.cut:
                raise
            message = "the server shut down before the request started; retry"
            raise ServeError(503, message, type="unavailable", code="shutting_down") from None
        return job

    async def wait(self, job: Job, http: HTTPRequest) -> tuple[GenerationOutput | None, str | None]:
        """The finished output (and the error, if it failed); cancels if the client leaves
        (checked every DISCONNECT_POLL_S seconds, whether tokens are flowing or not)."""
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
                if item[0] == "done":
                    self.jobs.discard(job)
                    return item[1], item[2]
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_check:
                if await http.is_disconnected():
                    self.jobs.discard(job)
                    self.loop.cancel(job)
                    return None, "the client disconnected"
                next_check = time.monotonic() + DISCONNECT_POLL_S

    def failure(self, out: GenerationOutput | None, error: str | None) -> JSONResponse | None:
        """The answer to a non-streaming request that failed (`error`: 500) or that a shutdown
        cut (503; `out` None: cut by the server, `Server.cut`); None when it finished."""
        if error is not None:
            return JSONResponse(error_body(error, "server_error", None, "engine_error"), status_code=500)
        if out is None or (self.draining and out.finish_reason == "cancelled"):
            message = "the server shut down before the request finished; retry"
            return JSONResponse(error_body(message, "unavailable", None, "shutting_down"), status_code=503)
        return None

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs and the page's trees show it."""
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, ids: list[int], lp: TokenLogprobs) -> ChatLogprobs:
        """OpenAI's chat logprobs of the tokens `ids` (rows of `lp`)."""

        def entry(tid: int, logprob: float) -> dict:
            text = self.token_text(tid)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            TokenLogprob(
                **entry(tid, float(lp.token[i])),
                top_logprobs=[
                    TopLogprob(**entry(t, v)) for t, v in zip(lp.top_ids[i].tolist(), lp.top[i].tolist())
                ],
            )
            for i, tid in enumerate(ids)
        ]
        return ChatLogprobs(content=content)

    def completion_logprobs(self, ids: list[int], lp: TokenLogprobs, offset: int = 0) -> CompletionLogprobs:
        """OpenAI's completions logprobs of the tokens `ids`, their text starting at `offset`."""
        tokens = [self.token_text(tid) for tid in ids]
        offsets = list(itertools.accumulate(map(len, tokens), initial=offset))[: len(tokens)]
        tops = [
            {self.token_text(t): v for t, v in zip(lp.top_ids[i].tolist(), lp.top[i].tolist())}
            for i in range(len(ids))
        ]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=lp.token.tolist(), top_logprobs=tops, text_offset=offsets
        )

    def stats(self, out: GenerationOutput) -> TreespecStats:
        s = out.stats
        return TreespecStats(
            tokens_per_step=s.tokens_per_step,
            acceptance_rate=s.acceptance_rate,
            mean_accepted_length=s.mean_accepted_length,
            acceptance_by_depth=s.acceptance_by_depth,
            target_steps=s.target_steps,
            drafted_tokens=s.tree_nodes,
            accepted_tokens=s.accepted_tokens,
            verification=out.verification,
            finish_reason=out.finish_reason,
        )

    def usage(self, job: Job, token_ids: list[int]) -> Usage:
        prompt, completion = len(job.request.prompt), len(token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def stream(
        self, job: Job, chat: bool, include_usage: bool, special_text: dict[int, str] | None = None
    ):
        """The chunks of one request's stream, as dicts (OpenAI's chunk objects), then `DONE`;
        `sse_events` writes them as server-sent events. `special_text`: the special tokens its
        text shows, and as what (`TextStream`)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        text = TextStream(self.tokenizer, job.request.stop_strings, special_text)
        finished = False
        # with logprobs, a round's text waits for its log-probabilities (they follow its tokens)
        pending, offset = None, 0

        def chunk(delta: str | None = None, finish: str | None = None, logprobs=None, **extra) -> dict:
            if chat:
                d = ChatDelta(content=delta) if delta is not None else ChatDelta()
                body = ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self.model_name,
                    choices=[ChatChunkChoice(delta=d, logprobs=logprobs, finish_reason=finish)],
                    **extra,
                )
            else:
                body = CompletionResponse(
                    id=rid,
                    created=created,
                    model=self.model_name,
                    choices=[CompletionChoice(text=delta or "", logprobs=logprobs, finish_reason=finish)],
                    **extra,
                )
            return body.model_dump(exclude_none=True)

        try:
            if chat:
                first = ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self.model_name,
                    choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
                )
                yield first.model_dump(exclude_none=True)
            while True:
                item = await job.queue.get()
                if item[0] == "tokens":
                    delta = text.feed(item[1])
                    if job.request.logprobs is not None:
                        pending = (delta, item[1])
                    elif delta:
                        yield chunk(delta)
                    continue
                if item[0] == "round":
                    drawn = round_to_json(item[1], self.token_text)
                    kind = ChatCompletionChunk if chat else CompletionResponse
                    body = kind(
                        id=rid, created=created, model=self.model_name, choices=[], treespec_round=drawn
                    )
                    yield body.model_dump(exclude_none=True)
                    continue
                if item[0] == "logprobs":
                    (delta, ids), lp = pending, item[1]
                    if chat:
                        yield chunk(delta, logprobs=self.chat_logprobs(ids, lp))
                    else:
                        logprobs = self.completion_logprobs(ids, lp, offset)
                        offset += sum(map(len, logprobs.tokens))
                        yield chunk(delta, logprobs=logprobs)
                    continue
                finished = True
                out, error = item[1], item[2]
                if error is not None:
                    yield error_body(error, "server_error", None, "engine_error")
                    break
                ids = text.ids if out is None else out.token_ids  # None: cut at a shutdown
                rest = text.finish(ids)
                if rest:
                    yield chunk(rest)
                if out is None:
                    yield chunk(finish="cancelled")
                else:
                    yield chunk(finish=openai_finish_reason(out.finish_reason), treespec=self.stats(out))
                if include_usage:
                    usage = self.usage(job, ids)
                    if chat:
                        body = ChatCompletionChunk(
                            id=rid, created=created, model=self.model_name, choices=[], usage=usage
                        )
                    else:
                        body = CompletionResponse(
                            id=rid, created=created, model=self.model_name, choices=[], usage=usage
                        )
                    yield body.model_dump(exclude_none=True)
                break
            yield DONE
        finally:
            self.jobs.discard(job)
            if not finished:  # the client went away (or the server is cancelling the stream)
                self.loop.cancel(job)


def _after(seconds: float, fn, *args) -> None:
    timer = threading.Timer(seconds, fn, args)
    timer.daemon = True
    timer.start()


def _call_soon(aloop: asyncio.AbstractEventLoop, fn) -> None:
    try:
        aloop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop is closed: nothing left to answer
        pass


def create_app(
    engine: Engine,
    tokenizer,
    model_name: str = "treespec",
    settings: ServeSettings | None = None,
    grace_period: float = 30.0,
) -> FastAPI:
    """The app serving `engine` (it steps it on a thread of its own from startup to shutdown;
    on shutdown whatever is still running is cancelled)."""
    if settings is None:
        settings = ServeSettings(faults=os.environ.get("TREESPEC_SERVE_FAULTS") == "1")
    srv = Server(engine, tokenizer, model_name, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.aloop = asyncio.get_running_loop()
        srv.loop.start()
        try:
            yield
        finally:
            srv.draining = True
            srv.cut()  # anything still open (none after a graceful shutdown) is answered now
            if not await asyncio.to_thread(srv.loop.stop, STOP_WAIT_S):
                log.warning("the engine thread is still in a step %g s after the shutdown", STOP_WAIT_S)
            srv.prepare.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="treespec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv
    app.state.page_html = PAGE.read_text(encoding="utf-8")  # read once: every GET / serves the same page
    app.add_middleware(
        Guard,
        api_keys=settings.api_keys,
        max_body_bytes=settings.max_body_bytes,
        read_timeout=settings.read_timeout,
    )
    if settings.allowed_origins:  # outside the guard: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    for error, handler in ERROR_HANDLERS:
        app.add_exception_handler(error, handler)
    app.include_router(routes.pages)
    app.include_router(routes.api)
    return app
