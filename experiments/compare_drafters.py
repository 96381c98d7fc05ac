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

`--verification token,block,traversal` runs every configuration once per rule that applies
to it ("model-linear/block", ...; "auto" = the decoder's default), same seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from treespec import GenerationStats, SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.request import encode_prompt
from treespec.sequoia import TreeShape
from treespec.zoo import heldout_chats, load_prompts


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
    ap.add_argument("--chat", action="store_true", help="the held-out chat instructions (a chat model)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--shape-json", type=Path, default=None, help="calibrate_sequoia.py output")
    ap.add_argument("--only", default=None, help="comma-separated subset of configuration names")
    ap.add_argument("--verification", default="auto", help="comma-separated rules: auto, token, block, traversal")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/compare_drafters.json"))
    args = ap.parse_args()

    prompts = heldout_chats(args.n_prompts) if args.chat else load_prompts(args.prompts, args.n_prompts)
    sampling = SamplingConfig(temperature=args.temperature)
    base = SpeculativeDecoder.from_pretrained(target=args.target, draft=args.draft, dtype=args.dtype)
    cfgs = configs(args)
    if args.only:
        cfgs = {k: v for k, v in cfgs.items() if k in args.only.split(",")}
    decoders = {name: SpeculativeDecoder(base.target_runner, base.draft_runner, base.tokenizer, drafter=d) for name, (d, _) in cfgs.items()}
    rules = [v.strip() for v in args.verification.split(",") if v.strip()]
    runs = {}  # row name -> (configuration, rule or None for the default)
    for name, (_, tree) in cfgs.items():
        fits = decoders[name].rules(tree)
        for v in rules if tree is not None else ["auto"]:
            if v == "auto" or v in fits:
                runs[name if len(rules) == 1 or tree is None else f"{name}/{v}"] = (name, None if v == "auto" else v)

    tps = {row: [] for row in runs}  # tokens/s of every run
    totals = {row: GenerationStats() for row in runs}  # pooled over prompts
    for i, prompt in enumerate(prompts):
        ids = list(encode_prompt(prompt, base.tokenizer))  # text, or a chat through its template
        for row, (name, rule) in runs.items():
            tree = cfgs[name][1]
            with torch.inference_mode():
                out = decoders[name].generate(ids, args.max_new_tokens, tree=tree, sampling=sampling, seed=i, ignore_eos=True,
                                              verification=rule)
            tps[row].append(out.stats.tokens_per_second)
            totals[row].add(out.stats)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    plain = statistics.median(tps["plain"]) if "plain" in tps else None
    print(f"\n{'config':<28}{'tokens/s':>10}{'vs plain':>10}{'tokens/step':>13}{'nodes/step':>12}{'draft s':>9}{'verify s':>10}")
    summary = {}
    for name, t in totals.items():
        median = statistics.median(tps[name])
        summary[name] = {
            "tokens_per_second_median": median,
            "tokens_per_step": t.tokens_per_step,
            "nodes_per_step": t.tree_nodes / t.target_steps,
            "draft_seconds": t.draft_seconds,
            "verify_seconds": t.verify_seconds,
            "acceptance_by_depth": t.acceptance_by_depth,
        }
        rel = f"{median / plain:.2f}x" if plain else "-"
        print(f"{name:<28}{median:>10.1f}{rel:>10}{t.tokens_per_step:>13.2f}{t.tree_nodes / t.target_steps:>12.1f}"
              f"{t.draft_seconds:>9.2f}{t.verify_seconds:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
