#!/usr/bin/env python
"""Would a head draft better at T=1 from a sharper or flatter q? Temperature scaling, measured
two ways: teacher-forced on held-out rows, and in decoding.

    python experiments/distill/head_temperature.py --head treespec/zoo/smollm2/head --data RUN [RUN ...] \\
        --fold 0.75 0.9 1.15 --out DIR --tag zen4

Teacher-forced: for each temperature tau, the mean over the held-out response rows (each data
run's heldout.safetensors, never trained on) of sum min(p, q) with q = softmax(head logits /
tau) at the head's first step, against the target's whole distribution p (a bf16 forward over
each sequence) and against the stored top-k only (the proxy `treespec distill` reports).
`--fold`: copies of the head with 1 / tau folded into its LM head (an EAGLE-3 checkpoint as
before; T=0's argmax unchanged), written under --out for `compare_heads.py` to decode with.
Writes results/head_temperature_<tag>.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import write_results  # noqa: E402

from treespec import loading
from treespec.backends.head import load_head, save_head
from treespec.distill.data import Dataset, load_shard
from treespec.distill.features import FeaturesInMemory, compute_features
from treespec.distill.head_model import HeadModel, head_batch
from treespec.distill.losses import alpha_lower_bound, buckets
from treespec.loading.gguf import smollm2_gguf

TEMPERATURES = (0.6, 0.7, 0.75, 0.8, 0.9, 1.0, 1.1, 1.2)


@torch.no_grad()
def alpha_by_temperature(target, model: HeadModel, held: Dataset, features) -> dict:
    """{"full": {tau: mean sum min(p, q)}, "stored_top_k": {...}, "rows": M}."""
    row_of = model.row_of(target.shape.vocab)
    mask, seqs = held.response_rows(), held.sequences()
    full, stored, rows = dict.fromkeys(TEMPERATURES, 0.0), dict.fromkeys(TEMPERATURES, 0.0), 0
    for s, seq in enumerate(seqs):
        seq = seq.tolist()
        target.reset()
        target.prefill(seq[:1])
        logits = target.extend(seq[1:], [-1, *range(len(seq) - 2)]).float()  # row t: token t + 2's
        target.discard_pending()
        batch = head_batch(held, features, [s], mask, row_of)
        _, t = batch.where  # head slot t reads (f_t, token t + 1) and drafts token t + 2
        z = model.logits(model.states(batch.features, batch.tokens, 0)[0][0, t]).float()  # [M, K]
        p = torch.softmax(logits[t], -1)  # [M, V]
        for tau in TEMPERATURES:
            q = torch.zeros_like(p)
            q[:, model.ids] = torch.softmax(z / tau, -1)
            full[tau] += float(torch.minimum(p, q).sum())
            P, Q, _ = buckets(torch.log_softmax(z / tau, -1), batch.rows, batch.probs, batch.rows >= 0)
            stored[tau] += float(alpha_lower_bound(P, Q).sum())
        rows += len(t)
    mean = lambda sums: {str(tau): round(v / rows, 4) for tau, v in sums.items()}  # noqa: E731
    return {"full": mean(full), "stored_top_k": mean(stored), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True)
    ap.add_argument("--target", default=None, help="the head's target (default: the SmolLM2 GGUF)")
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="data runs: their held-out shards")
    ap.add_argument("--fold", type=float, nargs="*", default=[], help="temperatures to write copies with")
    ap.add_argument("--out", type=Path, help="where the --fold copies go (DIR/tau_<tau>)")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    if args.fold and args.out is None:
        ap.error("--fold writes copies: give --out DIR")
    target = loading.load_runner(args.target or smollm2_gguf(), torch.bfloat16, torch.device("cpu"), "native")
    cfg, weights = load_head(args.head, target.shape.layers)
    floats = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    model = HeadModel(cfg, target.embed.detach(), floats).eval()
    held = Dataset([load_shard(run / "work" / "data" / "heldout.safetensors") for run in args.data])
    features = FeaturesInMemory(len(held.tokens), len(cfg.taps) * target.shape.hidden)
    compute_features(target, held, cfg.taps, features)
    result = alpha_by_temperature(target, model, held, features)
    print(result)
    for tau in args.fold:
        out = args.out / f"tau_{tau:g}"
        state = dict(weights, **{"lm_head.weight": (floats["lm_head.weight"] / tau).to(torch.bfloat16)})
        save_head(out, cfg, state)
        shutil.copy2(args.head / "README.md", out / "README.md")
        print(f"wrote {out}")
    write_results(
        f"head_temperature_{args.tag}.json",
        {"head": str(args.head), "data": [str(d) for d in args.data], "folded": args.fold, **result},
    )


if __name__ == "__main__":
    main()
