"""The static KV cache of the native backend, written by slot index: `KVPool`.

    kv [L, 2, R, Hkv, cap, D]     layer, (key | value), lane, kv head, slot, head dim

`kv[l, 0]` / `kv[l, 1]` are layer l's keys / values as [R, Hkv, cap, D], the layout SDPA reads;
moving slots (commit) is one gather over every layer at once. A runner is one lane (row) of a
pool. The capacity doubles (capped near max_positions) when a forward would overflow it, so a
128k-token model does not allocate 128k slots up front, and the rows allocated double when a
lane beyond them first runs, so an engine's idle lanes cost nothing. Both shrink back when the
lanes' sequences end (`trim`, after a burst of long prompts), with hysteresis: only a pool four
times larger than what its lanes hold is reallocated, to twice what they hold, so steady serving
does not reallocate every request. The pool also holds the RoPE tables of its positions
(positions never exceed the slot count).
"""

from __future__ import annotations

import torch

from ..checkpoint import LlamaShape
from .model import rope_rows

INITIAL_CAPACITY = 256  # cache slots allocated before the first growth
SHRINK_AT = 4  # `trim` reallocates a pool this many times larger than its lanes hold


def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on `device` now (Linux MemAvailable on the CPU, the CUDA
    allocator's free memory plus what its cache holds), or None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


class KVPool:
    """The static KV cache of `rows` lanes of one model, and the RoPE tables of its positions.
    Slots per lane (`capacity`) and lanes allocated (`allocated`) both grow with use: an
    engine of 64 lanes serving 3 requests holds about 3 rows, not 64."""

    def __init__(
        self, shape: LlamaShape, rows: int, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device
    ):
        self.shape, self.rows, self.inv_freq, self.dtype, self.device = shape, rows, inv_freq, dtype, device
        self.kv = torch.zeros(0, device=device, dtype=dtype)
        self.capacity = self.allocated = 0
        self.filled = [0] * rows  # slots each lane's cache holds (its runner's `filled`)
        capacity = min(INITIAL_CAPACITY, shape.max_positions or INITIAL_CAPACITY)
        self._check_memory(rows, capacity)  # a pool that could never hold its lanes: refused now
        self.grow(capacity, 1)

    def _check_memory(self, rows: int, capacity: int) -> None:
        s = self.shape
        need = s.layers * 2 * rows * s.kv_heads * capacity * s.head_dim * self.dtype.itemsize
        free = available_memory(self.device)
        if free is not None and need > free:
            raise MemoryError(
                f"a KV cache of {rows} lane(s) x {capacity} slots needs {need / 2**30:.2f} GiB and "
                f"{free / 2**30:.2f} GiB of {self.device.type} memory is available; serve fewer requests "
                f"at once (max_live / max_kv_tokens) or shorter ones"
            )

    @torch.inference_mode(False)
    def grow(self, capacity: int, rows: int) -> None:
        """Reallocate for `rows` lanes of `capacity` slots (keeping what the cache holds in
        them: a smaller pool keeps the slots and lanes that fit) and the RoPE tables for
        positions [0, capacity): positions never exceed the slot count. A cache that would not
        fit in the memory available now is refused before anything is allocated. The tensors
        are ordinary ones wherever it grows (inside a forward's inference mode too): a compiled
        graph guards on its inputs' dispatch keys, and would recompile."""
        s, old = self.shape, self.kv
        if capacity > self.capacity or rows > self.allocated:
            self._check_memory(rows, capacity)
        self.kv = torch.zeros(
            s.layers, 2, rows, s.kv_heads, capacity, s.head_dim, device=self.device, dtype=self.dtype
        )  # [L, 2, R, Hkv, cap, D]
        if old.numel():
            r, c = min(rows, old.shape[2]), min(capacity, old.shape[-2])
            self.kv[:, :, :r, :, :c] = old[:, :, :r, :, :c]
        del old
        self.allocated = rows
        if capacity != self.capacity:
            # as HF's rotary embedding: float32 angles, cos/sin, then the compute dtype
            pos = torch.arange(capacity, device=self.device)
            freqs = pos.float()[:, None] * self.inv_freq[None]  # [cap, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [cap, D]
            self.cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # [cap, D]
            half = s.head_dim // 2
            self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [cap, D], see rotate()
            self.capacity = capacity

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_rows` of this pool's tables: indexed once per forward, shared by every layer."""
        return rope_rows(self.cos, self.sin_signed, positions, self.shape)

    def fit(self, slots: int, rows: int = 1) -> None:
        """Make room for `slots` slots per lane in lanes [0, rows) (each doubling when it grows)."""
        capacity, allocated = self.capacity, self.allocated
        if slots > capacity:
            cap = self.shape.max_positions or 2 * capacity
            capacity = max(slots, min(2 * capacity, cap))
        if rows > allocated:
            allocated = min(self.rows, max(rows, 2 * allocated))
        if (capacity, allocated) != (self.capacity, self.allocated):
            self.grow(capacity, allocated)

    def trim(self) -> None:
        """Give back memory the lanes no longer hold (after their sequences ended: `filled`):
        a capacity or a row count over `SHRINK_AT` times what the lanes hold (at least the
        initial capacity, one row) is reallocated to twice that, keeping every slot a lane
        holds."""
        need = max(max(self.filled), min(INITIAL_CAPACITY, self.shape.max_positions or INITIAL_CAPACITY))
        used = max((row + 1 for row, n in enumerate(self.filled) if n), default=1)
        capacity = min(self.capacity, 2 * need) if self.capacity > SHRINK_AT * need else self.capacity
        rows = min(self.allocated, 2 * used) if self.allocated > SHRINK_AT * used else self.allocated
        if (capacity, rows) != (self.capacity, self.allocated):
            self.grow(capacity, rows)
