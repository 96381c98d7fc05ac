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

import sys

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
    from .hf import HFRunner
    from .native import NativeRunner, unsupported_reason

    if backend != "hf" and use_native(backend, unsupported_reason(model.config), "this model"):
        return NativeRunner.from_hf(model)
    return HFRunner(model)


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # bf16 matrix instructions (AMX tiles, AVX-512 dot products)


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """Which of `BF16_CPU_FLAGS` this CPU reports (Linux; an empty set where unreadable)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return set()
    return set(BF16_CPU_FLAGS) & set(flags)


def auto_dtype(device: torch.device | str, role: str = "target") -> torch.dtype:
    """The dtype `dtype="auto"` picks for a model in `role` ("target" or "draft").

    CUDA: bf16 for both. CPU: the target in bf16 where the CPU has bf16 matrix instructions
    (AMX or AVX512-BF16), else fp32; the draft in fp32. Measured on the bundled pair on a
    2-core EPYC with AVX512-BF16 and no AMX (README, "Defaults"): the target's forward of 1 /
    17 tokens costs 5.8 / 9.1 ms in bf16 against 8.3 / 18.9 ms in fp32, while the 1.4M-param
    draft, bound by per-op overhead and its lm_head GEMV, costs 0.82 ms per token in bf16
    against 0.50 ms in fp32 with warm caches (c = 0.086 instead of 0.14). Inside the decode
    loop, where the target's forward has just evicted the draft's weights from cache, the two
    draft dtypes measured within noise of each other end to end. Without either flag oneDNN
    emulates bf16 and fp32 wins. Pass a dtype explicitly (a large draft on an AMX CPU may
    prefer bf16).
    """
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and role == "target" and cpu_bf16_flags():
        return torch.bfloat16
    return torch.float32


__all__ = ["BACKENDS", "Runner", "auto_dtype", "check_backend", "cpu_bf16_flags", "make_runner", "use_native"]
