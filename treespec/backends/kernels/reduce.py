"""`torch.ops.treespec.row_max(x)`: each row's maximum and the index of its first occurrence,
as `torch.max(x, -1)` (NaN counts as the maximum), in one vectorised pass (reduce.cpp): torch's
CPU max over a dim is scalar, 44 us for a row of 49,152 against ~3 us. AVX512 cores with the
kernels built (`q4q8.built`: never built for it); `sampling.row_max` falls back to torch."""

from __future__ import annotations

from .q4q8 import runs


def available() -> bool:
    """Whether `row_max` runs here without building anything (an AVX512 core; `q4q8.runs`)."""
    return runs("row_max_available", build=False)
