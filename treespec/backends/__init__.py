"""Model backends behind one seam: a `Runner` scores token trees and commits accepted paths.

    base.py        the Runner interface and its bookkeeping (committed prefix, pending tree,
                   tree mask from parent pointers, positions); every backend shares it
    native/        a lean static-cache forward for Llama-architecture checkpoints: its model,
                   cache, weights, sharding and compiled graphs apart (see native/__init__.py)
    attention.py   tree attention math for the native forward (masked attention with LSE, the
                   flash-attn cascade)
    linear.py      how the native forward multiplies by a weight (packed, int8, int4)
    checkpoint.py  Llama-architecture config and safetensors weights, without transformers
    hf.py          a Hugging Face model over a DynamicCache, plus everything else that imports
                   transformers (loading, tokenizer, EOS lookup, logging)
    head.py        a feature head (EAGLE-3) as a one-layer native runner
    subset.py      a draft over a subset of the target's vocabulary, wrapping another runner
    cpu.py         what this machine's processor offers (dtype and weight-format choices)

`make_runner` picks a backend for a model: "native" where the architecture is supported,
else "hf" (with a one-line notice when "auto" had to fall back).
"""

from __future__ import annotations

import sys

import torch

from .base import Runner
from .cpu import auto_dtype, bf16_kernels_enabled, bf16_matmul_is_faster, cpu_bf16_flags, cpu_model

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


def make_runner(model, backend: str = "auto", compile: bool = False) -> Runner:
    """A `Runner` for `model` (a Runner is returned as is; an HF causal LM gets wrapped;
    `compile`: the native runner's inductor forward)."""
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
        return NativeRunner.from_hf(model, compile=compile)
    return HFRunner(model)


__all__ = [
    "BACKENDS",
    "Runner",
    "auto_dtype",
    "bf16_kernels_enabled",
    "bf16_matmul_is_faster",
    "check_backend",
    "cpu_bf16_flags",
    "cpu_model",
    "make_runner",
    "use_native",
]
