#!/usr/bin/env python
"""Linear vs tree speculation on a bundled pair: a grid, one JSONL row per cell, resumable.

    python experiments/linear_vs_tree.py --backend hf          # the committed linear_vs_tree.jsonl
    python experiments/linear_vs_tree.py --backend native --dtype bfloat16 --threads 2 \
        --drafters model --temperatures 0,1 --out experiments/results/defaults_sweep.jsonl
    python experiments/linear_vs_tree.py --widths 1,2 --depths 2 --n-prompts 1 --max-new-tokens 16 \
        --out /tmp/smoke.jsonl                                 # a smoke test
    python experiments/linear_vs_tree.py --pair smollm2 --backend native --dtype bfloat16 --threads 2 \
        --temperatures 0,1 --out experiments/results/linear_vs_tree_smollm2.jsonl   # the real pair

Grid: drafter x strategy x width x depth x temperature (plus plain decoding per temperature
as the baseline: strategy "none"), decoded on held-out prompts with the same seeds in every
cell: the pair's held-out prompts (`treespec.zoo.heldout_prompt_ids`: code openings for
pycode, chat instructions for smollm2) and its count drafters' counts (`treespec.zoo.counts_file`).
A cell already in `--out` (same key) is skipped, so an
interrupted run continues where it stopped.

Rows:
  {"kind": "costs", ...}  once: target forward latency t(n) for n tokens (n = draft nodes + 1,
                          the root) over a cached prefix, median of `--repeats`; c = t_draft /
                          t_target for one token (Leviathan's c)
  {"kind": "cell", ...}   per cell: tokens/step, tokens/s, acceptance by depth, nodes per
                          round, c, t(n)/t(1) at the cell's mean tree size (interpolated)

Only the public API is used: `SpeculativeDecoder.from_pretrained(*pair(name), dtype=, backend=)`, costs
through its runners (`treespec.bench.measure.forward_seconds`), `generate()` stats. Every row records
its backend, dtype and thread count.
`--plot` turns the JSONL (and nothing else) into PNGs beside it, one column per temperature:
<stem>_tokens_per_step.png, <stem>_tokens_per_second.png and <stem>_pareto.png (the frontier of
fewest draft nodes for the most tokens/step and tokens/s):

    python experiments/linear_vs_tree.py --plot --out experiments/results/linear_vs_tree_smollm2.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from common import heldout_prompt_ids
from tqdm import tqdm

from treespec import (
    BigramDrafter,
    GenerationStats,
    SamplingConfig,
    SpeculativeDecoder,
    TreeConfig,
    UnigramDrafter,
)
from treespec.bench.measure import forward_seconds
from treespec.zoo import counts_file, pair

COST_SIZES = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97)


def measure_costs(dec: SpeculativeDecoder, repeats: int) -> dict:
    """Target t(n) over a cached 128-token prefix and the draft's t(1), through the runners."""
    t = {n: forward_seconds(dec.target_runner, n, repeats=repeats) for n in COST_SIZES}
    t_draft = forward_seconds(dec.draft_runner, 1, repeats=repeats)
    return {
        "kind": "costs",
        "n_tokens": list(COST_SIZES),
        "target_seconds": [t[n] for n in COST_SIZES],
        "t_ratio": [t[n] / t[1] for n in COST_SIZES],
        "draft_seconds": t_draft,
        "c": t_draft / t[1],
        "repeats": repeats,
        "prefix": 128,
    }


def t_ratio_at(costs: dict, n_tokens: float) -> float:
    return float(np.interp(n_tokens, costs["n_tokens"], costs["t_ratio"]))


def cell_key(row: dict) -> tuple:
    return (
        row["drafter"],
        row["strategy"],
        row["width"],
        row["depth"],
        row["temperature"],
        row["n_prompts"],
        row["max_new_tokens"],
    )


