"""What a generation hands back, and the plumbing that builds it round by round.

OutputBuilder      a sequence's new tokens: length limit, EOS, stops, streaming callback
StopMatcher        stop strings (matched on decoded text across rounds) and stop token ids
StopSet            many stop strings as one automaton: where one begins, what may still become one
GenerationOutput   the result: tokens, their sources, stats, text, finish reason, trace
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from .stats import GenerationStats

if TYPE_CHECKING:
    from .trace import RoundTrace

# How an emitted token was produced:
#   accepted   - a draft token the target accepted
#   correction - drawn from the residual after every proposal at a node was rejected
#   bonus      - drawn from the target's p at a leaf (or at the root of a tree=None step)
TokenSource = Literal["accepted", "correction", "bonus"]


OnTokens = Callable[[list[int], list[TokenSource]], None]
# Why a sequence ended: EOS, its length limit, a stop string or id, cancel(), or an error of its own
FinishReason = Literal["eos", "length", "stop", "cancelled", "error"]


class StopSet:
    """Stop strings as one automaton, so that a check costs what the text costs, not what the
    number of strings does: a regex over their trie (common prefixes shared, every branch
    starting with its own character, so a position is ruled out after one character whatever
    the count) finds the first; a sorted list answers which tail of a text may still grow into
    one (a binary search per candidate start, the candidates being the last `longest` - 1
    characters that begin some stop string)."""

    def __init__(self, strings: Sequence[str]):
        self.strings = tuple(strings)
        self.longest = max(map(len, self.strings), default=0)
        self._sorted = sorted(set(self.strings))
        self._firsts = frozenset(x[0] for x in self._sorted if x)
        self._any = _trie_regex(self._sorted) if self._sorted else None

    def search(self, text: str, start: int = 0) -> int | None:
        """Where the first stop string in `text[start:]` begins (an index into `text`)."""
        m = None if self._any is None else self._any.search(text, start)
        return None if m is None else m.start()

    def prefix_len(self, text: str) -> int:
        """The longest tail of `text` that is a proper prefix of a stop string, 0 if none."""
        keys = self._sorted
        for i in range(max(0, len(text) - self.longest + 1), len(text)):
            if text[i] not in self._firsts:
                continue
            tail = text[i:]
            j = bisect.bisect_left(keys, tail)
            while j < len(keys) and keys[j] == tail:  # a whole stop string is not a proper prefix
                j += 1
            if j < len(keys) and keys[j].startswith(tail):
                return len(tail)
        return 0


def _trie_regex(strings: list[str]) -> re.Pattern:
    """One regex matching any of `strings` (sorted, distinct, non-empty), shaped as their trie;
    single-child runs are literals, so groups nest only where strings branch."""
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def walk(node: dict) -> str:
        alts = []
        for ch, child in node.items():
            if ch == "":
                continue
            run = ch
            while len(child) == 1 and "" not in child:  # a chain: one literal
                ((c, child),) = child.items()
                run += c
            alts.append(re.escape(run) + walk(child))
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        # the empty alternative: a string may end here (the search only needs where a match starts)
        return ("(?:" + body + ")?") if "" in node else body

    try:
        return re.compile(walk(trie))
    except (RecursionError, re.error, OverflowError):  # a trie too deep for re: a flat alternation
        return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


@functools.lru_cache(maxsize=64)
def stop_set(strings: tuple[str, ...]) -> StopSet:
    """The (cached) automaton of `strings`."""
    return StopSet(strings)


class StopMatcher:
    """Stop strings and stop token ids, checked after every emitted token.

    Semantics are Hugging Face's `generate(stop_strings=...)`: generation ends at the token
    that *completes* a stop string, and that token is kept, so the text ends with the stop
    string or runs past it by the rest of that token (e.g. stop "\n\n" completed by a token
    "\n\n\n"). Strings are matched on the decoded generated text (prompt excluded), so a stop
    string may span tokens accepted in different rounds. A stop token id ends generation at
    that token, kept, like EOS.

    A check decodes only the tail that can hold a stop string overlapping the last token and
    searches it with one automaton (`StopSet`): its cost grows with the longest stop string,
    not with their number (a request's count and length are capped: `treespec.request`).
    """

    def __init__(self, strings: list[str], token_ids: set[int], tokenizer=None):
        self.strings, self.token_ids, self.tokenizer = strings, token_ids, tokenizer
        self.longest = max((len(x) for x in strings), default=0)
        self._set = stop_set(tuple(strings)) if strings else None

    def match(self, ids: list[int]) -> str | int | None:
        """The stop string or id that the last of `ids` (the generated tokens) completes."""
        if ids[-1] in self.token_ids:
            return ids[-1]
        if self._set is None:
            return None
        # decode a tail long enough to hold any stop string overlapping the last token, plus a
        # margin for a character cut at the window's start (byte-level tokens)
        need = self.longest + len(self._decode(ids[-1:])) + 8
        w = min(len(ids), self.longest + 8)
        while True:
            text = self._decode(ids[-w:])
            if len(text) >= need or w == len(ids):
                break
            w = min(len(ids), 2 * w)
        if self._set.search(text) is None:
            return None
        return next(x for x in self.strings if x in text)  # the first in the caller's order

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class OutputBuilder:
    """Collects a sequence's new tokens round by round: the length limit, EOS, stop strings
    and stop ids (`StopMatcher`). `add` returns what was kept: nothing past a stop."""

    def __init__(
        self, max_new_tokens: int, eos_token_ids: set[int] | frozenset[int], stop: StopMatcher | None = None
    ):
        self.max_new_tokens, self.eos, self.stop = max_new_tokens, eos_token_ids, stop
        self.token_ids: list[int] = []
        self.sources: list[TokenSource] = []
        self.finish_reason: FinishReason | None = None
        self.stop_match: str | int | None = None  # the stop string or id that ended generation

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: list[int], last_kind: TokenSource) -> list[int]:
        """Append a round's tokens (accepted drafts, then one `last_kind` token), cut at the
        limit or at the first EOS; returns the tokens actually kept."""
        kinds: list[TokenSource] = ["accepted"] * (len(tokens) - 1) + [last_kind]
        n = min(len(tokens), self.remaining)
        start = len(self.token_ids)
        for t, kind in zip(tokens[:n], kinds):
            self.token_ids.append(t)
            self.sources.append(kind)
            if t in self.eos:
                self.finish_reason = "eos"
                break
            if self.stop is not None:
                self.stop_match = self.stop.match(self.token_ids)
                if self.stop_match is not None:
                    self.finish_reason = "stop"
                    break
        if self.finish_reason is None and len(self.token_ids) == self.max_new_tokens:
            self.finish_reason = "length"
        return self.token_ids[start:]


@dataclass
class TokenLogprobs:
    """The target's own distribution at each generated position (`Request.logprobs`): log
    softmax of its raw logits, before temperature, top-k / top-p and penalties, at the position
    that produced `token_ids[i]`, whether the token was accepted from a draft, a correction or
    a bonus. Row i of every tensor belongs to token i."""

    token: torch.Tensor  # [n] float32: log p of the generated token
    top_ids: torch.Tensor  # [n, k] int64: the k most likely tokens, most likely first
    top: torch.Tensor  # [n, k] float32: their log p

    @staticmethod
    def of(logits: torch.Tensor, tokens: Sequence[int], k: int) -> TokenLogprobs:
        """From the target's logits rows [n, V] and the n tokens they produced."""
        lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
        top = lp.topk(k, dim=-1)
        chosen = lp.gather(1, torch.tensor(list(tokens), device=lp.device).unsqueeze(1)).squeeze(1)
        return TokenLogprobs(chosen.cpu(), top.indices.cpu(), top.values.cpu())

    @staticmethod
    def tail(parts: Sequence[TokenLogprobs], n: int, k: int) -> TokenLogprobs:
        """The last `n` rows of `parts` (concatenated), reading only the parts that hold them."""
        start, rows = len(parts), 0
        while start > 0 and rows < n:
            start -= 1
            rows += len(parts[start].token)
        whole = TokenLogprobs.cat(parts[start:], k)
        return TokenLogprobs(whole.token[-n:], whole.top_ids[-n:], whole.top[-n:])

    @staticmethod
    def cat(parts: Sequence[TokenLogprobs], k: int) -> TokenLogprobs:
        if not parts:
            return TokenLogprobs(torch.zeros(0), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k))
        return TokenLogprobs(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("token", "top_ids", "top"))
        )


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only (prompt excluded), EOS included if hit
    sources: list[TokenSource]  # how each generated token was produced
    stats: GenerationStats
    text: str | None = None  # decoded token_ids, when a tokenizer is known
    finish_reason: FinishReason = "length"  # "stop": a stop string or id (see StopMatcher)
    stop: str | int | None = None  # the stop string or stop token id that ended generation
    verification: str = "token"  # the rule that verified every round ("token", "block", "traversal")
    trace: list[RoundTrace] | None = None  # generate(trace=True): one treespec.trace.RoundTrace per round
    error: str | None = None  # finish_reason "error": what went wrong (this request alone)
    exception: BaseException | None = field(default=None, repr=False, compare=False)  # ... as raised
    logprobs: TokenLogprobs | None = None  # generate(logprobs=k): the target's distribution per token
    plan: str | None = None  # TreeConfig() (auto): the shape it chose and why (`treespec.planning.Plan`)


