"""What the experiment scripts share: where results go, teacher-forced logits, a tree from
"strategy:WxD", and (from the package) what a run ran on and a pair's held-out prompts as ids.

Scripts run as `python experiments/<script>.py` (or `experiments/build/<script>.py`) from the
repository root; a script in a subfolder puts this folder on `sys.path` before importing it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from treespec.bench.measure import machine_info
from treespec.zoo import heldout_prompt_ids

__all__ = ["RESULTS", "chain_logits", "heldout_prompt_ids", "machine_info", "parse_tree", "write_results"]

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, data) -> Path:
    """`data` as JSON in results/`name` (indented, a final newline), said on stdout."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def chain_logits(runner, ids: list[int], cont: list[int]) -> torch.Tensor:
    """The `runner`'s next-token logits [len(cont), V] at the positions that predict each token
    of `cont` when `cont` follows the prompt `ids` (teacher forcing; the cache is reset first)."""
    runner.reset()
    runner.prefill(ids[:-1])
    logits = runner.extend([ids[-1]] + cont[:-1], list(range(-1, len(cont) - 1)))
    runner.commit([])
    return logits


def parse_tree(spec: str, acceptance: list[float] | None = None):
    """A `TreeConfig` from "strategy:WIDTHxDEPTH", or from "sequoia:NODESxDEPTH": the
    Sequoia-optimal shape of at most NODES draft nodes and depth DEPTH for a calibrated
    acceptance vector (`costs/calibrate_sequoia.py`'s JSON)."""
    from treespec import TreeConfig
    from treespec.sequoia import optimal_shape

    strategy, shape = spec.split(":")
    a, b = (int(x) for x in shape.split("x"))
    if strategy == "sequoia":
        if acceptance is None:
            raise SystemExit(
                f"{spec}: pass --sequoia with a calibrate_sequoia.py JSON (its acceptance vector)"
            )
        return TreeConfig(strategy="sequoia", shape=optimal_shape(acceptance, a, b), depth=b)
    return TreeConfig(width=a, depth=b, strategy=strategy)


def launch_server(args: list[str], timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`python -m treespec.serve ARGS` on a free loopback port; (the process, its base URL) once
    /health answers (SystemExit if it exits or does not come up within `timeout` seconds)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "treespec.serve", "--port", str(port), "--host", "127.0.0.1", *args]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not come up in {timeout:.0f} s")
