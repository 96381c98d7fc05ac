"""Constrained decoding: JSON schemas, regexes, choices and grammars (docs/structured.md).

`spec` holds the constraint kinds (typed, validated on construction), `grammar` the grammar
engine's view of a tokenizer (llguidance) and `matcher` a request's grammar state over a tree.
"""

from .grammar import GrammarVocabulary
from .matcher import (
    DRAFTER_MIN_SPEEDUP,
    FORCED_EXTRA,
    LOOKUP_DEPTH,
    LOOKUP_MIN_MATCH,
    TreeMatcher,
    drafted_walk,
)
from .spec import Choice, Constraint, Grammar, JsonObject, JsonSchema, Regex, constraint_from

__all__ = [
    "FORCED_EXTRA",
    "DRAFTER_MIN_SPEEDUP",
    "LOOKUP_DEPTH",
    "LOOKUP_MIN_MATCH",
    "drafted_walk",
    "Choice",
    "Constraint",
    "Grammar",
    "GrammarVocabulary",
    "JsonObject",
    "JsonSchema",
    "Regex",
    "TreeMatcher",
    "constraint_from",
]
