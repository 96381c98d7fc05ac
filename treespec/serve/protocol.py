"""The wire format: OpenAI-style request and response bodies, and the error body.

Requests are checked in two layers. Pydantic checks the JSON types here (a string where a
number goes, an unknown `tree` key); treespec's own classes check the values (`Request`,
`SamplingConfig`, `TreeConfig`, `Engine.add`), and their ValueError messages, which name the
field, become 400 answers with `param` set (`error_param`). Fields OpenAI defines that treespec
cannot honour (n > 1, echo, best_of, suffix, logit_bias, response_format or structured_outputs
with a tool call, an assistant message whose content is not text (tool_calls in the history),
...: the list is `treespec.serve.body.UNSUPPORTED`) are refused with a 400, never silently
ignored; fields OpenAI clients send that change nothing here (user, stream_options'
other keys, parallel_tool_calls: an answer makes one call at most, ...) are accepted and
ignored.

treespec's own settings ride in extra body fields (the openai client's `extra_body=`):
`tree` ({width, depth, strategy} or null for plain decoding), `verification`, `ignore_eos`,
`top_k`, `repetition_penalty`. Responses carry the round statistics in an extra field
`treespec`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema


class ServeError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ----------------------------------------------------------------------------------
class TreeSpec(BaseModel):
    """The draft tree of one request (treespec.TreeConfig); missing fields take the server's."""

    model_config = ConfigDict(extra="forbid", strict=True)
    width: int | None = None
    depth: int | None = None
    strategy: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class CommonFields(BaseModel):
    """Fields both endpoints take. Strict: a wrong JSON type is a 400 naming the field, never
    converted ("5", 4.0 or true for an integer; "yes" for a boolean)."""

    # extra fields are kept (`model_extra`) for `treespec.serve.body.check_supported`, else ignored
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # treespec's own (extra body fields)
    tree: TreeSpec | None = None  # absent: the server's default tree; null: plain decoding
    verification: str | None = None
    ignore_eos: bool = False
    trace: bool = False  # streaming: a chunk with each round's draft tree (`treespec_round`)
    top_k: int | None = None
    repetition_penalty: float | None = None
    # structured outputs (treespec.serve.structured): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # tests only, honoured with TREESPEC_SERVE_FAULTS=1: "callback" makes the request fail in the engine
    treespec_fault: SkipJsonSchema[str | None] = None  # never in a schema


class CompletionRequest(CommonFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the sampled token's log p and this many of the likeliest
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # the sampled token's log p ...
    top_logprobs: int | None = None  # ... and this many of the likeliest (needs logprobs)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


# ---- responses ---------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TreespecStats(BaseModel):
    """The request's round statistics (treespec.GenerationStats), in the extra field `treespec`."""

    tokens_per_step: float
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_depth: list[float]
    target_steps: int
    drafted_tokens: int
    accepted_tokens: int
    verification: str
    finish_reason: str  # treespec's own: eos, length, stop, cancelled, error


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's chat `logprobs`: one entry per generated token."""

    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """OpenAI's (legacy) completions `logprobs`: parallel lists over the generated tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    treespec: TreespecStats | None = None
    treespec_round: dict | None = None  # a round's tree (treespec.trace.round_to_json), with "trace"


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    treespec: TreespecStats | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # streamed calls (treespec.serve.tools)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    treespec: TreespecStats | None = None
    treespec_round: dict | None = None  # a round's tree (treespec.trace.round_to_json), with "trace"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "treespec"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- finish reasons and errors -----------------------------------------------------------------
def openai_finish_reason(reason: str) -> str:
    """treespec's finish reason as OpenAI's: EOS and stop strings are "stop"; a request cut
    short by the server (shutdown) keeps "cancelled"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)


# ValueError messages from treespec name the field; the first pattern found gives `param`.
_PARAMS: tuple[tuple[str, str], ...] = (
    (r"\bmax_new_tokens\b|\bmax_kv_tokens\b|KV cache slots", "max_tokens"),
    (r"\bverification\b", "verification"),
    (r"\btree\.\w+|\bTreeConfig\.\w+", ""),  # filled from the match
    (r"\btree\b", "tree"),
    (r"\btemperature\b", "temperature"),
    (r"\btop_p\b", "top_p"),
    (r"\btop_k\b", "top_k"),
    (r"\brepetition_penalty\b", "repetition_penalty"),
    (r"\bfrequency_penalty\b", "frequency_penalty"),
    (r"\bpresence_penalty\b", "presence_penalty"),
    (r"\bseed\b", "seed"),
    (r"\bstop\b", "stop"),
    (r"\bignore_eos\b", "ignore_eos"),
    (r"\bmessage \d+|\bchat\b|\brole\b", "messages"),
    (r"\bprompt\b", "prompt"),
)


def error_param(message: str, prompt_field: str = "prompt") -> str | None:
    """The request field a treespec ValueError message is about (None if it names none)."""
    m = re.search(r"\bmessage (\d+): (role)?", message)  # treespec.request.check_chat
    if m:
        return f"messages[{m.group(1)}].{m.group(2) or 'content'}"
    for pattern, param in _PARAMS:
        m = re.search(pattern, message)
        if m:
            if not param:
                return "tree." + m.group(0).split(".")[1]
            return prompt_field if param == "prompt" else param
    return None


def client_message(message: str) -> str:
    """A treespec message in the API's words (max_tokens, tree.width)."""
    return message.replace("max_new_tokens", "max_tokens").replace("TreeConfig.", "tree.")


DONE = "[DONE]"  # a stream's last event


async def sse_events(events):
    """A stream's chunks (dicts, then `DONE`) as server-sent events."""
    try:
        async for event in events:
            yield (
                "data: [DONE]\n\n" if event is DONE else f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            )
    finally:
        await events.aclose()
