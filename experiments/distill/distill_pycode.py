#!/usr/bin/env python
"""Measure `treespec distill` on the bundled pycode target: budgeted runs and recipe variants.

    nice -n 10 python experiments/distill/distill_pycode.py --mode budget --minutes 4 --variants default
    nice -n 10 python experiments/distill/distill_pycode.py --mode equal --variants default tv jsd ...

--mode budget: `distill(minutes=M)` from scratch, the whole run inside the wall-clock budget
(the number of steps it affords depends on how busy the machine is: the load average is
recorded). --mode equal: every variant trains the same number of steps (`--steps`) on the
same data (`--max-prompts` prompts, made once by the first variant and reused through
`data_from`), so recipes are compared at equal work, whatever else the machine runs.

Each saved draft is then evaluated more thoroughly than during training (`--prompts` held-out
pycode prompts x `--tokens` new tokens, chain TreeConfig(1, 4), T=0 and T=1, acceptance by
depth and tokens/step pooled over prompts), and the per-token decode latency of draft and
target is measured (batch 1, KV cache after a 128-token prefix, median of interleaved
repeats): c = t_draft / t_target. Variant "bundled" is the hand-trained draft shipped in
treespec/zoo/pycode/draft. Results are merged into experiments/results/distill_pycode.json
under "<mode>/<variant>_s<seed>".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from treespec import TreeConfig
from treespec.backends import cpu_model
from treespec.backends.hf import load_model, load_tokenizer, quiet_transformers
from treespec.decoder import SpeculativeDecoder
from treespec.distill import distill, load_draft, load_draft_runner
from treespec.distill.evaluate import acceptance, merged_acceptance
from treespec.distill.prompts import Rendered
from treespec.zoo import load_prompts, pair

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results" / "distill_pycode.json"
VARIANTS = {
    "default": {},
    "tv": {"loss": "tv"},
    "jsd": {"loss": "jsd"},
    "data60": {"data_fraction": 0.6},  # --mode budget only
    "no_prompt_positions": {"train_on_prompt": False},
    "random_embeddings": {"embeddings": "random"},
    "frozen_embeddings": {"freeze_embeddings": True},
    "subset2048": {"vocab_subset": 2048},
    "boost2": {"drafts": 2},
    "bundled": None,  # the hand-trained draft of treespec/zoo/pycode (30 min, 2.76M tokens)
}


def decode_ms(runner, prefix: list[int], n: int = 48) -> list[float]:
    """Per-token decode latencies (ms) after `prefix`: extend one token, commit it, repeat."""
    runner.reset()
    runner.prefill(prefix[:-1])
    times, token = [], prefix[-1]
    for _ in range(n):
        t0 = time.perf_counter()
        logits = runner.extend([token], [-1])
        runner.commit([0])
        times.append((time.perf_counter() - t0) * 1e3)
        token = int(logits[0].argmax())
    return times[8:]


def cost_ratio(target_runner, draft_runner, prefix: list[int], repeats: int = 5) -> dict:
    """Median per-token decode latency of both models, interleaved, and c = draft / target."""
    t, d = [], []
    for _ in range(repeats):
        t += decode_ms(target_runner, prefix)
        d += decode_ms(draft_runner, prefix)
    tm, dm = statistics.median(t), statistics.median(d)
    return {"target_ms": round(tm, 3), "draft_ms": round(dm, 3), "c": round(dm / tm, 4)}


def latencies(args, target_runner, bundled_dir: Path, prefix: list[int], repeats: int = 12) -> dict:
    """Per-token decode latency (median ms) of the target and of each --mode equal draft of
    `args.variants`, measured round-robin in one process so that load changes hit all alike."""
    dirs = {name: bundled_dir if VARIANTS[name] is None else
            Path(args.work) / f"equal_{name}_p{args.max_prompts}_n{args.steps}_s{args.seed}"
            for name in args.variants}  # fmt: skip
    runners = {"target": target_runner, **{name: load_draft_runner(d) for name, d in dirs.items()}}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            times[name] += decode_ms(runner, prefix)
    out = {name: round(statistics.median(t), 4) for name, t in times.items()}
    c = {name: round(ms / out["target"], 4) for name, ms in out.items() if name != "target"}
    return {"ms_per_token": out, "c": c, "repeats": repeats, "load_average_1min": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["budget", "equal", "latency"], default="budget")
    ap.add_argument("--minutes", type=float, default=4.0, help="--mode budget: the budget")
    ap.add_argument("--steps", type=int, default=120, help="--mode equal: steps per draft")
    ap.add_argument("--max-prompts", type=int, default=192, help="--mode equal: training prompts")
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    ap.add_argument("--work", default="/tmp/distill_pycode", help="where the run directories go")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts in the final evaluation")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per held-out prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    quiet_transformers()
    target_dir, bundled_dir = pair("pycode")
    tokenizer = load_tokenizer(target_dir)
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    target_runner = SpeculativeDecoder(target, None, tokenizer).target_runner
    held = Rendered(load_prompts(), tokenizer, 512 - args.tokens).take(0, args.prompts)
    prefix = Rendered(load_prompts(), tokenizer, 128).take(0, 1)[0]
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"variants": {}}
    results.update(
        machine=cpu_model(),
        threads=1,
        torch=torch.__version__,
        evaluation=f"{len(held)} held-out pycode prompts x {args.tokens} tokens, chain depth 4, T=0 and T=1",
    )
    if args.mode == "latency":
        results["latency"] = latencies(args, target_runner, bundled_dir, prefix)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(results["latency"], indent=1))
        return
    shared_data = None  # --mode equal: the first variant's run directory
    for name in args.variants:
        recipe = VARIANTS[name]
        load_before = os.getloadavg()[0]
        if recipe is None:
            out, summary = bundled_dir, {"note": "hand-trained draft, see treespec/zoo/pycode/README.md"}
        elif args.mode == "budget":
            out = Path(args.work) / f"budget_{name}_m{args.minutes:g}_s{args.seed}"
            distill(
                target_dir, out, minutes=args.minutes, threads=1, seed=args.seed, progress=False, **recipe
            )
            summary = json.loads((out / "distill.json").read_text())
        else:
            out = Path(args.work) / f"equal_{name}_p{args.max_prompts}_n{args.steps}_s{args.seed}"
            distill(target_dir, out, data_from=shared_data, threads=1, seed=args.seed, progress=False,
                    max_prompts=args.max_prompts, steps=args.steps, evals=2, **recipe)  # fmt: skip
            shared_data = shared_data or out
            summary = json.loads((out / "distill.json").read_text())
        draft_runner = load_draft_runner(out)
        row = {
            "recipe": recipe,
            "minutes": args.minutes if recipe is not None and args.mode == "budget" else None,
            "seed": args.seed,
            "load_average_1min": [load_before, os.getloadavg()[0]],  # before and after the run
            "final": acceptance(target_runner, tokenizer, draft_runner, held, args.tokens),
            "latency": cost_ratio(target_runner, draft_runner, prefix),
        }
        if recipe is not None:
            d = summary["drafts"][0]
            row.update(
                data=summary["data"],
                budget_seconds=summary["budget_seconds"],
                eval_seconds=summary["eval_seconds"],
                steps=d["steps"],
                params=d["params"],
                loss_first=d["loss_first"],
                loss_last_10pct=d["loss_last_10pct"],
                proxy=d["eval_final"]["proxy"],
                vocab_subset=summary["vocab_subset"],
            )
        if recipe is not None and recipe.get("drafts", 1) > 1:
            runners = [load_draft_runner(out / d["dir"]) for d in summary["drafts"]]
            row["merged"] = merged_acceptance(
                target_runner, tokenizer, runners, held, args.tokens, target.config.vocab_size
            )
            row["boost_2_alone"] = acceptance(target_runner, tokenizer, runners[1], held, args.tokens)
            # the same node budget from the first draft alone: two i.i.d. chains merged into a tree
            row["first_width2"] = acceptance(
                target_runner, tokenizer, runners[0], held, args.tokens, TreeConfig(2, 4)
            )
        model, _ = load_draft(out)
        row["draft_config"] = {
            k: getattr(model.config, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")
        }
        key = name if recipe is None else f"{args.mode}/{name}_s{args.seed}"
        results["variants"][key] = row
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        t0, t1 = row["final"]["T0"], row["final"]["T1"]
        print(
            f"{key}: T=0 depth-1 {t0['acceptance_by_depth'][0]} tau {t0['tokens_per_step']}; "
            f"T=1 depth-1 {t1['acceptance_by_depth'][0]} tau {t1['tokens_per_step']}; "
            f"c {row['latency']['c']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
