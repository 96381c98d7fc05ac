"""A causal LM with a KV cache that holds a committed prefix plus a tree of pending slots.

The same runner serves the target and the draft model. Its cache is laid out as

    [ committed slots 0 .. C-1 | pending slots C .. S-1 ]

Committed slots are a plain prefix of the sequence. Pending slots are tree nodes fed during
the current round; each has a parent slot (or -1: it continues the committed prefix), and a
depth, so its position id is `C + depth`. A forward appends new pending slots; each new node
attends to every committed slot, to its pending ancestors and to itself. `commit()` keeps a
chain of pending slots (the accepted path) and drops the rest, compacting the cache so the
kept slots follow the committed prefix. Keys were rotated with `C + depth`, which is exactly
their final position, so nothing is re-rotated.

`Runner` owns this bookkeeping; subclasses only compute logits and move cache rows, which
lets the exactness tests drive the real bookkeeping with table-defined toy models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

# Attention implementations that take a custom 4D mask as given. flash_attention_* ignore
# 4D masks and flex_attention rebuilds its own, so tree attention would silently be wrong.
TREE_MASK_ATTENTION = ("sdpa", "eager")


class Runner(ABC):
    vocab_size: int
    max_positions: int | None  # longest sequence the model supports (None: unknown)

    def __init__(self) -> None:
        self.forwards = 0  # model calls so far (prefills included), for statistics
        self.reset()

    def reset(self) -> None:
        """Forget everything (start of a new sequence)."""
        self.committed: list[int] = []  # token ids in the committed slots
        self._pending_tokens: list[int] = []
        self._pending_depth: list[int] = []
        self._pending_anc = torch.zeros(0, 0, dtype=torch.bool)  # [P, P] ancestor-or-self
        self._reset_cache()

    @property
    def n_committed(self) -> int:
        return len(self.committed)

    @property
    def n_slots(self) -> int:
        return len(self.committed) + len(self._pending_tokens)

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed and commit `tokens` after the committed prefix (no pending slots allowed)."""
        if self._pending_tokens:
            raise RuntimeError("prefill() with pending tree slots; commit() them first")
        if tokens:
            positions = torch.arange(len(tokens)) + self.n_committed
            self._forward(list(tokens), positions, None)
            self.forwards += 1
            self.committed.extend(int(t) for t in tokens)

    def forward(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed new tree nodes; return their next-token logits `[n, V]`.

        `parents[i]` is the slot index of node i's parent: a pending slot, a slot of a node
        earlier in this call (`n_slots + j`, j < i), or -1 to continue the committed prefix.
        """
        n, base, c = len(tokens), self.n_slots, self.n_committed
        if n == 0 or len(parents) != n:
            raise ValueError(f"forward() needs one parent per token, got {n} tokens, {len(parents)} parents")
        p0 = len(self._pending_tokens)
        anc = torch.zeros(p0 + n, p0 + n, dtype=torch.bool)
        anc[:p0, :p0] = self._pending_anc
        depth = list(self._pending_depth)
        for i, parent in enumerate(parents):
            row = p0 + i
            if parent != -1:
                if not c <= parent < base + i:
                    raise ValueError(f"node {i}: parent slot {parent} is not a pending slot before it")
                anc[row] = anc[parent - c]
                depth.append(depth[parent - c] + 1)
            else:
                depth.append(0)
            anc[row, row] = True
        positions = torch.tensor(depth[p0:], dtype=torch.long) + c  # [n]
        if self.max_positions is not None and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds the model's {self.max_positions} positions")
        # visible[i, j]: new node i may attend to slot j (committed, ancestor or itself)
        visible = torch.cat([torch.ones(n, c, dtype=torch.bool), anc[p0:]], dim=1)  # [n, S + n]
        logits = self._forward(list(tokens), positions, visible)
        self.forwards += 1
        self._pending_tokens.extend(int(t) for t in tokens)
        self._pending_depth = depth
        self._pending_anc = anc
        return logits

    def commit(self, slots: Sequence[int]) -> None:
        """Commit the chain of pending `slots` (root-level first); drop every other pending slot."""
        c = self.n_committed
        for i, s in enumerate(slots):
            if not c <= s < self.n_slots or self._pending_depth[s - c] != i:
                raise ValueError(f"slots {list(slots)} are not a root-first chain of pending slots")
            if i and not self._pending_anc[s - c, slots[i - 1] - c]:
                raise ValueError(f"slot {s} is not a child of slot {slots[i - 1]}")
        self._keep(list(slots))
        self.committed.extend(self._pending_tokens[s - c] for s in slots)
        self._pending_tokens, self._pending_depth = [], []
        self._pending_anc = torch.zeros(0, 0, dtype=torch.bool)

    # ---- what a model backend implements -------------------------------------------------
    @abstractmethod
    def _reset_cache(self) -> None: ...

    @abstractmethod
    def _forward(self, tokens: list[int], positions: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """Append `tokens` at `positions`; `visible` [n, S+n] is the attention pattern.
        Returns logits [n, V]; with `visible=None` (a prefill: plain causal after the committed
        prefix) the logits are unused and a backend may return only the last row."""

    @abstractmethod
    def _keep(self, slots: list[int]) -> None:
        """Move pending `slots` right after the committed prefix; drop all later slots."""


class HFRunner(Runner):
    """A Hugging Face causal LM (tested on `LlamaForCausalLM`) over a `DynamicCache`."""

    def __init__(self, model: torch.nn.Module):
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in TREE_MASK_ATTENTION:
            raise ValueError(
                f"attention implementation {impl!r} does not honour custom 4D tree masks; load the "
                f"model with attn_implementation='sdpa' (or 'eager')"
            )
        self.model = model
        self.attn_impl = impl
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        super().__init__()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _reset_cache(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[n, S+n] visibility -> the 4D mask the attention implementation expects."""
        visible = visible.to(self.device)[None, None]  # [1, 1, n, S+n]
        if self.attn_impl == "sdpa":
            return visible  # bool, True = attend
        # eager adds the mask to the scores: 0 where visible, dtype min elsewhere
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def _forward(self, tokens: list[int], positions: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([tokens], device=self.device),  # [1, n]
            position_ids=positions[None].to(self.device),  # [1, n]
            attention_mask=None if visible is None else self._mask(visible),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if visible is None else 0,  # 0 = all rows
        )
        return out.logits[0]  # [n, V]

    @torch.inference_mode()
    def _keep(self, slots: list[int]) -> None:
        c, k = self.n_committed, len(slots)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            # gather first (a copy), then write: never an overlapping in-place copy
            keys, values = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)  # [B, H, k, D]
            layer.keys[..., c : c + k, :] = keys
            layer.values[..., c : c + k, :] = values
            layer.keys = layer.keys[..., : c + k, :]
            layer.values = layer.values[..., : c + k, :]
