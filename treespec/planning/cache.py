"""Measured `Costs` kept on disk, keyed by the machine and the models' settings (`CostCache`),
and a model's identity on disk (`files_key`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from .. import parallel
from ..backends.cpu import machine_key
from ..config import default_cache_dir, write_cache_json
from ..timing import BUSY_KEEP_SECONDS, CpuWatch
from .costs import Costs

COST_VERSION = 19  # bump when what is measured changes: older cache entries are ignored
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # files that hold a model's tensors

log = logging.getLogger(__name__)


def model_file(f: Path) -> bool:
    """Whether `f` decides what a model computes: its weights, their index and its config.
    Everything else beside them (a README, acceptance.json, the tokenizer) may change
    without changing a forward's cost."""
    return f.name == "config.json" or f.name.endswith(WEIGHT_SUFFIXES + (".index.json",))


def files_key(path) -> list | None:
    """A model's identity on disk: the names, sizes and modification times of the files that
    decide what it computes (`model_file`; None: not a local path)."""
    if path is None:
        return None
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        return [str(path)]  # a hub id: the name is all there is
    files = sorted(f for f in p.rglob("*") if model_file(f)) if p.is_dir() else [p]
    return [str(p.resolve())] + [
        [f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files if f.is_file()
    ]


class CostCache:
    """Measured `Costs` on disk, one JSON file per key (machine + model settings), under
    `$TREESPEC_CACHE/costs` (default ~/.cache/treespec/costs). The first measurement of a key
    wins: processes that measure at once all keep the one written first, so that every process
    on a machine plans alike. A missing, unreadable or stale entry is measured again, never an
    error. A measurement taken while other processes kept the CPUs busy (`timing.CpuWatch`) is
    kept for BUSY_KEEP_SECONDS only: processes started together still plan alike, and later
    ones do not price their trees by that moment's load."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir() / "costs"
        self.memory: dict[str, Costs] = {}

    @staticmethod
    def key(settings: dict) -> str:
        blob = json.dumps(
            {"version": COST_VERSION, "machine": machine_key(), **settings}, sort_keys=True, default=str
        )
        return hashlib.sha1(blob.encode()).hexdigest()[:20]

    def get(self, settings: dict | None, measure) -> Costs:
        """The costs for `settings` (None: not cacheable on disk, e.g. models given as objects):
        from memory, from disk, or `measure()`d and stored. Tensor parallel, rank 0's cache
        decides for every rank (`measure` must return the same costs on every rank)."""
        if settings is None:
            return measure()
        key = self.key(settings)
        if key not in self.memory:
            path = self.root / f"{key}.json"
            # tensor parallel: rank 0's cache decides whether every rank measures (together:
            # the measurement runs forwards), and rank 0's measurement is every rank's
            costs = parallel.agree(self._read(path) if parallel.leader() else None)
            if costs is None:
                stale = path.exists()  # corrupt, or another version's: replaced
                log.info(
                    "measuring this machine's costs for the automatic tree (once; kept in %s)", self.root
                )
                with CpuWatch() as watch:
                    costs = measure()
                record = {**costs.to_json(), "settings": settings, "machine": machine_key()}
                if watch.busy:  # the others' work is in the numbers: kept for a while only
                    record["busy"] = watch.others
                    log.warning(
                        "other processes used %s of the CPUs while the costs were measured: kept for "
                        "%d minutes only, then measured again",
                        watch.describe(),
                        BUSY_KEEP_SECONDS // 60,
                    )
                if parallel.leader() and write_cache_json(path, record, replace=stale):
                    costs = self._read(path) or costs  # another process's, if it wrote first
                costs = parallel.agree(costs)
            self.memory[key] = costs
        return self.memory[key]

    @staticmethod
    def _read(path: Path) -> Costs | None:
        """The record at `path`; None where it is absent, corrupt, another version's, or was
        measured on a busy machine more than BUSY_KEEP_SECONDS ago."""
        try:
            data = json.loads(path.read_text())
            if "busy" in data and time.time() - path.stat().st_mtime > BUSY_KEEP_SECONDS:
                return None
            return Costs.from_json(data)
        except (OSError, ValueError, KeyError, TypeError):
            return None


COSTS = CostCache()  # the process's cost cache (on disk under $TREESPEC_CACHE/costs)
