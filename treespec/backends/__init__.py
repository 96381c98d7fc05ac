"""Model backends behind one seam: a `Runner` scores token trees and commits accepted paths.

    base.py    the Runner interface and its bookkeeping (committed prefix, pending tree,
               tree mask from parent pointers, positions); every backend shares it
    hf.py      a Hugging Face model over a DynamicCache, plus everything else that imports
               transformers (loading, tokenizer, EOS lookup, logging)
    native.py  a lean static-cache forward for Llama-architecture checkpoints
    attention.py  tree attention math for native.py (masked attention with LSE, the
               flash-attn cascade)

`make_runner` picks a backend for a model: "native" where the architecture is supported,
else "hf" (with a one-line notice when "auto" had to fall back).
"""

from __future__ import annotations

import functools
import sys
import time

import torch

from .base import Runner

BACKENDS = ("auto", "native", "hf")


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def use_native(backend: str, reason: str | None, what: str) -> bool:
    """Whether `backend` runs `what` natively, given why the native backend cannot (`reason`,
    None: it can). An unsupported model is an error under "native" and falls back to "hf"
    under "auto", with a one-line notice."""
    check_backend(backend)
    if backend == "hf":
        return False
    if reason is None:
        return True
    if backend == "native":
        raise ValueError(f"the native backend cannot run {what}: {reason}; use backend='hf'")
    print(f"treespec: native backend unsupported ({reason}); using the Hugging Face backend", file=sys.stderr)
    return False


def make_runner(model, backend: str = "auto") -> Runner:
    """A `Runner` for `model` (a Runner is returned as is; an HF causal LM gets wrapped)."""
    check_backend(backend)
    if isinstance(model, Runner):
        return model
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(
            f"expected a Hugging Face causal LM or a treespec Runner, got {type(model).__name__}; "
            f"load one with SpeculativeDecoder.from_pretrained(path)"
        )
    from .checkpoint import unsupported_reason
    from .hf import HFRunner
    from .native import NativeRunner

    if backend != "hf" and use_native(backend, unsupported_reason(model.config), "this model"):
        return NativeRunner.from_hf(model)
    return HFRunner(model)


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # bf16 matrix instructions (AMX tiles, AVX-512 dot products)


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """Which of `BF16_CPU_FLAGS` this CPU reports (Linux; an empty set where unreadable)."""
    return set(BF16_CPU_FLAGS) & set(_cpuinfo_field("flags", cpuinfo).split())


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

    CUDA: bf16 for both. CPU: the draft in fp32 (a small draft is bound by per-op overhead:
    0.30 ms per token in fp32 against 0.39-0.45 ms in bf16 for the bundled 1.4M-param draft,
    packed projections). The target in bf16 where the CPU has AMX; with AVX512-BF16 but no
    AMX, only where bf16 products measure faster than fp32 on this very CPU, multiplied as the
    native backend multiplies (`bf16_matmul_is_faster`, once per process); else fp32. The
    AVX512-BF16 case goes both ways: on a 2-core AMD EPYC the bundled target's forward of 1 / 13
    tokens costs 2.0 / 3.6 ms in bf16 against 3.4 / 4.7 ms in fp32 (packed projections), while
    on a 2-core Intel Xeon (AVX512-BF16, no AMX exposed) bf16 cost 9.7 / 12.0 ms against 6.9 /
    17.8 ms before packing, and its batch-8 decode loop spent 211 ms in matrix products in
    bf16 against 132 ms in fp32 (README, "Defaults"). Pass a dtype explicitly to override.
    """
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu" or role != "target":
        return torch.float32
    flags = cpu_bf16_flags()
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
            x = torch.randn(rows, 1024, generator=g).to(dtype)
            times = []
            for i in range(18):
                t0 = time.perf_counter()
                proj(x)
                if i >= 3:  # the first calls pay for allocation and primitive creation
                    times.append(time.perf_counter() - t0)
            median[dtype, rows] = sorted(times)[len(times) // 2]
    return all(median[torch.bfloat16, rows] < margin * median[torch.float32, rows] for rows in (1, 16))


__all__ = [
    "BACKENDS",
    "Runner",
    "auto_dtype",
    "bf16_matmul_is_faster",
    "check_backend",
    "cpu_bf16_flags",
    "cpu_model",
    "make_runner",
    "use_native",
]
