"""Round statistics of a generation: steps, drafted and accepted tokens by depth, seconds."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .proposal import DraftTree, Walk


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
    # constrained requests: emitted tokens the grammar allowed alone, and how many of those were
    # accepted draft tokens (the rest were correction or bonus tokens)
    forced_tokens: int = 0
    forced_accepted: int = 0
    prefill_seconds: float = 0.0
    plan_seconds: float = 0.0  # choosing the automatic tree (a process's first may measure the costs)
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
        spent = self.prefill_seconds + self.plan_seconds + self.draft_seconds + self.verify_seconds
        return max(0.0, self.total_seconds - spent)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: emitted tokens over the time after the prefill (and the plan)."""
        t = self.total_seconds - self.prefill_seconds - self.plan_seconds
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
