#!/usr/bin/env python
"""The automatic tree (`TreeConfig()`) against a grid of fixed trees and plain decoding.

    python experiments/auto_vs_grid.py --pair smollm2 --tag zen5            # the default pair
    python experiments/auto_vs_grid.py --pair pycode --dtype bfloat16 --tag zen5_bf16

One process, held-out prompts, every configuration run on the same prompt one after another
(interleaved, the order rotated from prompt to prompt; `--repeats` times over the prompts),
after an untimed warm-up of each; per temperature, each configuration's median tokens/s over
the runs, tokens/step and acceptance by depth, and the automatic tree's ratio to the best
fixed configuration and to plain decoding (issue 39's bar: >= 0.95x the best, >= 1.0x plain).
The grid: chains of depth 1-6, i.i.d. trees 2x1 to 4x4, a dynamic (EAGLE-2) tree and plain
decoding. Writes results/auto_vs_grid_<pair>_<tag>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import heldout_prompt_ids, machine_info, write_results
from head_bench import summarise

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.config import QUANTIZATIONS
from treespec.loading import quantize_setting
from treespec.zoo import pair, pair_draft

GRID = {
    **{f"chain 1x{d}": TreeConfig(1, d) for d in range(1, 7)},
    "iid 2x1": TreeConfig(2, 1),
    "iid 2x2": TreeConfig(2, 2),
    "iid 3x2": TreeConfig(3, 2),
    "iid 4x4": TreeConfig(4, 4),
    "dynamic 3x3 b6": TreeConfig(3, 3, "dynamic", budget=6),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2")
    ap.add_argument("--drafter", default=None, help="model or head (default: what the pair drafts with)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--quantize", choices=("auto", "none", *QUANTIZATIONS), default="auto", help="the target's weights"
    )
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs of every prompt and configuration (medians over all)"
    )
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()

    target, draft = pair(args.pair)[0], pair_draft(args.pair, args.drafter)
    t0 = time.perf_counter()
    dec = SpeculativeDecoder.from_pretrained(
        target=target,
        draft=draft,
        dtype=args.dtype,
        compile=args.compile,
        quantize=quantize_setting(args.quantize),
    )
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    costs = dec.planner.costs
    costs_s = time.perf_counter() - t0
    prompts = heldout_prompt_ids(args.pair, dec.tokenizer, args.n_prompts)
    methods = {"auto": TreeConfig(), "plain": None, **GRID}
    out = {
        "what": "TreeConfig() (automatic) against a grid of fixed trees and plain decoding",
        "command": " ".join(sys.argv),
        "pair": args.pair,
        "draft": str(draft),
        "dtype": str(dec.target_runner.dtype),
        "compile": args.compile,
        "quantize": getattr(dec.target_runner, "quantize", None),
        "draft_quantize": getattr(dec.draft_runner, "quantize", None),
        "machine": machine_info("cpu"),
        "load_seconds": round(load_s, 2),
        "costs_seconds": round(costs_s, 2),
        "repeats": args.repeats,
        "costs": costs.to_json(),
        "runs": {},
    }
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        plan = dec.planner.plan(sampling).describe()
        outs = {name: [] for name in methods}
        secs = {name: [] for name in methods}
        for tree in methods.values():  # warm-up: every configuration once, untimed
            dec.generate(prompts[0], 24, tree=tree, sampling=sampling, seed=99)
        order = list(methods.items())
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                seed = i + r * len(prompts)
                # each run starts the round of configurations one further along: none always
                # follows the same one (a heavy tree's run slowed the next by a few %)
                k = seed % len(order)
                for name, tree in order[k:] + order[:k]:
                    t0 = time.perf_counter()
                    o = dec.generate(prompt, args.max_new_tokens, tree=tree, sampling=sampling, seed=seed)
                    secs[name].append(time.perf_counter() - t0)
                    outs[name].append(o)
                where = f"repeat {r + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)}"
                print(f"\rT={temperature} {where}", end="", file=sys.stderr, flush=True)
        run = {name: summarise(outs[name], secs[name]) for name in methods}
        plain = run["plain"]["tokens_per_second"]
        best = max((r["tokens_per_second"], n) for n, r in run.items() if n != "auto")
        for r in run.values():
            r["vs_plain"] = round(r["tokens_per_second"] / plain, 3)
        auto = run["auto"]["tokens_per_second"]
        out["runs"][f"T={temperature}"] = {
            "plan": plan,
            "auto_vs_best": round(auto / best[0], 3),
            "best": best[1],
            "auto_vs_plain": round(auto / plain, 3),
            "configs": run,
        }
        print(f"\rT={temperature}: {plan}", file=sys.stderr)
        for name, r in sorted(run.items(), key=lambda kv: -kv[1]["tokens_per_second"]):
            speed = f"{r['tokens_per_second']:7.1f} tok/s ({r['vs_plain']:.2f}x plain)"
            print(f"  {name:16s} {speed}  tau {r['tokens_per_step']}")
        print(f"  auto: {auto / best[0]:.3f}x the best ({best[1]}), {auto / plain:.3f}x plain")
    write_results(f"auto_vs_grid_{args.pair}_{args.tag}.json", out)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
