"""Constraints as data: what a request's output must match, checked when it is made.

Each kind turns into one grammar for the grammar engine (llguidance, `treespec.constraints.
grammar`): a JSON schema, any JSON object, a regular expression, a choice among strings, or a
grammar in Lark or GBNF. A constraint that cannot compile (an invalid schema, regex or grammar)
raises ValueError on construction, before any work. `constraint_from` reads the forms front ends
take (a dict, a pydantic model class, a keyword).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

SYNTAXES = ("lark", "gbnf")
# JSON as json.dumps writes it: no free whitespace (a model that may pad with whitespace can pad
# forever), ", " and ": " between items; a schema's "x-guidance" options override these
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Constraint:
    """A constraint on a request's output; `grammar` is its llguidance grammar, validated."""

    grammar: str

    def describe(self) -> str:
        """One line for errors and logs."""
        return type(self).__name__

    def _set_grammar(self, grammar: str) -> None:
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"invalid {self.describe()}: {error.strip().splitlines()[0]}")
        object.__setattr__(self, "grammar", grammar)


@dataclass(frozen=True)
class JsonSchema(Constraint):
    """The output is JSON that validates against `schema` (a dict, or its JSON text)."""

    schema: Any
    name: str | None = None  # OpenAI's json_schema.name (informative)
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping) and not isinstance(schema, bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        object.__setattr__(self, "schema", json.dumps(schema))  # hashable; property order kept
        self._set_grammar(LLMatcher.grammar_from_json_schema(self.schema, defaults=JSON_OPTIONS))

    def describe(self) -> str:
        return "JSON schema" + (f" {self.name!r}" if self.name else "")


@dataclass(frozen=True)
class JsonObject(Constraint):
    """The output is a JSON object (OpenAI's `response_format={"type": "json_object"}`)."""

    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._set_grammar(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))

    def describe(self) -> str:
        return "JSON object"


@dataclass(frozen=True)
class Regex(Constraint):
    """The output matches `pattern` as a whole (Rust `regex` syntax, anchored at both ends)."""

    pattern: str
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"a regex must be a non-empty string, got {self.pattern!r}")
        self._set_grammar(LLMatcher.grammar_from_regex(self.pattern))

    def describe(self) -> str:
        return f"regex {self.pattern!r}"


@dataclass(frozen=True)
class Choice(Constraint):
    """The output is exactly one of `options`."""

    options: tuple[str, ...]
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        options = (self.options,) if isinstance(self.options, str) else tuple(self.options)
        if not options or any(not isinstance(o, str) or not o for o in options):
            raise ValueError(f"choice needs one or more non-empty strings, got {self.options!r}")
        object.__setattr__(self, "options", options)
        self._set_grammar("start: " + " | ".join(json.dumps(o) for o in options))

    def describe(self) -> str:
        return f"choice among {len(self.options)} strings"


@dataclass(frozen=True)
class Grammar(Constraint):
    """The output is a sentence of a context-free grammar: Lark (llguidance's dialect, with
    `start` as its start rule) or GBNF (llama.cpp's, with `root`)."""

    text: str
    syntax: str = "lark"
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.syntax not in SYNTAXES:
            raise ValueError(f"grammar syntax must be one of {', '.join(SYNTAXES)}, got {self.syntax!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError("the grammar is empty")
        text = self.text
        if self.syntax == "gbnf":
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 - the converter's own parse errors
                raise ValueError(f"invalid GBNF grammar: {e}") from None
        self._set_grammar(LLMatcher.grammar_from_lark(text))

    def describe(self) -> str:
        return f"{self.syntax} grammar"


def constraint_from(value) -> Constraint | None:
    """A `Constraint` from what a user passes: a Constraint, None, a pydantic model class (its
    JSON schema), or a dict with one key: {"json_schema": ...}, {"json": ...} (a schema, or
    "object" for any object), {"regex": ...}, {"choice": [...]}, {"grammar": ..., "syntax":
    "lark" | "gbnf"} (GBNF is recognised by its `::=` when no syntax is given)."""
    if value is None or isinstance(value, Constraint):
        return value
    schema_of = getattr(value, "model_json_schema", None)
    if isinstance(value, type) and callable(schema_of):  # a pydantic model class
        return JsonSchema(schema_of(), name=value.__name__)
    if not isinstance(value, Mapping):
        raise ValueError(
            f"constraint must be a treespec.constraints.Constraint, a pydantic model class or a dict "
            f"such as {{'json_schema': {{...}}}}, {{'regex': '...'}}, {{'choice': [...]}}, "
            f"{{'grammar': '...'}}; got {type(value).__name__}"
        )
    kinds = [k for k in ("json_schema", "json", "regex", "choice", "grammar") if k in value]
    extra = set(value) - set(kinds) - {"syntax", "name"}
    if len(kinds) != 1 or extra:
        raise ValueError(
            f"a constraint dict takes exactly one of json_schema, json, regex, choice, grammar, got "
            f"{sorted(value)}"
        )
    kind, arg = kinds[0], value[kinds[0]]
    if kind in ("json_schema", "json"):
        return JsonObject() if arg == "object" else JsonSchema(arg, name=value.get("name"))
    if kind == "regex":
        return Regex(arg)
    if kind == "choice":
        if isinstance(arg, str) or not isinstance(arg, Sequence):
            raise ValueError(f"choice takes a list of strings, got {arg!r}")
        return Choice(tuple(arg))
    syntax = value.get("syntax") or ("gbnf" if isinstance(arg, str) and "::=" in arg else "lark")
    return Grammar(arg, syntax)
