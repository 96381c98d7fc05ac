"""The server's routes, on two routers that `create_app` includes; each handler finds the app's
`Server` (treespec.serve.app) on `app.state.server`.

    pages   GET /          the chat page (page.html; read once, kept on `app.state.page_html`)
            GET /health    200 while the engine thread runs, 503 otherwise
            GET /metrics   Prometheus text format
    api     GET  /v1/models, POST /v1/completions, POST /v1/chat/completions (OpenAI's)
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter
from fastapi.requests import Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..output import TextStream
from .protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    ServeError,
    error_body,
    openai_finish_reason,
    sse_events,
)
from .tools import tool_plan, tool_stream

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

pages = APIRouter()
api = APIRouter()


@pages.get("/", response_class=HTMLResponse)
async def page(http: HTTPRequest):
    """A chat with the served model, each round's draft tree drawn as it is verified
    (page.html: the public API with "trace": true, no build step, no CDN)."""
    return HTMLResponse(http.app.state.page_html)


@pages.get("/health")
async def health(http: HTTPRequest):
    srv = http.app.state.server
    if srv.loop.alive and not srv.draining:
        return {"status": "ok"}
    return JSONResponse(error_body("the engine is not running", "unavailable"), status_code=503)


@pages.get("/metrics")
async def metrics(http: HTTPRequest):
    srv = http.app.state.server
    return Response(srv.metrics.render(), media_type=srv.metrics.content_type)


@api.get("/v1/models")
async def models(http: HTTPRequest):
    srv = http.app.state.server
    card = ModelCard(id=srv.model_name, created=srv.created, max_model_len=srv.max_positions)
    return ModelList(data=[card]).model_dump()


def completion_prompt(body: CompletionRequest):
    """The one prompt of a completions body (text or token ids); ServeError 400 for what is
    not supported (echo, best_of, suffix, several prompts, no tokens)."""
    for name, bad in (
        ("echo", body.echo),
        ("best_of", (body.best_of or 1) != 1),
        ("suffix", body.suffix),
    ):
        if bad:
            raise ServeError(400, f"{name} is not supported", param=name)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ServeError(400, f"give one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
        raise ServeError(400, "the prompt is empty; give at least one token", param="prompt")
    return prompt


@api.post("/v1/completions")
async def completions(http: HTTPRequest):
    arrival = time.perf_counter()
    srv = http.app.state.server
    body = srv.parse(await http.body(), CompletionRequest)
    srv.check_common(body)
    prompt = completion_prompt(body)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    request = await srv.off_loop(srv.build, body, prompt, max_tokens, "prompt")
    job = await srv.submit(request, arrival, body, "prompt")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            sse_events(srv.stream(job, False, include_usage)), media_type="text/event-stream"
        )
    out, error = await srv.wait(job, http)
    if (failed := srv.failure(out, error)) is not None:
        return failed
    logprobs = None if out.logprobs is None else srv.completion_logprobs(out.token_ids, out.logprobs)
    return CompletionResponse(
        id="cmpl-" + uuid.uuid4().hex,
        created=int(time.time()),
        model=srv.model_name,
        choices=[
            CompletionChoice(
                text=TextStream(srv.tokenizer, request.stop_strings).finish(out.token_ids),
                logprobs=logprobs,
                finish_reason=openai_finish_reason(out.finish_reason),
            )
        ],
        usage=srv.usage(job, out.token_ids),
        treespec=srv.stats(out),
    ).model_dump()


@api.post("/v1/chat/completions")
async def chat_completions(http: HTTPRequest):
    arrival = time.perf_counter()
    srv = http.app.state.server
    body = srv.parse(await http.body(), ChatCompletionRequest)
    srv.check_common(body)
    tools = tool_plan(body.tools, body.tool_choice, srv.tokenizer)
    special_text = None if tools is None else tools.special_text
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    def prepare():
        prompt = srv.chat_prompt(body) if tools is None else tools.prompt(srv, body)
        return srv.build(body, prompt, max_tokens, "messages", tools)

    request = await srv.off_loop(prepare)
    job = await srv.submit(request, arrival, body, "messages")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = srv.stream(job, True, include_usage, special_text)
        if tools is not None:
            events = tool_stream(events, tools.reader())
        return StreamingResponse(sse_events(events), media_type="text/event-stream")
    out, error = await srv.wait(job, http)
    if (failed := srv.failure(out, error)) is not None:
        return failed
    text = TextStream(srv.tokenizer, request.stop_strings, special_text).finish(out.token_ids)
    finish = openai_finish_reason(out.finish_reason)
    message = ChatResponseMessage(content=text)
    if tools is not None:
        message, finish = tools.answer(text, finish)
    return ChatCompletionResponse(
        id="chatcmpl-" + uuid.uuid4().hex,
        created=int(time.time()),
        model=srv.model_name,
        choices=[
            ChatChoice(
                message=message,
                logprobs=None if out.logprobs is None else srv.chat_logprobs(out.token_ids, out.logprobs),
                finish_reason=finish,
            )
        ],
        usage=srv.usage(job, out.token_ids),
        treespec=srv.stats(out),
    ).model_dump()
