#!/usr/bin/env python
"""Tensor parallelism on this machine: t(1), t(16), the all-reduce, and plain / speculative
decoding of a pair at several tp (each a torchrun launch of its own).

    python experiments/tp_bench.py --tp 1 3 --tag zen5            # SmolLM2: 9 heads, tp 1 or 3
    python experiments/tp_bench.py --tp 1 2 --pair pycode --tag zen5   # 8 / 2 heads

Without torchrun the script launches itself once per tp (`torch.distributed.run --standalone`)
and merges what rank 0 of each launch measured into experiments/results/tp_bench_PAIR_TAG.json.
Inside a launch: the target's forward of n tokens after a 128-token prefix (n = 1, 4, 16;
median of 30), an all-reduce of [n, hidden] (the collective each layer runs twice), then the
held-out chats decoded plainly and speculatively (the automatic tree and a fixed chain),
interleaved per prompt, tokens/s medians. Threads: 2 / tp per rank, at least 1 (this machine's
2 cores shared by every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def measure(args) -> dict:
    from common import heldout_prompt_ids

    from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig, parallel
    from treespec.timing import median_seconds
    from treespec.tree import TokenTree
    from treespec.zoo import heldout_chats, pair

    dec = SpeculativeDecoder.from_pretrained(*pair(args.pair), dtype=args.dtype)
    tp = parallel.current()
    world = 1 if tp is None else tp.world
    target = dec.target_runner
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (160,), generator=g).tolist()
    lane = target.lanes(1)[0]
    lane.prefill(tokens[:128])
    forward = {}
    for n in (1, 4, 16):
        tree = TokenTree(tokens[128 : 128 + n], [-1] + list(range(n - 1)))

        def score(tree=tree):
            lane.score(tree)
            lane.commit([])

        forward[n] = median_seconds(score, args.repeats, warmup=3)
    reduce = {}
    if tp is not None:
        for n in (1, 16):
            x = torch.randn(n, target.shape.hidden, dtype=target.dtype)
            reduce[n] = median_seconds(lambda x=x: tp.reduce(x), args.repeats * 3, warmup=3)
    if getattr(dec.tokenizer, "chat_template", None):
        chats = heldout_chats(args.n_prompts)
    else:  # a code model: its held-out prompts, as token ids
        chats = heldout_prompt_ids(args.pair, dec.tokenizer, args.n_prompts)
    methods = {"plain": None, "auto": TreeConfig(), "chain 1x2": TreeConfig(width=1, depth=2)}
    speed: dict[str, list[float]] = {m: [] for m in methods}
    steps: dict[str, list[float]] = {m: [] for m in methods}
    sampling = SamplingConfig(temperature=args.temperature)
    dec.generate(chats[0], 8, tree=TreeConfig(), sampling=sampling, seed=0)  # plans (measures costs) untimed
    for i, chat in enumerate(chats):
        for name, tree in methods.items():
            out = dec.generate(
                chat, args.max_new_tokens, tree=tree, sampling=sampling, seed=i, ignore_eos=True
            )
            speed[name].append(out.stats.tokens_per_second)
            steps[name].append(out.stats.tokens_per_step)
    layers = target.n_layers
    return {
        "tp": world,
        "threads_per_rank": torch.get_num_threads(),
        "dtype": str(target.dtype).removeprefix("torch."),
        "t_ms": {n: 1e3 * s for n, s in forward.items()},
        "t16_over_t1": forward[16] / forward[1],
        "all_reduce_ms": {n: 1e3 * s for n, s in reduce.items()},
        "collectives_per_forward": 0 if tp is None else 2 * layers,
        "tokens_per_s": {m: statistics.median(v) for m, v in speed.items()},
        "tokens_per_step": {m: statistics.median(v) for m, v in steps.items()},
        "plan": dec.generate(chats[0], 4, sampling=sampling, seed=0).plan,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])  # SmolLM2's 9 heads: 1 or 3 ranks
    p.add_argument("--pair", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--n-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None, help="(inside a launch) where rank 0 writes its JSON")
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ or args.out:  # inside a launch
        torch.set_num_threads(max(1, 2 // int(os.environ.get("WORLD_SIZE", "1"))))
        result = measure(args)
        from treespec import parallel

        if parallel.leader():
            Path(args.out).write_text(json.dumps(result))
        parallel.shutdown()
        return
    from common import machine_info

    runs = []
    for n in args.tp:
        out = RESULTS / f".tp_bench_{n}.json"
        flags = ["--pair", args.pair, "--dtype", args.dtype, "--temperature", str(args.temperature)]
        flags += ["--n-prompts", str(args.n_prompts), "--max-new-tokens", str(args.max_new_tokens)]
        cmd = [sys.executable, __file__, *flags, "--repeats", str(args.repeats), "--out", str(out)]
        if n > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                *cmd[1:],
            ]
        print(f"tp {n}: {' '.join(cmd[1:])}", file=sys.stderr)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // n))})
        runs.append(json.loads(out.read_text()))
        out.unlink()
    result = {"config": {**vars(args), **machine_info(torch.device("cpu"))}, "runs": runs}
    name = f"tp_bench_{args.pair}" + (f"_{args.tag}" if args.tag else "") + ".json"
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    head = ("tp", "t(1) ms", "t(16) ms", "t16/t1", "reduce(1) ms", "plain", "auto", "chain")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (3, 8, 9, 7, 13, 7, 7, 7))))
    for r in runs:
        tps = r["tokens_per_s"]
        print(
            f"{r['tp']:>3} {r['t_ms']['1']:>8.2f} {r['t_ms']['16']:>9.2f} {r['t16_over_t1']:>7.2f} "
            f"{r['all_reduce_ms'].get('1', 0):>13.3f} {tps['plain']:>7.1f} {tps['auto']:>7.1f} "
            f"{tps['chain 1x2']:>7.1f}"
        )
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
