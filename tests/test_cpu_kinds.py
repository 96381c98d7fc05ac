"""The CPU-dependent tests (marker `cpu`) once more, as on an AVX2-only core, on any machine.

These machines range from AVX2-only cores to AVX512-BF16 and AMX, and the paths treespec
takes differ with them: oneDNN packs bf16 weights only from AVX512 (BW/VL/DQ) on, bf16 products
are emulated on AVX2, `dtype="auto"` and the int8 kernels follow the CPU. `AVX2` makes torch
dispatch as on an AVX2 core (`ATEN_CPU_CAPABILITY`) and caps oneDNN there
(`ONEDNN_MAX_CPU_ISA`); `bf16_kernels_enabled` honours both. So a change that breaks the AVX2
path fails here, whatever CPU runs the suite.

Compiled forwards run too (with `-m slow`): tests/conftest.py has inductor vectorise for AVX2 under the
emulation (left alone, it picks its GEMM micro-kernels and vector width from the real CPU's
flags beside torch's AVX2 kernels, and that mix computed compiled int8 logits of 1e11 on an AMX
core). The served bf16 streams (`server`) stay out: a minute of emulated bf16 products for what
test_batch's deterministic-engine test checks in bf16 in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, **AVX2}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_emulation_reaches_torch_onednn_and_treespec():
    probe = (
        "import torch; from treespec.backends import auto_dtype, bf16_kernels_enabled;"
        "from treespec.backends.linear import Projection;"
        "print(torch.backends.cpu.get_cpu_capability(), bf16_kernels_enabled(), auto_dtype('cpu'),"
        " Projection(torch.randn(600, 512).bfloat16()).packed is None)"
    )
    out = run(["-c", probe], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AVX2", "False", "torch.float32", "True"]


# The cases that compile a forward (names with "compile"; the one that only picks each format's
# settings compiles nothing and stays) took 110 of this rerun's 140 s: the default run reruns the
# rest (bf16 emulation, oneDNN's packing, the int8 and int4 kernels, `dtype="auto"`); `-m slow`
# reruns every `cpu` case, the compiled ones (inductor's AVX2 code) and the slow ones included,
# but the compiled SmolLM2-shaped model (minutes as an AVX2 core).
COMPILED = "compile and not compiles_the_products"


def rerun_as_on_an_avx2_core(marks: str, select: str) -> None:
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks]
    # only the modules that mark a case `cpu`: collecting all of tests/ took most of 15 s
    files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.cpu" in p.read_text()]
    out = run([*args, "-k", f"not server and {select}", *files], timeout=600)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr
    assert out.returncode == 0, f"as on an AVX2 core: {summary}\n{out.stdout[-4000:]}"
    assert " passed" in summary and "failed" not in summary


def test_cpu_dependent_tests_pass_as_on_an_avx2_core():
    rerun_as_on_an_avx2_core("cpu and not slow", f"not ({COMPILED})")


@pytest.mark.slow
def test_every_cpu_dependent_test_passes_as_on_an_avx2_core():
    rerun_as_on_an_avx2_core("cpu", "not compiled_smollm2_shaped")
