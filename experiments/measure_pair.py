#!/usr/bin/env python
"""Acceptance numbers of a target/draft pair, for its model card.

    python experiments/measure_pair.py --n-prompts 16 --out experiments/results/pycode_pair.json

alpha(T) = mean over positions of sum_x min(p(x), q(x)) (Leviathan et al., Cor. 3.6), with p and
q under temperature T, at the positions of the target's own continuations (sampled at T, greedy
at T = 0) of held-out prompts. tokens/step is measured by running treespec: linear (width 1)
and tree (width 4, i.i.d.) speculation at depth 4, for T = 0 and T = 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.bench import chain_logits
from treespec.sampling import probs
from treespec.zoo import load_prompts


def alpha(dec: SpeculativeDecoder, prompts: list[str], sampling: SamplingConfig, n_tokens: int) -> float:
    values = []
    for i, prompt in enumerate(prompts):
        ids = dec.tokenizer(prompt)["input_ids"]
        cont = dec.generate(ids, n_tokens, tree=None, sampling=sampling, seed=i, ignore_eos=True).token_ids
        with torch.inference_mode():
            p = probs(chain_logits(dec.target_runner, ids, cont), sampling)
            q = probs(chain_logits(dec.draft_runner, ids, cont), sampling)
        values += torch.minimum(p, q).sum(-1).tolist()
    return statistics.fmean(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", type=Path, default=None)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/pycode_pair.json"))
    args = ap.parse_args()

    dec = SpeculativeDecoder.from_pretrained(target=args.target, draft=args.draft)
    prompts = load_prompts(args.prompts, args.n_prompts)
    result = {"n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    for t in (0.0, 1.0):
        sampling = SamplingConfig(temperature=t)
        result[f"alpha_T{t:g}"] = alpha(dec, prompts, sampling, args.max_new_tokens)
        for name, tree in (("linear_w1_d4", TreeConfig(1, 4)), ("tree_w4_d4", TreeConfig(4, 4))):
            tokens = steps = 0
            acc = []
            for i, prompt in enumerate(prompts):
                s = dec.generate(prompt, args.max_new_tokens, tree=tree, sampling=sampling, seed=i, ignore_eos=True).stats
                tokens, steps = tokens + s.tokens, steps + s.target_steps
                acc.append(s.acceptance_by_depth)
            depth_acc = [statistics.fmean(a[d] for a in acc if len(a) > d) for d in range(4)]
            result[f"{name}_T{t:g}"] = {"tokens_per_step": tokens / steps, "acceptance_by_depth": depth_acc}
        print(json.dumps({k: v for k, v in result.items() if f"T{t:g}" in k}, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
