"""treespec/backends/kernels: the int4-weight x int8-activation product (issue 58).

Every path this machine runs (amx, avx512vnni, avx2, scalar: compiled; aten: torch ops) against a
float64 reference of the same quantized math; a row's result never depends on the other rows
of the call (bitwise); the compiled paths agree bit for bit; GGUF's own quantizers and blocks;
the custom op under torch.compile. Without a C++ compiler the compiled paths skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from treespec.backends import kernels
from treespec.backends.kernels.q4q8 import QK, quantize_activations

ROOT = Path(__file__).resolve().parent.parent


def _compiled_paths() -> list[str]:
    return [isa for isa in kernels.available_isas() if isa != kernels.ATEN]


pytestmark = pytest.mark.filterwarnings("ignore:treespec's q4q8 kernels are not compiled")


@pytest.fixture(scope="module")
def compiled_paths():
    if not kernels.compiled():
        reason = kernels.unavailable_reason() or ""
        if "no C++ compiler" in reason:
            pytest.skip(f"compiled kernels: {reason}")
        pytest.fail(f"the kernels did not build: {reason}")
    return _compiled_paths()


ALL_PATHS = ["amx", "avx512vnni", "avx2", "scalar", "aten"]


def path_or_skip(isa: str, compiled_paths_: list[str] | None = None) -> None:
    if isa == kernels.ATEN:
        return
    if not kernels.compiled():
        reason = kernels.unavailable_reason() or ""
        if "no C++ compiler" in reason:
            pytest.skip(f"compiled kernels: {reason}")
        pytest.fail(f"the kernels did not build: {reason}")
    if isa not in kernels.available_isas():
        pytest.skip(f"this CPU does not run the {isa} path")


def reference(x: torch.Tensor, packed: kernels.PackedQ4, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bound) in float64: the dequantized activations x the dequantized weights, and
    |x| @ |W|^T, the scale of float32's rounding errors per output."""
    qa, s, S = quantize_activations(x.reshape(-1, packed.k))
    g = packed.k // QK
    xa = (qa.double().reshape(-1, g, QK) * s.double()[..., None]).reshape(-1, packed.k)
    w = packed.dequantize(torch.float64)
    y = xa @ w.t()
    bound = xa.abs() @ w.abs().t()
    if bias is not None:
        y = y + bias.double()
        bound = bound + bias.double().abs()
    return y, bound


QUANTIZERS = {"q4_0": kernels.quantize_q4_0, "q4_1": kernels.quantize_q4_1, "q8_0": kernels.quantize_q8_0}


