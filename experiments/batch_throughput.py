#!/usr/bin/env python
"""Throughput of batched decoding: treespec generate_batch() vs HF generate() at batch 1-16.

    python experiments/batch_throughput.py --temperature 0      # writes experiments/results/batch_T0.json

For each batch size B, the held-out prompts (cycled) form batches of B requests; every
method decodes the same batches with the same seeds, interleaved (repeat -> batch -> method),
and its tokens/s is the median over its runs of (all requests' new tokens / the batch's wall
seconds). "decode tokens/s" takes the prompts' prefill out of the wall time (treespec: its
measured prefill; HF: one forward over the padded batch, timed just before), since on a
2-core CPU the prefill of 8 x ~185-token prompts is a third of a batch's time. Methods: HF `generate()` on the left-padded batch (HF assisted generation cannot
batch: transformers #32165), treespec autoregressive (tree=None), linear (a chain of
--depth) and trees of each --widths at that depth, all through `generate_batch()` (one
target forward per round for the whole batch). At B=1 every method decodes the prompts one
by one, which is the "run them one by one" baseline of the batched rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.backends import hf
from treespec.bench import encode_batch, machine_info
from treespec.zoo import load_prompts, pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--widths", default="2,3,4", help="tree widths (strategy --strategy) besides the chain")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--strategy", default="iid")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--drafter", default="model", choices=("model", "ngram", "lookup", "merged"),
                    help="who proposes the trees (default: the draft model)")
    ap.add_argument("--backend", default="auto", choices=("auto", "native", "hf"),
                    help="treespec's runners (auto: native on the bundled pair; hf: the HF modules, batched by padding)")
    ap.add_argument("--speculate-max-live", type=lambda v: v if v == "auto" else int(v), default=None,
                    help="also time the first tree width with engine(speculate_max_live=N): plain rounds while more than N "
                         "requests are live; 'auto': speculative or plain rounds, whichever measures faster at each live count")
    ap.add_argument("--out", type=Path, default=None, help="default: experiments/results/batch_T{temperature}.json")
    args = ap.parse_args()
    out_path = args.out or Path(f"experiments/results/batch_T{args.temperature:g}.json")

    sampling = SamplingConfig(temperature=args.temperature)
    dec = SpeculativeDecoder.from_pretrained(*pair("pycode"), dtype=args.dtype, backend=args.backend, drafter=args.drafter)
    target_path, _ = pair("pycode")
    hf_target = hf.load_model(target_path, dec.target_runner.dtype, dec.target_runner.device)
    trees = {"autoregressive": None, f"linear 1x{args.depth}": TreeConfig(1, args.depth, args.strategy)}
    widths = [int(w) for w in args.widths.split(",")]
    trees |= {f"tree {w}x{args.depth}": TreeConfig(w, args.depth, args.strategy) for w in widths}
    switched = {}  # method -> speculate_max_live
    if args.speculate_max_live is not None:
        limit = args.speculate_max_live
        name = f"tree {widths[0]}x{args.depth} {'auto' if limit == 'auto' else f'<={limit}'}"
        trees[name], switched[name] = TreeConfig(widths[0], args.depth, args.strategy), args.speculate_max_live
    methods = ["hf generate", *trees]
    prompts = load_prompts(n=args.n_prompts)
    hf_kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, pad_token_id=dec.tokenizer.pad_token_id or 0)
    hf_kwargs |= dict(do_sample=False) if sampling.greedy else dict(do_sample=True, temperature=sampling.temperature, top_k=0)

    rows = []
    for B in map(int, args.batch_sizes.split(",")):
        n_batches = -(-len(prompts) // B)
        batches = [[prompts[(j * B + k) % len(prompts)] for k in range(B)] for j in range(n_batches)]
        runs = {m: [] for m in methods}
        decode = {m: [] for m in methods}  # tokens/s with the prompts' prefill taken out of the wall time
        steps = {m: [0, 0] for m in methods}  # tokens, target steps (pooled)
        dec.generate_batch([[1, 2]] * B, max_new_tokens=4, max_batch=B)  # warm-up: lanes allocated
        for rep in tqdm(range(args.repeats), desc=f"batch {B}"):
            for j, batch in enumerate(batches):
                ids, mask = encode_batch(dec.tokenizer, batch, hf_target.device)
                requests = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
                seeds = [rep * 1000 + j * B + k for k in range(B)]
                with torch.inference_mode():  # HF's prefill of this batch, timed apart (generate() hides it)
                    t0 = time.perf_counter()
                    hf_target(ids, attention_mask=mask, logits_to_keep=1)  # as generate() does
                    hf_prefill = time.perf_counter() - t0
                for m in methods:
                    t0 = time.perf_counter()
                    if m == "hf generate":
                        torch.manual_seed(seeds[0])
                        with torch.inference_mode():
                            out = hf_target.generate(ids, attention_mask=mask, **hf_kwargs)
                        tokens = out[:, ids.shape[1] :].numel()
                        prefill = hf_prefill
                    else:
                        outs = dec.generate_batch(requests, args.max_new_tokens, tree=trees[m], sampling=sampling, seeds=seeds,
                                                  ignore_eos=True, max_batch=B, speculate_max_live=switched.get(m))
                        tokens = sum(o.stats.tokens for o in outs)
                        prefill = max(o.stats.prefill_seconds for o in outs)  # all admitted in one prefill
                        steps[m][0] += tokens
                        steps[m][1] += sum(o.stats.target_steps for o in outs)
                    wall = time.perf_counter() - t0
                    runs[m].append(tokens / wall)
                    decode[m].append(tokens / (wall - prefill))
        for m in methods:
            rows.append({
                "batch_size": B, "method": m, "tokens_per_second": statistics.median(runs[m]), "runs": runs[m],
                "decode_tokens_per_second": statistics.median(decode[m]),
                "tokens_per_step": steps[m][0] / steps[m][1] if steps[m][1] else None,
            })
    config = vars(args) | {
        "out": str(out_path), "dtype_target": str(dec.target_runner.dtype), "dtype_draft": str(dec.draft_runner.dtype),
        "backend": type(dec.target_runner).__name__, **machine_info(dec.target_runner.device),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"config": config, "rows": rows}, indent=2))

    one_by_one = {r["method"]: r["tokens_per_second"] for r in rows if r["batch_size"] == 1}
    decode_one = {r["method"]: r["decode_tokens_per_second"] for r in rows if r["batch_size"] == 1}
    print(f"\n{'batch':>5} {'method':<16}{'tokens/s':>10}{'vs B=1':>8}{'vs HF':>8}{'tok/step':>9}{'decode tok/s':>14}{'vs B=1':>8}")
    for r in rows:
        hf_same = next(x["tokens_per_second"] for x in rows if x["batch_size"] == r["batch_size"] and x["method"] == "hf generate")
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
        print(f"{r['batch_size']:>5} {r['method']:<16}{r['tokens_per_second']:>10.1f}"
              f"{r['tokens_per_second'] / one_by_one[r['method']]:>7.2f}x{r['tokens_per_second'] / hf_same:>7.2f}x{tps:>9}"
              f"{r['decode_tokens_per_second']:>14.1f}{r['decode_tokens_per_second'] / decode_one[r['method']]:>7.2f}x")
    for B in sorted({r["batch_size"] for r in rows}):
        best = max((r for r in rows if r["batch_size"] == B and r["method"] not in ("hf generate", "autoregressive", *switched)),
                   key=lambda r: r["tokens_per_second"])
        print(f"best speculative config at batch {B}: {best['method']} ({best['tokens_per_second']:.1f} tokens/s)")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
