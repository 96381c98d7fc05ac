"""Reading a request body: JSON within limits, then the pydantic model, then what the model
lets through but treespec cannot honour. Everything here is a 400 in OpenAI's shape naming the
field, never a 500 and never a silent ignore:

- JSON that is not JSON, nests deeper than MAX_JSON_DEPTH (a 5,000-deep array raised Python's
  RecursionError), or holds text that is not Unicode (a lone surrogate escape, "\\udc00": it
  cannot be encoded, and failed wherever the text was used);
- lists the context cannot hold (token ids, messages) and more stop strings than a request
  may give, refused by their length before pydantic walks them (a huge list validated on the
  event loop holds every stream);
- fields other servers define that would change the output and that treespec does not do
  (`UNSUPPORTED`: logit_bias, functions, vLLM's guided_* ...); fields that change nothing here
  (user, metadata, store, ...) and unknown ones are accepted and ignored, as OpenAI's own API
  does;
- a chat content part that is not {"type": "text", "text": "..."}.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ..request import MAX_STOP_STRINGS, check_stop_strings
from .protocol import ServeError

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; a JSON schema rarely nests 15

# field -> the values that are no-ops (accepted); any other value is a 400 naming the field
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "functions": (None, []),  # OpenAI's legacy function calling: use tools + tool_choice
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    # vLLM's sampling extras
    "guided_json": (None,),  # vLLM's older structured outputs: use structured_outputs / response_format
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "echo": (None, False),  # chat (completions answers its own `echo`)
}

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a decoded str, any surrogate is a lone one


def load_json(raw: bytes):
    """The JSON value of a body; ServeError 400 for bytes that are not JSON (or nest past
    Python's recursion limit)."""
    try:
        return json.loads(raw) if raw.strip() else None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        raise ServeError(400, f"the request body is not valid JSON: {e}") from None


def _too_deep() -> ServeError:
    return ServeError(
        400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep; flatten it"
    )


def check_json(raw: bytes, data) -> None:
    """ServeError 400 for JSON nesting deeper than MAX_JSON_DEPTH or a lone surrogate
    anywhere in its text (`data`: `raw` loaded)."""
    # a depth past the limit needs that many brackets: most bodies skip the scan
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper(raw, MAX_JSON_DEPTH):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(data)) is not None:
        raise ServeError(
            400,
            f"{where or 'the request body'}: a lone surrogate (\\ud800-\\udfff) is not Unicode text; "
            "send valid UTF-8 (a character outside the BMP is a surrogate pair)",
            param=where or None,
        )


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_PAIR = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _deeper(raw: bytes, limit: int) -> bool:
    """Whether JSON `raw` (valid) nests arrays and objects more than `limit` deep: its brackets
    alone, the innermost pairs removed once per level (C loops, never a walk of every value in
    Python: a body of 120k messages is checked in milliseconds)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        brackets, n = _PAIR.subn(b"", brackets)
        if not brackets:
            return False
    return True


def _lone_surrogate(data) -> str | None:
    """The path ("messages[0].content") of the first text holding a lone surrogate; None if none."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                key = k if isinstance(k, str) else str(k)
                if _SURROGATE.search(key):
                    return path or ""
                stack.append((v, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def parse_body(raw: bytes, model, max_positions: int | None):
    """A request body as `model` (a pydantic class), everything above checked first."""
    data = load_json(raw)
    if not isinstance(data, dict):  # empty, or JSON that is not an object
        raise ServeError(400, "the request body must be a JSON object (Content-Type: application/json)")
    if max_positions is not None:
        prompt, messages = data.get("prompt"), data.get("messages")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        for field, items, what in (("prompt", prompt, "tokens"), ("messages", messages, "messages")):
            if isinstance(items, list) and len(items) > max_positions:
                raise ServeError(
                    400,
                    f"{field}: {len(items)} {what}, more than the model's {max_positions} "
                    "positions can hold; shorten it",
                    param=field,
                )
    stop = data.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        try:
            check_stop_strings(stop)
        except ValueError as e:
            raise ServeError(400, str(e), param="stop") from None
    check_json(raw, data)  # after the cheap refusals by length
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    check_supported(body)
    return body


def check_supported(body) -> None:
    """ServeError 400 naming the first field of `UNSUPPORTED` with a value that is not a no-op."""
    for name, value in (body.model_extra or {}).items():
        noops = UNSUPPORTED.get(name)
        if noops is not None and not any(value == ok and type(value) is type(ok) for ok in noops):
            raise ServeError(400, f"{name} is not supported by this server; leave it out", param=name)


def content_text(content: list, i: int) -> str:
    """The text of a chat message's content parts (`messages[i].content`): text parts only."""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ServeError(400, "only text content parts are supported", param=f"messages[{i}].content")
        text = part.get("text")
        if not isinstance(text, str):
            param = f"messages[{i}].content[{j}].text"
            raise ServeError(400, f"{param} must be a string, got {type(text).__name__}", param=param)
        texts.append(text)
    return "".join(texts)
