"""The target's features for training a feature head: one teacher-forced pass of the target
over every stored sequence of a `treespec distill` data run, its taps (the inputs of layers
{2, N/2, N-3}) kept in bf16.

    Features           one data run's, in a memory-mapped .npy file beside its shards
    FeatureSet         several runs' as one array
    FeaturesInMemory   a held-out set's, small enough to recompute
    compute_features   the target's forwards that fill any of them, chunk by chunk
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..backends.base import prefill_many
from .data import Dataset

FEATURE_CHUNK_TOKENS = 4096  # target tokens per features forward (packed lanes)


class Features:
    """The target's tapped features at every stored token of one data run, [T, F] bf16, aligned
    with its `tokens`, in a memory-mapped .npy file (bf16 bits as uint16): 3 x 576 x 2 bytes a
    token for SmolLM2's three taps, so millions of tokens stay on disk and in the page cache."""

    def __init__(self, path: Path, shape: tuple[int, int] | None = None):
        mode = "r+" if shape is None else "w+"
        self.array = np.lib.format.open_memmap(path, mode=mode, dtype=np.uint16, shape=shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.array[rows])).view(torch.bfloat16)

    def write(self, start: int, values: torch.Tensor) -> None:
        self.array[start : start + len(values)] = values.to(torch.bfloat16).view(torch.uint16).numpy()

    def flush(self) -> None:
        self.array.flush()


class FeatureSet:
    """Several runs' `Features` as one [T, F] array over their concatenated tokens (a slice
    never crosses from one run into the next: it is one sequence's)."""

    def __init__(self, parts: list[Features]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(f.array) for f in parts])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        i = int(np.searchsorted(self.starts, rows.start, side="right")) - 1
        a = self.starts[i]
        return self.parts[i][rows.start - a : rows.stop - a]


def compute_features(target, data: Dataset, taps, store, done: int = 0, on_chunk=None) -> None:
    """The target's tapped features of `data`'s sequences from sequence `done` on, written into
    `store` (a `Features`, or anything with `write(start, tensor)`), sequences prefilled as
    packed native lanes, `FEATURE_CHUNK_TOKENS` a forward; `on_chunk(sequences_done)` after each."""
    target.set_taps(tuple(taps))
    seqs = data.sequences()
    try:
        i = done
        while i < len(seqs):
            n, total = 0, 0
            while i + n < len(seqs) and (n == 0 or total + len(seqs[i + n]) <= FEATURE_CHUNK_TOKENS):
                total += len(seqs[i + n])
                n += 1
            scores = prefill_many([(lane, s.tolist()) for lane, s in zip(target.lanes(n), seqs[i : i + n])])
            store.write(int(data.offsets[i]), torch.cat([s.features for s in scores]))
            i += n
            if on_chunk is not None:
                on_chunk(i)
    finally:
        target.set_taps(())


class FeaturesInMemory:
    """`Features` held in memory, [T, F] bf16: a held-out set's, small enough to recompute."""

    def __init__(self, tokens: int, width: int):
        self.values = torch.zeros(tokens, width, dtype=torch.bfloat16)

    def write(self, start: int, values: torch.Tensor) -> None:
        self.values[start : start + len(values)] = values.to(torch.bfloat16)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.values[rows]
