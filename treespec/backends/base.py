"""The runner interface: a causal LM plus a KV cache holding a committed prefix and a tree.

The cache is laid out as

    [ committed slots 0 .. C-1 | pending slots C .. C+P-1 ]

Committed slots are a plain prefix of the sequence. Pending slots are tree nodes fed during
the current round, addressed by their *pending index* 0 .. P-1 (after `score(tree)` on an
empty pending area, pending index == tree node index). Each pending node has a parent (a
pending index, or -1: it continues the committed prefix) and a depth; its position id is
`C + depth`, so siblings share a position. A node attends to every committed slot, to its
pending ancestors and to itself. `commit(nodes)` keeps a root-first chain of pending nodes
(the accepted path) right after the committed prefix and drops every other pending node.
Keys were rotated with `C + depth`, which is exactly their final position: nothing is
re-rotated.

`Runner` owns this bookkeeping, the tree mask (built on the model's device from the parent
pointers) and the position ids; a backend only computes logits and moves cache slots. The
decoder and the drafters therefore never do slot arithmetic, and the exactness tests drive
this very bookkeeping with table-defined toy models.

The seam has two sides. The decoder and the drafters call `prefill`, `score`, `extend`,
`commit`, `discard_pending`, `keep_prefix`, `release`, `lanes` (and `prefill_many`, `score_many`,
`extend_many` for several runners at once). A model backend implements the cache hooks
`reset_cache`, `forward`, `keep_slots`, `truncate` (and `forward_many` where its lanes share
one forward, `new_lane` where it makes lanes by copying); the bookkeeping calls them. A wrapper
(`subset.SubsetVocabRunner`) delegates the hooks and the bookkeeping state (`committed`,
`pending`) to the runner it wraps.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import check_positive_int
from ..tree import TokenTree, ancestor_rows


@dataclass(frozen=True)
class Feed:
    """What one runner feeds in one forward: `n` new cache slots after its `S` current ones."""

    tokens: torch.Tensor  # [n] token ids
    positions: torch.Tensor  # [n] position ids
    visible: torch.Tensor | None  # [n, S + n] bool attention pattern; None: causal (a prefill, a chain)
    hidden: torch.Tensor | None = None  # [n, H] a hidden state read with each token (feature heads)


@dataclass(frozen=True)
class Scores:
    """What a forward returns for one runner's fed tokens (vLLM's SpeculativeScores): the
    logits, and the hidden states a drafter reads from the target where the runner has `taps`."""

    logits: torch.Tensor | None  # [n, V]; None where none were asked for (a prefill)
    features: torch.Tensor | None = None  # [n, F]: a target's taps concatenated; a head's output state

    def rows(self, index: Sequence[int], logits: bool = True) -> Scores:
        """The scores of rows `index` (e.g. a walk's accepted path; `logits=False`: its features
        alone). Consecutive rows are a view, others a copy."""
        idx = list(index)
        at = slice(idx[0], idx[-1] + 1) if idx and idx == list(range(idx[0], idx[-1] + 1)) else idx
        return Scores(
            None if self.logits is None or not logits else self.logits[at],
            None if self.features is None else self.features[at],
        )


@dataclass
class PendingNodes:
    """The tree nodes fed since the last commit, by pending index (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)  # token of each pending node
    parents: list[int] = field(default_factory=list)  # pending parent of each (-1: the prefix)
    depths: list[int] = field(default_factory=list)  # depth below the committed prefix (0: continues it)


# the cache hooks' names before they became public: a subclass that still defines one gets it
# under the new name, with a DeprecationWarning
RENAMED_HOOKS = {
    "_reset_cache": "reset_cache",
    "_forward": "forward",
    "_keep": "keep_slots",
    "_truncate": "truncate",
    "_new_lane": "new_lane",
    "_forward_many": "forward_many",
}


