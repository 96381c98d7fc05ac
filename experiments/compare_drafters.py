#!/usr/bin/env python
"""Drafters and tree shapes side by side, on held-out prompts, in one process.

    python experiments/compare_drafters.py --temperature 0 --budget 12 --out experiments/results/compare_T0.json

Configurations (all interleaved per prompt, medians of tokens/s, pooled tokens/step):
  plain                  no speculation (the in-library baseline)
  model-linear           draft model, width 1, depth D
  model-iid              draft model, i.i.d. tree, width W, depth D
  ngram / lookup         model-free drafters, width W, depth D
  merged                 draft model tree + n-gram tree in one
  static-topk@B          deterministic beam with ~B nodes (width B // D, depth D)
  dynamic@B              EAGLE-2 style, B nodes kept
  sequoia@B              Sequoia-optimal shape of B nodes (needs --shape-json from calibrate_sequoia.py)
  adaptive-hf / adaptive-entropy   draft model, width W, depth adapting in [1, 2D]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.sequoia import TreeShape
from treespec.zoo import load_prompts


def configs(args) -> dict[str, tuple[str, TreeConfig | None]]:
    W, D, B = args.width, args.depth, args.budget
    out = {
        "plain": ("model", None),
        "model-linear": ("model", TreeConfig(1, D)),
        "model-iid": ("model", TreeConfig(W, D)),
        "ngram": ("ngram", TreeConfig(W, D)),
        "lookup": ("lookup", TreeConfig(W, D)),
        "merged": ("merged", TreeConfig(W, D)),
        f"static-topk@{B}": ("model", TreeConfig(max(1, B // D), D, "topk")),
        f"dynamic@{B}": ("model", TreeConfig(W, D, "dynamic", budget=B)),
        "adaptive-hf": ("model", TreeConfig(W, D, adaptive="hf", depth_min=1, depth_max=2 * D)),
        "adaptive-entropy": ("model", TreeConfig(W, D, adaptive="entropy", depth_min=1, depth_max=2 * D)),
    }
    if args.shape_json:
        cal = json.loads(args.shape_json.read_text())
        parents = cal["shapes_by_budget"][str(B)]["parents"]
        shape = TreeShape(tuple(parents))
        out[f"sequoia@{B}"] = ("model", TreeConfig(depth=max(1, shape.depth), strategy="sequoia", shape=shape))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=Path, default=None, help="JSON prompts (default: bundled held-out)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--shape-json", type=Path, default=None, help="calibrate_sequoia.py output")
    ap.add_argument("--only", default=None, help="comma-separated subset of configuration names")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/compare_drafters.json"))
    args = ap.parse_args()

    prompts = load_prompts(args.prompts, args.n_prompts)
    sampling = SamplingConfig(temperature=args.temperature)
    base = SpeculativeDecoder.from_pretrained(target=args.target, draft=args.draft, dtype=args.dtype)
    cfgs = configs(args)
    if args.only:
        cfgs = {k: v for k, v in cfgs.items() if k in args.only.split(",")}
    decoders = {name: SpeculativeDecoder(base.target_model, base.draft_model, base.tokenizer, drafter=d) for name, (d, _) in cfgs.items()}

    rows = {name: {"tps": [], "tokens": 0, "steps": 0, "nodes": 0, "draft_s": 0.0, "verify_s": 0.0} for name in cfgs}
    for i, prompt in enumerate(prompts):
        ids = base.tokenizer(prompt)["input_ids"]
        for name, (_, tree) in cfgs.items():
            with torch.inference_mode():
                out = decoders[name].generate(ids, args.max_new_tokens, tree=tree, sampling=sampling, seed=i, ignore_eos=True)
            s, r = out.stats, rows[name]
            r["tps"].append(s.tokens_per_second)
            r["tokens"] += s.tokens
            r["steps"] += s.target_steps
            r["nodes"] += s.tree_nodes
            r["draft_s"] += s.draft_seconds
            r["verify_s"] += s.verify_seconds
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    plain = statistics.median(rows["plain"]["tps"]) if "plain" in rows else None
    print(f"\n{'config':<20}{'tokens/s':>10}{'vs plain':>10}{'tokens/step':>13}{'nodes/step':>12}{'draft s':>9}{'verify s':>10}")
    summary = {}
    for name, r in rows.items():
        tps = statistics.median(r["tps"])
        summary[name] = {
            "tokens_per_second_median": tps,
            "tokens_per_step": r["tokens"] / r["steps"],
            "nodes_per_step": r["nodes"] / r["steps"],
            "draft_seconds": r["draft_s"],
            "verify_seconds": r["verify_s"],
        }
        rel = f"{tps / plain:.2f}x" if plain else "-"
        print(f"{name:<20}{tps:>10.1f}{rel:>10}{r['tokens'] / r['steps']:>13.2f}{r['nodes'] / r['steps']:>12.1f}{r['draft_s']:>9.2f}{r['verify_s']:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
