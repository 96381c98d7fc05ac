"""Held-out evaluation of a draft: real acceptance through treespec, and a cheap proxy.

- `acceptance`: the held-out prompts decoded by `SpeculativeDecoder` (the target + this draft,
  a chain `TreeConfig(width=1, depth=4)`) at T=0 and T=1; acceptance by depth and tokens per
  step, pooled over prompts (accepted / attempted counts, not a mean of per-prompt rates).
- `proxy`: on held-out stored distributions (response positions), the mean of
  sum over the top-k of min(p, q) (a lower bound on alpha at T=1, see `losses`) and the rate at
  which the draft's argmax is the target's (alpha at T=0), with no target forward at all.

`plot` draws eval.jsonl (loss and both measures against the training step) to a PNG.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from ..config import SamplingConfig, TreeConfig
from ..decoder import SpeculativeDecoder
from ..drafters import MergedDrafter, ModelDrafter
from .losses import alpha_lower_bound, buckets
from .train import draft_logprobs

CHAIN = TreeConfig(width=1, depth=4)
TEMPERATURES = {"T0": 0.0, "T1": 1.0}


def _pooled(outs) -> dict:
    depth = max([CHAIN.depth] + [len(o.stats.attempted_by_depth) for o in outs])
    acc = np.zeros(depth)
    att = np.zeros(depth)
    for o in outs:
        a, t = o.stats.accepted_by_depth, o.stats.attempted_by_depth
        acc[: len(a)] += a
        att[: len(t)] += t
    tokens = sum(o.stats.tokens for o in outs)
    steps = sum(o.stats.target_steps for o in outs)
    return {
        "acceptance_by_depth": [round(float(a / t), 4) if t else None for a, t in zip(acc, att)],
        "tokens_per_step": round(tokens / steps, 4) if steps else None,
    }


def acceptance(
    target_runner,
    tokenizer,
    draft_runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    tree: TreeConfig = CHAIN,
) -> dict:
    """{"T0": {...}, "T1": {...}} for the target and one draft on held-out prompt ids."""
    dec = SpeculativeDecoder(target_runner, draft_runner, tokenizer)
    out = {}
    for name, t in TEMPERATURES.items():
        outs = dec.generate_batch(
            prompts,
            max_new_tokens=max_new_tokens,
            tree=tree,
            sampling=SamplingConfig(temperature=t),
            seeds=list(range(len(prompts))),
            max_batch=len(prompts),
        )
        out[name] = _pooled(outs)
    return out


def merged_acceptance(
    target_runner, tokenizer, draft_runners, prompts, max_new_tokens: int, vocab_size: int
) -> dict:
    """As `acceptance`, with every draft's chain merged into one tree (`MergedDrafter`)."""
    out = {}
    for name, t in TEMPERATURES.items():
        drafter = MergedDrafter([ModelDrafter(r, CHAIN, vocab_size=vocab_size) for r in draft_runners])
        dec = SpeculativeDecoder(target_runner, None, tokenizer, drafter=drafter)
        outs = [
            dec.generate(
                p, max_new_tokens=max_new_tokens, tree=CHAIN, sampling=SamplingConfig(temperature=t), seed=i
            )
            for i, p in enumerate(prompts)
        ]
        out[name] = _pooled(outs)
    return out


@torch.no_grad()
def proxy(draft, dataset, vocab_map, batch_size: int = 16) -> dict:
    """{"alpha": mean sum_topk min(p, q), "top1": argmax agreement} on `dataset`'s response rows."""
    mask = dataset.response_rows()
    alpha, top1, n = 0.0, 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = dataset.batch(list(range(start, min(len(dataset), start + batch_size))), mask)
        logq, ids = draft_logprobs(draft, batch, vocab_map)  # [M, V_draft], [M, k]
        P, Q, _ = buckets(logq, ids, batch.topk_probs, ids >= 0)
        alpha += float(alpha_lower_bound(P, Q).sum())
        top1 += float((logq.argmax(-1) == ids[:, 0]).sum())
        n += len(P)
    return {"alpha": round(alpha / n, 4), "top1": round(top1 / n, 4)}


def read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def plot(eval_path: Path, png_path: Path) -> None:
    """Loss, acceptance at depth 1 (T=0, T=1) and the proxies against the step, one line per draft."""
    try:
        import matplotlib
    except ImportError:  # an optional dependency (treespec[experiments]); the JSONL has every number
        print(f"treespec distill: matplotlib is not installed; {png_path.name} not drawn", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(eval_path) if "step" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for d in sorted({r["draft"] for r in rows}):
        mine = [r for r in rows if r["draft"] == d and not r.get("final")]
        steps = [r["step"] for r in mine]
        ax_loss.plot(
            [r["step"] for r in mine if r.get("loss") is not None],
            [r["loss"] for r in mine if r.get("loss") is not None],
            "o-",
            label=f"draft {d}",
        )
        for key, style in (("T0", "o-"), ("T1", "s-")):
            ax_acc.plot(
                steps,
                [r[key]["acceptance_by_depth"][0] for r in mine],
                style,
                label=f"draft {d} {key} depth 1",
            )
        ax_acc.plot(steps, [r["proxy"]["alpha"] for r in mine], ":", label=f"draft {d} proxy sum min(p, q)")
        ax_acc.plot(steps, [r["proxy"]["top1"] for r in mine], "--", label=f"draft {d} proxy top-1")
    ax_loss.set(xlabel="step", ylabel="training loss (mean since last eval)", title="loss")
    ax_acc.set(xlabel="step", ylabel="acceptance", ylim=(0, 1), title="held-out acceptance")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
