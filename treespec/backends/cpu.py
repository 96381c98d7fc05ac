"""What this machine's processor offers, for choosing dtypes and weight formats: bf16 matrix
instructions read from /proc/cpuinfo, and one-off measurements of whether bf16 products beat
fp32 here and whether int4 products beat the dtype's own."""

from __future__ import annotations

import functools
import time

import torch

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # bf16 matrix instructions (AMX tiles, AVX-512 dot products)


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """Which of `BF16_CPU_FLAGS` this CPU reports (Linux; an empty set where unreadable)."""
    return set(BF16_CPU_FLAGS) & set(_cpuinfo_field("flags", cpuinfo).split())


def bf16_kernels_enabled() -> bool:
    """Whether torch may run bf16 matrix instructions here: its kernels dispatch at AVX512 or
    above and oneDNN serves bf16. False on an AVX2-only core, and on any core told to act as a
    plainer one (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`: how the tests run the
    AVX2 path on any machine), whatever /proc/cpuinfo lists."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("cpu" where unreadable)."""
    return _cpuinfo_field("model name", cpuinfo) or "cpu"


def _cpuinfo_field(key: str, cpuinfo: str) -> str:
    """The value of the first `key : value` line of `cpuinfo` ("" if absent or unreadable)."""
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), "")
    except OSError:
        return ""


def auto_dtype(device: torch.device | str, role: str = "target") -> torch.dtype:
    """The dtype `dtype="auto"` picks for a model in `role` ("target" or "draft").

    CUDA: bf16 for both. CPU: the draft in fp32 (a small draft is bound by per-op overhead,
    which bf16 does not shorten). The target in bf16 where the CPU has AMX; with AVX512-BF16
    but no AMX only where bf16 products measure faster than fp32 on this very CPU
    (`bf16_matmul_is_faster`, once per process), since that goes both ways across such CPUs
    (docs/performance.md, "Defaults"); else fp32, as where torch may not use the flags
    (`bf16_kernels_enabled`). Pass a dtype explicitly to override.
    """
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu" or role != "target":
        return torch.float32
    flags = cpu_bf16_flags() if bf16_kernels_enabled() else set()
    if "amx_bf16" in flags or ("avx512_bf16" in flags and bf16_matmul_is_faster()):
        return torch.bfloat16
    return torch.float32


@functools.cache
def bf16_matmul_is_faster(margin: float = 0.9) -> bool:
    """Whether bf16 matrix products beat fp32 on this CPU, measured the way the native backend
    multiplies (`linear.Projection`, packed where oneDNN can): a decode-shaped product
    (1 x 1024 @ 1024 x 2048) and a tree-shaped one (16 rows), median of 15 each after a warm-up;
    bf16 must take under `margin` of fp32's time in both. About 30 ms, once per process."""
    from .linear import Projection

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=g)
    median = {}
    for dtype in (torch.float32, torch.bfloat16):
        proj = Projection(weight.to(dtype))
        for rows in (1, 16):
            median[dtype, rows] = _median_seconds(proj, torch.randn(rows, 1024, generator=g).to(dtype))
    return all(median[torch.bfloat16, rows] < margin * median[torch.float32, rows] for rows in (1, 16))


@functools.cache
def int4_matmul_is_faster(dtype: torch.dtype, margin: float = 0.9) -> bool:
    """Whether an int4 product (`linear.Int4Projection`) of one row takes under `margin` of the
    dense one in `dtype` (`linear.Projection`, packed where oneDNN can) on this CPU: the decode
    step's product, 1 x 1024 @ 1024 x 2048, median of 15 after a warm-up. torch's int4 kernel
    is fast in bf16 on AVX512 cores and far slower than dense in float32; a tree's many rows
    favour dense weights, which the automatic tree accounts for with the measured t(n). About
    20 ms, once per process and dtype; False where int4 cannot compute in `dtype`."""
    from .linear import QUANTIZABLE_DTYPES, Int4Projection, Projection

    if dtype not in QUANTIZABLE_DTYPES:
        return False
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=g).to(dtype)
    x = torch.randn(1, 1024, generator=g).to(dtype)
    median = {
        kind: _median_seconds(proj, x)
        for kind, proj in (("dense", Projection(weight)), ("int4", Int4Projection.quantize(weight)))
    }
    return median["int4"] < margin * median["dense"]


def _median_seconds(product, x: torch.Tensor, calls: int = 15, warmup: int = 3) -> float:
    """The median time of `calls` calls `product(x)` after `warmup` untimed ones (the first
    calls pay for allocation and primitive creation)."""
    times = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        product(x)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
