"""`torch.ops.treespec.row_max(x)`: each row's maximum and the index of its first occurrence,
as `torch.max(x, -1)` (NaN counts as the maximum), in one vectorised pass (reduce.cpp): torch's
CPU max over a dim is scalar, 44 us for a row of 49,152 against ~3 us. AVX512 cores with the
kernels built (`q4q8.built`: never built for it); `sampling.row_max` falls back to torch."""

from __future__ import annotations

import torch

from .q4q8 import built


def available() -> bool:
    """Whether `row_max` runs here without building anything (the kernels built, an AVX512
    core, the path not capped below AVX512)."""
    return built() and bool(torch.ops.treespec.row_max_available())
