#!/usr/bin/env python
"""Choose the default `TreeConfig`: the candidates' tokens/s at T=0 and T=1, interleaved.

    python experiments/pick_default_tree.py                      # writes experiments/results/default_tree.json

A grid sweep (`linear_vs_tree.py`) times each cell once, in sequence, so a slow minute of a
shared machine lands on whichever cell ran then. Here the shortlist from such a sweep runs
interleaved (repeat -> prompt -> temperature -> candidate, plain decoding included), every
candidate sees the same prompts and seeds, and each gets the median over its runs of
tokens/s relative to plain decoding in the same repeat. The winner maximises the geometric
mean of that speedup over the temperatures: one default that is good greedy and sampled.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.sequoia import optimal_shape
from treespec.zoo import load_prompts, pair

CANDIDATES = (
    "iid:1x4", "iid:1x5", "iid:1x6", "iid:2x3", "iid:2x4", "iid:4x3", "iid:4x4",
    "without_replacement:2x3", "without_replacement:2x4", "topk:2x4",
)


def parse(spec: str, acceptance: list[float] | None = None) -> TreeConfig:
    """"strategy:WIDTHxDEPTH", or "sequoia:NODESxDEPTH": the Sequoia-optimal shape of at most
    NODES draft nodes and depth DEPTH for a calibrated acceptance vector (`--sequoia`)."""
    strategy, shape = spec.split(":")
    a, b = (int(x) for x in shape.split("x"))
    if strategy == "sequoia":
        if acceptance is None:
            raise SystemExit(f"{spec}: pass --sequoia with a calibrate_sequoia.py JSON (its acceptance vector)")
        return TreeConfig(strategy="sequoia", shape=optimal_shape(acceptance, a, b), depth=b)
    return TreeConfig(width=a, depth=b, strategy=strategy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help="strategy:WIDTHxDEPTH or sequoia:NODESxDEPTH, comma-separated")
    ap.add_argument("--sequoia", type=Path, default=None,
                    help="calibrate_sequoia.py output whose acceptance vector shapes the sequoia:NODESxDEPTH candidates")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto", choices=("auto", "native", "hf"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/default_tree.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    acceptance = json.loads(args.sequoia.read_text())["acceptance"] if args.sequoia else None
    candidates = {spec: parse(spec, acceptance) for spec in args.candidates.split(",")}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    dec = SpeculativeDecoder.from_pretrained(*pair("pycode"), dtype=args.dtype, backend=args.backend)
    prompts = [dec.tokenizer(p)["input_ids"] for p in load_prompts(n=args.n_prompts)]
    methods = {"plain": None, **candidates}
    speedups = {(t, m): [] for t in temperatures for m in methods}
    per_step = {(t, m): [] for t in temperatures for m in methods}
    dec.generate(prompts[0], 16, tree=TreeConfig(2, 2))  # warm-up

    jobs = [(r, i, t) for r in range(args.repeats) for i in range(len(prompts)) for t in temperatures]
    for rep, i, t in tqdm(jobs, desc="prompts", unit="prompt"):
        speeds = {}
        for name, tree in methods.items():
            out = dec.generate(prompts[i], args.max_new_tokens, tree=tree, sampling=SamplingConfig(temperature=t),
                               seed=1000 * rep + i, ignore_eos=True)
            speeds[name] = out.stats.tokens_per_second
            per_step[t, name].append(out.stats.tokens_per_step)
        for name in methods:
            speedups[t, name].append(speeds[name] / speeds["plain"])

    rows = []
    for name in methods:
        row = {"candidate": name}
        for t in temperatures:
            row[f"speedup_T{t:g}"] = statistics.median(speedups[t, name])
            row[f"tokens_per_step_T{t:g}"] = statistics.mean(per_step[t, name])
        row["geomean_speedup"] = math.exp(statistics.mean(math.log(row[f"speedup_T{t:g}"]) for t in temperatures))
        rows.append(row)
    rows.sort(key=lambda r: -r["geomean_speedup"])
    runner = dec.target_runner
    config = dict(vars(args), out=str(args.out), sequoia=args.sequoia and str(args.sequoia), dtype=str(runner.dtype), backend=type(runner).__name__,
                  threads=torch.get_num_threads(), torch=torch.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "results": rows}, indent=1) + "\n")

    cols = [f"speedup_T{t:g}" for t in temperatures] + [f"tokens_per_step_T{t:g}" for t in temperatures]
    print(f"{'candidate':<26}{'geomean':>9}" + "".join(f"{c:>22}" for c in cols))
    for r in rows:
        print(f"{r['candidate']:<26}{r['geomean_speedup']:>9.2f}" + "".join(f"{r[c]:>22.2f}" for c in cols))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
