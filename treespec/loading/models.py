"""Loading runners and tokenizers: one target, its draft (a model or a feature head), their
tokenizers, and what they were loaded from (`load_models`, the one path `from_pretrained` takes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import parallel
from ..backends import Runner, check_backend, make_runner, use_native
from .paths import PathKind, checkpoint, path_kind
from .weights import resolve_device, resolve_dtype, resolve_quantize, resolve_weights

log = logging.getLogger(__name__)


@dataclass
class LoadedModels:
    """What `load_models` loaded."""

    target: Runner
    draft: Runner | None  # a draft model's runner, a feature head's (`HeadRunner`), or None
    tokenizer: object  # the target's (None if its directory holds none)
    draft_tokenizer: object  # a draft model's own, where it holds other files than the target's
    # what was loaded and how (paths' files, dtypes, formats): the key of the measured costs
    origin: dict


def load_models(
    target,
    draft=None,
    dtype="auto",
    device=None,
    backend: str = "auto",
    draft_dtype=None,
    compile: bool | str = "auto",
    quantize: str | None = "auto",
    draft_quantize: str | None = "auto",
    tp: int | None = None,
    rank_settings: dict | None = None,
) -> LoadedModels:
    """The target at `target` and the draft at `draft` (a model or an EAGLE-3 head directory;
    None: none): what `SpeculativeDecoder.from_pretrained` loads, its arguments meaning the same.
    `rank_settings`: the caller's own settings every tensor-parallel rank must share too."""
    check_backend(backend)
    device = resolve_device(device)
    group = parallel.init(tp, device)
    if group is not None:
        settings = {
            "dtype": str(dtype), "draft_dtype": str(draft_dtype), "backend": backend, "compile": compile,
            "quantize": quantize, "draft_quantize": draft_quantize, **(rank_settings or {}),
        }  # fmt: skip
        prepare_ranks(target, draft, settings)
    # "auto" measures this machine's products: rank 0's measurement decides for every rank
    target_dtype, quantize = resolve_weights(dtype, quantize, target, device, backend, group, compile)
    draft_role_dtype = resolve_dtype(dtype if draft_dtype is None else draft_dtype, device, "draft")
    dtypes = parallel.agree((target_dtype, draft_role_dtype))
    target_runner = load_runner(target, dtypes[0], device, backend, compile, quantize, group)
    head = draft is not None and path_kind(draft) is PathKind.HEAD
    if head:  # a feature head computes with its target's features: in the target's dtype unless told
        head_dtype = dtypes[0] if draft_dtype is None else dtypes[1]
        draft_runner = load_head(draft, target_runner, head_dtype, device, draft_quantize, compile)
    elif draft is not None:
        draft_runner = load_runner(draft, dtypes[1], device, backend, compile, draft_quantize)
    else:
        draft_runner = None
    if head:  # its target's forwards return the features it reads (the engine sets them too)
        target_runner.set_taps(draft_runner.target_taps)
    tokenizer = load_tokenizer(target)
    # a head shares its target's tokenizer; a draft loads its own unless it holds the same files
    draft_tokenizer = None
    if draft is not None and not head:
        draft_tokenizer = load_tokenizer(draft, same_as=(target, tokenizer))
    if getattr(target_runner, "compile_setting", None) == "auto" and target_runner.compiled is None:
        log.info(
            "eager forward: no compiled graphs kept for this model on this machine (run once with "
            "--compile, or compile=True, to build them in about two minutes; later runs load them)"
        )
    from ..planning import files_key

    origin = {
        "target": files_key(target), "draft": files_key(draft), "dtypes": [str(d) for d in dtypes],
        "device": str(device), "backend": backend, "quantize": target_runner.quantize,
        "compile": getattr(target_runner, "compiled", None) is not None,  # as resolved: graphs found
        "draft_quantize": getattr(draft_runner, "quantize", draft_quantize),
        "tp": 1 if group is None else group.world,
    }  # fmt: skip
    return LoadedModels(target_runner, draft_runner, tokenizer, draft_tokenizer, origin)


