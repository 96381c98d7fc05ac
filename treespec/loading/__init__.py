"""Loading models, tokenizers and checkpoints: devices, dtypes, local directories, hub ids, GGUF.

    resolve_device / resolve_dtype   what a user typed, as a torch device and dtype that exist
    resolve_weights                  the target's dtype and weight format, "auto" decided
    checkpoint(path)                 a model directory: a local one, a hub id, or a GGUF file
                                     converted once into a cached directory (`loading.gguf`)
    load_runner(path, ...)           a `Runner`: the native backend straight from safetensors
                                     where it supports the architecture, else Hugging Face's
    load_tokenizer(path)             the tokenizer saved with a model (None if there is none)

Everything here runs once, before decoding; nothing here decides how to decode.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..backends import Runner, auto_dtype, check_backend, make_runner, use_native


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


def resolve_weights(
    dtype, quantize, path, device: torch.device, backend: str = "auto", tp=None
) -> tuple[torch.dtype, str | None]:
    """The target's dtype and weight format, from what was asked ("auto" for either, or a
    dtype and None / "int8" / "int4"), decided here and nowhere else.

    `quantize="auto"` is "int4" where the checkpoint at `path` (`checkpoint`, asked only
    then: a bad dtype fails first) carries a GGUF file's own 4-bit blocks (the file's model
    exactly, a quarter of bf16's bytes), the native backend runs the whole target (no `tp`)
    on a CPU, and a one-row int4 product measures under 0.9x the dense one
    (`backends.cpu.int4_matmul_is_faster`); with `dtype="auto"` too, int4 may compute in bf16
    where the auto dtype is float32: torch's int4 kernel is fast with bf16 inputs on AVX512
    and AVX2 cores and slow with float32 ones, so an AVX2-only core, whose dense products
    stay float32, runs the file's blocks fastest in bf16. Else None: the file's weights
    dequantized into the dtype."""
    resolved = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device, "target")
    if quantize != "auto":
        return resolved, quantize
    from ..backends.checkpoint import BLOCKS_FILE
    from ..backends.cpu import int4_matmul_is_faster

    if not (tp is None and device.type == "cpu" and backend != "hf"):
        return resolved, None
    local = checkpoint(path)
    if not (isinstance(local, Path) and (local / BLOCKS_FILE).is_file()):
        return resolved, None
    if int4_matmul_is_faster(resolved):
        return resolved, "int4"
    if dtype == "auto" and resolved != torch.bfloat16 and int4_matmul_is_faster(torch.bfloat16, resolved):
        return torch.bfloat16, "int4"
    return resolved, None


def checkpoint(path) -> str | Path:
    """The model directory behind `path`: a GGUF file (or a directory holding one and no
    config.json) is converted once into a cached directory; a local directory is checked; any
    other string is a hub id, returned as given."""
    from ..backends import hf

    if isinstance(path, (str, os.PathLike)):
        from . import gguf

        local = Path(path).expanduser()
        holds_gguf = local.is_dir() and not (local / "config.json").exists() and any(local.glob("*.gguf"))
        if local.suffix == ".gguf" or gguf.is_gguf(local) or holds_gguf:
            return gguf.convert(local)
    return hf.resolve_path(path)


def load_runner(
    path,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "auto",
    compile: bool = False,
    quantize: str | None = None,
    tp=None,
) -> Runner:
    """A runner for the checkpoint at `path` (`checkpoint`): native straight from safetensors
    when the backend allows it and the directory holds a supported checkpoint, else through HF.
    `compile`: the native runner's inductor forward (`NativeRunner(compile=True)`; ignored,
    with a warning, where it cannot compile; the HF backend has none). `quantize`: the native
    runner's weight-only quantization (`NativeRunner(quantize=...)`; "auto": `resolve_weights`);
    a ValueError where the checkpoint runs on the HF backend (but for "auto", which is None there).
    A draft with a subset vocabulary (`vocab_map.json` beside its weights) is wrapped so that
    it reads and proposes the target's token ids (`backends.subset`).
    `tp`: this rank's `treespec.parallel.TensorParallel` (the native backend only; each rank
    reads its blocks of the weights)."""
    from ..backends import hf, subset
    from ..backends.subset import VocabMap

    check_backend(backend)
    local = checkpoint(path)
    runner = None
    if tp is not None:
        reason = "" if isinstance(local, Path) else f" ({str(path)!r} is not a local directory or GGUF file)"
        if backend == "hf" or reason:
            raise ValueError(
                f"tensor parallelism runs the native backend on a local checkpoint{reason}; "
                "load the target with backend='auto' or 'native'"
            )
        backend = "native"  # an unsupported architecture is an error, not a fallback
    if backend != "hf" and isinstance(local, Path):
        from ..backends.checkpoint import read_json, unsupported_reason
        from ..backends.native import NativeRunner

        if use_native(backend, unsupported_reason(read_json(local / "config.json")), repr(str(path))):
            quantize = resolve_weights(dtype, quantize, local, device, backend, tp)[1]
            runner = NativeRunner.from_pretrained(
                local, dtype=dtype, device=device, compile=compile, quantize=quantize, tp=tp
            )
        else:
            backend = "hf"  # the fallback notice has been printed
    if quantize == "auto":
        quantize = None  # "auto" quantizes only where the native backend runs the checkpoint
    if runner is None and quantize is not None:
        raise ValueError(
            f"quantize={quantize!r} needs the native backend, and {str(path)!r} runs on Hugging Face's; "
            "load it without quantize"
        )
    if runner is None:
        runner = make_runner(hf.load_model(local, dtype, device), backend)
    vocab_map = VocabMap.load(local) if isinstance(local, Path) else None
    return subset.wrap(runner, vocab_map)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path, same_as=None):
    """The tokenizer saved with the model at `path` (`checkpoint`), or None (a local directory
    holding no tokenizer file: None at once, without asking transformers). `same_as`: (a path,
    its loaded tokenizer), returned as it is where both directories hold the same tokenizer files
    (a draft distilled for its target carries the target's): one load, not two."""
    from ..backends import hf

    where = checkpoint(path)
    if isinstance(where, Path) and not any((where / f).is_file() for f in TOKENIZER_FILES):
        return None
    if same_as is not None:
        other = checkpoint(same_as[0])
        if isinstance(other, Path) and _same_files(where, other, TOKENIZER_FILES):
            return same_as[1]
    return hf.load_tokenizer(where)


def _same_files(a: Path, b: Path, names) -> bool:
    """Whether directories `a` and `b` hold the same files `names` (absent in both counts)."""
    for name in names:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file() or (fa.is_file() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True
