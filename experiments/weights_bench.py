#!/usr/bin/env python
"""The target's weight formats on this machine: dense (the dtype), int8, int4 (a GGUF file's own
4-bit blocks), each decoding plainly and speculatively, beside llama.cpp on the same file.

    python experiments/weights_bench.py --tag zen5
    python experiments/weights_bench.py --tag zen5 --llama-cpp ~/llamacpp/.../llama.cpp/build/bin

One process: the pair loads once per format (`SpeculativeDecoder.from_pretrained(quantize=...)`,
the pair's drafter: SmolLM2's feature head), every format and configuration runs on the same
held-out chat one after another (interleaved; `--repeats` times over the prompts), after an
untimed warm-up of each; per temperature, median tokens/s, tokens/step and acceptance by depth.
The configurations: plain decoding, the automatic tree (`TreeConfig()`, planned from this
format's own measured costs) and chains of depth 1-3. `--llama-cpp DIR` adds llama.cpp's plain
decoding of the GGUF file (its own timers: prompt and decode, loading excluded). Also records
what `dtype="auto"` with `quantize="auto"` picks here (`loading.resolve_weights`). Writes
results/weights_<pair>_<tag>.json. A format may name its own dtype (`int4:bfloat16`) and
the eager forward (`auto::eager`; otherwise the compiled graphs kept for this machine run,
`compile="auto"`), and "auto" is `quantize="auto"`:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python experiments/weights_bench.py \
        --formats none:float32 int4:bfloat16 int8:bfloat16 none:bfloat16 --tag as_avx2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import heldout_prompt_ids, machine_info, write_results
from head_bench import summarise

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.bench.llamacpp import LlamaCpp
from treespec.loading import resolve_weights
from treespec.zoo import pair, pair_draft

CONFIGS = {
    "plain": None,
    "auto": TreeConfig(),
    **{f"chain 1x{d}": TreeConfig(1, d) for d in (1, 2, 3)},
}


def weights(dec) -> list[str]:
    """The target's dtype, weight format and forward: the graphs kept for this machine
    (`compile="auto"`) or the eager one."""
    target = dec.target_runner
    forward = "compiled" if getattr(target, "compiled", None) is not None else "eager"
    return [str(target.dtype), target.quantize, forward]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["none", "int8", "int4"],
        help="quantize settings: FORMAT or FORMAT:DTYPE",
    )
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()

    target, draft = pair(args.pair)[0], pair_draft(args.pair, None)
    decs = {}
    for spec in args.formats:
        t0 = time.perf_counter()
        fmt, dtype, *rest = spec.split(":") + [""]
        q = None if fmt == "none" else fmt
        decs[spec] = SpeculativeDecoder.from_pretrained(
            target=target, draft=draft, dtype=dtype or args.dtype, quantize=q,
            compile=False if "eager" in rest else "auto",
        )  # fmt: skip
        print(f"loaded {spec} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    first = next(iter(decs.values()))
    dtype, auto = resolve_weights("auto", "auto", target, torch.device("cpu"))
    tokenizer = first.tokenizer
    prompts = heldout_prompt_ids(args.pair, tokenizer, args.n_prompts)
    llama = LlamaCpp.find(args.llama_cpp) if args.llama_cpp else None
    out = {
        "what": "the target's weight formats, plain and speculative, beside llama.cpp",
        "command": " ".join(sys.argv),
        "pair": args.pair,
        "weights": {k: weights(d) for k, d in decs.items()},
        "auto_weights_here": [str(dtype), auto],
        "machine": machine_info("cpu"),
        "repeats": args.repeats,
        "runs": {},
    }
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        names = [(fmt, name) for fmt in decs for name in CONFIGS]
        outs = {n: [] for n in names}
        secs = {n: [] for n in names}
        llama_tps = []
        plans = {fmt: dec.planner.plan(sampling).describe() for fmt, dec in decs.items()}
        for fmt, name in names:  # warm-up, untimed
            decs[fmt].generate(prompts[0], 24, tree=CONFIGS[name], sampling=sampling, seed=99)
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                seed = i + r * len(prompts)
                for fmt, name in names:
                    t0 = time.perf_counter()
                    o = decs[fmt].generate(
                        prompt, args.max_new_tokens, tree=CONFIGS[name], sampling=sampling, seed=seed
                    )
                    secs[fmt, name].append(time.perf_counter() - t0)
                    outs[fmt, name].append(o)
                if llama is not None:
                    text = tokenizer.decode(prompt)
                    llama_tps.append(
                        llama.decode(
                            Path(target), text, args.max_new_tokens, temperature, seed
                        ).tokens_per_second
                    )
                print(
                    f"\rT={temperature} repeat {r + 1}, prompt {i + 1}/{len(prompts)}",
                    end="",
                    file=sys.stderr,
                )
        run = {f"{fmt} {name}": summarise(outs[fmt, name], secs[fmt, name]) for fmt, name in names}
        base = run[f"{args.formats[0]} plain"]["tokens_per_second"]
        for r in run.values():
            r["vs_first_plain"] = round(r["tokens_per_second"] / base, 3)
        if llama_tps:
            run["llama.cpp plain"] = {"tokens_per_second": round(statistics.median(llama_tps), 2)}
        out["runs"][f"T={temperature}"] = {"plans": plans, "configs": run}
        print(f"\rT={temperature}", file=sys.stderr)
        for fmt, plan in plans.items():
            print(f"  plan {fmt}: {plan}")
        for name, r in sorted(run.items(), key=lambda kv: -kv[1]["tokens_per_second"]):
            print(f"  {name:18s} {r['tokens_per_second']:7.1f} tok/s  tau {r.get('tokens_per_step')}")
    write_results(f"weights_{args.pair}_{args.tag}.json", out)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