def load_runner(
    path,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "auto",
    compile: bool | str = False,
    quantize: str | None = None,
    tp=None,
) -> Runner:
    """A runner for the checkpoint at `path` (`checkpoint`): native straight from safetensors
    when the backend allows it and the directory holds a supported checkpoint, else through HF.
    `compile`: the native runner's inductor forward (`NativeRunner(compile=True)`; ignored,
    with a warning, where it cannot compile; the HF backend has none; "auto": the graphs
    already stored for this machine and model, else eager). `quantize`: the native
    runner's weight-only quantization (`NativeRunner(quantize=...)`; "auto": `resolve_quantize`);
    a ValueError where the checkpoint runs on the HF backend (but for "auto", which is None there).
    A draft with a subset vocabulary (`vocab_map.json` beside its weights) is wrapped so that
    it reads and proposes the target's token ids (`backends.subset`).
    `tp`: this rank's `treespec.parallel.TensorParallel` (the native backend only; each rank
    reads its blocks of the weights)."""
    from ..backends import hf, subset
    from ..backends.subset import VocabMap

    check_backend(backend)
    local = checkpoint(path)
    if tp is not None:
        reason = "" if isinstance(local, Path) else f" ({str(path)!r} is not a local directory or GGUF file)"
        if backend == "hf" or reason:
            raise ValueError(
                f"tensor parallelism runs the native backend on a local checkpoint{reason}; "
                "load the target with backend='auto' or 'native'"
            )
        backend = "native"  # an unsupported architecture is an error, not a fallback
    native = False
    if backend != "hf" and isinstance(local, Path):
        from ..backends.checkpoint import read_json, unsupported_reason

        native = use_native(backend, unsupported_reason(read_json(local / "config.json")), repr(str(path)))
        if not native:
            backend = "hf"  # the fallback notice has been printed
    # "auto" quantizes only where the native backend runs the checkpoint
    quantize = resolve_quantize(quantize, local, dtype, device, backend if native else "hf", tp)
    if native:
        from ..backends.native import NativeRunner

        runner = NativeRunner.from_pretrained(
            local, dtype=dtype, device=device, compile=compile, quantize=quantize, tp=tp
        )
    elif quantize is not None:
        raise ValueError(
            f"quantize={quantize!r} needs the native backend, and {str(path)!r} runs on Hugging Face's; "
            "load it without quantize"
        )
    else:
        runner = make_runner(hf.load_model(local, dtype, device), backend)
    vocab_map = VocabMap.load(local) if isinstance(local, Path) else None
    return subset.wrap(runner, vocab_map)


def load_head(path, target: Runner, dtype: torch.dtype, device: torch.device, quantize=None, compile="auto"):
    """A `HeadRunner` for the EAGLE-3 head directory `path` over `target`'s embedding, its
    weights format decided by `resolve_quantize`."""
    from ..backends.head import load_head_runner

    quantize = resolve_quantize(quantize, path, dtype, device, head_of=target)
    return load_head_runner(path, target, dtype, device, quantize, compile)


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


def prepare_ranks(target, draft, settings: dict) -> None:
    """Tensor parallel, before anything loads: every rank was started with the same models
    and settings (else every rank fails, naming what differs), and a GGUF target is converted
    once, by rank 0, while the others wait for its directory."""
    from ..planning import files_key

    def files(path) -> list:  # names and sizes: paths and times may differ between machines
        return [f[:2] if isinstance(f, list) else Path(f).name for f in files_key(path) or []]

    parallel.check_same(
        "models or settings",
        {"target": files(target), "draft": files(draft), "torch": torch.__version__, **settings},
    )
    failed = None
    if parallel.leader():
        try:
            checkpoint(target)
        except ValueError as e:
            failed = str(e)
    failed = parallel.agree(failed)
    if failed:
        raise ValueError(failed)


def _same_files(a: Path, b: Path, names) -> bool:
    """Whether directories `a` and `b` hold the same files `names` (absent in both counts)."""
    for name in names:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file() or (fa.is_file() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True
