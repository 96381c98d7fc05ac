"""Compiled forwards kept across processes: AOTInductor packages.

A graph compiled in process (`torch.compile`) is rebuilt by every new process: dynamo traces the
forward again and AOT autograd captures it again (its cache refuses frozen graphs) before
inductor's own cache answers. An AOTInductor package (`torch._inductor.aoti_compile_and_package`)
is the graph compiled once, its frozen weights inside, into a shared library; a later process
loads it instead, and it runs as fast as the graph built in process (docs/performance.md).

`GraphStore` keeps packages under a directory ($TREESPEC_GRAPHS, else $TREESPEC_CACHE/graphs-v1), one file a
graph, named by a digest of everything the compiled code depends on: the module's weights
(their bytes) and what else its forward reads (the model's shape, the taps it returns), which
graph it is (a feed size, or "dynamic"), the inductor settings, the backends' source,
torch's version and the machine (`cpu.machine_key`). When any of them changes, another file is
named; a file that does not load is compiled again and replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from ...config import default_cache_dir
from ..cpu import machine_key

STORE_VERSION = 1  # bump when what a package holds or how it is called changes

log = logging.getLogger(__name__)


@functools.cache
def source_digest() -> str:
    """A digest of the backends' source files (treespec/backends/, native/ and the kernels'
    C++ included): the forward a package compiled."""
    h = hashlib.sha256()
    backends = Path(__file__).parents[1]
    for path in sorted(p for p in backends.rglob("*") if p.suffix in (".py", ".cpp")):
        h.update(path.relative_to(backends).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def model_digest(module: torch.nn.Module, **attributes) -> str:
    """A digest of what a graph of `module` computes with: its buffers (names, dtypes, shapes
    and bytes) and the `attributes` its forward reads
    besides (the model's shape, the taps it returns)."""
    h = hashlib.sha256()
    for name, value in sorted(attributes.items()):
        h.update(f"{name}={value!r}".encode())
    for name, t in sorted(module.named_buffers()):
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def load_package(path: Path) -> Callable:
    """The AOTInductor package at `path`, loaded by torch's own C++ loader, as
    `torch._inductor.aoti_load_package` loads it but without its imports and checks: inductor
    and dynamo (~1.6 s) and the export archive reader (~1.2 s) imported, and the compiler run to
    probe this CPU's vector ISA (~1.1 s), only to warn if the package was built for another
    machine, which a store's key (torch's version, the machine) already rules out. Where this
    torch has no such loader, `aoti_load_package` itself."""
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is None:
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path))
    model = loader(str(path), "model", False, 1, -1)  # model name, single-threaded, runners, device
    out_spec = pytree.treespec_loads(model.get_call_spec()[1])

    def run(*inputs: torch.Tensor):
        return pytree.tree_unflatten(
            model.boxed_run([t for t in inputs if isinstance(t, torch.Tensor)]), out_spec
        )

    return run


class GraphStore:
    """AOTInductor packages on disk, one per graph, found by `key`; a package not used for
    `keep_days` is removed when another is stored (a package holds its model's weights)."""

    def __init__(self, root: str | os.PathLike | None = None, keep_days: float = 14.0):
        if root is None:
            root = os.environ.get("TREESPEC_GRAPHS") or default_cache_dir() / f"graphs-v{STORE_VERSION}"
        self.root, self.keep_days = Path(root), keep_days

    @staticmethod
    def key(model: str, graph: int | str, settings: dict) -> str:
        """The file name of a graph: the `model` it computes (`model_digest`), which graph, the
        inductor `settings` it compiles under, the source, torch and the machine."""
        record = {
            "model": model,
            "graph": graph,
            "settings": settings,
            "source": source_digest(),
            "torch": torch.__version__,
            "machine": machine_key(),
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt2"

    def empty(self) -> bool:
        """Whether the store holds no package at all."""
        return not self.root.is_dir() or next(self.root.glob("*.pt2"), None) is None

    def refused(self, key: str) -> bool:
        """Whether compiling `key` ahead of time failed before (`refuse`): not tried again."""
        return self.path(key).with_suffix(".failed").is_file()

    def refuse(self, key: str, error: Exception) -> None:
        """Remember that `key` failed to compile ahead of time (the error, for a person)."""
        with contextlib.suppress(OSError):  # a read-only store: the next process tries again
            self.root.mkdir(parents=True, exist_ok=True)
            self.path(key).with_suffix(".failed").write_text(f"{type(error).__name__}: {error}\n")

    def load(self, key: str) -> Callable | None:
        """The package stored under `key`, loaded; None when there is none or it does not load
        (a corrupt file is removed, so that it is compiled again)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            package = load_package(path)
        except Exception as e:  # noqa: BLE001 - any unreadable package is rebuilt, never an error
            log.info("the compiled forward in %s does not load (%s); compiling it again", path, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):  # a read-only store: nothing to prune there anyway
            os.utime(path)  # used now: the last to be pruned
        return package

    def build(
        self, key: str, module: torch.nn.Module, inputs: tuple, dynamic_shapes: tuple, settings: dict
    ) -> Callable:
        """Export `module` on `inputs` (their sizes free along `dynamic_shapes`), compile it
        under the inductor `settings` into a package stored under `key` (written whole: a
        temporary file, then a rename), and load it."""
        from torch._inductor import aoti_compile_and_package

        program = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".pt2")
        os.close(fd)
        try:
            aoti_compile_and_package(program, package_path=tmp, inductor_configs=dict(settings))
            os.replace(tmp, self.path(key))
        finally:
            Path(tmp).unlink(missing_ok=True)
        self.prune()
        return load_package(self.path(key))

    def prune(self) -> None:
        """Remove the packages not used for `keep_days` (older models, settings or versions)."""
        cutoff = time.time() - self.keep_days * 86400
        for path in self.root.glob("*.pt2"):
            if path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
