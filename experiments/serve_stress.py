#!/usr/bin/env python
"""`treespec serve` under long prompts, as issue 60's "Done when" measures it, over HTTP on
loopback (the default pair unless `--server-arg=--pair ...`):

    python experiments/serve_stress.py --tag zen4                     # starts its own server
    python experiments/serve_stress.py --url http://127.0.0.1:8000    # a running one (no SIGTERM)

1. alone: a neighbour's 16-token completion (median of 3); one ~3k-token prompt with
   max_tokens 32 (its time x 6: "the prefills one after another alone"); /health idle.
2. burst: six such prompts streamed at once; /health polled every 0.2 s throughout (bar: every
   poll <= 0.25 s); the neighbour sent 1 s in (bar: <= 5 s); the burst's wall time (bar: <= 1.3x
   the six alone); the server's RSS before, right after and 30 s after (bar: <= before + 500 MB).
3. rounds that are Python, not torch: eight concurrent short T=1 streams with the default tree;
   /health polled (the GIL question: docs/serving.md, "The event loop and the engine").
4. stop strings: the neighbour beside a stream carrying the cap's maximum (16 strings of 256
   characters that never match) against beside the same stream without them (bar: within
   1.2x); 100,000 stop strings (bar: 400).
5. SIGTERM (own server only) while six long streams run: exit code and seconds (bar: 0 within
   --grace-period + 5), and whether every stream ended with a finish_reason and [DONE].

Prints each number beside its bar and writes results/serve_stress_<tag>.json. On shared cores
the timings are indicative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import time

import httpx
from common import launch_server, machine_info, write_results

LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 300  # ~3k tokens
NEIGHBOUR = {"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
PHASES = ["alone", "burst", "python_rounds", "stop_strings", "sigterm"]
LONG = {"prompt": LONG_TEXT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def start_server(args) -> tuple[subprocess.Popen, str]:
    extra = ["--log-level", "warning", "--grace-period", str(args.grace_period), "--max-live", "8"]
    return launch_server([*extra, *args.server_arg], timeout=600)


def rss_mb(proc) -> float | None:
    if proc is None:
        return None
    import psutil

    return psutil.Process(proc.pid).memory_info().rss / 2**20


async def complete(c: httpx.AsyncClient, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await c.post("/v1/completions", json=body, timeout=600)
    return time.perf_counter() - t0, r.status_code


async def stream(c: httpx.AsyncClient, body: dict, log: list | None = None) -> dict:
    """One streamed completion: seconds, finish_reason, whether it ended with [DONE]."""
    t0, finish, done = time.perf_counter(), None, False
    try:
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if log is not None:
                    log.append(time.perf_counter())
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as e:
        return {"s": time.perf_counter() - t0, "finish": finish, "done": done, "error": type(e).__name__}
    return {"s": time.perf_counter() - t0, "finish": finish, "done": done}


async def poll_health(c: httpx.AsyncClient, stop: asyncio.Event, every: float = 0.2) -> list[float]:
    lat = []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            await c.get("/health", timeout=10)
            lat.append(time.perf_counter() - t0)
        except httpx.HTTPError:
            lat.append(float("inf"))
        await asyncio.sleep(every)
    return lat


def health_summary(lat: list[float]) -> dict:
    return {
        "polls": len(lat),
        "max": max(lat, default=None),
        "median": statistics.median(lat) if lat else None,
    }


async def alone(c) -> dict:
    neighbour = statistics.median([(await complete(c, NEIGHBOUR))[0] for _ in range(3)])
    long_s, status = await complete(c, LONG)
    stop = asyncio.Event()
    idle = asyncio.create_task(poll_health(c, stop))
    await asyncio.sleep(1.0)
    stop.set()
    return {
        "neighbour_s": neighbour,
        "long_s": long_s,
        "long_status": status,
        "health_idle": health_summary(await idle),
    }


async def burst(c, proc, args) -> dict:
    before = rss_mb(proc)
    stop = asyncio.Event()
    health = asyncio.create_task(poll_health(c, stop))
    t0 = time.perf_counter()
    longs = [asyncio.create_task(stream(c, LONG)) for _ in range(6)]
    await asyncio.sleep(1.0)
    neighbour = (await complete(c, NEIGHBOUR))[0]
    results = await asyncio.gather(*longs)
    wall = time.perf_counter() - t0
    stop.set()
    after = rss_mb(proc)
    await asyncio.sleep(30 if proc is not None else 0)
    return {
        "wall_s": wall,
        "neighbour_s": neighbour,
        "health": health_summary(await health),
        "streams": results,
        "rss_mb": {"before": before, "after": after, "after_30s": rss_mb(proc)},
    }


async def python_rounds(c) -> dict:
    stop = asyncio.Event()
    health = asyncio.create_task(poll_health(c, stop))
    body = {"prompt": "def quicksort(xs):", "max_tokens": 64, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    results = await asyncio.gather(*[stream(c, {**body, "seed": i}) for i in range(8)])
    stop.set()
    return {
        "wall_s": time.perf_counter() - t0,
        "health": health_summary(await health),
        "streams": len(results),
    }


async def beside(c, body: dict | None, n: int = 5) -> float:
    """The neighbour's median seconds, alone (`body` None) or while a stream of `body` runs."""
    runner = None if body is None else asyncio.create_task(stream(c, body))
    await asyncio.sleep(0.5 if runner else 0)
    seconds = statistics.median([(await complete(c, NEIGHBOUR))[0] for _ in range(n)])
    if runner is not None:
        await runner
    return seconds


