"""int4-weight x int8-activation products for small M (issue 58; docs: DESIGN.md, "Verification
cost on a CPU (small-M products)").

y [M, N] = x [M, K] @ W [N, K]^T (+ bias), float32, with

- W in GGUF's 4-bit blocks: per output row and group of 32 inputs a scale d and a min m,
  w = d q + m, q in 0..15 (Q4_1; Q4_0 is m = -8 d), d and m held in float16 as in GGUF;
- x quantized per row and group of 32 (Q8_1-style): q_a = rne(x * 127 / amax) in -127..127, a
  scale s = amax / 127, and the group's sum S = s * sum(q_a), so the min term is m S.

  y[r, o] = sum over groups g, in order, of fma(float(dot_g), d s, .) then fma(m, S, .), + bias

The default int4 target's own precision (bfloat16 inputs, not quantized) has tile kernels of
its own in bf16.py.

Output layers, which GGUF files keep in 8 bits (Q8_0: w = d q, q in -127..127), multiply by
8-bit weights the same way (`pack_q8`, `quantize_q8_0`; `torch.ops.treespec.q8q8_linear`):
y[r, o] = sum over g of fma(float(dot_g), d s, .), the integer dot exact, as llama.cpp's
Q8_0 x Q8_0. `q4q8_linear` takes either packing.

The weights are repacked once (`pack_q4`, `quantize_q4_1`, `from_gguf_blocks`) into tiles of 16
output columns whose 4-bit values are unpacked once per call and fed to every row (VPDPBUSD on
AVX512-VNNI cores, AMX-INT8 tiles there for calls of 10 rows or more where the core has AMX,
vpmaddubsw on AVX2 ones, plain C++ elsewhere), parallel over output tiles only.
Integer dot products are exact and the float steps are the same everywhere, so the compiled paths
agree bit for bit and **a row's result never depends on the other rows of the call**.

The C++ sources (q4q8.cpp, bf16.cpp, attention.cpp, reduce.cpp, isa.h) are compiled on first use with
torch.utils.cpp_extension (needs a C++ compiler and the `ninja` package) into
$TREESPEC_CACHE/kernels/<hash>, and registered as custom ops, `torch.ops.treespec.q4q8_linear`
and the others (with fake implementations: torch.compile graphs call them directly). Without a
compiler q4q8_linear and q8q8_linear run as torch ops ("aten": the same numbers up to rare double
roundings, slowly). `describe()` says which path runs; TREESPEC_KERNEL_ISA=amx|avx512vnni|
avx2|scalar|aten caps it (ATEN_CPU_CAPABILITY=avx2 caps it at avx2, as on such a core).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import build

QK = 32  # inputs per group
TILE = 16  # output columns per tile
TILE_BYTES = 320  # per tile and group: 256 bytes of nibbles, 16 fp16 d, 16 fp16 m
TILE8_BYTES = 544  # per tile and group, 8-bit weights: 512 bytes of q + 128, 16 fp16 d
ISAS = ("scalar", "avx2", "avx512vnni", "amx")  # the compiled paths, by code (isa.h's Isa)
ATEN = "aten"  # torch ops, no compiled code
_lock = threading.Lock()
_state: dict = {"tried": False, "compiled": False, "error": None, "dir": None, "build_s": None, "op": False}


# ------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class PackedTiles:
    """A weight [n, k] in a kernel's tiles: `data` uint8 [ceil(n/16), k/32, bytes per tile and
    group] (`PackedQ4`, `PackedQ8`)."""

    data: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _fp16_per_column(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 value per output column and group stored at bytes [start, start + 32) of
    each tile and group of `raw` [t, g, bytes] -> [16 t, g]."""
    t, g = raw.shape[:2]
    return raw[..., start : start + 32].contiguous().view(torch.float16).permute(0, 2, 1).reshape(t * TILE, g)


