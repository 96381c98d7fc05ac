"""The grammar engine's view of a tokenizer, and matchers for constraints (llguidance).

`GrammarVocabulary.of(tokenizer, vocab_size, eos)` maps a tokenizer once (a Hugging Face fast
tokenizer, or any object with `tokens` (one bytes string per id), `eos_token_id` and a call that
tokenizes bytes: the toy vocabularies of the tests) and is cached per tokenizer. `matcher()`
starts a fresh llguidance matcher for a constraint; the checked grammar text is cached per
(constraint, vocabulary), so a schema is validated against a tokenizer once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from .spec import Constraint

_LOCK = threading.Lock()
_VOCABS: dict[int, tuple[object, GrammarVocabulary]] = {}  # id(tokenizer) -> (tokenizer, its vocabulary)
_CHECKED: OrderedDict[tuple[str, int], str] = OrderedDict()  # (grammar, id(vocab)) -> "" or an error
CACHE_SIZE = 256


@dataclass(frozen=True, eq=False)
class GrammarVocabulary:
    """A tokenizer as llguidance sees it, for a model with `size` logit rows (ids at or above
    the tokenizer's own size are never allowed)."""

    tokenizer: llguidance.LLTokenizer
    size: int
    eos: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer, size: int, eos: frozenset[int] | tuple[int, ...] = ()) -> GrammarVocabulary:
        """The vocabulary of `tokenizer` (cached per tokenizer object); ValueError if this
        tokenizer cannot be mapped."""
        with _LOCK:
            hit = _VOCABS.get(id(tokenizer))
            if hit is not None and hit[0] is tokenizer and hit[1].size == size:
                return hit[1]
        eos = tuple(sorted(eos)) or tuple(
            e for e in [getattr(tokenizer, "eos_token_id", None)] if e is not None
        )
        if tokenizer is None:
            raise ValueError("a constraint needs the model's tokenizer to map grammar bytes to token ids")
        try:
            if hasattr(tokenizer, "backend_tokenizer"):  # a Hugging Face fast tokenizer
                lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=list(eos) or None)
            elif hasattr(tokenizer, "tokens") and hasattr(tokenizer, "eos_token_id"):
                lltok = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(tokenizer),
                    n_vocab=size,
                    eos_token=list(eos) or None,
                    slices=[],
                )
            else:
                raise TypeError("neither a Hugging Face fast tokenizer nor a token list")
        except Exception as e:  # noqa: BLE001 - whatever the mapping failed on, said once
            raise ValueError(
                f"constraints cannot map this tokenizer ({type(tokenizer).__name__}) to token bytes: {e}"
            ) from None
        vocab = cls(lltok, size, eos)
        with _LOCK:
            _VOCABS[id(tokenizer)] = (tokenizer, vocab)
        return vocab

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for `constraint` at the start of the output; ValueError if the
        constraint does not compile against this vocabulary."""
        key = (constraint.grammar, id(self))
        with _LOCK:
            error = _CHECKED.get(key)
        if error is None:
            error = llguidance.LLMatcher.validate_grammar(constraint.grammar, self.tokenizer)
            with _LOCK:
                _CHECKED[key] = error
                while len(_CHECKED) > CACHE_SIZE:
                    _CHECKED.popitem(last=False)
        if error:
            raise ValueError(f"invalid {constraint.describe()}: {error.strip().splitlines()[0]}")
        m = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {constraint.describe()}: {m.get_error()}")
        return m

    def single(self, bitmask: bytes) -> int | None:
        """The one token id llguidance's bitmask allows, or None (none, or several)."""
        words = np.frombuffer(bitmask, dtype="<u4")  # bit i of word w: token 32 w + i
        nonzero = np.flatnonzero(words)
        if nonzero.size != 1:
            return None
        word = int(words[nonzero[0]])
        if word & (word - 1):
            return None
        token = int(nonzero[0]) * 32 + word.bit_length() - 1
        return token if token < self.size else None

    def unpack(self, bitmask: bytes) -> torch.Tensor:
        """[size] bool: llguidance's bitmask (one bit per token id, little-endian words)."""
        bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
        out = np.zeros(self.size, dtype=bool)
        n = min(self.size, len(bits))
        out[:n] = bits[:n]
        return torch.from_numpy(out)