def run_cell(dec, prompts, cell: dict, seed: int) -> GenerationStats:
    sampling = SamplingConfig(temperature=cell["temperature"])
    tree = (
        None
        if cell["strategy"] == "none"
        else TreeConfig(width=cell["width"], depth=cell["depth"], strategy=cell["strategy"])
    )
    total = GenerationStats()
    for i, ids in enumerate(prompts):
        out = dec.generate(
            ids, cell["max_new_tokens"], tree=tree, sampling=sampling, seed=seed + i, ignore_eos=True
        )
        total.add(out.stats)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    strs = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--widths", type=ints, default=[1, 2, 4])
    ap.add_argument("--depths", type=ints, default=[2, 4, 6])
    ap.add_argument("--strategies", type=strs, default=["iid", "without_replacement", "topk"])
    ap.add_argument(
        "--drafters",
        type=strs,
        default=["model", "bigram"],
        help="model, bigram, unigram (count drafters: iid only)",
    )
    ap.add_argument("--temperatures", type=floats, default=[0.0, 0.6, 1.0])
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7, help="forward timings per size (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="auto", choices=("auto", "native", "hf"))
    ap.add_argument("--dtype", default="float32", help="float32 (the committed run), bfloat16 or auto")
    ap.add_argument("--pair", default="pycode", choices=("pycode", "smollm2"))
    ap.add_argument("--draft", type=Path, default=None, help="another draft for the pair's target")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/linear_vs_tree.jsonl"))
    ap.add_argument("--plot", action="store_true", help="only draw --out as PNGs in --outdir, then exit")
    ap.add_argument(
        "--outdir", type=Path, default=Path("experiments/results"), help="--plot: where the PNGs go"
    )
    ap.add_argument("--dpi", type=int, default=80, help="--plot: the PNGs' resolution")
    args = ap.parse_args()
    if args.plot:
        plot(args.out, args.outdir, args.dpi)
        return

    torch.set_num_threads(args.threads)
    target_path, draft_path = pair(args.pair)
    model = SpeculativeDecoder.from_pretrained(
        target_path, args.draft or draft_path, dtype=args.dtype, backend=args.backend
    )
    target, tok = model.target_runner, model.tokenizer
    prompts = heldout_prompt_ids(args.pair, tok, args.n_prompts)
    counts = {"counts_file": counts_file(args.pair)}
    decoders = {"model": model}
    if "bigram" in args.drafters:
        decoders["bigram"] = SpeculativeDecoder(target, None, tok, drafter=BigramDrafter(width=1, **counts))
    if "unigram" in args.drafters:
        decoders["unigram"] = SpeculativeDecoder(target, None, tok, drafter=UnigramDrafter(width=1, **counts))

    rows = (
        [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
        if args.out.exists()
        else []
    )
    done = {cell_key(r) for r in rows if r.get("kind") == "cell"}
    costs = next((r for r in rows if r.get("kind") == "costs"), None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fh = args.out.open("a")
    if costs is None:
        print("measuring forward costs t(n) ...", file=sys.stderr, flush=True)
        costs = measure_costs(model, args.repeats)
        costs.update(threads=args.threads, backend=type(target).__name__, dtype=str(target.dtype))
        fh.write(json.dumps(costs) + "\n")
        fh.flush()

    base = dict(n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens)
    cells = [
        dict(drafter="model", strategy="none", width=0, depth=0, temperature=t, **base)
        for t in args.temperatures
    ]
    for drafter in args.drafters:
        for strategy in args.strategies:
            if drafter != "model" and strategy != "iid":
                continue
            for t in args.temperatures:
                for w in args.widths:
                    for d in args.depths:
                        cells.append(
                            dict(drafter=drafter, strategy=strategy, width=w, depth=d, temperature=t, **base)
                        )
    todo = [c for c in cells if cell_key(c) not in done]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} already in {args.out}", file=sys.stderr, flush=True)
    for cell in tqdm(todo, desc="cells", unit="cell"):
        dec = decoders[cell["drafter"]]
        if cell["drafter"] != "model":
            dec.drafter.kind.width = cell["width"]  # the Drafter instance this decoder uses
        s = run_cell(dec, prompts, cell, args.seed)
        nodes = s.tree_nodes / s.target_steps
        row = dict(
            kind="cell",
            **cell,
            tokens=s.tokens,
            target_steps=s.target_steps,
            tokens_per_step=s.tokens_per_step,
            tokens_per_second=s.tokens_per_second,
            acceptance_by_depth=s.acceptance_by_depth,
            nodes_per_round=nodes,
            draft_forwards_per_round=s.draft_forwards / s.target_steps,
            draft_seconds=s.draft_seconds,
            verify_seconds=s.verify_seconds,
            decode_seconds=s.total_seconds - s.prefill_seconds,
            c=costs["c"] if cell["drafter"] == "model" and cell["strategy"] != "none" else 0.0,
            t_ratio=t_ratio_at(costs, nodes + 1),
            threads=args.threads,
            backend=type(target).__name__,
            dtype=str(target.dtype),
            seed=args.seed,
            pair=args.pair,
        )
        fh.write(json.dumps(row) + "\n")
        fh.flush()
    fh.close()
    print(f"wrote {args.out}", file=sys.stderr)


# ---- plots: from the JSONL alone -------------------------------------------------------------
STYLE = {  # (drafter, strategy): colour, label
    ("model", "iid"): ("tab:blue", "model, i.i.d."),
    ("model", "without_replacement"): ("tab:orange", "model, without replacement"),
    ("model", "topk"): ("tab:green", "model, top-k beam"),
    ("model", "sequoia"): ("tab:purple", "model, Sequoia"),
    ("bigram", "iid"): ("tab:red", "bigram, i.i.d."),
    ("unigram", "iid"): ("tab:brown", "unigram, i.i.d."),
}
MARKERS = {1: "o", 2: "s", 3: "D", 4: "^", 8: "v"}


def load_jsonl(path: Path) -> tuple[list[dict], dict | None]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "cell"], next(
        (r for r in rows if r.get("kind") == "costs"), None
    )


