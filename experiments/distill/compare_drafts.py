#!/usr/bin/env python
"""Several drafts for one target, on the same held-out positions: alpha at T = 0 and T = 1
(Leviathan et al., Cor. 3.6: E[sum_x min(p(x), q(x))], at T = 0 the rate at which the draft's
argmax is the target's), tokens/step of a chain, and c = t_draft / t_target.

    python experiments/distill/compare_drafts.py --drafts treespec/zoo/smollm2/draft runs/slice2 \
        --out experiments/results/compare_drafts_smollm2.json

    python experiments/distill/compare_drafts.py --pair pycode --drafts treespec/zoo/pycode/draft \
        --out experiments/results/compare_drafts_pycode.json      # the pycode pair's model card

The target (default: the `--pair`'s) samples its own continuations of the pair's held-out
prompts (`heldout_prompt_ids`: chat instructions for smollm2, code openings for pycode; greedy
at T = 0, sampled at T = 1); every draft is scored on those very positions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import RESULTS, chain_logits, heldout_prompt_ids, machine_info  # noqa: E402

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig, theory
from treespec.bench.measure import forward_seconds
from treespec.sampling import probs
from treespec.zoo import pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2", choices=("smollm2", "pycode"), help="its target and prompts")
    ap.add_argument("--target", default=None, help="default: the pair's target")
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4, help="the chain whose tokens/step is measured")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: results/compare_drafts_<pair>.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = args.target or pair(args.pair)[0]
    args.out = args.out or RESULTS / f"compare_drafts_{args.pair}.json"
    decs = {
        d: SpeculativeDecoder.from_pretrained(target, d, dtype=args.dtype, draft_dtype=args.draft_dtype)
        for d in args.drafts
    }
    first = next(iter(decs.values()))
    prompts = heldout_prompt_ids(args.pair, first.tokenizer, args.n_prompts)
    t_target = forward_seconds(first.target_runner, 1, repeats=9)
    rows = {d: {"c": forward_seconds(dec.draft_runner, 1, repeats=9) / t_target} for d, dec in decs.items()}
    for t in (0.0, 1.0):
        sampling = SamplingConfig(temperature=t)
        sums = {d: 0.0 for d in decs}
        n = 0
        for i, ids in enumerate(prompts):
            cont = first.generate(ids, args.max_new_tokens, tree=None, sampling=sampling, seed=i, ignore_eos=True)
            with torch.inference_mode():
                p = probs(chain_logits(first.target_runner, ids, cont.token_ids), sampling)
                for d, dec in decs.items():
                    q = probs(chain_logits(dec.draft_runner, ids, cont.token_ids), sampling)
                    sums[d] += theory.alpha(p, q) * len(cont.token_ids)
            n += len(cont.token_ids)
        for d, dec in decs.items():
            steps = tokens = 0
            for i, ids in enumerate(prompts):
                out = dec.generate(ids, args.max_new_tokens, tree=TreeConfig(1, args.depth), sampling=sampling, seed=i,
                                  ignore_eos=True)
                steps, tokens = steps + out.stats.target_steps, tokens + out.stats.tokens
            rows[d][f"T={t:g}"] = {"alpha": sums[d] / n, "tokens_per_step": tokens / steps}
            print(f"T={t:g} {d}: alpha {sums[d] / n:.3f}, chain 1x{args.depth} {tokens / steps:.2f} tokens/step, "
                  f"c {rows[d]['c']:.3f}", file=sys.stderr, flush=True)  # fmt: skip
    out = {
        "command": "python experiments/distill/compare_drafts.py " + " ".join(sys.argv[1:]),
        "pair": args.pair, "target": str(target), "dtype": args.dtype, "draft_dtype": args.draft_dtype,
        "positions": {"prompts": len(prompts), "tokens_each": args.max_new_tokens},
        "t_target_1_s": t_target, "drafts": rows, "machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
