"""Attention whose rows are independent: `torch.ops.treespec.row_attention(q, k, v, mask,
scale)` (attention.cpp). A query row's result depends only on the keys it sees, in slot order,
never on the other rows of the call, the span or where masked keys sit, so a tree node scores
bit for bit as its path alone and greedy speculative decoding equals greedy plain decoding
token for token. torch's CPU SDPA rounds a row by its span and the mask's layout.

AVX512 cores (built with the other kernels: `q4q8.compiled`); elsewhere the native backend
keeps SDPA (`backends.attention`)."""

from __future__ import annotations

import torch

from .q4q8 import runs


def available(build: bool = True) -> bool:
    """Whether `row_attention` runs here (an AVX512 core; `q4q8.runs`)."""
    return runs("row_attention_available", build)


def row_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    lanes: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D]; k, v [B, Hkv, S, D] (views of a cache: unit stride on D only); mask bool
    [n, S] (True = attend); `lanes` int64 [n]: the lane each row reads (None: B = 1). Returns
    [n, Hq * D] in q's dtype (float32 or bfloat16)."""
    return torch.ops.treespec.row_attention(q, k, v, mask, lanes, scale)
