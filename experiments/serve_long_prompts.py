#!/usr/bin/env python
"""Long prompts in the continuous-batching engine: chunked prefill's cost and what it buys.

    python experiments/serve_long_prompts.py chunks --threads 1 --tag zen4   # tokens/s vs chunk size
    python experiments/serve_long_prompts.py burst --threads 1 --tag zen4    # 6 x ~3k-token prompts

`chunks`: prefill throughput of the default pair's target (its head's taps set, as an engine
sets them) for a ~3k-token prompt fed in chunks of 64 .. 1024 tokens (and whole): tokens/s
and the slowest chunk's seconds (the last, over the longest cache), sizes interleaved, median
of --repeats. The engine's default `round_tokens` is chosen from it: the largest chunk whose
slowest piece stays well under 0.3 s on a 2-core machine, losing little throughput.

`burst`: one greedy decode (the neighbour) is live when six ~3k-token prompts (max_new_tokens
32) are added to an 8-lane engine (`dec.engine(max_live=8)`, the server's; `--round-tokens`
budgets run in turn, 0: unchunked; default: the engine's): the step latencies the neighbour
sees while they load (median, max), the burst's time against the six prompts' prefills one
after another alone (issue 60's bar: within 1.3x), and the process RSS before the burst, right
after it and 30 s later (bar: <= before + 500 MB; read it from the first budget run).

Both print their numbers and write results/serve_long_prompts_<mode>_<tag>.json. Shared cores
make the timings indicative: compare runs made in one process.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_results  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 300  # ~3k tokens with SmolLM2's tokenizer
CHUNKS = (32, 64, 128, 256, 512, 1024)


def rss_mb() -> float:
    """This process's resident set, MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def load():
    from treespec import SpeculativeDecoder

    return SpeculativeDecoder.from_pretrained()


def chunks(args) -> dict:
    from treespec.backends.base import prefill_many

    dec = load()
    eng = dec.engine(max_live=1)  # a lane with the head's taps, as the server's
    lane = eng.targets[0]
    ids = dec.tokenizer(PROMPT)["input_ids"][: args.prompt_tokens]
    sizes = [*CHUNKS, len(ids)]
    seconds: dict[int, list[float]] = {k: [] for k in sizes}
    slowest: dict[int, list[float]] = {k: [] for k in sizes}
    for rep in range(args.repeats + 1):  # the first pass warms up
        for k in sizes:
            lane.reset()
            pieces = []
            t0 = time.perf_counter()
            for a in range(0, len(ids), k):
                t = time.perf_counter()
                prefill_many([(lane, ids[a : a + k])])
                pieces.append(time.perf_counter() - t)
            if rep:
                seconds[k].append(time.perf_counter() - t0)
                slowest[k].append(max(pieces))
    # one piece of n tokens after a cache of `at` tokens: what a step's prefill costs there
    pieces = {}
    for at in (0, len(ids) - max(CHUNKS[:5])):
        lane.reset()
        prefill_many([(lane, ids[:at])])
        times: dict[int, list[float]] = {n: [] for n in CHUNKS[:5]}
        for _ in range(args.repeats):
            for n in times:
                t = time.perf_counter()
                prefill_many([(lane, ids[at : at + n])])
                times[n].append(time.perf_counter() - t)
                del lane.committed[at:]
                lane.truncate(at)
        pieces[at] = {n: statistics.median(v) for n, v in times.items()}
        print(
            f"a piece after {at} cached tokens: "
            + ", ".join(f"{n}: {v:.3f} s" for n, v in pieces[at].items())
        )
    rows = []
    for k in sizes:
        s = statistics.median(seconds[k])
        rows.append(
            {
                "chunk": k,
                "seconds": s,
                "tokens_per_s": len(ids) / s,
                "slowest_chunk_s": statistics.median(slowest[k]),
            }
        )
        print(
            f"chunk {k:5d}: {len(ids) / s:7.1f} tok/s, total {s:6.2f} s, "
            f"slowest chunk {rows[-1]['slowest_chunk_s']:.3f} s"
        )
    return {"prompt_tokens": len(ids), "rows": rows, "piece_seconds_after": pieces}


def burst(args) -> dict:
    from treespec import SamplingConfig

    dec = load()
    ids = dec.tokenizer(PROMPT)["input_ids"][: args.prompt_tokens]
    # six prompts that share no prefix (each starts with another token)
    prompts = [[(ids[0] + i) % 1000 + 10] + ids[1:] for i in range(6)]
    greedy = SamplingConfig(temperature=0)
    runs = []
    for budget in args.round_tokens or [None]:
        settings = {} if budget is None else {"round_tokens": budget or None}
        eng = dec.engine(max_live=8, **settings)  # the server's lanes
        alone = []  # a long request alone: its prefill (and one token)
        for p in prompts[:2]:
            t = time.perf_counter()
            eng.add(p, max_new_tokens=1, sampling=greedy, ignore_eos=True)
            eng.run()
            alone.append(time.perf_counter() - t)
        gc.collect()
        before = rss_mb()
        neighbour = eng.add("Once upon a time", max_new_tokens=100_000, sampling=greedy, ignore_eos=True)
        eng.step()
        t0 = time.perf_counter()
        long_ids = [eng.add(p, max_new_tokens=32, sampling=greedy, ignore_eos=True) for p in prompts]
        rounds, tokens = [], 0
        while any(eng.output(i) is None for i in long_ids):
            t = time.perf_counter()
            emitted = eng.step()
            rounds.append(time.perf_counter() - t)
            tokens += len(emitted.get(neighbour, []))
        burst_s = time.perf_counter() - t0
        eng.cancel(neighbour)
        eng.run()
        gc.collect()
        after = rss_mb()
        time.sleep(args.settle)
        later = rss_mb()
        sequential = statistics.mean(alone) * len(prompts)
        run = {
            "round_tokens": eng.round_tokens,
            "prefill_alone_s": alone,
            "burst_s": burst_s,
            "burst_over_sequential": burst_s / sequential,
            "neighbour_step_s": {
                "median": statistics.median(rounds),
                "max": max(rounds),
                "steps": len(rounds),
            },
            "neighbour_tokens": tokens,
            "rss_mb": {"before": before, "after": after, f"after_{args.settle}s": later},
        }
        print(
            f"round_tokens {eng.round_tokens}: burst {burst_s:.1f} s = {run['burst_over_sequential']:.2f}x "
            f"six prefills alone ({sequential:.1f} s); neighbour steps median "
            f"{statistics.median(rounds):.3f} s, max {max(rounds):.3f} s over {len(rounds)} steps "
            f"({tokens} tokens); RSS {before:.0f} -> {after:.0f} -> {later:.0f} MB ({args.settle} s)",
            flush=True,
        )
        runs.append(run)
        del eng
    return {"prompt_tokens": len(ids), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("chunks", "burst"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (the server: cores - 1)")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--round-tokens",
        type=int,
        nargs="*",
        default=None,
        help="burst: budgets to run in turn (0: unchunked)",
    )
    ap.add_argument("--settle", type=int, default=30, help="burst: seconds before RSS is read again")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        **{"chunks": chunks, "burst": burst}[args.mode](args),
    }
    write_results(f"serve_long_prompts_{args.mode}_{args.tag}.json", result)


if __name__ == "__main__":
    main()