class Runner(ABC):
    """A causal LM and its KV cache, with the bookkeeping of the module docstring: the decoder's
    calls on one side, the cache hooks a backend implements on the other."""

    vocab_size: int  # rows of the output projection
    max_positions: int | None  # longest sequence the model supports (None: unknown)
    eos_token_ids: frozenset[int] = frozenset()  # from the model's generation config
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    quantize: str | None = None  # weight-only format of the products ("int8", "int4"; native backend)
    # True: this lane's forwards never share a batched forward with other lanes, so its numbers
    # are those of the same sequence decoded alone, whatever runs beside it (a lane of a
    # deterministic engine; costs the batching speed-up)
    batch_invariant: bool = False
    # True: keep_prefix() keeps the cached slots a new sequence shares with the last one (a
    # chat's earlier turns), instead of starting from an empty cache
    prefix_reuse: bool = False
    # layers whose input hidden states every forward returns as `Scores.features`, concatenated
    # in this order (EAGLE-3's taps; the layer count itself: the last layer's output, before the
    # final norm); () computes none. Set with `set_taps` by whoever runs a feature drafter.
    taps: tuple[int, ...] = ()
    n_layers: int | None = None  # decoder layers (None: this runner has no features to tap)
    takes_hidden: bool = False  # True: each fed token comes with a hidden state (`Feed.hidden`)

    def __init_subclass__(cls, **kwargs) -> None:
        """A hook defined under its former name (`RENAMED_HOOKS`) serves under its new one."""
        super().__init_subclass__(**kwargs)
        for old, new in RENAMED_HOOKS.items():
            if old in cls.__dict__ and new not in cls.__dict__:
                warnings.warn(
                    f"{cls.__name__}.{old} is deprecated: the Runner hook is now named {new}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                setattr(cls, new, cls.__dict__[old])

    def __init__(self) -> None:
        self.forwards = 0  # model calls so far (prefills included), for statistics
        self.reset()

    def reset(self) -> None:
        """Forget everything (start of a new sequence)."""
        self.committed: list[int] = []  # token ids in the committed slots
        self.pending = PendingNodes()
        self.reset_cache()

    @property
    def n_committed(self) -> int:
        return len(self.committed)

    @property
    def n_pending(self) -> int:
        return len(self.pending.tokens)

    @property
    def n_slots(self) -> int:
        return self.n_committed + self.n_pending

    # ---- the API the decoder and the drafters use ------------------------------------------
    def input_embeddings(self) -> torch.Tensor | None:
        """The model's input embedding matrix [V, hidden] (what a feature head shares), or None."""
        return None

    def set_taps(self, taps: Sequence[int]) -> None:
        """Make every forward return the input hidden states of layers `taps` (see `taps`)."""
        taps = tuple(int(t) for t in taps)
        if taps and self.n_layers is None:
            raise ValueError(f"{type(self).__name__} has no hidden states to tap for a feature drafter")
        bad = [t for t in taps if not 0 <= t <= (self.n_layers or 0)]
        if bad:
            raise ValueError(
                f"tap layers {bad} are outside the target's layers [0, {self.n_layers}] "
                f"(a head made for another target?)"
            )
        self.taps = taps

    def load_graphs(self) -> None:
        """Load what this runner's forwards will run before the first tokens: the compiled
        graphs a runner under `compile="auto"` found kept for its taps (else nothing)."""

    @property
    def lanes_match_solo(self) -> bool:
        """Whether a lane of `lanes(n)` forwarding alone computes exactly what this runner
        computes for the same sequence (what a deterministic engine needs)."""
        return True

    def keep_prefix(self, tokens: Sequence[int]) -> int:
        """Start a new sequence that begins with `tokens`: returns how many of them the cache
        already holds (and keeps), 0 after a reset. Only with `prefix_reuse`: then the longest
        common prefix of the committed tokens and `tokens` stays, the rest is dropped; the
        caller prefills `tokens[kept:]`. Reused slots hold keys and values computed in earlier
        forwards, equal to a fresh prefill's up to rounding."""
        if not self.prefix_reuse:
            self.reset()
            return 0
        self.discard_pending()
        kept = 0
        for a, b in zip(self.committed, tokens):
            if a != int(b):
                break
            kept += 1
        del self.committed[kept:]
        self.truncate(kept)
        return kept

    def release(self) -> None:
        """End this lane's sequence and give back the memory its cache held (an engine calls it
        when a request leaves the lane). A reset; a backend whose cache memory outlives a reset
        (the native pool) also shrinks it."""
        self.reset()

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed and commit `tokens` after the committed prefix (no pending nodes allowed). A
        prompt may be prefilled in pieces, one call each: a piece is causal after the cached
        slots, positions continuing, so the cache ends as one call would leave it."""
        prefill_many([(self, tokens)])

    def score(self, tree: TokenTree) -> torch.Tensor:
        """Feed a whole tree rooted right after the committed prefix; logits `[N, V]` (the
        logits of `score_many`'s `Scores`).

        Row i holds the next-token logits after node i. Pending index == node index.
        """
        return score_many([(self, tree)])[0].logits

    def extend(
        self, tokens: Sequence[int], parents: Sequence[int], hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Feed new pending nodes (level-by-level drafting); their logits `[n, V]`.

        `parents[i]` is the pending index of node i's parent: an earlier pending node, a node
        earlier in this call (`n_pending + j`, j < i), or -1 to continue the committed prefix.
        `hidden` [n, H]: the hidden state read with each token (runners that `takes_hidden`).
        """
        return extend_many([(self, tokens, parents, hidden)])[0].logits

    def add_pending(
        self, tokens: Sequence[int], parents: Sequence[int], hidden: torch.Tensor | None = None
    ) -> Feed:
        """Record new pending nodes and say what to feed for them (no forward yet; `extend_many`
        runs it)."""
        n, p0, c, pending = len(tokens), self.n_pending, self.n_committed, self.pending
        if n == 0 or len(parents) != n:
            raise ValueError(f"extend() needs one parent per token, got {n} tokens, {len(parents)} parents")
        if (hidden is not None) != self.takes_hidden or (hidden is not None and hidden.shape[0] != n):
            wants = "one hidden state per token" if self.takes_hidden else "no hidden states"
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"{type(self).__name__} reads {wants}, got {got} for {n} tokens")
        depths = []
        for i, parent in enumerate(parents):
            if not -1 <= parent < p0 + i:
                raise ValueError(f"node {i}: parent {parent} is not a pending node before it")
            depths.append(
                0 if parent == -1 else (pending.depths[parent] if parent < p0 else depths[parent - p0]) + 1
            )
        self.check_positions(c + max(depths))
        pending.tokens += [int(t) for t in tokens]
        pending.parents += [int(p) for p in parents]
        pending.depths += depths
        if all(d == p0 + i for i, d in enumerate(depths)):
            # a chain below every pending node (each step of linear drafting, a chain tree):
            # every new node sees all slots before it, the causal pattern; no tree mask to build
            ids = torch.tensor([pending.tokens[p0:], [c + d for d in depths]], device=self.device)  # [2, n]
            return Feed(ids[0], ids[1], None, hidden)
        # one host -> device copy: tokens, positions and the parent pointers of every pending node
        ids = torch.tensor(
            [pending.tokens, [c + d for d in pending.depths], pending.parents], device=self.device
        )  # [3, P]
        new = ancestor_rows(ids[2], p0, max(pending.depths[p0:]))  # [n, P] ancestor-or-self of the new nodes
        visible = torch.ones(n, c + p0 + n, dtype=torch.bool, device=self.device)  # [n, S + n]
        visible[:, c:] = new
        return Feed(ids[0, p0:], ids[1, p0:], visible, hidden)

    def commit(self, nodes: Sequence[int]) -> None:
        """Commit the chain of pending `nodes` (root level first); drop every other pending node."""
        nodes = [int(n) for n in nodes]
        for i, n in enumerate(nodes):
            if not 0 <= n < self.n_pending or self.pending.parents[n] != (nodes[i - 1] if i else -1):
                raise ValueError(f"nodes {nodes} are not a root-first chain of pending nodes")
        if nodes != list(range(len(nodes))):  # a chain fed in order is already in place
            self.keep_slots(nodes)
        self.committed.extend(self.pending.tokens[n] for n in nodes)
        self.pending = PendingNodes()
        self.truncate(self.n_committed)

    def discard_pending(self) -> None:
        """Drop every pending node, keeping the committed prefix: undoes `score` / `extend`
        when a round is abandoned (the engine's rollback)."""
        self.pending = PendingNodes()
        self.truncate(self.n_committed)

    def check_positions(self, last: int) -> None:
        """Refuse a position id past the model's last one."""
        if self.max_positions is not None and last >= self.max_positions:
            raise ValueError(f"position {last} exceeds the model's {self.max_positions} positions")

    # ---- the cache hooks: what a model backend implements (the bookkeeping calls them) -----
    @abstractmethod
    def reset_cache(self) -> None:
        """Empty the cache (a new sequence)."""

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, need_logits: bool
    ) -> Scores:
        """Append `tokens` [n] at `positions` [n] to the cache (slots S .. S+n-1, S = n_slots).

        `visible` [n, S+n] (bool, on the device) is the attention pattern; None means a prefill:
        plain causal after the committed prefix. Returns the logits [n, V] (None when
        `need_logits` is False) and, with `taps`, the features [n, F]. A runner that
        `takes_hidden` overrides `forward_many`, which sees each feed's hidden states."""

    @abstractmethod
    def keep_slots(self, nodes: list[int]) -> None:
        """Move pending `nodes` (pending indices) to the slots right after the committed prefix."""

    def truncate(self, n_slots: int) -> None:
        """Drop every cache slot from `n_slots` on (a static cache just forgets them)."""

    @classmethod
    def forward_many(cls, runners: list[Runner], feeds: list[Feed], need_logits: bool) -> list[Scores]:
        """One `forward` per runner; a backend whose lanes share a batched forward overrides
        this (`runners` are all of this class)."""
        return [r.forward(f.tokens, f.positions, f.visible, need_logits) for r, f in zip(runners, feeds)]

    # ---- batching ----------------------------------------------------------------------------
    def lanes(self, n: int) -> list[Runner]:
        """`n` runners of this very model, each with a cache of its own (one per request of a
        batch). A backend whose lanes can share one forward (`forward_many`) returns them so;
        by default each lane is a copy made by `new_lane` and runs its own forwards."""
        check_positive_int("lanes(n)", n)
        return [self.new_lane() for _ in range(n)]

    def new_lane(self) -> Runner:
        """A runner of this very model with a cache of its own (what `lanes` makes by default)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot make lanes for batched decoding; implement new_lane()"
        )


def tapped(x: torch.Tensor, layer: int, taps: tuple[int, ...], found: dict[int, torch.Tensor]) -> None:
    """Keep `x`, the input of layer `layer` (or the last layer's output, layer = L), if tapped."""
    if layer in taps:
        found[layer] = x


def features_of(taps: tuple[int, ...], found: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The tapped hidden states concatenated in `taps` order: [T, len(taps) * H], or None."""
    return torch.cat([found[t] for t in taps], dim=-1) if taps else None


def extend_many(jobs: Sequence[tuple]) -> list[Scores]:
    """`runner.extend(tokens, parents[, hidden])` for every job `(runner, tokens, parents[,
    hidden])`; the `Scores` of each job's n_i new nodes. Lanes of one batched backend (see
    `Runner.lanes`) run in ONE forward; others one after another."""
    feeds = [job[0].add_pending(*job[1:]) for job in jobs]
    return _run([job[0] for job in jobs], feeds, need_logits=True)


def score_many(jobs: Sequence[tuple[Runner, TokenTree]]) -> list[Scores]:
    """`runner.score(tree)` for every job, in one forward where the runners allow it: each
    tree's `Scores` (logits [N, V], features where the runner has taps)."""
    for runner, _ in jobs:
        if runner.n_pending:
            raise RuntimeError("score() needs an empty pending area; commit() the last tree first")
    return extend_many([(runner, tree.tokens, tree.parents) for runner, tree in jobs])


def prefill_many(jobs: Sequence[tuple[Runner, Sequence[int]]]) -> list[Scores | None]:
    """`runner.prefill(tokens)` for every job (ragged lengths: packed, never padded). Returns
    each job's `Scores` without logits, its features where the runner has taps (None for an
    empty job)."""
    for runner, _ in jobs:
        if runner.n_pending:
            raise RuntimeError("prefill() with pending tree nodes; commit() them first")
        if runner.takes_hidden:
            raise ValueError(f"{type(runner).__name__} reads a hidden state per token: feed it with extend()")
    given = [(r, [int(t) for t in tokens]) for r, tokens in jobs]
    jobs = [(r, tokens) for r, tokens in given if tokens]
    feeds = []
    for runner, tokens in jobs:
        runner.check_positions(runner.n_committed + len(tokens) - 1)
        c = runner.n_committed
        ids = torch.tensor([tokens, list(range(c, c + len(tokens)))], device=runner.device)  # [2, n]
        feeds.append(Feed(ids[0], ids[1], None))
    out = iter(_run([r for r, _ in jobs], feeds, need_logits=False))
    for runner, tokens in jobs:
        runner.committed.extend(tokens)
    return [next(out) if tokens else None for _, tokens in given]


def _run(runners: list[Runner], feeds: list[Feed], need_logits: bool) -> list[Scores]:
    """Forward `feeds`, grouping runners by class so a batched backend sees all its lanes (a
    batch-invariant lane forms a group of its own)."""
    out = forward_grouped(
        runners,
        feeds,
        lambda r: id(r) if r.batch_invariant else type(r),
        lambda group, fs: type(group[0]).forward_many(group, fs, need_logits),
    )
    for r in runners:
        r.forwards += 1
    return out


def forward_grouped(
    runners: list[Runner],
    feeds: list[Feed],
    key: Callable[[Runner], Hashable],
    forward: Callable[[list[Runner], list[Feed]], list],
) -> list:
    """`forward(group, group_feeds)` once per group of runners sharing `key(runner)` (one
    result per runner of the group); the results in the order of `runners`."""
    groups: dict[Hashable, list[int]] = {}
    for i, r in enumerate(runners):
        groups.setdefault(key(r), []).append(i)
    out: list = [None] * len(runners)
    for idx in groups.values():
        for i, result in zip(idx, forward([runners[i] for i in idx], [feeds[i] for i in idx])):
            out[i] = result
    return out


def lanes_mask(
    starts: Sequence[int],
    ns: Sequence[int],
    visibles: Sequence[torch.Tensor | None],
    device: torch.device,
    new_at: Sequence[int] | None = None,
) -> torch.Tensor:
    """The padded attention mask of B lanes fed in one forward: [B, n_max, W] bool.

    Lane b holds S_b = starts[b] cached slots (columns [0, S_b)) and feeds n_b = ns[b] new
    tokens, whose keys sit at columns new_at[b] .. new_at[b] + n_b (default S_b, right after its
    own cache, as the native pool stores them; HF's batched cache puts every lane's new tokens
    after the common padded length). Row i < n_b sees the lane's cached slots and its new tokens
    by `visibles[b]` ([n_b, S_b + n_b], as a Feed's `visible`; None: causal); a padding row
    (i >= n_b) sees column 0 only, so it has no NaN, and its output is dropped."""
    new_at = list(starts) if new_at is None else list(new_at)
    n_max, width = max(ns), max(a + n for a, n in zip(new_at, ns))
    S, n, a = torch.tensor([list(starts), list(ns), new_at], device=device)[:, :, None, None]  # [B, 1, 1]
    i = torch.arange(n_max, device=device)[:, None]  # [n_max, 1]
    j = torch.arange(width, device=device)  # [W]
    causal = (j < S) | ((j >= a) & (j <= a + i))
    mask = torch.where(i < n, causal, j == 0)  # [B, n_max, W]
    for b, visible in enumerate(visibles):
        if visible is not None:
            S_b, n_b, a_b = starts[b], ns[b], new_at[b]
            mask[b, :n_b, :S_b] = visible[:, :S_b]
            mask[b, :n_b, a_b : a_b + n_b] = visible[:, S_b:]
    return mask


def causal_visible(n: int, S: int, device: torch.device) -> torch.Tensor:
    """[n, S+n] bool: n new tokens fed causally after S cached slots (what a Feed's
    `visible=None` stands for)."""
    return torch.ones(n, S + n, dtype=torch.bool, device=device).tril(S)
