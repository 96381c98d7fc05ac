#!/usr/bin/env python
"""Heads (or drafts) for one target on the same held-out chats: acceptance by depth and tokens/step
(what each proposes, untimed; experiments/compare_drafters.py times drafters and shapes).

    python experiments/compare_heads.py --pair smollm2 \
        --drafts "shipped head=treespec/zoo/smollm2/head" "new head=/path/to/head" \
                 "draft=treespec/zoo/smollm2/draft" --tag zen5

Every drafter decodes the pair's held-out chats with the same chain (depth 4 by default) at
T=0 and T=1, same seeds; acceptance at depth d is accepted / attempted there, pooled over the
prompts. `--dynamic WxDxB ...` adds EAGLE-2 dynamic trees (width W, depth D, B nodes kept) per
drafter: the tokens/step a wide tree reaches. No timing: what it compares is what a drafter
proposes, not how fast. Writes results/compare_heads_<tag>.json.
"""

from __future__ import annotations

import argparse
import itertools

from common import heldout_prompt_ids, write_results

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.config import QUANTIZATIONS
from treespec.loading import quantize_setting
from treespec.zoo import pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2")
    ap.add_argument("--drafts", nargs="+", required=True, metavar="NAME=PATH")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--dynamic", nargs="*", default=[], metavar="WxDxB", help="dynamic trees, e.g. 6x8x32")
    weights = ("auto", "none", *QUANTIZATIONS)
    ap.add_argument("--quantize", choices=weights, default="auto", help="the target's weights")
    ap.add_argument("--draft-quantize", choices=weights, default="auto", help="the drafters' weights")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    trees = {"chain": TreeConfig(1, args.depth)}
    for spec in args.dynamic:
        width, depth, budget = (int(v) for v in spec.split("x"))
        trees[f"dynamic {spec}"] = TreeConfig(width=width, depth=depth, strategy="dynamic", budget=budget)

    target = pair(args.pair)[0]
    drafts = dict(d.split("=", 1) for d in args.drafts)
    decs = {
        name: SpeculativeDecoder.from_pretrained(
            target=target,
            draft=path,
            quantize=quantize_setting(args.quantize),
            draft_quantize=quantize_setting(args.draft_quantize),
        )
        for name, path in drafts.items()
    }
    prompts = heldout_prompt_ids(args.pair, next(iter(decs.values())).tokenizer, args.n_prompts)
    results = {
        "pair": args.pair, "drafts": drafts, "quantize": args.quantize,
        "draft_quantize": args.draft_quantize, "prompts": len(prompts), "depth": args.depth,
        "trees": {k: str(t) for k, t in trees.items()}, "runs": {},
    }  # fmt: skip
    for temperature, (name, dec), (tree_name, tree) in itertools.product(
        (0.0, 1.0), decs.items(), trees.items()
    ):
        outs = dec.generate_batch(
            prompts, max_new_tokens=args.max_new_tokens, tree=tree,
            sampling=SamplingConfig(temperature=temperature), seeds=list(range(len(prompts))),
        )  # fmt: skip
        depth = tree.depth

        def pooled(field: str, d: int, outs=outs) -> int:
            return sum(getattr(o.stats, field)[d] for o in outs if d < len(getattr(o.stats, field)))

        by_depth = [
            round(pooled("accepted_by_depth", d) / max(1, pooled("attempted_by_depth", d)), 4)
            for d in range(depth)
        ]
        steps = sum(o.stats.target_steps for o in outs)
        record = {
            "acceptance_by_depth": by_depth,
            "tokens_per_step": round(sum(len(o.token_ids) for o in outs) / steps, 4),
        }
        label = name if tree_name == "chain" else f"{name}, {tree_name}"  # the chain's keys as before
        results["runs"][f"{label}, T={temperature:g}"] = record
        print(f"{label:>16}  T={temperature:g}  {record}", flush=True)
    write_results(f"compare_heads_{args.tag}.json", results)


if __name__ == "__main__":
    main()
