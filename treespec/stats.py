"""What a generation returns: the tokens, how each was produced, and the round statistics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .proposal import DraftTree
    from .trace import RoundTrace
    from .verify import Walk

# How an emitted token was produced:
#   accepted   - a draft token the target accepted
#   correction - drawn from the residual after every proposal at a node was rejected
#   bonus      - drawn from the target's p at a leaf (or at the root of a tree=None step)
TokenSource = Literal["accepted", "correction", "bonus"]


@dataclass
class GenerationStats:
    target_steps: int = 0  # target forward passes after the prefill (= rounds)
    draft_forwards: int = 0  # draft model forward passes (0 for model-free drafters)
    tokens: int = 0  # tokens emitted (after truncation at EOS / max_new_tokens)
    tree_nodes: int = 0  # draft nodes verified, summed over rounds (root excluded)
    # accepted_by_depth[d-1]: rounds that accepted a draft token at depth d;
    # attempted_by_depth[d-1]: rounds whose walk reached depth d-1 at a node with proposals
    accepted_by_depth: list[int] = field(default_factory=list)
    attempted_by_depth: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # building draft trees (draft forwards + sampling)
    verify_seconds: float = 0.0  # target tree forwards + verification walks + cache compaction
    total_seconds: float = 0.0  # the whole generate() call

    @property
    def tokens_per_step(self) -> float:
        """tau: tokens emitted per target forward, correction/bonus token included."""
        return self.tokens / self.target_steps if self.target_steps else 0.0

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens the target accepted, summed over rounds (correction/bonus excluded)."""
        return sum(self.accepted_by_depth)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (vLLM's draft acceptance rate). Drafted
        tokens = draft tree nodes sent to the target (`tree_nodes`: for a width-w tree every
        node counts, so trees have lower rates than chains at equal tokens/step)."""
        return self.accepted_tokens / self.tree_nodes if self.tree_nodes else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per round (target step), correction/bonus token excluded.
        vLLM's "mean acceptance length" counts that token too: it is 1 + this."""
        return self.accepted_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(accept a draft token at depth d | the walk stood at depth d-1 with proposals)."""
        return [a / t if t else 0.0 for a, t in zip(self.accepted_by_depth, self.attempted_by_depth)]

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: emitted tokens over the time after the prefill."""
        t = self.total_seconds - self.prefill_seconds
        return self.tokens / t if t > 0 else 0.0

    def record_round(self, draft: DraftTree, walk: Walk, draft_seconds: float, verify_seconds: float) -> None:
        """One round: a target forward over `draft`, verified into `walk`."""
        self.target_steps += 1
        self.tree_nodes += len(draft.tree) - 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        depths = draft.tree.depths
        self.record_walk([depths[n] for n in walk.path if draft.groups_at(n)], len(walk.path) - 1)

    def record_walk(self, depths_with_proposals: list[int], accepted: int) -> None:
        """One round: the walk stood at depths 0..len-1 with proposals and accepted `accepted` tokens."""
        n = max(len(depths_with_proposals), accepted)  # both lists stay the same length
        attempted = [0] * n
        for d in depths_with_proposals:
            attempted[d] += 1
        _add_by_depth(self.attempted_by_depth, attempted)
        _add_by_depth(self.accepted_by_depth, [1] * accepted + [0] * (n - accepted))

    def add(self, other: GenerationStats) -> None:
        """Pool another generation's counts and seconds into these (benchmark totals)."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, list):
                _add_by_depth(mine, getattr(other, f.name))
            else:
                setattr(self, f.name, mine + getattr(other, f.name))


def _add_by_depth(total: list[int], counts: list[int]) -> None:
    """total[d] += counts[d], growing total as needed."""
    total.extend([0] * (len(counts) - len(total)))
    for d, c in enumerate(counts):
        total[d] += c


OnTokens = Callable[[list[int], list[TokenSource]], None]
FinishReason = Literal["eos", "length", "stop"]


class StopMatcher:
    """Stop strings and stop token ids, checked after every emitted token.

    Semantics are Hugging Face's `generate(stop_strings=...)`: generation ends at the token
    that *completes* a stop string, and that token is kept, so the text ends with the stop
    string or runs past it by the rest of that token (e.g. stop "\n\n" completed by a token
    "\n\n\n"). Strings are matched on the decoded generated text (prompt excluded), so a stop
    string may span tokens accepted in different rounds. A stop token id ends generation at
    that token, kept, like EOS.
    """

    def __init__(self, strings: list[str], token_ids: set[int], tokenizer=None):
        self.strings, self.token_ids, self.tokenizer = strings, token_ids, tokenizer
        self.longest = max((len(x) for x in strings), default=0)

    def match(self, ids: list[int]) -> str | int | None:
        """The stop string or id that the last of `ids` (the generated tokens) completes."""
        if ids[-1] in self.token_ids:
            return ids[-1]
        if not self.strings:
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
        return next((x for x in self.strings if x in text), None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class OutputBuilder:
    """Collects a sequence's new tokens round by round: the length limit, EOS, stop strings
    and stop ids (`StopMatcher`), streaming. Nothing past a stop reaches `on_tokens`."""

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: set[int] | frozenset[int],
        on_tokens: OnTokens | None = None,
        stop: StopMatcher | None = None,
    ):
        self.max_new_tokens, self.eos, self.on_tokens, self.stop = max_new_tokens, eos_token_ids, on_tokens, stop
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
        kept = self.token_ids[start:]
        if self.on_tokens is not None:
            self.on_tokens(kept, self.sources[start:])
        return kept


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