@dataclass(frozen=True)
class PackedQ4(PackedTiles):
    """A weight [n, k] in 4 bits, in the kernel's layout: `data` uint8 [ceil(n/16), k/32, 320]
    (per tile of 16 output columns and group of 32 inputs: the nibbles, then d and m in fp16)."""

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [n, k] in 0..15, d float16 [n, k/32], m float16 [n, k/32])."""
        t, g = self.data.shape[0], self.k // QK
        raw = self.data.reshape(t, g, TILE_BYTES)
        nib = raw[..., :256].reshape(t, g, 4, TILE, 4)  # [t, g, p, j, b]
        q = torch.stack([nib & 15, nib >> 4], dim=4)  # [t, g, p, j, h, b]; k = 32g + 8p + 4h + b
        q = q.permute(0, 3, 1, 2, 4, 5).reshape(t * TILE, self.k)[: self.n]
        d, m = _fp16_per_column(raw, 256), _fp16_per_column(raw, 288)
        return q.contiguous(), d[: self.n].contiguous(), m[: self.n].contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] = d q + m (exact in float32 and float64)."""
        q, d, m = self.unpack()
        g = self.k // QK
        w = q.to(dtype).reshape(self.n, g, QK) * d.to(dtype)[..., None] + m.to(dtype)[..., None]
        return w.reshape(self.n, self.k)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> PackedQ4:
    """q [n, k] integers 0..15, d and m [n, k/32] -> `PackedQ4` (w = d q + m; Q4_0: m = -8 d).
    d and m are stored as float16, as in GGUF (exact for values that came from a GGUF file)."""
    n, k = q.shape
    if k % QK or k == 0:
        raise ValueError(f"q4 weights need rows of whole groups of {QK} inputs, not {k}")
    g = k // QK
    if d.shape != (n, g) or m.shape != (n, g):
        raise ValueError(f"d and m must be [{n}, {g}], got {tuple(d.shape)} and {tuple(m.shape)}")
    q = q.to(torch.uint8)
    if q.numel() and int(q.max()) > 15:
        raise ValueError("q4 values must be in 0..15")
    t = -(-n // TILE)
    pad = t * TILE - n
    d16 = d.to(torch.float16)
    m16 = m.to(torch.float16)
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d16 = torch.cat([d16, d16.new_zeros(pad, g)])
        m16 = torch.cat([m16, m16.new_zeros(pad, g)])
    nib = _nibble_tiles(q, t, g)
    dd = d16.reshape(t, TILE, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [t, g, 32]
    mm = m16.reshape(t, TILE, g).permute(0, 2, 1).contiguous().view(torch.uint8)
    return PackedQ4(torch.cat([nib, dd, mm], dim=-1).contiguous(), n, k)


@dataclass(frozen=True)
class PackedQ8(PackedTiles):
    """A weight [n, k] in 8 bits (GGUF's Q8_0: w = d q), in the kernel's layout: `data` uint8
    [ceil(n/16), k/32, 544] (per tile of 16 output columns and group of 32 inputs: q + 128, then
    d in fp16)."""

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [n, k] in -127..127, d float16 [n, k/32])."""
        t, g = self.data.shape[0], self.k // QK
        raw = self.data.reshape(t, g, TILE8_BYTES)
        q = (raw[..., :512].to(torch.int16) - 128).to(torch.int8).reshape(t, g, 8, TILE, 4)  # [t, g, p, j, b]
        q = q.permute(0, 3, 1, 2, 4).reshape(t * TILE, self.k)[: self.n]
        d = _fp16_per_column(raw, 512)
        return q.contiguous(), d[: self.n].contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] = d q (exact in float32 and float64)."""
        q, d = self.unpack()
        w = q.to(dtype).reshape(self.n, -1, QK) * d.to(dtype)[..., None]
        return w.reshape(self.n, self.k)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> PackedQ8:
    """q [n, k] integers -127..127 and d [n, k/32] -> `PackedQ8` (w = d q), d stored as float16."""
    n, k = q.shape
    if k % QK or k == 0:
        raise ValueError(f"q8 weights need rows of whole groups of {QK} inputs, not {k}")
    g = k // QK
    if d.shape != (n, g):
        raise ValueError(f"d must be [{n}, {g}], got {tuple(d.shape)}")
    q = q.to(torch.int16)
    if q.numel() and int(q.abs().max()) > 127:
        raise ValueError("q8 values must be in -127..127")
    t = -(-n // TILE)
    pad = t * TILE - n
    d16 = d.to(torch.float16)
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d16 = torch.cat([d16, d16.new_zeros(pad, g)])
    u = (q + 128).to(torch.uint8).reshape(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512)
    dd = d16.reshape(t, TILE, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [t, g, 32]
    return PackedQ8(torch.cat([u, dd], dim=-1).contiguous(), n, k)


def quantize_q8_0(w: torch.Tensor) -> PackedQ8:
    """W [n, k] float -> Q8_0 as GGUF rounds it (ggml's quantize_row_q8_0_ref): per group
    d = amax / 127, q = round(w / d) half away from zero, d kept in fp16. A weight that a
    GGUF file's Q8_0 blocks dequantised to comes back as those blocks."""
    x = _groups(w)
    d = x.abs().amax(dim=-1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = x * inv[..., None]
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127)
    return pack_q8(q.reshape(w.shape), d)


def _nibble_tiles(q: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """q [16 t, 32 g] uint8 0..15 -> [t, g, 256]: per tile and group, 64 bytes per p = 0..3 with
    column j at bytes 4j..4j+3, low nibbles q[j, 8p + b], high nibbles q[j, 8p + 4 + b]."""
    q6 = q.reshape(t, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [t, g, p, j, h, b]
    return (q6[..., 0, :] | (q6[..., 1, :] << 4)).reshape(t, g, 256)


def pack_q4_offsets(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> PackedQ4:
    """From the int4 form w = (q - 8) s + z (`linear.Int4Projection`, the GGUF loader's .q4 /
    .q4_scales / .q4_zeros after `linear.unpack_nibbles`): d = s, m = z - 8 s, which must be exact
    in float16 (they are for a GGUF file's Q4_0 / Q4_1 blocks; for other weights use
    `quantize_q4_1`)."""
    s = scales.to(torch.float32)
    m = zeros.to(torch.float32) - 8 * s
    d16, m16 = s.to(torch.float16), m.to(torch.float16)
    if not (torch.equal(d16.float(), s) and torch.equal((m16.float() + 8 * d16.float()), zeros.float())):
        raise ValueError("these scales and offsets are not GGUF's float16 d and m; use quantize_q4_1")
    return pack_q4(q, d16, m16)


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % QK or k == 0:
        raise ValueError(f"q4 weights need rows of whole groups of {QK} inputs, not {k}")
    return w.detach().to(torch.float32).reshape(n, k // QK, QK)


def quantize_q4_1(w: torch.Tensor) -> PackedQ4:
    """W [n, k] float -> Q4_1 as GGUF rounds it (ggml's quantize_row_q4_1_ref): per group
    d = (max - min) / 15, q = min(15, trunc((w - min) / d + 0.5)), d and min kept in fp16."""
    x = _groups(w)
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor((x - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return pack_q4(q.reshape(w.shape), d, lo)


def quantize_q4_0(w: torch.Tensor) -> PackedQ4:
    """W [n, k] float -> Q4_0 as GGUF rounds it (ggml's quantize_row_q4_0_ref): per group the
    value of largest magnitude v, d = v / -8, q = min(15, trunc(w / d + 8.5)), w = d (q - 8)."""
    x = _groups(w)
    v = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))[..., 0]
    d = v / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor(x * inv[..., None] + 8.5).clamp(0, 15).to(torch.uint8)
    d16 = d.to(torch.float16)
    return pack_q4(q.reshape(w.shape), d16, -8 * d16)


def from_gguf_blocks(raw, kind, n: int, k: int) -> PackedQ4:
    """A GGUF tensor's raw Q4_0 (18-byte blocks: fp16 d, 16 bytes) or Q4_1 (20 bytes: fp16 d,
    fp16 m, 16 bytes) data, n rows of k / 32 blocks (GGUF shape [k, n]) -> `PackedQ4`. In a block,
    byte j holds value j (low nibble) and value j + 16 (high nibble). `kind`: "Q4_0" / "Q4_1",
    gguf.GGMLQuantizationType, or its number (2 / 3)."""
    name = getattr(kind, "name", kind)
    name = {2: "Q4_0", 3: "Q4_1"}.get(name, name)
    if name not in ("Q4_0", "Q4_1"):
        raise ValueError(f"from_gguf_blocks takes Q4_0 or Q4_1 blocks, not {kind!r}")
    size = 18 if name == "Q4_0" else 20
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().view(torch.uint8).numpy()
    if isinstance(raw, np.ndarray):
        b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    else:
        b = np.frombuffer(memoryview(raw).cast("B"), np.uint8)
    if k % QK or b.size != n * (k // QK) * size:
        raise ValueError(f"{name} data of {b.size} bytes is not [{n}, {k}] in {size}-byte blocks")
    b = b.reshape(n, k // QK, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    m = b[..., 2:4].copy().view(np.float16)[..., 0] if name == "Q4_1" else (-8 * d).astype(np.float16)
    qs = b[..., size - 16 :]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    return pack_q4(torch.from_numpy(q), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


# ------------------------------------------------------------------------------------- activations


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], s float32 [M, K/32], S float32 [M, K/32]): the kernel's own
    rounding, per row and group (s = amax / 127, q = rne(x * (127 / amax)), S = s * sum(q))."""
    x = x.to(torch.float32)
    m, k = x.shape
    g = x.reshape(m, k // QK, QK)
    amax = g.abs().amax(dim=-1)
    s = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).clamp(-127, 127)
    S = s * q.sum(dim=-1)
    return q.to(torch.int8).reshape(m, k), s, S


def _aten_linear8(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """`_aten_linear` for 8-bit weights (`PackedQ8`)."""
    k = x.shape[-1]
    if k % QK or packed.numel() != -(-n // TILE) * (k // QK) * TILE8_BYTES:
        raise ValueError(f"q8q8_linear: {packed.numel()} bytes of weights are not [{n}, {k}] packed")
    shape = (*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    q, d = PackedQ8(packed, n, k).unpack()
    qa, s, _ = quantize_activations(x2)
    groups = k // QK
    qa = qa.to(torch.float64).reshape(-1, groups, QK)
    qw = q.to(torch.float64).reshape(n, groups, QK)
    d = d.to(torch.float32)
    acc = torch.zeros(x2.shape[0], n, dtype=torch.float32)
    for j in range(groups):
        dot = qa[:, j] @ qw[:, j].t()  # exact integers
        ds = (d[None, :, j] * s[:, j, None]).to(torch.float64)  # float32 product, as in C++
        acc = (acc.to(torch.float64) + dot * ds).to(torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.reshape(shape)


def _aten_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The product in torch ops (no compiled code): the same steps, each fma as one float64
    sum rounded to float32 (equal to the fused one but for rare double roundings)."""
    k = x.shape[-1]
    if k % QK or packed.numel() != -(-n // TILE) * (k // QK) * TILE_BYTES:
        raise ValueError(f"q4q8_linear: {packed.numel()} bytes of weights are not [{n}, {k}] packed")
    shape = (*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    q, d, m = PackedQ4(packed, n, k).unpack()
    qa, s, S = quantize_activations(x2)
    groups = k // QK
    qa = qa.to(torch.float64).reshape(-1, groups, QK)
    qw = q.to(torch.float64).reshape(n, groups, QK)
    d, m = d.to(torch.float32), m.to(torch.float32)
    acc = torch.zeros(x2.shape[0], n, dtype=torch.float32)
    for j in range(groups):
        dot = qa[:, j] @ qw[:, j].t()  # exact integers
        ds = (d[None, :, j] * s[:, j, None]).to(torch.float64)  # float32 product, as in C++
        acc = (acc.to(torch.float64) + dot * ds).to(torch.float32)
        ms = m[None, :, j].to(torch.float64) * S[:, j, None].to(torch.float64)
        acc = (acc.to(torch.float64) + ms).to(torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.reshape(shape)


# ------------------------------------------------------------------------------------- build, op


def _load_compiled() -> None:
    """Load the kernels' library, building it once per (source, torch, compiler, flags)."""
    lib, where, name = build.library()
    _state["dir"] = str(where)
    _state["build_s"] = build.load(lib, where, name)


def _fake(x, packed, bias, n, isa=-1):
    return x.new_empty((*x.shape[:-1], n), dtype=torch.float32)


def _fake_bf16(x, packed, bias, n, float_out=False):
    return x.new_empty((*x.shape[:-1], n), dtype=torch.float32 if float_out else torch.bfloat16)


def _fake_attention(q, k, v, mask, lanes, scale):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


OPS = {"q4q8_linear": _aten_linear, "q8q8_linear": _aten_linear8}  # the ops, and their torch-op forms


def _register_python_ops() -> None:
    """Without the compiled library: the same ops, in torch ops."""
    for name, aten in OPS.items():

        def op(
            x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, isa: int = -1, aten=aten
        ):
            return aten(x, packed, bias, n)

        torch.library.custom_op(
            f"treespec::{name}",
            op,
            mutates_args=(),
            schema=("(Tensor x, Tensor packed, Tensor? bias, int n, int isa=-1) -> Tensor"),
        ).register_fake(_fake)


def _ensure() -> bool:
    """Register `torch.ops.treespec.q4q8_linear` (compiled if possible). Whether compiled."""
    if _state["op"]:
        return _state["compiled"]
    with _lock:
        if _state["op"]:
            return _state["compiled"]
        if os.environ.get("TREESPEC_KERNEL_ISA", "").lower() == ATEN:
            _state["error"] = "TREESPEC_KERNEL_ISA=aten"
        else:
            try:
                _load_compiled()
                _state["compiled"] = True
            except Exception as e:  # no compiler, no ninja, a failed build: torch ops instead
                lines = str(e).strip().splitlines() or [""]
                _state["error"] = f"{type(e).__name__}: {lines[-1]}"
                warnings.warn(
                    f"treespec's q4q8 kernels are not compiled ({str(e).strip()[-2000:]}); "
                    "the products run as torch ops (slow)",
                    stacklevel=3,
                )
        if _state["compiled"]:
            for name in OPS:
                torch.library.register_fake(f"treespec::{name}")(_fake)
            for name in ("q4bf16_linear", "q8bf16_linear"):
                torch.library.register_fake(f"treespec::{name}")(_fake_bf16)
            torch.library.register_fake("treespec::row_attention")(_fake_attention)
        else:
            _register_python_ops()
        _state["op"] = True
        if _state["compiled"]:
            _choose_prefetch()
        return _state["compiled"]


PREFETCH_ROWS = 5  # q4q8.cpp's default: blocks of at least 5 rows prefetch the weights they stream


def _choose_prefetch() -> None:
    """Whether blocks of any size prefetch the weights they stream, or only those of
    `PREFETCH_ROWS` rows and more: a single row's product is 22% faster with it on a Xeon with
    AMX, slower on Zen 4. Measured once per machine (`cpu.remembered`), then set in the library
    (`torch.ops.treespec.q4q8_prefetch_rows`), which eager and compiled forwards read alike."""
    from ..cpu import remembered

    rows = 1 if remembered("q4q8 single rows prefetch the weights", _prefetch_pays) else PREFETCH_ROWS
    torch.ops.treespec.q4q8_prefetch_rows(rows)


STREAMED_WEIGHTS = 64  # _prefetch_pays's copies of a 2048 x 1024 weight: 70 MB, as a forward's


def _prefetch_pays(margin: float = 0.95, repeats: int = 15) -> bool:
    """Whether one row's products over `STREAMED_WEIGHTS` distinct 4-bit weights, read in turn as
    a forward reads its layers', take under `margin` of the time with every block prefetching:
    medians of `repeats` sweeps each, interleaved, on the AVX512-VNNI path whatever the
    environment caps (False where the CPU has none: no other path prefetches)."""
    vnni = ISAS.index("avx512vnni")  # the path whose blocks prefetch (AMX's start at 10 rows)
    if not torch.ops.treespec.q4q8_isa(-2) >> vnni & 1:
        return False
    g = torch.Generator().manual_seed(0)
    first = quantize_q4_1(torch.randn(2048, 1024, generator=g))
    weights = [PackedQ4(first.data.clone(), first.n, first.k) for _ in range(STREAMED_WEIGHTS)]
    x = torch.randn(1, 1024, generator=g)
    op, before = torch.ops.treespec.q4q8_linear, torch.ops.treespec.q4q8_prefetch_rows(-1)
    times: dict[int, list[float]] = {1: [], PREFETCH_ROWS: []}
    try:
        for r in range(repeats + 1):
            for rows, seconds in times.items():
                torch.ops.treespec.q4q8_prefetch_rows(rows)
                start = time.perf_counter()
                for w in weights:
                    op(x, w.data, None, w.n, vnni)
                if r:  # the first sweep pays for allocations
                    seconds.append(time.perf_counter() - start)
    finally:
        torch.ops.treespec.q4q8_prefetch_rows(before)
    median = {rows: sorted(t)[len(t) // 2] for rows, t in times.items()}
    return median[1] < margin * median[PREFETCH_ROWS]


def compiled() -> bool:
    """Whether the compiled kernels are available (built or loaded on first call)."""
    return _ensure()


def built() -> bool:
    """Whether the compiled kernels are available without building them: loaded, or built for
    this source, torch and compiler before (then loaded). A default model's optional paths ask
    this, so that no run waits for the compiler; `compiled()` builds."""
    if _state["op"]:
        return _state["compiled"]
    if os.environ.get("TREESPEC_KERNEL_ISA", "").lower() == ATEN:
        return False
    try:
        lib, where, _ = build.library()
    except RuntimeError:
        return False
    return lib.exists() and (where / "built").exists() and _ensure()


def runs(check: str, build: bool = True) -> bool:
    """Whether a compiled kernel runs here: the library compiled (`build=False`: only if it is
    `built()` already, so that nothing waits for the compiler) and its own CPU check,
    `torch.ops.treespec.<check>()`, true (the core's ISA, the path not capped below it by
    TREESPEC_KERNEL_ISA or ATEN_CPU_CAPABILITY)."""
    ready = compiled() if build else built()
    return ready and bool(getattr(torch.ops.treespec, check)())


def unavailable_reason() -> str | None:
    """Why the compiled kernels are not used (None when they are)."""
    return None if _ensure() else _state["error"]


def available_isas() -> list[str]:
    """The paths this machine runs, fastest first: compiled ones this CPU has, then "aten"."""
    if not _ensure():
        return [ATEN]
    mask = torch.ops.treespec.q4q8_isa(-2)
    return [name for code, name in reversed(list(enumerate(ISAS))) if mask >> code & 1] + [ATEN]


def default_isa() -> str:
    """The path `q4q8_linear` takes unless told: the best this CPU runs, capped by
    TREESPEC_KERNEL_ISA (or ATEN_CPU_CAPABILITY)."""
    if not _ensure():
        return ATEN
    return ISAS[torch.ops.treespec.q4q8_isa(-1)]


def describe() -> str:
    """One line: which path the product takes here."""
    if not _ensure():
        return f"q4q8 products: aten (torch ops, slow; no compiled kernel: {_state['error']})"
    isa = default_isa()
    how = {
        "amx": "AMX-INT8 tiles (TDPBSUD) for calls of many rows, AVX512-VNNI VPDPBUSD for few",
        "avx512vnni": "AVX512-VNNI, VPDPBUSD over 16 columns",
        "avx2": "AVX2, vpmaddubsw over 8 columns",
        "scalar": "portable C++",
    }[isa]
    built = f", built in {_state['build_s']:.0f} s" if _state["build_s"] else ""
    return f"q4q8 products: {isa} ({how}; compiled in {_state['dir']}{built})"


def q4q8_linear(
    x: torch.Tensor, packed: PackedQ4 | PackedQ8, bias: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) @ W^T (+ bias) -> [..., N] float32, W `packed` in 4 bits
    (`torch.ops.treespec.q4q8_linear`) or 8 (`q8q8_linear`). `isa`: None (the default path), or
    one of `available_isas()`."""
    if x.shape[-1] != packed.k:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weights {packed.k}")
    if not _ensure() and isa not in (None, ATEN):
        raise ValueError(f"q4q8 path {isa!r} is not available: {_state['error']}")
    if isa is None:
        code = -1
    elif isa == ATEN:
        return OPS[op_name(packed)](x, packed.data, bias, packed.n)
    elif isa in ISAS:
        code = ISAS.index(isa)
    else:
        raise ValueError(f"isa must be one of {ISAS + (ATEN,)}, not {isa!r}")
    return getattr(torch.ops.treespec, op_name(packed))(x, packed.data, bias, packed.n, code)


def op_name(packed: PackedQ4 | PackedQ8) -> str:
    """The op that multiplies by `packed`: "q4q8_linear" or "q8q8_linear"."""
    return "q8q8_linear" if isinstance(packed, PackedQ8) else "q4q8_linear"