class TextStream:
    """A request's text as it streams: only text that can no longer change is released (not a
    character still being spelled by byte tokens, not a tail that may begin a stop string;
    `stops` with OpenAI's meaning: the text ends before the first one). The concatenated
    stream equals the final text."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), special_text: Mapping[int, str] | None = None):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.special_text = dict(special_text or {})  # special tokens shown as this text (others: none)
        self._stops = stop_set(self.stops) if self.stops else None
        self.ids: list[int] = []
        self.shown = ""  # text released so far

    def feed(self, ids: Sequence[int]) -> str:
        """Add a round's tokens; the new text that is safe to show (may be empty)."""
        self.ids.extend(ids)
        text = self._decode(self.ids).rstrip("\ufffd")  # a character still being spelled out
        cut = None if self._stops is None else self._stops.search(text)
        if cut is None:
            text = text if self._stops is None else text[: len(text) - self._stops.prefix_len(text)]
        else:
            text = text[:cut]
        return self._release(text)

    def finish(self, token_ids: Sequence[int]) -> str:
        """The request is over with these tokens (all of them); the rest of the text."""
        self.ids = list(token_ids)
        return self._release(self.text)

    @property
    def text(self) -> str:
        """The final text of the tokens so far: decoded, cut before the first stop string."""
        text = self._decode(self.ids)
        cut = None if self._stops is None else self._stops.search(text)
        return text if cut is None else text[:cut]

    def _release(self, text: str) -> str:
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def _decode(self, ids: list[int]) -> str:
        if not self.special_text or not any(i in self.special_text for i in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        parts, piece = [], []
        for i in ids:  # such a special token ends a piece, and each piece decodes alone
            if i in self.special_text:
                parts += [self.tokenizer.decode(piece, skip_special_tokens=True), self.special_text[i]]
                piece = []
            else:
                piece.append(i)
        return "".join(parts) + self.tokenizer.decode(piece, skip_special_tokens=True)


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins (None if there is none)."""
    return stop_set(tuple(stops)).search(text) if stops else None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string (it may still
    become one), 0 if none."""
    return stop_set(tuple(stops)).prefix_len(text) if stops else 0