def weights(n: int, k: int, seed: int, kind: str = "q4_1") -> kernels.PackedQ4 | kernels.PackedQ8:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1 + 0.02 * torch.randn(n, 1, generator=gen)
    return QUANTIZERS[kind](w)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, :: max(1, k // 7)] *= 20  # outlier channels, as in LLM hidden states
    if m > 1:
        x[-1, :QK] = 0  # an all-zero group
    return x


CASES = [  # (n, k, m)
    (1, 32, 1),
    (15, 64, 3),
    (16, 96, 8),
    (17, 576, 9),
    (100, 1536, 5),
    (960, 576, 16),
    (33, 1536, 64),
    (576, 1536, 2),
    (70, 576, 200),  # prefill-sized
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", ALL_PATHS)
def test_each_path_equals_the_float64_reference(isa, bits):
    path_or_skip(isa)
    for i, (n, k, m) in enumerate(CASES):
        packed = weights(n, k, seed=i, kind="q8_0" if bits == 8 else "q4_1" if i % 2 else "q4_0")
        x = activations(m, k, seed=100 + i)
        bias = torch.randn(n) if i % 3 == 0 else None
        y = kernels.q4q8_linear(x, packed, bias, isa=isa)
        assert y.shape == (m, n) and y.dtype == torch.float32
        ref, bound = reference(x, packed, bias)
        err = (y.double() - ref).abs()
        assert (err <= 1e-5 * bound + 1e-30).all(), (isa, n, k, m, float((err / bound).max()))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("isa", ALL_PATHS)
def test_a_row_never_depends_on_the_other_rows(isa, kind):
    path_or_skip(isa)
    rng = np.random.default_rng(0 if isa == "avx512vnni" else len(isa))
    n, k = (100, 576) if isa in ("scalar", "aten") else (257, 1536)
    packed = weights(n, k, seed=7, kind=kind)
    for trial in range(6):
        m = int(rng.integers(1, 65))
        x = activations(m, k, seed=trial)
        full = kernels.q4q8_linear(x, packed, isa=isa)
        idx = torch.from_numpy(rng.permutation(m)[: int(rng.integers(1, m + 1))])
        assert torch.equal(kernels.q4q8_linear(x[idx], packed, isa=isa), full[idx])
        for r in rng.choice(m, size=min(m, 3), replace=False):
            assert torch.equal(kernels.q4q8_linear(x[r : r + 1], packed, isa=isa), full[r : r + 1])
        old = torch.get_num_threads()
        torch.set_num_threads(2)  # another split of the output tiles
        try:
            assert torch.equal(kernels.q4q8_linear(x, packed, isa=isa), full)
        finally:
            torch.set_num_threads(old)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_compiled_paths_agree_bit_for_bit(compiled_paths, kind):
    for i, (n, k, m) in enumerate(CASES):
        packed = weights(n, k, seed=i, kind=kind)
        x = activations(m, k, seed=i)
        bias = torch.randn(n)
        ys = {isa: kernels.q4q8_linear(x, packed, bias, isa=isa) for isa in compiled_paths}
        first = ys[compiled_paths[0]]
        for isa, y in ys.items():
            assert torch.equal(y, first), (isa, compiled_paths[0], n, k, m)
        xb = x.bfloat16()  # read as it is by each path: exactly its float32 values' product
        for isa in compiled_paths:
            y = kernels.q4q8_linear(xb, packed, bias, isa=isa)
            assert torch.equal(y, kernels.q4q8_linear(xb.float(), packed, bias, isa=isa)), (isa, n, k, m)
        # torch ops: each fma as a float64 sum rounded once more; equal but for rare double roundings
        aten = kernels.q4q8_linear(x, packed, bias, isa=kernels.ATEN)
        torch.testing.assert_close(aten, first, rtol=1e-6, atol=1e-6)


def test_shapes_dtypes_and_the_default_path():
    packed = weights(40, 64, seed=1)
    x = activations(6, 64, seed=2)
    y = kernels.q4q8_linear(x, packed)
    assert torch.equal(y, kernels.q4q8_linear(x, packed, isa=kernels.default_isa()))
    assert kernels.default_isa() in kernels.describe()
    # [..., K] inputs, bfloat16 (converted exactly to float32 first)
    assert torch.equal(kernels.q4q8_linear(x.reshape(2, 3, 64), packed), y.reshape(2, 3, 40))
    xb = x.bfloat16()
    assert torch.equal(kernels.q4q8_linear(xb, packed), kernels.q4q8_linear(xb.float(), packed))
    assert kernels.q4q8_linear(x[:0], packed).shape == (0, 40)
    with pytest.raises(ValueError):
        kernels.q4q8_linear(torch.randn(2, 32), packed)
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.treespec.q4q8_linear(torch.randn(2, 48), packed.data, None, 40, -1)
    with pytest.raises(ValueError):
        kernels.pack_q4(torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1))


def test_prefetching_changes_no_bit(compiled_paths):
    """Which blocks prefetch the weights (measured per machine) is a speed setting only."""
    before = torch.ops.treespec.q4q8_prefetch_rows(-1)
    assert before in (1, kernels.q4q8.PREFETCH_ROWS)
    try:
        for kind in ("q4_1", "q8_0"):
            packed = weights(300, 576, seed=3, kind=kind)
            x = activations(12, 576, seed=4)
            for isa in compiled_paths:
                ys = []
                for rows in (1, 64):
                    assert torch.ops.treespec.q4q8_prefetch_rows(rows) == rows
                    ys.append([kernels.q4q8_linear(x[:m], packed, isa=isa) for m in (1, 5, 12)])
                assert all(torch.equal(a, b) for a, b in zip(*ys)), (kind, isa)
    finally:
        torch.ops.treespec.q4q8_prefetch_rows(before)


def test_packing_round_trips():
    gen = torch.Generator().manual_seed(3)
    for n, k in [(1, 32), (17, 64), (48, 96)]:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        d = torch.rand(n, k // QK, generator=gen).half()
        m = -torch.rand(n, k // QK, generator=gen).half()
        packed = kernels.pack_q4(q, d, m)
        assert packed.data.shape == (-(-n // 16), k // QK, 320)
        q2, d2, m2 = packed.unpack()
        assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)
        w = (q.float().reshape(n, -1, QK) * d.float()[..., None] + m.float()[..., None]).reshape(n, k)
        assert torch.equal(packed.dequantize(), w)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_and_quantizers_match_gguf(kind):
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    gen = torch.Generator().manual_seed(5)
    n, k = 37, 128
    w = torch.randn(n, k, generator=gen) * 0.05
    raw = quants.quantize(w.numpy(), qtype)  # [n, k / 32 * block bytes]
    packed = kernels.from_gguf_blocks(raw, qtype, n, k)
    assert torch.equal(packed.dequantize(), torch.from_numpy(quants.dequantize(raw, qtype)))
    ours = kernels.quantize_q4_0(w) if kind == "Q4_0" else kernels.quantize_q4_1(w)
    assert torch.equal(ours.data, packed.data)
    assert torch.equal(kernels.from_gguf_blocks(raw.tobytes(), kind, n, k).data, packed.data)
    with pytest.raises(ValueError):
        kernels.from_gguf_blocks(raw, kind, n + 1, k)
    # the GGUF loader's int4 form, w = (q - 8) s + z with z = m + 8 d in float32
    q, d, m = packed.unpack()
    zeros = m.float() + 8 * d.float()
    assert torch.equal(kernels.pack_q4_offsets(q, d.float(), zeros).data, packed.data)
    with pytest.raises(ValueError):
        kernels.pack_q4_offsets(q, d.float() * (1 + 1e-6), zeros)


def test_q8_0_packing_and_quantizer_match_gguf():
    from gguf import GGMLQuantizationType, quants

    gen = torch.Generator().manual_seed(6)
    n, k = 37, 128
    w = torch.randn(n, k, generator=gen) * 0.05
    w[3, :QK] = 0  # an all-zero group
    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    packed = kernels.quantize_q8_0(w)
    assert packed.data.shape == (-(-n // 16), k // QK, 544) and torch.equal(packed.dequantize(), want)
    # a weight that Q8_0 blocks dequantised to comes back as those blocks
    assert torch.equal(kernels.quantize_q8_0(want).data, packed.data)
    q, d = packed.unpack()
    assert torch.equal(kernels.pack_q8(q, d).data, packed.data) and int(q.abs().max()) == 127
    with pytest.raises(ValueError):
        kernels.pack_q8(torch.full((2, 32), 128), torch.ones(2, 1))


def test_int4_times_bfloat16_tiles_multiply_by_the_int4_matrix_rows_alone():
    """`kernels.q4bf16_linear` (AVX512-BF16 cores): the int4 matrix (q - 8) s + z, bfloat16
    inputs unrounded, within bfloat16's output rounding of a float64 reference; a row's result
    bit for bit the same whatever rows share the call; `Int4Projection(tiles=True)` uses it."""
    from treespec.backends.linear import Int4Projection

    if not kernels.bf16.available():
        pytest.skip("q4bf16_linear needs compiled kernels on an AVX512-BF16 core")
    rng = np.random.default_rng(3)
    for i, (n, k, m) in enumerate([(16, 32, 1), (48, 96, 5), (960, 576, 9), (576, 1536, 17), (64, 576, 64)]):
        gen = torch.Generator().manual_seed(i)
        proj = Int4Projection.quantize(torch.randn(n, k, generator=gen).bfloat16(), tiles=True)
        assert proj.tiles is not None
        x = activations(m, k, seed=i).bfloat16()
        y = proj(x)
        w = proj.weight.double()  # aten's matrix, exact: small integers times bf16 scales, plus bf16 offsets
        want, bound = x.double() @ w.t(), x.double().abs() @ w.abs().t()
        assert y.dtype == torch.bfloat16 and ((y.double() - want).abs() <= 2**-8 * bound + 1e-30).all()
        for _ in range(3):
            idx = torch.from_numpy(rng.permutation(m)[: int(rng.integers(1, m + 1))])
            assert torch.equal(proj(x[idx]), y[idx])


def test_int8_times_bfloat16_tiles_multiply_by_the_int8_matrix_rows_alone():
    """`kernels.bf16`'s q8bf16_linear (AVX512-BF16 cores): weight-only int8 s q, bfloat16 inputs
    unrounded, within bfloat16's output rounding of a float64 reference for every tail of the
    tile (n % 16) and of the row blocks (M up to 64); a row's result bit for bit the same
    whatever rows share the call, in any order; `QuantizedProjection(tiles=True)` uses it, and
    with `float_out=True` (an output layer) gets the float32 totals unrounded."""
    from treespec.backends.linear import QuantizedProjection

    if not kernels.bf16.available():
        pytest.skip("q8bf16_linear needs compiled kernels on an AVX512-BF16 core")
    rng = np.random.default_rng(5)
    for i, (n, k, m) in enumerate([(16, 4, 1), (33, 36, 7), (96, 64, 9), (49, 576, 17), (200, 128, 64)]):
        gen = torch.Generator().manual_seed(i)
        bias = torch.randn(n, generator=gen).bfloat16() if i % 2 else None
        weight = torch.randn(n, k, generator=gen).bfloat16()
        proj = QuantizedProjection(weight, bias, tiles=True)
        assert proj.tiles is not None and proj.wide is None
        x = activations(m, k, seed=i).bfloat16()
        y = proj(x)
        w = proj.weight_int8.double() * proj.scales.double()[:, None]
        want, bound = x.double() @ w.t(), x.double().abs() @ w.abs().t()
        if bias is not None:
            want, bound = want + bias.double(), bound + bias.double().abs()
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert ((y.double() - want).abs() <= 2**-8 * bound + 1e-30).all()
        # an output layer's: the same float32 totals, not rounded (bf16 logits tie a near tie)
        logits = QuantizedProjection(weight, bias, tiles=True, float_out=True)
        yf = logits(x)
        assert yf.dtype == torch.float32 and torch.equal(yf.bfloat16(), y)
        assert ((yf.double() - want).abs() <= 1e-5 * bound + 1e-30).all()
        for _ in range(3):
            idx = torch.from_numpy(rng.permutation(m)[: int(rng.integers(1, m + 1))])
            assert torch.equal(proj(x[idx]), y[idx]) and torch.equal(logits(x[idx]), yf[idx])
    with pytest.raises(ValueError, match="multiple of 4"):
        kernels.bf16.pack_q8s(torch.zeros(16, 6, dtype=torch.int8), torch.ones(16))


def test_built_answers_without_building(tmp_path):
    """`kernels.built()` (what a default model's load asks) never runs the compiler: with an
    empty cache it answers False and leaves no library behind; an int4 projection then keeps
    aten's kernel alone."""
    probe = (
        "import torch; from treespec.backends import kernels\n"
        "from treespec.backends.linear import Int4Projection\n"
        "p = Int4Projection.quantize(torch.randn(16, 64).bfloat16(), tiles=True)\n"
        "print(kernels.built(), p.tiles is None)\n"
        # asked per sampled row where the kernels are not built: no compiler run after the first
        "import subprocess; subprocess.run = None; from treespec import sampling\n"
        "print(kernels.built(), int(sampling.argmax(torch.tensor([[0.0, 2.0, 1.0]]))))"
    )
    env = {**os.environ, "TREESPEC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "False", "1"]
    assert not list(tmp_path.rglob("*.so"))


def test_activations_are_quantized_per_row_and_group():
    x = activations(3, 96, seed=9)
    q, s, S = quantize_activations(x)
    g = x.reshape(3, 3, QK)
    assert torch.equal(s, g.abs().amax(-1) / 127)
    assert int(q.abs().max()) == 127 and torch.equal(S, s * q.reshape(3, 3, QK).float().sum(-1))
    assert (s[-1, 0] == 0) and (q[-1, :QK] == 0).all()


@pytest.mark.cpu
def test_the_op_runs_in_a_compiled_graph():
    import torch._dynamo

    if "no C++ compiler" in (kernels.unavailable_reason() or ""):  # inductor needs one too
        pytest.skip(f"torch.compile: {kernels.unavailable_reason()}")

    packed = weights(48, 64, seed=11)
    bias = torch.randn(48)

    def f(x):
        return torch.relu(kernels.q4q8_linear(x * 2, packed, bias))

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True)
    x = activations(5, 64, seed=12)
    assert torch.equal(g(x), f(x))
    assert torch.equal(g(x[:2]), f(x[:2]))


def test_the_environment_caps_the_path_and_aten_needs_no_compiler(tmp_path):
    probe = (
        "import torch; from treespec.backends import kernels as k; from tests.test_kernels import *\n"
        "x = activations(3, 64, 2)\n"
        "for p in (weights(20, 64, 1), weights(20, 64, 1, 'q8_0')):\n"
        "    y, (r, b) = k.q4q8_linear(x, p), reference(x, p)\n"
        "    assert ((y.double() - r).abs() <= 1e-5 * b).all()\n"
        "print(k.default_isa(), k.compiled())"
    )
    env = {**os.environ, "TREESPEC_KERNEL_ISA": "aten"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["aten", "False"]
    if kernels.compiled() and "avx2" in kernels.available_isas():
        env = {**os.environ, "TREESPEC_KERNEL_ISA": "avx2"}
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["avx2", "True"]


def test_row_max_is_torch_max_with_its_first_index():
    """`kernels.reduce`'s row_max (what `sampling.row_max` and `argmax` run on AVX512 cores):
    torch.max(x, -1)'s values and first indices, every vector tail, ties, NaN (the first NaN) and
    rows of -inf, float32 and bfloat16."""
    from treespec.sampling import argmax, row_max

    if not (kernels.compiled() and kernels.reduce.available()):
        pytest.skip("row_max needs compiled kernels on an AVX512 core")
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for V in (1, 15, 16, 17, 100, 49152):
            x = torch.randn(6, V, generator=gen).to(dtype)
            x[1] = x[1, 0]  # all tied: the first index
            x[2, V // 2 :] = x[2].max() + 1  # a tie from the middle on
            x[3] = float("-inf")
            x[4, V // 3] = float("nan")
            x[5, -1] = float("inf")
            values, indices = row_max(x)
            want_values, want_indices = x.max(-1)
            assert torch.equal(indices, want_indices) and torch.equal(argmax(x), want_indices), (dtype, V)
            torch.testing.assert_close(values, want_values.float(), rtol=0, atol=0, equal_nan=True)
    assert row_max(torch.randn(2, 3, 50))[1].shape == (2, 3)


def test_a_killed_build_never_blocks_the_next(tmp_path, monkeypatch):
    """cpp_extension waits on its baton file (`lock`) while it exists, and a killed build leaves
    it: `build.load` removes it once it holds the directory's own lock (which the system releases
    when its holder dies), and builds."""
    from torch.utils import cpp_extension

    from treespec.backends.kernels import build

    (tmp_path / "lock").write_text("")  # a killed build's baton
    lib = tmp_path / "lib.so"

    def fake_load(name, sources, build_directory, **kwargs):
        assert not (Path(build_directory) / "lock").exists()
        lib.write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    assert build.load(lib, tmp_path, "lib") >= 0 and (tmp_path / "built").exists()
    assert build.load(lib, tmp_path, "lib") is None  # built before: loaded as it is