def pareto(points: list[tuple[float, float, dict]]) -> list[tuple[float, float, dict]]:
    """Points not dominated by one with fewer (or equal) nodes and more (or equal) value."""
    front, best = [], float("-inf")
    for x, y, r in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y, r))
            best = y
    return front


def log_axis(ax) -> None:
    import matplotlib.ticker

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("draft nodes per round (log scale)")


def panel_grid(temps, title):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temps), figsize=(4.6 * len(temps), 3.8), squeeze=False, sharey=True)
    fig.suptitle(title, fontsize=10)
    return fig, axes[0]


def scatter(ax, cells, y_key):
    for (drafter, strategy), (colour, label) in STYLE.items():
        sel = [r for r in cells if r["drafter"] == drafter and r["strategy"] == strategy]
        if not sel:
            continue
        for w in sorted({r["width"] for r in sel}):
            line = sorted((r for r in sel if r["width"] == w), key=lambda r: r["depth"])
            ax.plot(
                [r["nodes_per_round"] for r in line],
                [r[y_key] for r in line],
                "-",
                color=colour,
                alpha=0.35,
                lw=1,
            )
            ax.scatter(
                [r["nodes_per_round"] for r in line],
                [r[y_key] for r in line],
                color=colour,
                marker=MARKERS.get(w, "x"),
                s=28,
                label=f"{label}, width {w}",
            )


