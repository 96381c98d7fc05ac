"""Structured outputs on the wire: which constraint a request body asks for, and tool calls.

    response_format     {"type": "text"} | {"type": "json_object"} |
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  (OpenAI)
    structured_outputs  {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}  (vLLM)
    tools + tool_choice the calls the output may make (treespec.serve.tools.ToolPlan): a named
                        function's arguments, valid under its `parameters`; or, with "required"
                        and several tools or with "auto", a grammar of one call (or free text)

A body that asks for a constraint in two ways, or for one that does not compile, is a 400
naming the field, before any work.
"""

from __future__ import annotations

from ..constraints import Constraint, GrammarVocabulary, JsonObject, JsonSchema, constraint_from
from .errors import ServeError


def constraint_of(body, tools=None) -> Constraint | None:
    """The constraint of a request body (None: none); `tools` (a `treespec.serve.tools.ToolPlan`,
    when the body lets the model call) gives the calls' constraint."""
    asked = []
    if tools is not None:
        try:
            asked.append(("tool_choice", tools.constraint()))
        except ValueError as e:
            names = ", ".join(fn["name"] for fn in tools.functions)
            raise ServeError(400, f"tools: the parameters of {names}: {e}", param="tools") from None
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


def check_compiles(constraint: Constraint | None, tokenizer, engine) -> None:
    """Compile `constraint` for the served tokenizer now (cached), so that one that cannot is
    a 400 before the request is queued."""
    if constraint is None:
        return
    try:
        GrammarVocabulary.of(tokenizer, engine.vocab_size, engine.eos_token_ids).matcher(constraint)
    except ValueError as e:
        raise ServeError(400, str(e), param="response_format") from None
