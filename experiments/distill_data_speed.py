#!/usr/bin/env python
"""How fast `treespec distill` makes data on this machine: response tokens per second of the
target's batched plain decoding and of the teacher forward that keeps its top-k, per dtype and
batch size, on the bundled chat training prompts (the smollm2 target by default).

    python experiments/distill_data_speed.py --out experiments/results/distill_data_speed.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from treespec import SamplingConfig, SpeculativeDecoder
from treespec.backends import hf
from treespec.bench import machine_info
from treespec.distill.data import teacher_topk
from treespec.distill.prompts import Rendered, bundled_prompts
from treespec.loading import checkpoint
from treespec.zoo import pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--response-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/distill_data_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = checkpoint(pair(args.pair)[0])
    tok = hf.load_tokenizer(path)
    train, _, _ = bundled_prompts(tok, 0)
    rendered = Rendered(train, tok, 192)
    rows = []
    for dtype in args.dtypes:
        model = hf.load_model(path, getattr(torch, dtype), torch.device("cpu"))
        dec = SpeculativeDecoder(model, None, tok)
        for batch in args.batches:
            ids = rendered.take(0, batch)
            t0 = time.perf_counter()
            outs = dec.generate_batch(
                ids, args.response_tokens, tree=None, sampling=SamplingConfig(temperature=args.temperature),
                seeds=list(range(batch)), max_batch=batch,
            )  # fmt: skip
            t1 = time.perf_counter()
            teacher_topk(model, [list(p) + o.token_ids for p, o in zip(ids, outs)], 32)
            t2 = time.perf_counter()
            n = sum(len(o.token_ids) for o in outs)
            rows.append({
                "dtype": dtype, "batch": batch, "response_tokens": n,
                "generate_tokens_per_s": round(n / (t1 - t0), 1), "teacher_seconds": round(t2 - t1, 2),
                "data_tokens_per_s": round(n / (t2 - t0), 1),
            })  # fmt: skip
            print(rows[-1], flush=True)
    result = {"command": "python experiments/distill_data_speed.py", "rows": rows, "machine": machine_info()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
