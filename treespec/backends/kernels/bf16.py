"""Integer weights x bfloat16 activations as they are (not quantized): the default int4
target's own precision, with each weight tile unpacked once for all rows of a call (a tree's).

- `torch.ops.treespec.q4bf16_linear(x, pack_q4s(q, s, z), bias, n)`: torch's int4 matrix
  w = (q - 8) s + z (per output row and group of 32, `linear.Int4Projection`), computed as
  s * dot_g(128 + q, x) + (z - 136 s) * sum_g(x) per group (128 + q: a nibble's bf16 with no
  table, by its bits);
- `torch.ops.treespec.q8bf16_linear(x, pack_q8s(q, s), bias, n)`: weight-only int8, w = s q
  with one scale per output row (`linear.QuantizedProjection`, the output layer of an int4
  target), computed as s * dot(q, x).

Both run VDPBF16PS over bf16 pairs (the integers are exact in bf16) with float32 totals, the
same models as aten's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` up to float32
rounding; parallel over output tiles only, so **a row's result never depends on the other rows
of the call**. AVX512-BF16 cores only (bf16.cpp, built with q4q8.cpp: `q4q8.compiled`); the
projections keep aten's kernels elsewhere.
"""

from __future__ import annotations

import torch

from .q4q8 import QK, TILE, runs


def available(build: bool = True) -> bool:
    """Whether the bf16 tile kernels run here (an AVX512-BF16 core; `q4q8.runs`)."""
    return runs("bf16_available", build)


def _tiles(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [n, ...] padded with zero rows to whole tiles of TILE: [ceil(n / TILE) * TILE, ...]."""
    pad = -n % TILE
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_q4s(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """torch's int4 form w = (q - 8) s + z (q [n, k] 0..15, s and z [n, k/32]) -> the layout of
    `q4bf16_linear`: uint8 [ceil(n/16), k/32, 384], per tile and group 4 chunks c of 32
    little-endian 16-bit words, word u holding q[u // 2, 8c + 2e + u % 2] in its bits 4e..4e+3
    (e = 0..3), then s and z - 136 s of the 16 columns in float32."""
    n, k = q.shape
    g = k // QK
    if k % QK or scales.shape != (n, g) or zeros.shape != (n, g):
        raise ValueError(f"q4 weights [{n}, {k}] need whole groups of {QK} and s, z [{n}, {g}]")
    t = -(-n // TILE)
    q, s, z = (_tiles(v, n) for v in (q.to(torch.uint8), scales.to(torch.float32), zeros.to(torch.float32)))
    q6 = q.reshape(t, TILE, g, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)  # [t, g, c, column, u % 2, e]
    nibbles = (q6[..., 0::2] | (q6[..., 1::2] << 4)).reshape(t, g, 256)  # word u: bytes 2u, 2u + 1
    ss = s.reshape(t, TILE, g).permute(0, 2, 1).contiguous()  # [t, g, 16]
    zz = z.reshape(t, TILE, g).permute(0, 2, 1) - 136 * ss
    return torch.cat([nibbles, ss.view(torch.uint8), zz.contiguous().view(torch.uint8)], dim=-1).contiguous()


def pack_q8s(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 w = s q (q [n, k] int8, s [n]) -> the layout of `q8bf16_linear`: uint8
    [ceil(n/16), 16 k + 64], per tile k/4 chunks of 64 bytes (column j at bytes 4j..4j+3 =
    q[j, 4c..4c+3]), then the 16 scales in float32."""
    n, k = q.shape
    if k % 4 or scales.shape != (n,) or q.dtype != torch.int8:
        raise ValueError(f"int8 weights [{n}, {k}] need k a multiple of 4, int8 values and one scale a row")
    t = -(-n // TILE)
    chunks = _tiles(q, n).reshape(t, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(t, 16 * k)  # [t, k/4 * 64]
    s = _tiles(scales.to(torch.float32), n).reshape(t, TILE).contiguous().view(torch.uint8)  # [t, 64]
    return torch.cat([chunks.view(torch.uint8), s], dim=-1).contiguous()
