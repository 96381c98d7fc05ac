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
        # makes (float64: bitwise HF; CUDA: cuBLAS transposes for free); a CPU float32/bf16
        # weight is laid out [in, out], which multiplies faster per row than F.linear's layout
        if self.packed is not None:
            self.weight_t = None  # the packed copy replaces it
        elif weight.device.type == "cpu" and weight.dtype != torch.float64:
            self.weight_t = weight.t().contiguous()
        else:
            self.weight_t = weight.t()

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


QUANTIZATIONS = ("int8",)  # weight-only formats a `QuantizedProjection` stores
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what int8 products compute in


def check_quantize(quantize: str, dtype: torch.dtype) -> None:
    """A ValueError unless `quantize` is a known format and `dtype` one its products compute in."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantize {quantize!r}; choose None or one of {', '.join(QUANTIZATIONS)}")
    if dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"quantize={quantize!r} computes in float32, bfloat16 or float16, not {dtype}")


class QuantizedProjection:
    """y = x @ (Q * s)^T + b with Q [out, in] int8 and s [out] one scale per output row
    (symmetric, s = max|W_row| / 127; gpt-fast's weight-only int8): half the bytes of bf16
    per product, through torch's `_weight_int8pack_mm` kernel (AVX-512 on CPU; inductor lowers
    it in compiled graphs). A different matrix from W, so a different model: lossless for a
    draft (any q is), the quantized model's own distribution for a target."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, quantize: str = "int8"):
        check_quantize(quantize, weight.dtype)
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        self.weight_int8 = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
        self.scales = scales.to(weight.dtype)  # [out], the kernel takes them in x's dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized W [out, in] (Q * s, in the compute dtype): the matrix this multiplies by."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = int8_product(x, self.weight_int8, self.scales)
        return y if self.bias is None else y + self.bias


def int8_product(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ (weight_int8 [out, in] * scales [out, 1])^T -> [T, out], in x's dtype."""
    return torch.ops.aten._weight_int8pack_mm(x, weight_int8, scales)
