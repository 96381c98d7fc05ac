#!/usr/bin/env python
"""Plots of `experiments/linear_vs_tree.py`'s JSONL (and nothing else) into experiments/results/.

    python experiments/plot_linear_vs_tree.py [--jsonl experiments/results/linear_vs_tree.jsonl]
    python experiments/plot_linear_vs_tree.py --jsonl experiments/results/linear_vs_tree_smollm2.jsonl

Files are named after the JSONL (linear_vs_tree_smollm2.jsonl -> linear_vs_tree_smollm2_*.png).

Writes, one column per temperature:
  linear_vs_tree_tokens_per_step.png    tokens/step vs draft nodes per round, per strategy
  linear_vs_tree_tokens_per_second.png  tokens/s vs draft nodes per round (plain decoding dashed)
  linear_vs_tree_pareto.png             tokens/step vs nodes: the Pareto frontier (fewest nodes
                                        for the most tokens/step), and the same for tokens/s
and prints the frontier cells.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {  # (drafter, strategy): colour, label
    ("model", "iid"): ("tab:blue", "model, i.i.d."),
    ("model", "without_replacement"): ("tab:orange", "model, without replacement"),
    ("model", "topk"): ("tab:green", "model, top-k beam"),
    ("model", "sequoia"): ("tab:purple", "model, Sequoia"),
    ("bigram", "iid"): ("tab:red", "bigram, i.i.d."),
    ("unigram", "iid"): ("tab:brown", "unigram, i.i.d."),
}
MARKERS = {1: "o", 2: "s", 3: "D", 4: "^", 8: "v"}


def load(path: Path) -> tuple[list[dict], dict | None]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "cell"], next((r for r in rows if r.get("kind") == "costs"), None)


def pareto(points: list[tuple[float, float, dict]]) -> list[tuple[float, float, dict]]:
    """Points not dominated by one with fewer (or equal) nodes and more (or equal) value."""
    front, best = [], float("-inf")
    for x, y, r in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y, r))
            best = y
    return front


def log_axis(ax) -> None:
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("draft nodes per round (log scale)")


def panel_grid(temps, title):
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
            ax.plot([r["nodes_per_round"] for r in line], [r[y_key] for r in line], "-", color=colour, alpha=0.35, lw=1)
            ax.scatter([r["nodes_per_round"] for r in line], [r[y_key] for r in line], color=colour,
                       marker=MARKERS.get(w, "x"), s=28, label=f"{label}, width {w}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonl", type=Path, default=Path("experiments/results/linear_vs_tree.jsonl"))
    ap.add_argument("--outdir", type=Path, default=Path("experiments/results"))
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args()
    cells, costs = load(args.jsonl)
    temps = sorted({r["temperature"] for r in cells})
    spec = [r for r in cells if r["strategy"] != "none"]
    plain = {r["temperature"]: r for r in cells if r["strategy"] == "none"}
    n = cells[0]["n_prompts"] if cells else 0
    m = cells[0]["max_new_tokens"] if cells else 0
    name = cells[0].get("pair", "pycode") if cells else "?"
    sub = f"{name} pair, {n} held-out prompts x {m} tokens, CPU ({cells[0]['threads'] if cells else '?'} thread)"
    stem = args.jsonl.stem
    args.outdir.mkdir(parents=True, exist_ok=True)

    for y_key, ylabel, fname in (("tokens_per_step", "tokens / target step", "tokens_per_step"),
                                 ("tokens_per_second", "tokens / s", "tokens_per_second")):
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
        fig.savefig(args.outdir / f"{stem}_{fname}.png", dpi=args.dpi)
        plt.close(fig)

    fig, axes = plt.subplots(2, len(temps), figsize=(4.6 * len(temps), 7), squeeze=False)
    fig.suptitle(f"Pareto frontier: fewest draft nodes for the most tokens/step (top) and tokens/s (bottom)\n{sub}")
    for row, y_key in enumerate(("tokens_per_step", "tokens_per_second")):
        for ax, t in zip(axes[row], temps):
            sel = [r for r in spec if r["temperature"] == t]
            for r in sel:
                colour = STYLE.get((r["drafter"], r["strategy"]), ("grey", ""))[0]
                ax.scatter(r["nodes_per_round"], r[y_key], color=colour, s=14, alpha=0.5)
            front = pareto([(r["nodes_per_round"], r[y_key], r) for r in sel])
            ax.plot([p[0] for p in front], [p[1] for p in front], "k-", lw=1.2)
            for x, y, r in front:
                ax.annotate(f"{r['strategy'][:4]} {r['width']}x{r['depth']}" + (" bg" if r["drafter"] == "bigram" else ""),
                            (x, y), fontsize=6, xytext=(2, -8), textcoords="offset points")
            if t in plain:
                ax.axhline(plain[t][y_key], color="k", ls="--", lw=1)
            log_axis(ax)
            ax.set_title(f"T = {t:g}")
            ax.grid(alpha=0.3)
            print(f"T={t:g} {y_key} frontier: " + ", ".join(
                f"{r['drafter']}/{r['strategy']} {r['width']}x{r['depth']} ({x:.1f} nodes, {y:.2f})" for x, y, r in front))
        axes[row][0].set_ylabel(y_key.replace("_", " "))
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=l) for (d, s), (c, l) in STYLE.items()
               if any(r["drafter"] == d and r["strategy"] == s for r in spec)]
    axes[0][-1].legend(handles=handles, fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.outdir / f"{stem}_pareto.png", dpi=args.dpi)
    plt.close(fig)
    if costs:
        print(f"c = {costs['c']:.3f}; t(n)/t(1): " + ", ".join(f"{n}:{r:.2f}" for n, r in zip(costs["n_tokens"], costs["t_ratio"])))
    print(f"wrote {args.outdir}/{stem}_*.png")


if __name__ == "__main__":
    main()
