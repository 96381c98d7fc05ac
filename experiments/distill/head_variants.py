#!/usr/bin/env python
"""Feature-head recipe variants on equal data and equal steps (issue 35's list): which target
layers the head reads, the unroll depth of the training-time test, its own LM head against the
target's, and the data volume; and the learning rate.

    python experiments/distill/head_variants.py --data RUN [RUN ...] --steps 600 --out DIR --tag zen5

Every variant is `treespec distill --head` with one recipe field changed from the baseline
(EAGLE-3's taps, unroll 2, its own LM head, all the data), trained for the same `--steps` on
the same runs (the data variant on the first quarter of the first run's shards), evaluated
on the same held-out prompts: acceptance by depth and tokens/step at T=0 and T=1, and the
held-out proxy (top-1 agreement, sum of min(p, q)). Writes results/head_variants_<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from treespec.distill.head import distill_head
from treespec.loading.gguf import smollm2_gguf

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = {
    "baseline": {},
    "last layer only (taps 30)": {"taps": [30]},
    "unroll 0": {"unroll": 0},
    "unroll 4": {"unroll": 4},
    "the target's LM head (frozen)": {"freeze_lm_head": True},
    "a quarter of the data": {},
    "lr 2e-3": {"lr": 2e-3},
    "lr 5e-4": {"lr": 5e-4},
}


def quarter(run: Path, out: Path) -> Path:
    """A data run holding the first quarter of `run`'s shards (links), its held-out shard too."""
    meta = json.loads((run / "work" / "data" / "meta.json").read_text())
    n = max(1, meta["shards"] // 4)
    data = out / "work" / "data"
    data.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        name = f"shard_{i:05d}.safetensors"
        if not (data / name).exists():
            (data / name).symlink_to((run / "work" / "data" / name).resolve())
    shutil.copy2(run / "work" / "data" / "heldout.safetensors", data / "heldout.safetensors")
    (data / "meta.json").write_text(json.dumps({**meta, "shards": n, "complete": True}) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="finished data runs")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", type=Path, required=True, help="a directory for the variants' heads")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    out_path = RESULTS / f"head_variants_{args.tag}.json"
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"variants": {}}
    results.update(command=" ".join(sys.argv), data=[str(d) for d in args.data], steps=args.steps)
    for name in args.variants:
        if name in results["variants"]:
            continue  # done in an earlier invocation
        recipe = dict(
            VARIANTS[name], steps=args.steps, evals=1, threads=args.threads, progress=False, acceptance=False
        )
        data = args.data
        if name == "a quarter of the data":
            data = [quarter(args.data[0], args.out / "quarter_data")]
        directory = args.out / name.split(" (")[0].replace(" ", "_").replace("'", "")
        t0 = time.time()
        resume = (directory / "work" / "run.json").is_file()
        distill_head(smollm2_gguf(), directory, data, resume=resume, **recipe)
        head = json.loads((directory / "head.json").read_text())
        final = head["curve"][-1]
        results["variants"][name] = {
            "recipe": head["recipe"],
            "data": head["data"],
            "train_seconds": head["train_seconds"],
            "seconds": round(time.time() - t0, 1),
            "T0": final["T0"],
            "T1": final["T1"],
            "proxy": final["proxy"],
        }
        out_path.write_text(json.dumps(results, indent=1) + "\n")
        r = results["variants"][name]
        print(
            f"{name:32s} T=0 {r['T0']['acceptance_by_depth'][:2]} tau {r['T0']['tokens_per_step']}; "
            f"T=1 {r['T1']['acceptance_by_depth'][:2]} tau {r['T1']['tokens_per_step']}; proxy {r['proxy']}",
            flush=True,
        )
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
