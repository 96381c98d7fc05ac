#!/usr/bin/env python
"""Measure a draft's positional acceptance on held-out prompts (by default the 16 after the
first 32, which the benchmarks time) and ship it beside the draft.

    python experiments/build/calibrate_acceptance.py --pair pycode                 # zoo/pycode/draft
    python experiments/build/calibrate_acceptance.py --pair smollm2 --drafter head # zoo/smollm2/head

Writes `acceptance.json` into the draft's directory (`treespec.planning.write_acceptance`): the
vectors `TreeConfig()` (the automatic tree) plans with at temperature 0 and above. `treespec
distill` writes it for the drafts and heads it makes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import heldout_prompt_ids  # noqa: E402

from treespec import SpeculativeDecoder
from treespec.planning import write_acceptance
from treespec.zoo import pair_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2")
    ap.add_argument("--drafter", default=None, help="model or head (default: what the pair drafts with)")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument(
        "--skip", type=int, default=32,
        help="held-out prompts left out first: the benchmarks time the first ones, so calibrating "
        "on later ones keeps the plan's acceptance from being measured on the prompts it is judged on",
    )  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = pair_draft(args.pair, args.drafter)
    from treespec.zoo import pair

    dec = SpeculativeDecoder.from_pretrained(target=pair(args.pair)[0], draft=draft)
    prompts = heldout_prompt_ids(args.pair, dec.tokenizer, args.skip + args.n_prompts)[args.skip :]
    record = write_acceptance(dec, prompts, draft, args.max_new_tokens)
    print(json.dumps({k: v["acceptance"] if isinstance(v, dict) else v for k, v in record.items()}))
    print(f"wrote {draft / 'acceptance.json'}")


if __name__ == "__main__":
    main()
