#!/usr/bin/env python
"""The default pair's feature head with its products dense, int8 or int4 (`draft_quantize`).

    python experiments/costs/head_quantize.py --tag zen5

One process: the default pair (`SpeculativeDecoder.from_pretrained()`: the GGUF target as
`dtype="auto"` / `quantize="auto"` choose, the shipped head) loaded once per head format; on
the same held-out chats, each configuration (a fixed chain of 1, and the automatic tree
planned from that format's own measured costs) runs every format in turn, after an untimed
warm-up; medians of tokens/s and tokens/step per temperature. A quantized head changes only
q, so every row decodes losslessly; what moves is the head's cost and how well it proposes.
Writes results/head_quantize_<tag>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import heldout_prompt_ids, machine_info, write_results  # noqa: E402

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig

FORMATS = {"dense": None, "int8": "int8", "int4": "int4"}
CONFIGS = {"chain 1x1": TreeConfig(1, 1), "auto": TreeConfig()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    decs = {name: SpeculativeDecoder.from_pretrained(draft_quantize=q) for name, q in FORMATS.items()}
    target = next(iter(decs.values())).target_runner
    prompts = heldout_prompt_ids("smollm2", decs["dense"].tokenizer, args.n_prompts)
    out = {
        "what": "the default pair's head dense / int8 / int4, a chain of 1 and the automatic tree",
        "command": " ".join(sys.argv),
        "target": [str(target.dtype), target.quantize],
        "machine": machine_info("cpu"),
        "runs": {},
    }
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        for dec in decs.values():  # warm-up, untimed (and the costs measured)
            for tree in CONFIGS.values():
                dec.generate(prompts[0], 16, tree=tree, sampling=sampling, seed=99)
        rows = {(f, c): [] for f in decs for c in CONFIGS}
        for i, prompt in enumerate(prompts):
            for c, tree in CONFIGS.items():
                for f, dec in decs.items():
                    rows[f, c].append(
                        dec.generate(prompt, args.max_new_tokens, tree=tree, sampling=sampling, seed=i)
                    )
            print(f"\rT={temperature} prompt {i + 1}/{len(prompts)}", end="", file=sys.stderr)
        run = {
            f"{f} {c}": {
                "tokens_per_second": round(statistics.median(o.stats.tokens_per_second for o in outs), 2),
                "tokens_per_step": round(statistics.median(o.stats.tokens_per_step for o in outs), 3),
            }
            for (f, c), outs in rows.items()
        }
        plans = {f: dec.planner.plan(sampling).describe() for f, dec in decs.items()}
        out["runs"][f"T={temperature}"] = {"plans": plans, "configs": run}
        print(f"\rT={temperature}", file=sys.stderr)
        for name, r in run.items():
            print(f"  {name:16s} {r['tokens_per_second']:7.1f} tok/s  tau {r['tokens_per_step']}")
    write_results(f"head_quantize_{args.tag}.json", out)


if __name__ == "__main__":
    main()
