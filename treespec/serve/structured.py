"""Structured outputs on the wire: which constraint a request body asks for, and tool calls.

    response_format     {"type": "text"} | {"type": "json_object"} |
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  (OpenAI)
    structured_outputs  {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}  (vLLM)
    tools + tool_choice {"type": "function", "function": {"name": ...}} (or "required" with one
                        tool): the output is that function's arguments, valid under its
                        `parameters`, answered as `tool_calls`

A body that asks for a constraint in two ways, or for one that does not compile, is a 400
naming the field, before any work.
"""

from __future__ import annotations

import json
import uuid

from ..constraints import Constraint, GrammarVocabulary, JsonObject, JsonSchema, constraint_from
from .errors import ServeError


def constraint_of(body, tools: dict | None = None) -> Constraint | None:
    """The constraint of a request body (None: none); `tools` (the called function, when the
    body names one) takes its parameters' schema."""
    asked = []
    if tools is not None:
        try:
            asked.append(
                ("tool_choice", JsonSchema(tools.get("parameters") or {"type": "object"}, tools["name"]))
            )
        except ValueError as e:
            raise ServeError(400, f"tools: {tools['name']}'s parameters: {e}", param="tools") from None
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        asked.append(("response_format", _response_format(fmt)))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        try:
            given = {k: v for k, v in so.items() if v is not None}
            asked.append(("structured_outputs", constraint_from(given) if given else None))
        except ValueError as e:
            raise ServeError(400, f"structured_outputs: {e}", param="structured_outputs") from None
    asked = [(field, c) for field, c in asked if c is not None]
    if len(asked) > 1:
        raise ServeError(
            400,
            f"one constraint per request: got {' and '.join(f for f, _ in asked)}",
            param=asked[1][0],
        )
    return asked[0][1] if asked else None


def _response_format(fmt) -> Constraint | None:
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise ServeError(400, "response_format must be an object with a type", param="response_format")
    kind = fmt["type"]
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return JsonObject()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError("json_schema must be an object with a schema")
            return JsonSchema(spec["schema"], name=spec.get("name"))
    except ValueError as e:
        raise ServeError(400, f"response_format: {e}", param="response_format") from None
    raise ServeError(
        400,
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def called_tool(tools, tool_choice) -> dict | None:
    """The function a chat body makes the model call ({"name", "parameters"}), or None when
    it calls none ("none", or no tools); "auto" cannot be honoured exactly and is refused."""
    if tool_choice == "none":
        return None
    if not tools:
        if tool_choice is None:
            return None
        raise ServeError(400, "tool_choice needs tools: give the functions in tools", param="tool_choice")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ServeError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}",
                             param=f"tools[{i}]")  # fmt: skip
        functions[fn["name"]] = fn
    if tool_choice == "required" and len(functions) == 1:
        return next(iter(functions.values()))
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in functions:
            raise ServeError(
                400, f"tool_choice names {name!r}, which is not among tools", param="tool_choice"
            )
        return functions[name]
    raise ServeError(
        400,
        "tool_choice must name a function ({'type': 'function', 'function': {'name': ...}}), or be "
        "'required' with one tool, or 'none'; 'auto' is not supported",
        param="tool_choice",
    )


def check_compiles(constraint: Constraint | None, tokenizer, engine) -> None:
    """Compile `constraint` for the served tokenizer now (cached), so that one that cannot is
    a 400 before the request is queued."""
    if constraint is None:
        return
    try:
        GrammarVocabulary.of(tokenizer, engine.vocab_size, engine.eos_token_ids).matcher(constraint)
    except ValueError as e:
        raise ServeError(400, str(e), param="response_format") from None


def tool_calls(function: dict, text: str) -> list[dict]:
    """The `tool_calls` of an answer whose text is the function's arguments (JSON)."""
    try:
        arguments = json.dumps(json.loads(text))
    except ValueError:
        arguments = text  # cut short (max_tokens): as generated
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }
    ]
