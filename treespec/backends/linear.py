"""How the native backend multiplies activations by a weight matrix: `Projection`.

On CPU the products are most of a forward, and how the weight is stored decides their speed
more than the dtype does. oneDNN can multiply by a weight reordered once into its kernel's
blocked layout (what inductor's weight freezing and IPEX do); plain `x @ W` / `F.linear` hand
the library a strided matrix on every call, so whatever reordering its kernel needs is redone
per call. A packed call also has a fixed cost of its own, larger than MKL's for a small fp32
weight, so fp32 weights below `MIN_PACKED_FP32` elements stay plain; bf16 weights are packed
wherever oneDNN serves bf16 (MKL has no fast bf16 path for them; an AVX2-only core has
neither, and multiplies them unpacked). The measurements behind these rules are in
docs/performance.md ("Native forward overhead on SmolLM2-135M").

So a `Projection` packs where oneDNN serves the dtype (CPU, float32 / bfloat16) and checks the
packed product against `F.linear` once, at construction; anywhere else (CUDA, float64, a torch
without oneDNN, a failed check, a small fp32 weight) it multiplies by W^T as plain BLAS does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import QUANTIZATIONS
from .kernels import bf16
from .kernels.q4q8 import (
    PackedQ4,
    PackedQ8,
    compiled,
    pack_q4_offsets,
    q4q8_linear,
    quantize_q4_1,
    quantize_q8_0,
)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MIN_PACKED_FP32 = 1 << 18  # fp32 weights with fewer elements multiply faster unpacked (MKL)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold weights of `dtype` on `device` in its packed layout. bf16 needs
    AVX512 (BW/VL/DQ) or AVX-NE-CONVERT: an AVX2-only core, or oneDNN capped below them by
    `ONEDNN_MAX_CPU_ISA`, multiplies bf16 weights unpacked."""
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


class Projection:
    """y = x @ W^T + b for x [T, in], W [out, in] (nn.Linear's layout), b [out] or None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        worth_it = weight.dtype != torch.float32 or weight.numel() >= MIN_PACKED_FP32
        self.packed = (
            _pack(weight, bias)
            if pack and worth_it and packing_available(weight.device, weight.dtype)
            else None
        )
        # unpacked: W^T [in, out]. A transposed view makes x @ W^T the very BLAS call F.linear
        # makes (float64: bitwise HF; CUDA: cuBLAS transposes for free; bf16 on a CPU without
        # oneDNN's bf16: torch's own bf16 kernel, whose one-row product reads W [out, in] row by
        # row, far faster than through W^T laid out [in, out]); a CPU float32 weight is laid out
        # [in, out], which MKL multiplies faster per row than F.linear's layout
        if self.packed is not None:
            self.weight_t = None  # the packed copy replaces it
        elif weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.weight_t = weight.t().contiguous()
        else:
            self.weight_t = weight.contiguous().t()

    @property
    def weight(self) -> torch.Tensor | None:
        """W [out, in] (a view of the unpacked weight), or None where only the packed copy is kept."""
        return None if self.weight_t is None else self.weight_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed is not None:
            return _packed_product(x, self.packed, self.bias)
        return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """W in oneDNN's layout, or None where packing fails or its product disagrees with F.linear
    on a probe (a torch whose private oneDNN ops changed must fall back, not answer wrong)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = _packed_product(probe, packed, bias)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return None
    want = F.linear(probe, weight, bias)
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    scale = want.abs().max().item() + 1e-6
    if got.shape != want.shape or not (got - want).abs().max().item() <= tol * scale:
        return None
    return packed


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what quantized products compute in
WIDE_ROWS = 3  # rows from which a `QuantizedProjection` with a wide copy multiplies by it
INT4_GROUP = 32  # input columns per int4 scale and offset: one GGUF Q4_0 / Q4_1 block
INT4_ROWS = 16  # torch's int4 layout packs output rows in multiples of this


Q4Q8_DTYPES = (torch.float32, torch.bfloat16)  # what q4q8 products take as input


