#!/usr/bin/env python
"""What grows with the tree in the default target's eager forward (issue 58): torch.profiler's
self CPU time per op, and the forward with its parts stubbed out.

    nice -n 5 python experiments/costs/forward_profile.py [--quantize q4q8] [--threads 2] [--reps 3]

After a held-out chat as prefix, random trees of n = 1, 2, 4, 8, 16, 32 nodes, interleaved:
1. per op, the median over `--reps` profiles of 5 forwards each of its self CPU time per
   forward, ms (the top `--top` ops at the largest n);
2. the median wall time of one forward as it is, with every product stubbed (a zero tensor of
   its output's shape: what is left is the forward's non-product cost), and with SDPA stubbed
   too (what is left outside attention's kernel).
Writes results/forward_profile_<quantize>.json. On a shared machine the times are indicative.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import heldout_prompt_ids, machine_info, write_results  # noqa: E402

from treespec.backends import linear
from treespec.backends.native import NativeRunner
from treespec.tree import TokenTree

SIZES = (1, 2, 4, 8, 16, 32)
PRODUCTS = (linear.Projection, linear.QuantizedProjection, linear.Int4Projection, linear.Q4Q8Projection)


def by_op(runner: NativeRunner, trees: dict, reps: int) -> dict:
    """{n: {op: median self CPU seconds per forward}}."""
    got: dict = {n: {} for n in trees}
    for _ in range(reps):
        for n, tree in trees.items():
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(5):
                    runner.score(tree)
                    runner.commit([])
            for e in p.key_averages():
                got[n].setdefault(e.key, []).append(e.self_cpu_time_total / 5e6)
    return {n: {k: statistics.median(v) for k, v in ops.items()} for n, ops in got.items()}


def stubbed(runner: NativeRunner, trees: dict, reps: int) -> dict:
    """{mode: {n: median seconds of one forward}} with products / SDPA stubbed."""
    calls = {c: c.__call__ for c in PRODUCTS}
    sdpa = F.scaled_dot_product_attention

    def zero_product(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)

    def zero_sdpa(q, k, v, **kw):
        return torch.zeros_like(q)

    modes = {"as is": (False, False), "no products": (True, False), "no products, no SDPA": (True, True)}
    times = {m: {n: [] for n in trees} for m in modes}
    try:
        for _ in range(reps):
            for n, tree in trees.items():
                for m, (no_products, no_sdpa) in modes.items():
                    for c in PRODUCTS:
                        c.__call__ = zero_product if no_products else calls[c]
                    F.scaled_dot_product_attention = zero_sdpa if no_sdpa else sdpa
                    runner.score(tree)  # warm
                    runner.commit([])
                    start = time.perf_counter()
                    runner.score(tree)
                    times[m][n].append(time.perf_counter() - start)
                    runner.commit([])
    finally:
        for c in PRODUCTS:
            c.__call__ = calls[c]
        F.scaled_dot_product_attention = sdpa
    return {m: {n: statistics.median(v) for n, v in t.items()} for m, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a converted checkpoint (default: SmolLM2-135M's GGUF)")
    ap.add_argument("--quantize", default="q4q8")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from treespec.loading import load_tokenizer

    if args.model is None:
        from treespec.loading.gguf import convert, smollm2_gguf

        args.model = str(convert(smollm2_gguf()))
    quantize = None if args.quantize == "none" else args.quantize
    runner = NativeRunner.from_pretrained(args.model, dtype=getattr(torch, args.dtype), quantize=quantize)
    prompt = heldout_prompt_ids("smollm2", load_tokenizer(args.model), 1)[0]
    runner.reset()
    runner.prefill(prompt)
    rng = random.Random(0)
    trees = {
        n: TokenTree([rng.randrange(1000) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)])
        for n in SIZES
    }
    ops = by_op(runner, trees, args.reps)
    top = sorted(ops[SIZES[-1]], key=lambda k: -ops[SIZES[-1]][k])[: args.top]
    print(f"{'self CPU ms per forward':45s}" + "".join(f"{f'n={n}':>8}" for n in SIZES))
    print(f"{'(all ops)':45s}" + "".join(f"{sum(ops[n].values()) * 1e3:8.2f}" for n in SIZES))
    for k in top:
        print(f"{k[:45]:45s}" + "".join(f"{ops[n].get(k, 0) * 1e3:8.3f}" for n in SIZES))
    walls = stubbed(runner, trees, 2 * args.reps + 1)
    print(f"\n{'wall ms per forward':45s}" + "".join(f"{f'n={n}':>8}" for n in SIZES))
    for m, t in walls.items():
        print(f"{m:45s}" + "".join(f"{t[n] * 1e3:8.2f}" for n in SIZES))
    write_results(
        f"forward_profile_{args.quantize}.json",
        {
            "command": " ".join(sys.argv),
            "machine": machine_info("cpu"),
            "threads": args.threads,
            "self_cpu_seconds": {str(n): {k: ops[n].get(k, 0.0) for k in top} for n in SIZES},
            "wall_seconds": {m: {str(n): v for n, v in t.items()} for m, t in walls.items()},
            "note": "indicative on a shared machine (run under nice)",
        },
    )


if __name__ == "__main__":
    main()
