"""What this machine's processor offers, for choosing dtypes and weight formats: bf16 matrix
instructions read from /proc/cpuinfo, and one-off measurements of whether bf16 products beat
fp32 here, whether int4 products beat the dtype's own and whether q4q8 products beat int4's
(taken once per machine, kept on disk); and the machine's key, for what is measured or compiled
once per machine (`machine_key`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable

import torch

from ..config import default_cache_dir, write_cache_json
from ..timing import BUSY_KEEP_SECONDS, CpuWatch, median_seconds

log = logging.getLogger(__name__)

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


CHOICES_FILE = "cpu-choices.json"  # under $TREESPEC_CACHE: the measured choices below, per machine


def remembered(name: str, measure: Callable[[], bool]) -> bool:
    """`measure()`, taken once per machine: kept under `name` in $TREESPEC_CACHE/cpu-choices.json
    beside `machine_key()`. A missing, unreadable or other machine's file is measured again
    (and replaced), never an error; a read-only cache only measures each time. A choice
    measured while other processes kept the CPUs busy (`timing.CpuWatch`) is kept for
    BUSY_KEEP_SECONDS only."""
    path = default_cache_dir() / CHOICES_FILE
    machine = machine_key()
    try:
        data = json.loads(path.read_text())
        choices, busy = (data["choices"], data.get("busy", {})) if data["machine"] == machine else ({}, {})
    except (OSError, ValueError, KeyError, TypeError):
        choices, busy = {}, {}
    busy = dict(busy) if isinstance(busy, dict) else {}  # name -> when a busy machine measured it
    since = busy.pop(name, None)
    fresh = not isinstance(since, (int, float)) or time.time() - since <= BUSY_KEEP_SECONDS
    if isinstance(choices.get(name), bool) and fresh:
        return choices[name]
    with CpuWatch() as watch:
        value = bool(measure())
    if watch.busy:  # decided under the others' load: kept for a while only
        busy[name] = time.time()
        log.warning(
            "other processes used %s of the CPUs while %r was measured: kept for %d minutes only",
            watch.describe(),
            name,
            BUSY_KEEP_SECONDS // 60,
        )
    write_cache_json(path, {"machine": machine, "choices": {**choices, name: value}, "busy": busy})
    return value


@functools.cache
def bf16_matmul_is_faster(margin: float = 0.9) -> bool:
    """Whether bf16 matrix products beat fp32 on this CPU, measured the way the native backend
    multiplies (`linear.Projection`, packed where oneDNN can): a decode-shaped product
    (1 x 1024 @ 1024 x 2048) and a tree-shaped one (16 rows), median of 15 each after a warm-up;
    bf16 must take under `margin` of fp32's time in both. Once per machine (`remembered`)."""
    return remembered(f"bf16 products under {margin} of float32's", lambda: _bf16_faster(margin))


def _bf16_faster(margin: float) -> bool:
    from .linear import Projection

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=g)
    median = {}
    for dtype in (torch.float32, torch.bfloat16):
        proj = Projection(weight.to(dtype))
        for rows in (1, 16):
            x = torch.randn(rows, 1024, generator=g).to(dtype)
            median[dtype, rows] = median_seconds(functools.partial(proj, x), 15, warmup=3)
    return all(median[torch.bfloat16, rows] < margin * median[torch.float32, rows] for rows in (1, 16))


STREAMED_COPIES = 16  # the weights int4_matmul_is_faster reads in turn: 16 x 8 MB in fp32, 4x a 32 MB L3


