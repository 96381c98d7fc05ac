"""Building and loading the kernels' library (q4q8.cpp, bf16.cpp, attention.cpp, reduce.cpp,
one library): once per source, torch, compiler and flags, under $TREESPEC_CACHE/kernels/<key>,
by torch's cpp_extension; `q4q8` decides when, and what runs without it."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

SOURCES = tuple(
    Path(__file__).with_name(f) for f in ("isa.h", "q4q8.cpp", "bf16.cpp", "attention.cpp", "reduce.cpp")
)
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds (inline, so compiled here; the
# extension then shares torch's libgomp); -ffp-contract=off: no fused multiply-adds but the written
# ones, the same in every path
CFLAGS = ["-O3", "-ffp-contract=off", "-Wno-psabi", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def compiler() -> tuple[str | None, str]:
    """`$CXX`'s (default c++) path and version line (`compiler_named`)."""
    return compiler_named(os.environ.get("CXX", "c++"))


@functools.cache
def compiler_named(cxx: str) -> tuple[str | None, str]:
    """(the compiler's path, its version line), or (None, why not): asked once a process (a
    subprocess each time would cost a millisecond, and `built()` is asked per sampled row)."""
    path = shutil.which(cxx)
    if path is None:
        return None, f"no C++ compiler ({cxx!r} is not on PATH)"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"C++ compiler {cxx!r} does not run: {e}"
    return path, version.splitlines()[0] if version else cxx


def build_dir(key: str) -> Path:
    """The directory of the library keyed `key` under the cache (a temporary one where the cache
    is read-only)."""
    from treespec.config import default_cache_dir

    return build_dir_in(default_cache_dir(), key)


@functools.cache
def build_dir_in(cache: Path, key: str) -> Path:
    base = cache / "kernels" / key
    try:
        base.mkdir(parents=True, exist_ok=True)
        probe = base / ".writable"
        probe.touch()
        return base
    except OSError:  # a read-only cache: build in a temporary folder
        import tempfile

        tmp = Path(tempfile.gettempdir()) / f"treespec-kernels-{os.getuid()}" / key
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp


def library() -> tuple[Path, Path, str]:
    """(the library's path, its build directory, its name) for this source, torch, compiler and
    flags; a RuntimeError without a compiler."""
    cxx, version = compiler()
    if cxx is None:
        raise RuntimeError(version)
    key = source_key(version)
    name = f"treespec_q4q8_{key}"
    where = build_dir(key)
    return where / f"{name}.so", where, name


@functools.cache
def source_key(version: str) -> str:
    """The library's key: a digest of its sources, torch, the compiler `version` and flags."""
    parts = [*(f.read_text() for f in SOURCES), torch.__version__, version, " ".join(CFLAGS + LDFLAGS)]
    parts += [platform.machine(), sys.version]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def builder(where: Path):
    """Hold the build directory `where` against other processes' builds: an advisory lock the
    system releases when its holder dies, so a killed build never blocks the next (POSIX; elsewhere
    nothing is held)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(where / "build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load(lib: Path, where: Path, name: str) -> float | None:
    """Load the library `lib` (`library()`), building it first where no build finished: the
    seconds the build took, None where it was built before."""
    done = where / "built"
    if lib.exists() and done.exists():
        torch.ops.load_library(str(lib))
        return None
    if shutil.which("ninja") is None:  # cpp_extension runs `ninja` from PATH: the package's binary
        try:
            import ninja
        except ImportError:
            raise RuntimeError("building the kernels needs ninja (pip install ninja)") from None
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    with builder(where):
        if lib.exists() and done.exists():  # another process built it while this one waited
            torch.ops.load_library(str(lib))
            return None
        # no live builder holds the directory: a baton cpp_extension left is a killed build's,
        # which it would wait on for ever
        (where / "lock").unlink(missing_ok=True)
        start = time.perf_counter()
        cpp_extension.load(
            name=name,
            sources=[str(f) for f in SOURCES if f.suffix == ".cpp"],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(where),
            is_python_module=False,
            verbose=bool(os.environ.get("TREESPEC_KERNELS_VERBOSE")),
        )
        seconds = time.perf_counter() - start
        done.write_text(f"{seconds:.1f} s\n")
        return seconds
