"""The Llama decoder as math: a layer's weights, RMSNorm, RoPE, and the one layer loop.

Nothing here holds state: the runner (runner.py) and the compiled graph (compile.py) both call
`decoder_stack` with their own layers, attention and RoPE rows, so the eager forward and the
graph compute the same thing layer for layer.

Numerics mirror HF's Llama exactly where it matters for parity: RoPE cos/sin from float32
inverse frequencies, cast to the compute dtype (kv.py); RMSNorm statistics in float32 (even
for float64 models) and the weight applied in the input dtype; logits in the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import features_of, tapped
from ..checkpoint import LlamaShape
from ..linear import Product


@dataclass
class Layer:
    """One decoder layer's weights, fused where two products read the same input; each
    projection stored as this device multiplies by it fastest (`linear.Projection`)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Product  # hidden -> (Hq + 2 Hkv) D: q, k, v side by side (+ bias)
    o: Product  # Hq D -> hidden (+ bias: llama attention_bias)
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Product  # hidden -> 2 I: gate and up side by side
    down: Product  # I -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: x32 * rsqrt(mean(x32^2) + eps) with x32 = x in float32 (whatever x's
    dtype, float64 included), then weight * (that in x's dtype). F.rms_norm without a weight
    is that very expression in one call: it computes in float32 for float32 and narrower inputs
    and returns x's dtype (bitwise equal on CPU, tests/test_native.py), so only float64 converts
    explicitly, two ops more."""
    if x.dtype == torch.float64:
        return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE as HF applies it, x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1).
    As sin = cat(s, s), rotate_half(x) * sin == roll(x, D/2) * cat(-s, s) exactly (a sign flip
    is exact), one op fewer: `sin_signed` is that cat(-s, s). The forward rotates the whole
    fused q/k/v output at once, the v heads with cos = 1 and sin = 0, which leaves them exactly
    as they were (v * 1 + roll(v) * 0 == v for finite v): one rotation per layer, and k and v
    stay side by side for the cache write."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def rope_rows(
    cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor, shape: LlamaShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin_signed ([cap, D] tables) at `positions` [T], laid out for the fused q/k/v
    heads: [T, Hq + 2 Hkv, D] each, the v heads with cos 1 and sin 0 (see `rotate`)."""
    T, qk, D = positions.shape[0], shape.heads + shape.kv_heads, shape.head_dim
    cos, sin = cos[positions][:, None], sin_signed[positions][:, None]  # [T, 1, D]
    v_cos = torch.ones(1, 1, D, dtype=cos.dtype, device=cos.device).expand(T, shape.kv_heads, D)
    return (
        torch.cat((cos.expand(T, qk, D), v_cos), dim=1),
        torch.cat((sin.expand(T, qk, D), torch.zeros_like(v_cos)), dim=1),
    )


def decoder_stack(
    x: torch.Tensor,
    layers: Iterable[Layer],
    attend: Callable[[int, torch.Tensor], torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: LlamaShape,
    taps: tuple[int, ...],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder layers over the embedded new tokens x [T, hidden]: the last layer's output
    [T, hidden] (before the final norm) and the tapped features [T, F] (or None). The one
    layer loop of the eager forward and the compiled graph alike.

    `attend(i, qkv)`: layer i's attention of the rotated q/k/v [T, Hq+2Hkv, D] (writing k and
    v into the cache) -> [T, Hq D]. `cos`, `sin`: the RoPE rows of the fed positions. `reduce`:
    tensor parallel, the sum over ranks of a row-parallel product (o and down hold this rank's
    columns, so each gives a partial sum); None in a single process."""
    T, F_qkv, D, eps = x.shape[0], shape.heads + 2 * shape.kv_heads, shape.head_dim, shape.eps
    found: dict[int, torch.Tensor] = {}  # tapped layer -> its input [T, hidden]
    for i, layer in enumerate(layers):
        tapped(x, i, taps, found)
        # attention: fused q/k/v projection, RoPE on all of it at once, k and v into the cache
        qkv = rotate(layer.qkv(rms_norm(x, layer.attn_norm, eps)).view(T, F_qkv, D), cos, sin)
        o = layer.o(attend(i, qkv))  # [T, hidden]
        x = (o if reduce is None else reduce(o)) + x

        # MLP: fused gate/up projection, SiLU gate, down projection
        gate, up = layer.gate_up(rms_norm(x, layer.mlp_norm, eps)).chunk(2, dim=-1)  # [T, I] each
        down = layer.down(F.silu(gate) * up)  # [T, hidden]
        x = (down if reduce is None else reduce(down)) + x
    tapped(x, shape.layers, taps, found)
    return x, features_of(taps, found)