def check_quantize(quantize: str, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """A ValueError unless `quantize` is a known format, `dtype` one its products compute in
    and `device` (None: not checked) one they run on (q4q8: CPU only)."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantize {quantize!r}; choose None or one of {', '.join(QUANTIZATIONS)}")
    if quantize == "q4q8":
        if dtype not in Q4Q8_DTYPES:
            raise ValueError(f"quantize='q4q8' computes in float32 or bfloat16, not {dtype}")
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(
                f"quantize='q4q8' runs on a CPU only (its kernel is C++ for x86 cores), not on "
                f"{torch.device(device).type}; use int8 or int4 there"
            )
    elif dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"quantize={quantize!r} computes in float32, bfloat16 or float16, not {dtype}")


class QuantizedProjection:
    """y = x @ (Q * s)^T + b with Q [out, in] int8 and s [out] one scale per output row
    (symmetric, s = max|W_row| / 127; gpt-fast's weight-only int8): half the bytes of bf16
    per product, through torch's `_weight_int8pack_mm` kernel (fast with bf16 inputs on CPU,
    slow with float32 ones; inductor lowers it in compiled graphs). A different matrix from
    W, so a different model: lossless for a draft (any q is), the quantized model's own
    distribution for a target."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        wide: bool = False,
        tiles: bool = False,
        float_out: bool = False,
    ):
        """`tiles`: also lay Q out for `kernels.bf16`'s q8bf16_linear (bfloat16, an AVX512-BF16
        CPU with the kernels built: `kernels.built`), which then multiplies every bf16 product:
        each weight tile unpacked once for all rows, rows independent (SmolLM2's output layer,
        2 threads: 0.6 / 1.4 / 3.3 ms at 1 / 8 / 16 rows against int8pack's 1.2 / 6.6 / 12.8).
        `wide`, where there are no tiles: keep Q in oneDNN's packed layout, in W's dtype (its
        integers exactly), for products of WIDE_ROWS rows or more (2.1 / 3.4 ms at 8 / 16 rows),
        at twice the int8 copy's bytes. `float_out` (an output layer): the tiles' float32 totals
        as they are, not rounded to bfloat16 (logits one bf16 step apart are not tied)."""
        check_quantize("int8", weight.dtype)
        self.float_out = float_out
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        w = weight.to(torch.float32, copy=True)  # a copy of its own, rounded in place
        scales = torch.linalg.vector_norm(w, ord=float("inf"), dim=1).clamp_(min=1e-12).div_(127)  # [out]
        self.weight_int8 = w.div_(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # [out, in]
        self.scales = scales.to(weight.dtype)  # [out], the kernel takes them in x's dtype
        self.tiles = self.wide = None
        if (
            tiles
            and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and self.in_features % 4 == 0
            and bf16.available(build=False)
        ):
            self.tiles = bf16.pack_q8s(self.weight_int8, self.scales.float())
        elif wide and packing_available(weight.device, weight.dtype):
            self.wide = _pack(self.weight_int8.to(weight.dtype), None)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized W [out, in] (Q * s, in the compute dtype): the matrix this multiplies by."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.tiles is not None and x.dtype == torch.bfloat16:
            n, f32 = self.out_features, self.float_out  # float32 totals, not bf16
            return torch.ops.treespec.q8bf16_linear(x, self.tiles, self.bias, n, f32)
        if self.wide is not None and x.shape[0] >= WIDE_ROWS and x.dtype == self.scales.dtype:
            y = _packed_product(x, self.wide, None) * self.scales  # x @ Q^T, then the scales
        else:
            y = int8_product(x, self.weight_int8, self.scales)
        return y if self.bias is None else y + self.bias


def int8_product(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ (weight_int8 [out, in] * scales [out, 1])^T -> [T, out], in x's dtype."""
    return torch.ops.aten._weight_int8pack_mm(x, weight_int8, scales)


class Int4Projection:
    """y = x @ W^T + b with W [out, in] held in 4 bits an entry: in groups of INT4_GROUP input
    columns, W = (Q - 8) * s + z with Q in 0..15 and one scale s and offset z per group and
    output row, torch's int4 layout (`_weight_int4pack_mm_for_cpu`: a quarter of bf16's bytes).

    GGUF's Q4_0 (w = d (q - 8): s = d, z = 0) and Q4_1 (w = d q + m: s = d, z = m + 8 d)
    blocks are this layout exactly, so a file's 4-bit weights run as they are (`from_blocks`,
    the scales in the compute dtype: exact in float32 and float16, rounded to bfloat16's 8 bits
    there); any other weight is quantized with Q4_1's rule (`quantize`). Like int8, another
    model than the float weights': lossless for a draft, the 4-bit model's own for a target.
    The kernel is fast in bfloat16 (on AVX512 and AVX2 cores) and slow in float32
    (docs/performance.md). `tiles`: bfloat16 inputs multiply through
    `kernels.bf16`'s q4bf16_linear where it runs (AVX512-BF16 cores, the kernels built: `kernels.built`):
    the same matrix, each weight tile unpacked once for all rows of the call (a tree's), rows
    independent of each other."""

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        dtype,
        tiles: bool = False,
    ):
        """q [out, in] integers 0..15; scales, zeros [out, in / INT4_GROUP]; `dtype`: the
        compute dtype (x's); `tiles`: also lay W out for `kernels.bf16`'s q4bf16_linear (bfloat16, an
        AVX512-BF16 CPU; otherwise ignored)."""
        check_quantize("int4", dtype)
        self.out_features, self.in_features = q.shape
        groups = self.in_features // INT4_GROUP
        if (
            self.in_features % INT4_GROUP
            or scales.shape != (self.out_features, groups)
            or zeros.shape != scales.shape
        ):
            raise ValueError(
                f"int4 weights need rows of whole groups of {INT4_GROUP} with one scale and offset "
                f"each: got q {tuple(q.shape)}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}"
            )
        if self.out_features % INT4_ROWS:
            raise ValueError(
                f"int4 weights need a multiple of {INT4_ROWS} output rows (torch's int4 layout), not "
                f"{self.out_features}; use int8 for this one"
            )
        self.bias = bias
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = (
            torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        )  # [in/G, out, 2]
        self.tiles = None
        # where the kernels are built already: a default model's load never waits for a compiler
        if tiles and dtype == torch.bfloat16 and q.device.type == "cpu" and bf16.available(build=False):
            s, z = self.scales_and_zeros.float().unbind(-1)  # the values aten multiplies by
            self.tiles = bf16.pack_q4s(q, s.t(), z.t())

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether a weight [out_features, in_features] suits torch's int4 layout: whole groups
        of INT4_GROUP inputs, a multiple of INT4_ROWS outputs (what the constructor requires)."""
        return in_features % INT4_GROUP == 0 and out_features % INT4_ROWS == 0

    @classmethod
    def from_blocks(
        cls, q_packed, scales, zeros, bias=None, dtype=torch.bfloat16, tiles=False
    ) -> Int4Projection:
        """From `pack_nibbles`' [out, in / 2] bytes and the scales and offsets per group."""
        return cls(unpack_nibbles(q_packed), scales, zeros, bias, dtype, tiles)

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: bool = False
    ) -> Int4Projection:
        """W [out, in] by Q4_1's rule, per group: s = (max - min) / 15, Q = round((w - min) / s)."""
        out, n = weight.shape
        if n % INT4_GROUP:
            raise ValueError(f"int4 needs rows of whole groups of {INT4_GROUP} columns, not {n}")
        w = weight.float().reshape(out, n // INT4_GROUP, INT4_GROUP)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
        scales = (hi - lo) / 15
        q = ((w - lo[..., None]) / scales.clamp(min=1e-30)[..., None]).round().clamp(0, 15)
        return cls(q.reshape(out, n), scales, lo + 8 * scales, bias, weight.dtype, tiles)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized W [out, in] in the compute dtype: the matrix this multiplies by (the
        aten kernel's own product with the identity)."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return int4_product(eye, self.packed, self.scales_and_zeros).t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.tiles is not None and x.dtype == torch.bfloat16:
            return torch.ops.treespec.q4bf16_linear(x, self.tiles, self.bias, self.out_features)
        y = int4_product(x, self.packed, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ W^T -> [T, out] for `Int4Projection`'s packed W, in x's dtype."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_and_zeros)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] integers 0..15 -> [out, in / 2] uint8: column 2j in the low nibble, 2j + 1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` undone: [out, in / 2] uint8 -> [out, in] uint8."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


class Q4Q8Projection:
    """y = x @ W^T + b with W in GGUF's 4-bit form (per output row and group of 32 inputs
    w = d q + m; an output layer in the 8-bit form w = d q, `quantize8`, as GGUF files keep
    it) and x rounded to int8 per row and group of 32 on every call
    (`kernels.q4q8_linear`, documented in kernels/q4q8.py): the int4 weights' bytes, with a
    cost that grows slowly with the number of rows, and a row's result independent of the
    other rows of the call. Rounding the activations makes it another model than `Int4Projection`
    over the same weights (DESIGN.md, "A precision is a model"). CPU only; x float32 or
    bfloat16, y in x's dtype (the kernel's float32 result, rounded once for bfloat16)."""

    def __init__(self, packed: PackedQ4 | PackedQ8, bias: torch.Tensor | None, dtype: torch.dtype):
        """`packed`: W in the kernel's layout (`from_blocks`, `quantize`, `quantize8`); `dtype`: x's."""
        check_quantize("q4q8", dtype)
        self.packed, self.dtype = packed, dtype
        self.out_features, self.in_features = packed.n, packed.k
        if bias is not None and bias.device.type != "cpu":
            raise ValueError(f"quantize='q4q8' runs on a CPU only, not on {bias.device.type}")
        self.bias = None if bias is None else bias.to(torch.float32)
        compiled()  # the op registered (built on first use) before any graph traces or loads it

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether a weight [out_features, in_features] suits the kernel: whole groups of 32 inputs."""
        return in_features > 0 and in_features % INT4_GROUP == 0 and out_features > 0

    @staticmethod
    def check(weight: torch.Tensor) -> None:
        """A ValueError unless `weight` [out, in] is on a CPU and fits (`fits`)."""
        if weight.device.type != "cpu":
            raise ValueError(f"quantize='q4q8' runs on a CPU only, not on {weight.device.type}")
        if not Q4Q8Projection.fits(*weight.shape):
            raise ValueError(
                f"quantize='q4q8' needs rows of whole groups of {INT4_GROUP} inputs, not a weight "
                f"{tuple(weight.shape)}"
            )

    @classmethod
    def from_blocks(cls, q_packed, scales, zeros, bias=None, dtype=torch.float32) -> Q4Q8Projection:
        """From `pack_nibbles`' [out, in / 2] bytes and a GGUF file's scales and offsets per
        group (w = (q - 8) s + z, the int4 form): its own numbers, not rounded again."""
        return cls(pack_q4_offsets(unpack_nibbles(q_packed), scales, zeros), bias, dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q4Q8Projection:
        """W [out, in] by GGUF's Q4_1 rule (`kernels.quantize_q4_1`), computing in W's dtype."""
        cls.check(weight)
        return cls(quantize_q4_1(weight), bias, weight.dtype)

    @classmethod
    def quantize8(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q4Q8Projection:
        """W [out, in] by GGUF's Q8_0 rule (`kernels.quantize_q8_0`: a weight dequantised from
        Q8_0 blocks gets those blocks back), computing in W's dtype."""
        cls.check(weight)
        return cls(quantize_q8_0(weight), bias, weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized W [out, in] (d q + m or d q, exact in float32), in the compute dtype."""
        return self.packed.dequantize(torch.float32).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = q4q8_linear(x, self.packed, self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


# what a layer's projection may be
Product = Projection | QuantizedProjection | Int4Projection | Q4Q8Projection
