"""What a model computes in: its device, its dtype and its weights format, "auto" decided here.

    resolve_device / resolve_dtype   what a user typed, as a torch device and dtype that exist
    quantize_setting                 a --quantize / --draft-quantize flag as the loader takes it
    resolve_weights                  the target's dtype and weights format ("auto" for either)
    resolve_quantize                 a draft model's or a feature head's weights format

Every front end (the Python API, the CLI, bench, distill) asks these; no other module reads
"auto" or "none" for a weights format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..backends import auto_dtype
from .paths import checkpoint


def resolve_device(device) -> torch.device:
    """`device` (None = CPU) as a torch.device that exists on this machine, or a ValueError
    saying which devices do."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)) and not (
        isinstance(device, int) and not isinstance(device, bool)
    ):
        raise ValueError(f"device must be a string like 'cpu' or 'cuda:0', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N' (or 'mps' on a Mac)"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no weights; use 'cpu' or 'cuda'")
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else getattr(torch.backends, "mps", None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(
            f"device {device!r} is not available on this machine (torch {torch.__version__}); use "
            "device='cpu'"
        )
    count = getattr(backend, "device_count", None)
    n = count() if count is not None else 1
    if dev.index is not None and dev.index >= n:
        raise ValueError(
            f"device {device!r} is not available: this machine has {n} {dev.type} device(s), "
            f"{dev.type}:0 .. {dev.type}:{n - 1}"
        )
    return dev


def resolve_dtype(dtype, device: torch.device, role: str = "target") -> torch.dtype:
    """A torch dtype, or its name, or "auto" (`treespec.backends.auto_dtype` for `role`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, role)
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32' or 'bfloat16'")
    return getattr(torch, dtype)


def quantize_setting(value: str | None) -> str | None:
    """A --quantize / --draft-quantize flag as `from_pretrained` takes it: "none" is None (dense
    weights); "auto", "int8", "int4", "q4q8" as given."""
    return None if value == "none" else value


def resolve_weights(
    dtype, quantize, path, device: torch.device, backend: str = "auto", tp=None, compile: bool | str = False
) -> tuple[torch.dtype, str | None]:
    """The target's dtype and weights format, from what was asked ("auto" for either, or a
    dtype and None / "int8" / "int4" / "q4q8").

    `quantize="auto"` is "int4" where the checkpoint at `path` (`checkpoint`, asked only
    then: a bad dtype fails first) carries a GGUF file's own 4-bit blocks (the file's model
    exactly, a quarter of bf16's bytes), the native backend runs the whole target (no `tp`)
    on a CPU, and a one-row int4 product measures under 0.9x the dense one
    (`backends.cpu.int4_matmul_is_faster`); with `dtype="auto"` too, int4 may compute in bf16
    where the auto dtype is float32: torch's int4 kernel is fast with bf16 inputs on AVX512
    and AVX2 cores and slow with float32 ones, so an AVX2-only core, whose dense products
    stay float32, runs the file's blocks fastest in bf16. Else None: the file's weights
    dequantized into the dtype.

    In place of that int4, "q4q8" (the same blocks times activations rounded to int8: another
    model, as llama.cpp's Q4 x Q8 is, docs/performance.md) where its compiled kernels are built
    here already (or `compile=True`, the one-time step that builds them, asks now) and its
    products measure faster than int4's in that dtype (`backends.cpu.q4q8_matmul_is_faster`):
    a first run never waits for a compiler, and the step that builds the graphs builds them
    for the weights later runs choose."""
    resolved = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device, "target")
    if quantize != "auto":
        return resolved, quantize
    from ..backends.checkpoint import BLOCKS_FILE
    from ..backends.cpu import int4_matmul_is_faster, q4q8_matmul_is_faster

    if not (tp is None and device.type == "cpu" and backend != "hf"):
        return resolved, None
    local = checkpoint(path)
    if not (isinstance(local, Path) and (local / BLOCKS_FILE).is_file()):
        return resolved, None
    if int4_matmul_is_faster(resolved):
        chosen = resolved
    elif dtype == "auto" and resolved != torch.bfloat16 and int4_matmul_is_faster(torch.bfloat16, resolved):
        chosen = torch.bfloat16
    else:
        return resolved, None
    if compile is True:
        from ..backends.kernels import q4q8

        q4q8.compiled()  # the one-time step builds the kernels anyway: its graphs are q4q8's if faster
    return chosen, "q4q8" if q4q8_matmul_is_faster(chosen) else "int4"


def resolve_quantize(
    quantize, path, dtype: torch.dtype, device: torch.device, backend: str = "auto", tp=None, head_of=None
) -> str | None:
    """The weights format of a draft at `path` computing in `dtype`: `quantize` as given, or for
    "auto": a draft model's as a target's would be (`resolve_weights`, None on the HF backend);
    a feature head's (`head_of`: its target runner) on a CPU: q4q8 where the target runs q4q8
    and the head's shapes suit the kernel, else int4 where its int4 products in `dtype` measure
    faster than dense ones (`cpu.int4_matmul_is_faster`) and its shapes suit torch's int4
    layout, else None."""
    if quantize != "auto":
        return quantize
    if head_of is None:  # "auto" quantizes only where the native backend runs the checkpoint
        return None if backend == "hf" else resolve_weights(dtype, quantize, path, device, backend, tp)[1]
    from ..backends.cpu import int4_matmul_is_faster
    from ..backends.head import HeadConfig, head_weight_shapes
    from ..backends.linear import Q4Q8_DTYPES, Int4Projection, Q4Q8Projection

    cfg = HeadConfig.from_json(json.loads((Path(path) / "config.json").read_text()), head_of.n_layers)
    products = ("fc.weight", "lm_head.weight")
    shapes = [s for n, s in head_weight_shapes(cfg).items() if n in products or n.endswith("proj.weight")]
    if device.type != "cpu":
        return None
    if (
        getattr(head_of, "quantize", None) == "q4q8"
        and dtype in Q4Q8_DTYPES
        and all(Q4Q8Projection.fits(*s) for s in shapes)
    ):
        return "q4q8"  # the target's kernel, already built and chosen
    return "int4" if all(Int4Projection.fits(*s) for s in shapes) and int4_matmul_is_faster(dtype) else None
