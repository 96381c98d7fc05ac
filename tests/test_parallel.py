"""Tensor parallelism (`treespec.parallel`, the sharded native runner) on gloo, in real torchrun
launches: token-for-token equality with one process in float64 (a tiny Llama on 2 ranks,
SmolLM2-135M-Instruct on 3), the CLI's generate and serve under torchrun, and every fault
(a head count the ranks do not divide, ranks started differently, a rank that dies, one that
hangs) ending every rank with a clear error within seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from treespec import parallel
from treespec.parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "tp_worker.py"
TIMEOUT_S = 4  # $TREESPEC_TP_TIMEOUT in the fault tests


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]


def run(cmd: list[str], timeout: float = 300, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra), cwd=ROOT)


def outputs(tmp_path: Path, case: str, ranks: int) -> dict:
    out = tmp_path / f"{case}-{ranks}.json"
    cmd = [sys.executable, str(WORKER), case, str(out)]
    done = run(torchrun(ranks, str(WORKER), case, str(out)) if ranks > 1 else cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# ---- in one process ---------------------------------------------------------------------------
def test_a_rank_holds_its_block_and_refuses_what_it_cannot_divide():
    assert TensorParallel(1, 3).block(9, "the query heads") == slice(3, 6)
    with pytest.raises(ValueError, match="needs the key/value heads divisible by 2, and the model has 3"):
        TensorParallel(0, 2).block(3, "the key/value heads")


def test_without_a_launch_there_is_no_group_and_agree_is_the_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.init() is None and parallel.init(tp=1) is None
    assert parallel.current() is None and parallel.leader()
    assert parallel.agree({"a": 1}) == {"a": 1}
    parallel.check_same("settings", {"x": 1})  # nothing to compare with
    with pytest.raises(ValueError, match=r"--tp 2 asks for 2 ranks.*torchrun --nproc-per-node 2"):
        parallel.init(tp=2)


def test_the_cli_says_how_to_launch_ranks(capsys, monkeypatch):
    from treespec.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "hi", "--tp", "2", "--max-new-tokens", "2"]) == 2
    assert "launch with `torchrun --nproc-per-node 2 -m treespec ...`" in capsys.readouterr().err


def test_sharded_products_sum_to_the_whole_one():
    """What each rank computes, summed as the all-reduce does, is the unsharded layer stack:
    the sharding itself, without processes (q/k/v rows, o columns, gate/up rows, down columns)."""
    from treespec.backends.native import NativeRunner

    from .conftest import tiny_llama

    model = tiny_llama(0)
    whole = NativeRunner.from_hf(model)
    ranks = [NativeRunner.from_hf(model, tp=TensorParallel(r, 2)) for r in range(2)]
    x = torch.randn(3, whole.shape.hidden, dtype=torch.float64)
    for i in range(len(whole.layers)):
        assert ranks[0].shape.heads == 2 and ranks[0].shape.kv_heads == 1
        gate_up = [r.layers[i].gate_up(x) for r in ranks]
        parts = [
            r.layers[i].down(torch.nn.functional.silu(g.chunk(2, -1)[0]) * g.chunk(2, -1)[1])
            for r, g in zip(ranks, gate_up)
        ]
        g = whole.layers[i].gate_up(x)
        full = whole.layers[i].down(torch.nn.functional.silu(g.chunk(2, -1)[0]) * g.chunk(2, -1)[1])
        torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-12, atol=1e-12)


# ---- launched ---------------------------------------------------------------------------------
def test_two_ranks_decode_token_for_token_as_one_process(tmp_path):
    """A float64 Llama with 4 query / 2 KV heads: greedy and seeded, chains and trees, plain,
    generate_batch and the continuous engine (a request joining two rounds late)."""
    single, sharded = outputs(tmp_path, "tiny", 1), outputs(tmp_path, "tiny", 2)
    for name in single:
        if name != "auto":  # the automatic tree plans with each world's own measured costs
            assert sharded[name] == single[name], name
    assert len(sharded["auto"][0]) == 8


# ~30 s (four processes load SmolLM2): with -m slow. The default run keeps ranks decoding token
# for token as one process with the tiny Llama on 2 ranks (above; one KV head group per rank, as
# here) and the ranks' partial products summing to the whole layer.
@pytest.mark.slow
def test_smollm2_on_three_ranks_decodes_as_one_process(tmp_path):
    """SmolLM2-135M-Instruct, 9 query / 3 KV heads, an MLP of 1536: one head group per rank."""
    single, sharded = outputs(tmp_path, "smollm2", 1), outputs(tmp_path, "smollm2", 3)
    assert sharded == single


# int8 weights (~15 s more: two more graphs to compile on each rank) with -m slow
@pytest.mark.parametrize("case", ["compiled", pytest.param("compiled-int8", marks=pytest.mark.slow)])
def test_the_compiled_forward_traces_the_all_reduce(tmp_path, case):
    """float32 on 2 ranks: the inductor graph (all-reduce inside it) == the eager sharded
    forward, for float and int8 weights."""
    out = outputs(tmp_path, case, 2)
    assert list(out) == (["int8"] if case == "compiled-int8" else ["None"])
    for quantize, got in out.items():
        assert got["graphs"] == [1], quantize  # compiled, not fallen back to eager
        assert got["max_diff"] < 1e-4, quantize


def test_cli_generate_under_torchrun_prints_once_what_one_process_prints():
    args = ["generate", "def add(a, b):", "--max-new-tokens", "20", "--dtype", "float64", "--seed", "3"]
    args += ["--temperature", "1", "--width", "2", "--depth", "3"]
    one = run([sys.executable, "-m", "treespec", *args])
    two = run(torchrun(2, "-m", "treespec", *args, "--tp", "2"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.startswith("def add(a, b):")


# ~15 s (three launches): with -m slow. The default run keeps `torchrun -m treespec generate`
# printing once what one process prints (above); this adds the c10d rendezvous of two launchers.
@pytest.mark.slow
def test_two_launchers_rendezvous_as_two_nodes():
    """The multi-node launch of docs/parallel.md, both "nodes" on this machine: two torchrun
    launchers of one rank each meet through the c10d rendezvous; rank 0's node prints what one
    process prints, the other nothing."""
    args = ["generate", "def add(a, b):", "--max-new-tokens", "12", "--dtype", "float64", "--seed", "3"]
    args += ["--temperature", "1", "--width", "2", "--depth", "2"]
    one = run([sys.executable, "-m", "treespec", *args])
    endpoint = f"127.0.0.1:{_free_port()}"
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    node += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=treespec-test"]
    nodes = [
        subprocess.Popen(
            node + ["-m", "treespec", *args], env=env(), cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    printed = sorted(p.communicate(timeout=180)[0] for p in nodes)
    assert [p.returncode for p in nodes] == [0, 0]
    assert printed == ["", one.stdout] and one.stdout.startswith("def add(a, b):")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def test_served_under_torchrun_a_completion_equals_one_process():
    from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig

    dec = SpeculativeDecoder.from_pretrained(dtype="float64")
    tree = TreeConfig(width=2, depth=3)
    want = [
        dec.generate("def add(a, b):", 24, tree=tree, sampling=SamplingConfig(temperature=1.0), seed=s).text
        for s in (3, 4)
    ]
    port = _free_port()
    cmd = torchrun(2, "-m", "treespec", "serve", "--port", str(port), "--dtype", "float64")
    server = subprocess.Popen(
        cmd + ["--width", "2", "--depth", "3"],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        for seed, text in zip((3, 4), want):
            body = {
                "model": "pycode",
                "prompt": "def add(a, b):",
                "max_tokens": 24,
                "temperature": 1.0,
                "seed": seed,
            }
            assert _post(port, body)["choices"][0]["text"] == text
    finally:
        server.send_signal(signal.SIGTERM)
        log = server.communicate(timeout=60)[0]
    assert "Traceback" not in log.split("Shutting down")[0], log[-3000:]


# ---- faults -----------------------------------------------------------------------------------
def test_heads_the_ranks_cannot_divide_end_every_rank_with_one_line():
    done = run(torchrun(2, "-m", "treespec", "generate", "hi", "--pair", "smollm2", "--plain"), timeout=120)
    assert done.returncode != 0
    for rank in (0, 1):
        assert (
            f"rank {rank}: error: tensor parallelism over 2 ranks needs the query heads divisible by 2, "
            "and the model has 9" in done.stderr
        )


def test_ranks_started_with_different_settings_fail_on_every_rank(tmp_path):
    done = run(torchrun(2, str(WORKER), "mismatch", str(tmp_path / "x.json")), timeout=120)
    assert done.returncode != 0
    message = (
        "different models or settings (rank(s) 1 differ from rank 0): dtype: rank 0 'float32', "
        "rank 1 'bfloat16'"
    )
    assert done.stderr.count(message) >= 2  # once per rank


def _ranks(launcher: subprocess.Popen, n: int, deadline: float) -> dict[int, int]:
    """rank -> pid of the processes `launcher` (torchrun) started."""
    while time.monotonic() < deadline:
        found = {}
        for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(child)
        if len(found) == n:
            return found
        time.sleep(0.2)
    raise AssertionError("torchrun did not start its ranks")


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_ends_the_run_with_a_clear_error(fault):
    """A long generation; once rank 0 prints, rank 1 is killed (SIGKILL) or frozen (SIGSTOP)."""
    cmd = torchrun(
        2, "-m", "treespec", "generate", "def f(x):", "--plain", "--max-new-tokens", "400", "--ignore-eos"
    )
    launcher = subprocess.Popen(
        cmd,
        env=env(TREESPEC_TP_TIMEOUT=str(TIMEOUT_S)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ranks = _ranks(launcher, 2, time.monotonic() + 60)
        assert launcher.stdout.read(4) == b"def "  # rank 0 decodes
        os.kill(ranks[1], signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
        t0 = time.monotonic()
        if fault == "hangs":  # rank 0 gives up on the frozen rank after the timeout
            err = b""
            while b"a tensor-parallel collective failed" not in err:
                assert time.monotonic() - t0 < TIMEOUT_S + 30, err.decode()[-2000:]
                err += launcher.stderr.read1(4096)
            os.kill(ranks[1], signal.SIGCONT)  # let the launcher's SIGTERM reach it
        launcher.wait(timeout=60)
        waited = time.monotonic() - t0
        err = (err if fault == "hangs" else b"") + launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    text = err.decode()
    assert waited < TIMEOUT_S + 40
    if fault == "hangs":
        assert "rank 0 of 2: a tensor-parallel collective failed" in text
    else:  # rank 0 reports the lost peer, or the launcher stops it first: either way, one line
        assert (
            "rank 0 of 2: a tensor-parallel collective failed" in text
            or "rank 0: stopped by the launcher" in text
        )
    assert f'File "{ROOT / "treespec"}' not in text  # no rank's traceback (torchrun prints its own summary)
