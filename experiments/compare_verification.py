#!/usr/bin/env python
"""Verification rules side by side: tokens per target step from the same drafts.

    nice -n 19 python experiments/compare_verification.py --n-prompts 8 --seeds 4 --max-new-tokens 64

For every temperature and tree, each rule decodes every (held-out prompt, seed) pair with the
same seed (rules interleaved per pair). Reported per cell: tokens/step as the mean over runs of
(tokens / target steps) with a 95% confidence interval (normal approximation, t quantile), the
pooled tokens/step, acceptance by depth, and the paired gain over the token rule (mean of
per-run differences, 95% CI). Trees:

    chain-d4 / d6 / d8     width 1, i.i.d. draws from q          token vs block (vs traversal)
    wor-2x3 / 3x3 / 2x4    full k-ary shapes of depth d, each node's children drawn without
                           replacement (strategy "sequoia" with a fixed shape)   token vs traversal
    sequoia-T1             the calibrated Sequoia shape of experiments/results/sequoia_T1_shape.json
    topk-4x4               deterministic beam (top-k), width 4, depth 4           token vs traversal

Results go to experiments/results/verification.json (rewritten after every cell).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from scipy.stats import t as student_t

from treespec import GenerationStats, SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.sequoia import TreeShape
from treespec.theory import kary_parents
from treespec.zoo import load_prompts, pair

RESULTS = Path(__file__).parent / "results"


def trees(args) -> dict[str, tuple[TreeConfig, tuple[str, ...]]]:
    out: dict[str, tuple[TreeConfig, tuple[str, ...]]] = {}
    for d in args.chain_depths:
        out[f"chain-d{d}"] = (TreeConfig(1, d), ("token", "block", "traversal") if args.chain_traversal else ("token", "block"))
    for w, d in args.wor:
        shape = TreeShape(kary_parents(w, d))
        out[f"wor-{w}x{d}"] = (TreeConfig(depth=d, strategy="sequoia", shape=shape), ("token", "traversal"))
    cal = RESULTS / "sequoia_T1_shape.json"
    if args.sequoia and cal.exists():
        shape = TreeShape(tuple(json.loads(cal.read_text())["parents"]))
        out[f"sequoia-T1-{shape.n_nodes}n"] = (TreeConfig(depth=shape.depth, strategy="sequoia", shape=shape), ("token", "traversal"))
    if args.topk:
        out["topk-4x4"] = (TreeConfig(4, 4, "topk"), ("token", "traversal"))
    return out


def ci95(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval."""
    n = len(xs)
    m = statistics.fmean(xs)
    if n < 2:
        return m, float("nan")
    return m, float(student_t.ppf(0.975, n - 1)) * statistics.stdev(xs) / math.sqrt(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6])
    ap.add_argument("--chain-depths", type=int, nargs="+", default=[4, 6, 8])
    ap.add_argument("--wor", type=lambda s: tuple(int(v) for v in s.split("x")), nargs="*", default=[(2, 3), (3, 3), (2, 4)],
                    help="full without-replacement shapes WIDTHxDEPTH")
    ap.add_argument("--chain-traversal", action="store_true", help="also run traversal on chains (equals block)")
    ap.add_argument("--no-sequoia", dest="sequoia", action="store_false")
    ap.add_argument("--no-topk", dest="topk", action="store_false")
    ap.add_argument("--only", default=None, help="comma-separated subset of tree names")
    ap.add_argument("--out", type=Path, default=RESULTS / "verification.json")
    args = ap.parse_args()

    torch.set_num_threads(1)
    prompts = load_prompts(None, args.n_prompts)
    dec = SpeculativeDecoder.from_pretrained(*pair("pycode"), dtype="float32")
    ids = [dec.tokenizer(p)["input_ids"] for p in prompts]
    cells = trees(args)
    if args.only:
        cells = {k: v for k, v in cells.items() if k in args.only.split(",")}
    report = {"config": {**{k: str(v) for k, v in vars(args).items()}, "threads": 1, "dtype": "float32",
                         "pair": "bundled pycode (treespec/zoo/pycode)", "prompts": "bundled held-out"}, "cells": []}
    print(f"{'T':>4} {'tree':<18}{'rule':<11}{'tokens/step':>18}{'pooled':>8}{'gain vs token':>20}{'verify s':>9}  n")
    for temp in args.temperatures:
        sampling = SamplingConfig(temperature=temp)
        for name, (tree, rules) in cells.items():
            per_run = {r: [] for r in rules}
            totals = {r: GenerationStats() for r in rules}
            t0 = time.time()
            for i, prompt in enumerate(ids):
                for seed in range(args.seeds):
                    for rule in rules:
                        with torch.inference_mode():
                            out = dec.generate(prompt, args.max_new_tokens, tree=tree, sampling=sampling,
                                               seed=1000 * seed + i, ignore_eos=True, verification=rule)
                        per_run[rule].append(out.stats.tokens_per_step)
                        totals[rule].add(out.stats)
            for rule in rules:
                mean, half = ci95(per_run[rule])
                gain, gain_half = ci95([a - b for a, b in zip(per_run[rule], per_run["token"])])
                s = totals[rule]
                cell = {
                    "temperature": temp, "tree": name, "rule": rule, "n": len(per_run[rule]),
                    "nodes_per_step": s.tree_nodes / s.target_steps,
                    "tokens_per_step_mean": mean, "tokens_per_step_ci95": half,
                    "tokens_per_step_pooled": s.tokens_per_step,
                    "gain_vs_token_mean": gain, "gain_vs_token_ci95": gain_half,
                    "acceptance_by_depth": s.acceptance_by_depth,
                    "verify_seconds": s.verify_seconds, "draft_seconds": s.draft_seconds,
                    "tokens_per_second": s.tokens / max(1e-9, s.total_seconds - s.prefill_seconds),
                    "per_run_tokens_per_step": per_run[rule],
                }
                report["cells"].append(cell)
                g = "" if rule == "token" else f"{gain:+.3f} ± {gain_half:.3f}"
                print(f"{temp:>4} {name:<18}{rule:<11}{mean:>10.3f} ± {half:.3f}{s.tokens_per_step:>8.3f}{g:>20}"
                      f"{s.verify_seconds:>9.2f}  {len(per_run[rule])}", flush=True)
            print(f"     ({time.time() - t0:.0f}s)", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