def plot(jsonl: Path, outdir: Path, dpi: int) -> None:
    """The JSONL (and nothing else) as PNGs in `outdir`, named after it: <stem>_tokens_per_step.png,
    <stem>_tokens_per_second.png (plain decoding dashed) and <stem>_pareto.png (the fewest nodes
    for the most tokens/step, and the same for tokens/s); prints the frontier cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, costs = load_jsonl(jsonl)
    temps = sorted({r["temperature"] for r in cells})
    spec = [r for r in cells if r["strategy"] != "none"]
    plain = {r["temperature"]: r for r in cells if r["strategy"] == "none"}
    n = cells[0]["n_prompts"] if cells else 0
    m = cells[0]["max_new_tokens"] if cells else 0
    name = cells[0].get("pair", "pycode") if cells else "?"
    sub = f"{name} pair, {n} held-out prompts x {m} tokens, CPU ({cells[0]['threads'] if cells else '?'} thread)"
    stem = jsonl.stem
    outdir.mkdir(parents=True, exist_ok=True)

    for y_key, ylabel, fname in (
        ("tokens_per_step", "tokens / target step", "tokens_per_step"),
        ("tokens_per_second", "tokens / s", "tokens_per_second"),
    ):
        fig, axes = panel_grid(temps, f"{ylabel} vs draft nodes per round\n{sub}")
        for ax, t in zip(axes, temps):
            scatter(ax, [r for r in spec if r["temperature"] == t], y_key)
            if t in plain:
                ax.axhline(plain[t][y_key], color="k", ls="--", lw=1, label="plain decoding")
            ax.set_title(f"T = {t:g}")
            log_axis(ax)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(ylabel)
        axes[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        fig.savefig(outdir / f"{stem}_{fname}.png", dpi=dpi)
        plt.close(fig)

    fig, axes = plt.subplots(2, len(temps), figsize=(4.6 * len(temps), 7), squeeze=False)
    fig.suptitle(
        f"Pareto frontier: fewest draft nodes for the most tokens/step (top) and tokens/s (bottom)\n{sub}"
    )
    for row, y_key in enumerate(("tokens_per_step", "tokens_per_second")):
        for ax, t in zip(axes[row], temps):
            sel = [r for r in spec if r["temperature"] == t]
            for r in sel:
                colour = STYLE.get((r["drafter"], r["strategy"]), ("grey", ""))[0]
                ax.scatter(r["nodes_per_round"], r[y_key], color=colour, s=14, alpha=0.5)
            front = pareto([(r["nodes_per_round"], r[y_key], r) for r in sel])
            ax.plot([p[0] for p in front], [p[1] for p in front], "k-", lw=1.2)
            for x, y, r in front:
                ax.annotate(
                    f"{r['strategy'][:4]} {r['width']}x{r['depth']}"
                    + (" bg" if r["drafter"] == "bigram" else ""),
                    (x, y),
                    fontsize=6,
                    xytext=(2, -8),
                    textcoords="offset points",
                )
            if t in plain:
                ax.axhline(plain[t][y_key], color="k", ls="--", lw=1)
            log_axis(ax)
            ax.set_title(f"T = {t:g}")
            ax.grid(alpha=0.3)
            print(
                f"T={t:g} {y_key} frontier: "
                + ", ".join(
                    f"{r['drafter']}/{r['strategy']} {r['width']}x{r['depth']} ({x:.1f} nodes, {y:.2f})"
                    for x, y, r in front
                )
            )
        axes[row][0].set_ylabel(y_key.replace("_", " "))
    handles = [
        plt.Line2D([], [], color=c, marker="o", ls="", label=lab)
        for (d, s), (c, lab) in STYLE.items()
        if any(r["drafter"] == d and r["strategy"] == s for r in spec)
    ]
    axes[0][-1].legend(handles=handles, fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(outdir / f"{stem}_pareto.png", dpi=dpi)
    plt.close(fig)
    if costs:
        print(
            f"c = {costs['c']:.3f}; t(n)/t(1): "
            + ", ".join(f"{n}:{r:.2f}" for n, r in zip(costs["n_tokens"], costs["t_ratio"]))
        )
    print(f"wrote {outdir}/{stem}_*.png")


if __name__ == "__main__":
    main()
