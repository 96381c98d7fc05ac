#!/usr/bin/env python
"""Load on `treespec serve` through its HTTP API: throughput, time to first token, inter-token
latency, speculation on vs off.

    python experiments/serve_load.py --concurrency 1 4 16 --requests 16 --max-tokens 48

Starts a server on 127.0.0.1 (a free port; `--pair`, `--dtype`, `--threads` passed on) or uses
`--url` (loopback only). For each concurrency C, and for speculation off (`tree: null`) and on
(the server's default tree), in alternating order, it sends `--requests` streamed completions
of the held-out prompts (cycled), at most C in flight, temperature 0 and `ignore_eos` so that
both modes produce the same tokens. It stops by itself: every request has a timeout, and no
new request starts after `--time-limit` seconds.

Measured on the client, per request: TTFT (request sent -> first text chunk), ITL (the gaps
between successive text chunks; with speculation a chunk carries a whole round's tokens),
TPOT ((end - first chunk) / (completion tokens - 1): the per-token latency after the first);
per run: tokens/s = completion tokens of all requests / wall seconds. Also the server's own
acceptance counters from /metrics (deltas over each run). Writes JSON (default
experiments/results/serve_load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/
from common import launch_server  # noqa: E402

from treespec.zoo import heldout_chats, load_prompts  # noqa: E402

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(values: list[float]) -> dict:
    return {
        "p50": pct(values, 0.5),
        "p99": pct(values, 0.99),
        "mean": statistics.fmean(values) if values else None,
        "n": len(values),
    }


def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("treespec_") and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def one(client: httpx.AsyncClient, body: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage = None
    finish = None
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream("POST", endpoint, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return {"error": data["error"]["message"]}
            if data.get("usage"):
                usage = data["usage"]
            for c in data.get("choices", []):
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    chunks.append(time.perf_counter())
                finish = c.get("finish_reason") or finish
    t1 = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else 0
    return {
        "ttft": chunks[0] - t0 if chunks else None,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])],
        "tpot": (t1 - chunks[0]) / (tokens - 1) if chunks and tokens > 1 else None,
        "latency": t1 - t0,
        "tokens": tokens,
        "finish_reason": finish,
    }


async def run_load(base, prompts, n, concurrency, tree, max_tokens, deadline, timeout) -> dict:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def task(i):
        async with sem:
            if time.time() > deadline:
                return
            prompt = prompts[i % len(prompts)]
            body = {
                **({"messages": prompt} if isinstance(prompt, list) else {"prompt": prompt}),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if tree == "off":
                body["tree"] = None
            try:
                results.append(await one(client, body, timeout))
            except httpx.HTTPError as e:
                results.append({"error": f"{type(e).__name__}: {e}"})

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        before = scrape(base)
        t0 = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(n)))
        wall = time.perf_counter() - t0
        after = scrape(base)
    ok = [r for r in results if "error" not in r]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    steps, drafted = (
        delta.get("treespec_target_steps_total", 0),
        delta.get("treespec_drafted_tokens_total", 0),
    )
    accepted = delta.get("treespec_accepted_tokens_total", 0)
    by_depth = []
    for d in range(1, 33):
        a = delta.get(f'treespec_accepted_by_depth_total{{depth="{d}"}}')
        t = delta.get(f'treespec_attempted_by_depth_total{{depth="{d}"}}')
        if a is None or t is None or not t:
            break
        by_depth.append(a / t)
    tokens = sum(r["tokens"] for r in ok)
    return {
        "speculation": tree,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": summary([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": summary([x for r in ok for x in r["itl"]]),
        "tpot_s": summary([r["tpot"] for r in ok if r["tpot"] is not None]),
        "latency_s": summary([r["latency"] for r in ok]),
        "server": {
            "tokens_per_step": delta.get("treespec_generated_tokens_total", 0) / steps if steps else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / steps if steps else None,
            "acceptance_by_depth": by_depth,
        },
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    extra = ["--max-live", str(max(args.concurrency)), "--max-queue", str(max(args.requests, 1))]
    extra += ["--dtype", args.dtype, "--log-level", "warning"]
    if args.pair:
        extra += ["--pair", args.pair]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    return launch_server([*extra, *args.server_arg])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per (concurrency, mode) run")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1, help="runs per (concurrency, mode), alternating modes")
    ap.add_argument("--time-limit", type=float, default=900, help="no new request after this many seconds")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--url", default=None, help="a running server (loopback only); default: start one")
    ap.add_argument("--pair", default="pycode")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chat", action="store_true", help="chat completions of the held-out chat instructions")
    ap.add_argument(
        "--server-arg", action="append", default=[], help="passed on to treespec serve (e.g. --deterministic)"
    )
    ap.add_argument("--out", type=Path, default=Path("experiments/results/serve_load.json"))
    args = ap.parse_args()
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1:
        raise SystemExit("--concurrency, --requests and --max-tokens must be >= 1")

    proc = None
    if args.url is not None:
        host = urlparse(args.url).hostname or ""
        if host not in LOOPBACK and f"[{host}]" not in LOOPBACK:
            raise SystemExit(f"--url must be a loopback address (127.0.0.1, localhost, ::1), got {host!r}")
        base = args.url.rstrip("/").removesuffix("/v1")
    else:
        proc, base = start_server(args)
    try:
        prompts = heldout_chats() if args.chat else load_prompts()
        deadline = time.time() + args.time_limit
        # warm-up: both modes once (lanes allocated, first-call costs paid)
        for mode in ("off", "on"):
            asyncio.run(run_load(base, prompts, 2, 2, mode, 8, deadline, args.request_timeout))
        runs = []
        for c in args.concurrency:
            for rep in range(args.repeats):
                for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    if time.time() > deadline:
                        break
                    r = asyncio.run(
                        run_load(
                            base,
                            prompts,
                            args.requests,
                            c,
                            mode,
                            args.max_tokens,
                            deadline,
                            args.request_timeout,
                        )
                    )
                    r["repeat"] = rep
                    runs.append(r)
                    print(
                        f"C={c:<3} speculation {mode:<3} {r['tokens_per_s']:7.1f} tok/s  "
                        f"TTFT p50 {fmt(r['ttft_s']['p50'])} p99 {fmt(r['ttft_s']['p99'])}  "
                        f"ITL p50 {fmt(r['itl_s']['p50'])} p99 {fmt(r['itl_s']['p99'])}  "
                        f"TPOT p50 {fmt(r['tpot_s']['p50'])}  "
                        f"tokens/step {fmt(r['server']['tokens_per_step'], 2)}"
                        + (f"  errors {r['errors']}" if r["errors"] else ""),
                        flush=True,
                    )
        models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": models[0]["id"] if models else None,
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "processor": cpu_name(),
            "load_average": os.getloadavg(),
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.*)", text)
        return m.group(1) if m else platform.processor()
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    main()
