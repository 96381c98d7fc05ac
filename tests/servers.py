"""A `treespec serve` process for the tests that talk to one over HTTP (`start_server`: a
generator fixture body that yields {"base", "proc", "log"} once /health answers, and kills the
server after), and the official client of one (`openai_client`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MAX_LIVE, MAX_QUEUE = 4, 2  # the servers' lanes and queue limit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path_factory, dtype: str, *extra: str, models=("--pair", "pycode")):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, TREESPEC_SERVE_FAULTS="1", OMP_NUM_THREADS="1", NO_COLOR="1")
    cmd = [sys.executable, "-m", "treespec.serve", *models, "--dtype", dtype, "--threads", "1"]
    cmd += ["--port", str(port), "--max-live", str(MAX_LIVE), "--max-queue", str(MAX_QUEUE)]
    cmd += ["--grace-period", "20", "--log-level", "warning", *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up:\n{log.read_text()}")
        time.sleep(0.2)
    yield {"base": base, "proc": proc, "log": log}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def openai_client(server: dict, timeout: float = 60) -> openai.OpenAI:
    """The official client of a started server (`start_server`'s), retrying nothing."""
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="x", max_retries=0, timeout=timeout)
