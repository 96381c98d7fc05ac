#!/usr/bin/env python
"""Batched decoding on the pycode pair: what batching and speculation give together.

`batch`: throughput of generate_batch() against HF generate() at batch 1-16.

    python experiments/batching.py batch --temperature 0    # writes experiments/results/batch_T0.json

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

`stream`: continuous batching, a stream of requests through one engine, speculating or not.

    python experiments/batching.py stream --temperature 1 --requests 32 --max-live 8   # continuous_T1.json

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
import sys
import time
from pathlib import Path

import torch
from common import machine_info
from tqdm import tqdm

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.backends import hf
from treespec.bench.harness import encode_batch
from treespec.zoo import load_prompts, pair


def batched(argv: list[str]) -> None:
    """`batch`: generate_batch() against HF generate() at batch sizes 1-16."""
    ap = argparse.ArgumentParser(prog="batching.py batch", description=batched.__doc__)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--widths", default="2,3,4", help="tree widths (strategy --strategy) besides the chain")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--strategy", default="iid")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--drafter",
        default="model",
        choices=("model", "ngram", "lookup", "merged"),
        help="who proposes the trees (default: the draft model)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "native", "hf"),
        help="treespec's runners (auto: native on the bundled pair; hf: the HF modules, batched by padding)",
    )
    ap.add_argument(
        "--speculate-max-live",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="also time the first tree width with engine(speculate_max_live=N): plain rounds while more than N "
        "requests are live; 'auto': speculative or plain rounds, whichever measures faster at each live count",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="default: experiments/results/batch_T{temperature}.json"
    )
    args = ap.parse_args(argv)
    out_path = args.out or Path(f"experiments/results/batch_T{args.temperature:g}.json")

    sampling = SamplingConfig(temperature=args.temperature)
    dec = SpeculativeDecoder.from_pretrained(
        *pair("pycode"), dtype=args.dtype, backend=args.backend, drafter=args.drafter
    )
    target_path, _ = pair("pycode")
    hf_target = hf.load_model(target_path, dec.target_runner.dtype, dec.target_runner.device)
    trees = {"autoregressive": None, f"linear 1x{args.depth}": TreeConfig(1, args.depth, args.strategy)}
    widths = [int(w) for w in args.widths.split(",")]
    trees |= {f"tree {w}x{args.depth}": TreeConfig(w, args.depth, args.strategy) for w in widths}
    switched = {}  # method -> speculate_max_live
    if args.speculate_max_live is not None:
        limit = args.speculate_max_live
        name = f"tree {widths[0]}x{args.depth} {'auto' if limit == 'auto' else f'<={limit}'}"
        trees[name], switched[name] = (
            TreeConfig(widths[0], args.depth, args.strategy),
            args.speculate_max_live,
        )
    methods = ["hf generate", *trees]
    prompts = load_prompts(n=args.n_prompts)
    hf_kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        pad_token_id=dec.tokenizer.pad_token_id or 0,
    )
    hf_kwargs |= (
        dict(do_sample=False)
        if sampling.greedy
        else dict(do_sample=True, temperature=sampling.temperature, top_k=0)
    )

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
                        outs = dec.generate_batch(
                            requests,
                            args.max_new_tokens,
                            tree=trees[m],
                            sampling=sampling,
                            seeds=seeds,
                            ignore_eos=True,
                            max_batch=B,
                            speculate_max_live=switched.get(m),
                        )
                        tokens = sum(o.stats.tokens for o in outs)
                        prefill = max(o.stats.prefill_seconds for o in outs)  # all admitted in one prefill
                        steps[m][0] += tokens
                        steps[m][1] += sum(o.stats.target_steps for o in outs)
                    wall = time.perf_counter() - t0
                    runs[m].append(tokens / wall)
                    decode[m].append(tokens / (wall - prefill))
        for m in methods:
            rows.append(
                {
                    "batch_size": B,
                    "method": m,
                    "tokens_per_second": statistics.median(runs[m]),
                    "runs": runs[m],
                    "decode_tokens_per_second": statistics.median(decode[m]),
                    "tokens_per_step": steps[m][0] / steps[m][1] if steps[m][1] else None,
                }
            )
    config = vars(args) | {
        "out": str(out_path),
        "dtype_target": str(dec.target_runner.dtype),
        "dtype_draft": str(dec.draft_runner.dtype),
        "backend": type(dec.target_runner).__name__,
        **machine_info(dec.target_runner.device),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"config": config, "rows": rows}, indent=2))

    one_by_one = {r["method"]: r["tokens_per_second"] for r in rows if r["batch_size"] == 1}
    decode_one = {r["method"]: r["decode_tokens_per_second"] for r in rows if r["batch_size"] == 1}
    print(
        f"\n{'batch':>5} {'method':<16}{'tokens/s':>10}{'vs B=1':>8}{'vs HF':>8}{'tok/step':>9}{'decode tok/s':>14}{'vs B=1':>8}"
    )
    for r in rows:
        hf_same = next(
            x["tokens_per_second"]
            for x in rows
            if x["batch_size"] == r["batch_size"] and x["method"] == "hf generate"
        )
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
        print(
            f"{r['batch_size']:>5} {r['method']:<16}{r['tokens_per_second']:>10.1f}"
            f"{r['tokens_per_second'] / one_by_one[r['method']]:>7.2f}x{r['tokens_per_second'] / hf_same:>7.2f}x{tps:>9}"
            f"{r['decode_tokens_per_second']:>14.1f}{r['decode_tokens_per_second'] / decode_one[r['method']]:>7.2f}x"
        )
    for B in sorted({r["batch_size"] for r in rows}):
        best = max(
            (
                r
                for r in rows
                if r["batch_size"] == B and r["method"] not in ("hf generate", "autoregressive", *switched)
            ),
            key=lambda r: r["tokens_per_second"],
        )
        print(
            f"best speculative config at batch {B}: {best['method']} ({best['tokens_per_second']:.1f} tokens/s)"
        )
    print(f"wrote {out_path}")


def stream(argv: list[str]) -> None:
    """`stream`: a queue of requests through one engine's lanes."""
    ap = argparse.ArgumentParser(prog="batching.py stream", description=stream.__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-live", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--limit", type=int, default=2, help="the fixed speculate_max_live row")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: experiments/results/continuous_T{temperature}.json"
    )
    args = ap.parse_args(argv)
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
            outs = dec.generate_batch(
                requests,
                args.max_new_tokens,
                tree=t,
                sampling=sampling,
                seeds=list(range(len(requests))),
                ignore_eos=True,
                max_batch=args.max_live,
                speculate_max_live=limit,
            )
            runs[m].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
            print(f"repeat {rep + 1}/{args.repeats} {m:<18} {runs[m][-1]:8.1f} tokens/s", flush=True)

    rows = [{"method": m, "tokens_per_second": statistics.median(v), "runs": v} for m, v in runs.items()]
    config = vars(args) | {
        "out": str(out_path),
        "dtype_target": str(dec.target_runner.dtype),
        "backend": type(dec.target_runner).__name__,
        **machine_info(dec.target_runner.device),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    plain = rows[0]["tokens_per_second"]
    for r in rows:
        print(
            f"{r['method']:<18} {r['tokens_per_second']:8.1f} tokens/s  {r['tokens_per_second'] / plain:5.2f}x plain"
        )
    print(f"wrote {out_path}")


MODES = {"batch": batched, "stream": stream}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        print(__doc__)
        raise SystemExit(
            f"usage: batching.py {{{','.join(MODES)}}} [options]  (--help after a mode for its options)"
        )
    MODES[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
