#!/usr/bin/env python
"""Continuous batching: a stream of requests through one engine, speculating or not.

    python experiments/continuous_batching.py --temperature 1 --requests 32 --max-live 8

The held-out prompts (cycled) form `--requests` requests of `--max-new-tokens` each, all
queued at once on an engine with `--max-live` lanes: as one finishes, the next is admitted.
Methods, interleaved (repeat -> method), same seeds: plain decoding (tree=None), the tree
always speculating, the tree with `speculate_max_live=--limit` (plain rounds while more
than that many requests are live) and with `speculate_max_live="auto"` (each round
speculative or plain by measured tokens/s; its measurements carry over between repeats, as
in a long-running server). tokens/s = all requests' tokens / wall seconds, prefills
included; medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.bench import machine_info
from treespec.zoo import load_prompts, pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-live", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--limit", type=int, default=2, help="the fixed speculate_max_live row")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="default: experiments/results/continuous_T{temperature}.json")
    args = ap.parse_args()
    out_path = args.out or Path(f"experiments/results/continuous_T{args.temperature:g}.json")

    dec = SpeculativeDecoder.from_pretrained(*pair("pycode"), dtype=args.dtype)
    texts = load_prompts()
    requests = [dec.tokenizer.encode(texts[i % len(texts)]) for i in range(args.requests)]
    tree = TreeConfig(args.width, args.depth)
    methods = {  # name -> (tree, speculate_max_live)
        "plain": (None, None),
        f"tree {args.width}x{args.depth}": (tree, None),
        f"tree {args.width}x{args.depth} <={args.limit}": (tree, args.limit),
        f"tree {args.width}x{args.depth} auto": (tree, "auto"),
    }
    sampling = SamplingConfig(temperature=args.temperature)
    dec.generate_batch(requests[: args.max_live], 8, max_batch=args.max_live)  # warm-up: lanes allocated
    runs = {m: [] for m in methods}
    for rep in range(args.repeats):
        for m, (t, limit) in methods.items():
            t0 = time.perf_counter()
            outs = dec.generate_batch(requests, args.max_new_tokens, tree=t, sampling=sampling, seeds=list(range(len(requests))),
                                      ignore_eos=True, max_batch=args.max_live, speculate_max_live=limit)
            runs[m].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
            print(f"repeat {rep + 1}/{args.repeats} {m:<18} {runs[m][-1]:8.1f} tokens/s", flush=True)

    rows = [{"method": m, "tokens_per_second": statistics.median(v), "runs": v} for m, v in runs.items()]
    config = vars(args) | {"out": str(out_path), "dtype_target": str(dec.target_runner.dtype),
                           "backend": type(dec.target_runner).__name__, **machine_info(dec.target_runner.device)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    plain = rows[0]["tokens_per_second"]
    for r in rows:
        print(f"{r['method']:<18} {r['tokens_per_second']:8.1f} tokens/s  {r['tokens_per_second'] / plain:5.2f}x plain")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