def int4_matmul_is_faster(dtype: torch.dtype, dense: torch.dtype | None = None, margin: float = 0.9) -> bool:
    """Whether int4 products computing in `dtype` (`linear.Int4Projection`, through
    `kernels.bf16`'s tiles where they run, as a runner's are) of one row take under `margin`
    of the dense ones in `dense` (default: `dtype`; `linear.Projection`, packed where oneDNN
    can) on this CPU: the decode step's product, 1 x 1024 @ 1024 x 2048, over
    `STREAMED_COPIES` distinct weights in turn, as a forward reads its layers' weights from
    memory (one weight, left in the cache, would favour the dense product); medians of 7
    sweeps. torch's int4 kernel is fast with bf16 inputs and far slower than dense with
    float32 ones; a tree's many rows favour dense weights, which the automatic tree accounts
    for with the measured t(n). Once per machine and dtype (`remembered`); False where int4
    cannot compute in `dtype`."""
    from .linear import QUANTIZABLE_DTYPES

    if dtype not in QUANTIZABLE_DTYPES:
        return False
    dense = dense or dtype

    def measure() -> bool:
        bar = margin * _streamed_seconds("dense", dense)
        return _streamed_seconds("int4", dtype, stop_above=3 * bar) < bar

    return remembered(f"int4 products in {dtype} under {margin} of dense {dense}'s", measure)


def q4q8_matmul_is_faster(dtype: torch.dtype, margin: float = 0.95) -> bool:
    """Whether q4q8 products (`linear.Q4Q8Projection`) with inputs in `dtype` take under `margin`
    of int4's (`linear.Int4Projection`, through `kernels.bf16`'s tiles where they run) on this
    CPU, summed over a decode step's product and a 4-node tree's: 1 and 4 rows of 1 x 1024 @
    1024 x 2048, weights streamed as `int4_matmul_is_faster` streams them. The compiled kernels
    must be built already (`kernels.built`): nothing here waits for a compiler. Once per
    machine and dtype (`remembered`); False where q4q8 cannot compute in `dtype`."""
    from .kernels import q4q8
    from .linear import Q4Q8_DTYPES

    if dtype not in Q4Q8_DTYPES or not q4q8.built():
        return False

    def measure() -> bool:
        int4 = sum(_streamed_seconds("int4", dtype, rows) for rows in (1, 4))
        return sum(_streamed_seconds("q4q8", dtype, rows) for rows in (1, 4)) < margin * int4

    return remembered(f"q4q8 products in {dtype} under {margin} of int4's", measure)


@functools.cache
def _streamed_seconds(
    kind: str, dtype: torch.dtype, rows: int = 1, stop_above: float = float("inf")
) -> float:
    """A sweep of products of `rows` rows over `STREAMED_COPIES` copies of one 2048 x 1024
    weight, `kind` "dense", "int4" or "q4q8", computing in `dtype`: the median of 7 after a
    warm-up."""
    from .linear import Int4Projection, Projection, Q4Q8Projection

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=g).to(dtype)
    x = torch.randn(rows, 1024, generator=g).to(dtype)
    if kind == "dense":
        product = Projection(weight)
    elif kind == "int4":
        product = Int4Projection.quantize(weight, tiles=True)
    else:
        product = Q4Q8Projection.quantize(weight)
    products = []
    for _ in range(STREAMED_COPIES):  # the same numbers at distinct addresses
        products.append(_copy(product))
    return median_seconds(lambda: [p(x) for p in products], 7, warmup=1, stop_above=stop_above)


def _copy(product):
    """`product` with its own copy of every tensor it holds (oneDNN's packed layout clones as
    itself; a q4q8 product's tiles are a frozen `PackedTiles`)."""
    c = copy.copy(product)
    for name, value in vars(product).items():
        if isinstance(value, torch.Tensor):
            setattr(c, name, value.clone())
        elif dataclasses.is_dataclass(value) and isinstance(getattr(value, "data", None), torch.Tensor):
            setattr(c, name, dataclasses.replace(value, data=value.data.clone()))
    return c


def machine_key() -> dict:
    """What a measurement or a compiled graph depends on besides the models: the processor and
    torch's setup."""
    return {
        "cpu": cpu_model(),
        "bf16": sorted(cpu_bf16_flags()),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),  # oneDNN capped (the AVX2 emulation)
    }
