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


def make_runner(model, backend: str = "auto") -> Runner:
    """A `Runner` for `model` (a Runner is returned as is; an HF causal LM gets wrapped)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(model, Runner):
        return model
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(
            f"expected a Hugging Face causal LM or a treespec Runner, got {type(model).__name__}; "
            f"load one with SpeculativeDecoder.from_pretrained(path)"
        )
    from .hf import HFRunner

    if backend == "hf":
        return HFRunner(model)
    from .native import NativeRunner, unsupported_reason

    reason = unsupported_reason(model.config)
    if reason is None:
        return NativeRunner.from_hf(model)
    if backend == "native":
        raise ValueError(f"the native backend cannot run this model: {reason}; use backend='hf'")
    print(f"treespec: native backend unsupported ({reason}); using the Hugging Face backend", file=sys.stderr)
    return HFRunner(model)


def has_amx() -> bool:
    """True if this CPU has AMX tiles for bf16 matmuls (Linux /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any("amx_bf16" in line for line in f if line.startswith("flags"))
    except OSError:
        return False


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where it is fast (CUDA, or a CPU with AMX), else fp32.

    Measured on the bundled pair: see the README's "Defaults" section for the numbers.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and has_amx() else torch.float32


__all__ = ["BACKENDS", "Runner", "auto_dtype", "has_amx", "make_runner"]