async def stop_strings(c) -> dict:
    stops = [chr(0x4E00 + i) * 256 for i in range(16)]  # 16 x 256 characters that never match
    other = {**NEIGHBOUR, "max_tokens": 400}
    alone_s = await beside(c, None)
    # alternated, so that a drift of the shared cores weighs on both alike
    plain, stopped = [], []
    for _ in range(2):
        plain.append(await beside(c, other))
        stopped.append(await beside(c, {**other, "stop": stops}))
    plain_s, stops_s = statistics.median(plain), statistics.median(stopped)
    many = [f"stop {i}" for i in range(100_000)]
    t0 = time.perf_counter()
    r = await c.post("/v1/completions", json={**NEIGHBOUR, "stop": many}, timeout=60)
    return {
        "neighbour_alone_s": alone_s,
        "neighbour_beside_a_stream_s": plain_s,
        "neighbour_beside_a_stream_with_16x256_stops_s": stops_s,
        "ratio": stops_s / plain_s,
        "stop_100k_status": r.status_code,
        "stop_100k_s": time.perf_counter() - t0,
    }


async def sigterm(c, proc, args) -> dict:
    longs = [asyncio.create_task(stream(c, {**LONG, "max_tokens": 400})) for _ in range(6)]
    await asyncio.sleep(args.sigterm_after)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*longs)
    code = await asyncio.to_thread(proc.wait, args.grace_period + 60)
    return {
        "exit_code": code,
        "exit_s": time.perf_counter() - t0,
        "streams_ended": sum(bool(r["finish"]) and r["done"] for r in results),
        "streams": results,
    }


async def run(args, base, proc) -> dict:
    out = {}
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=64)) as c:
        for name, phase in (
            ("alone", lambda: alone(c)),
            ("burst", lambda: burst(c, proc, args)),
            ("python_rounds", lambda: python_rounds(c)),
            ("stop_strings", lambda: stop_strings(c)),
        ):
            if name in args.phases:
                print(f"{name} ...", flush=True)
                out[name] = await phase()
        if proc is not None and "sigterm" in args.phases:
            print("sigterm ...", flush=True)
            out["sigterm"] = await sigterm(c, proc, args)
    return out


def report(r: dict, grace: float) -> None:
    if "alone" in r and "burst" in r:
        report_burst(r["alone"], r["burst"])
    if "python_rounds" in r:
        p = r["python_rounds"]
        print(
            f"8 T=1 streams (Python rounds): /health max {p['health']['max']:.3f} s, "
            f"{p['health']['polls']} polls"
        )
    if "stop_strings" in r:
        s = r["stop_strings"]
        print(
            f"neighbour beside a stream with 16x256 stop strings: {s['ratio']:.2f}x beside one without "
            f"(bar 1.2); 100k stops -> {s['stop_100k_status']}"
        )
    if "sigterm" in r:
        t = r["sigterm"]
        print(f"SIGTERM: exit {t['exit_code']} after {t['exit_s']:.1f} s (bar 0 within {grace + 5:g} s), "
              f"{t['streams_ended']}/6 streams with a finish_reason and [DONE]")  # fmt: skip


def report_burst(a: dict, b: dict) -> None:
    sequential = 6 * a["long_s"]
    print(f"neighbour alone {a['neighbour_s']:.2f} s; one long prompt alone {a['long_s']:.1f} s")
    print(f"burst of 6: {b['wall_s']:.1f} s = {b['wall_s'] / sequential:.2f}x six alone (bar 1.3x)")
    print(
        f"/health during the burst: max {b['health']['max']:.3f} s, {b['health']['polls']} polls (bar 0.25)"
    )
    print(f"neighbour during the burst: {b['neighbour_s']:.2f} s (bar 5)")
    print(f"streams ended: {sum(bool(s['finish']) and s['done'] for s in b['streams'])}/6")
    rss = b["rss_mb"]
    if rss["before"] is not None:
        print(
            f"RSS {rss['before']:.0f} -> {rss['after']:.0f} -> {rss['after_30s']:.0f} MB 30 s on (bar +500)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server on loopback (else one is started)")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to treespec serve (repeatable)")
    ap.add_argument("--grace-period", type=float, default=10.0)
    ap.add_argument("--sigterm-after", type=float, default=5.0, help="seconds into the six streams")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--phases", nargs="+", default=PHASES, choices=PHASES, help="default: all, in order")
    args = ap.parse_args()
    proc, base = (None, args.url) if args.url else start_server(args)
    try:
        result = asyncio.run(run(args, base, proc))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    report(result, args.grace_period)
    meta = {"machine": machine_info(), "server_args": args.server_arg, "grace_period": args.grace_period}
    write_results(f"serve_stress_{args.tag}.json", {**meta, **result})


if __name__ == "__main__":
    main()
