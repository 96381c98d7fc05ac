#!/usr/bin/env python
"""How much a second sibling can add at T=1: P(2nd proposal accepted | 1st rejected).

    python experiments/sibling_acceptance.py      # writes experiments/results/sibling_acceptance.json

A tree beats a chain at T=1 only through its siblings: after the first proposal x1 ~ q is
rejected (probability 1 - sum min(p, q)), the target's residual r = norm(max(p - q, 0)) is
what the second proposal must hit. For every position of the held-out prompts (target p and
draft q from one forward each, T=1), this computes the exact conditional acceptance of a
second proposal drawn from several candidate distributions, pooled over rejections:

    iid q                    sum min(r, q)               what "iid" trees do
    q at temperature tau     sum min(r, q_tau)           a flatter draft for the sibling
    q without x1             E_x1[sum min(r, q - x1)]    "without_replacement" trees
    argmax q (deterministic) E[r(argmax q)]              a top-1 sibling

The largest of these bounds what any width buys on this pair (Sequoia's acceptance vector,
`calibrate_sequoia.py`, measures the same quantity by sampling: 0.09 unconditional = 0.30 x
the 0.30 rejection rate).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from treespec import SpeculativeDecoder
from treespec.zoo import load_prompts, pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=300, help="positions per prompt")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/sibling_acceptance.json"))
    args = ap.parse_args()

    dec = SpeculativeDecoder.from_pretrained(*pair("pycode"), dtype="float32", backend="native")
    zp, zq = [], []
    for text in load_prompts(n=args.n_prompts):
        ids = dec.tokenizer.encode(text)[: args.max_tokens]
        for runner, out in ((dec.target_runner, zp), (dec.draft_runner, zq)):
            runner.reset()
            out.append(runner.extend(ids, list(range(-1, len(ids) - 1))))  # a chain: logits after every token
    zp, zq = torch.cat(zp).double(), torch.cat(zq).double()
    p, q = zp.softmax(-1), zq.softmax(-1)  # [N, V] each
    rejected = 1 - torch.minimum(p, q).sum(-1)  # [N] P(x1 rejected)
    r = (p - q).clamp(min=0)
    r = r / r.sum(-1, keepdim=True).clamp(min=1e-300)  # [N, V] the residual after a rejection

    def pooled(accept: torch.Tensor) -> float:  # [N] conditional acceptance -> pooled over rejections
        return float((rejected * accept).sum() / rejected.sum())

    def without_x1(base: torch.Tensor, k: int = 64) -> float:
        # x1 ~ q and rejected: weight q(x1) (1 - min(1, p/q)); the top-k such x1 per position
        w = q * (1 - torch.minimum(torch.ones_like(p), p / q.clamp(min=1e-300)))
        wv, wi = w.topk(k, -1)
        total = 0.0
        for j in range(k):
            q2 = base.scatter(1, wi[:, j : j + 1], 0.0)
            q2 = q2 / q2.sum(-1, keepdim=True)
            total += float((wv[:, j] * torch.minimum(r, q2).sum(-1)).sum())
        return total / float(w.sum())

    rows = {"iid q": pooled(torch.minimum(r, q).sum(-1))}
    for tau in (1.25, 1.5, 2.0, 3.0):
        rows[f"q at temperature {tau}"] = pooled(torch.minimum(r, (zq / tau).softmax(-1)).sum(-1))
    rows["q without x1"] = without_x1(q)
    rows["argmax q (deterministic)"] = pooled(r.gather(1, q.argmax(-1, keepdim=True))[:, 0])
    result = {
        "command": "python experiments/sibling_acceptance.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "positions": len(p), "alpha_1": float(1 - rejected.mean()),
        "second_accepted_given_first_rejected": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{len(p)} positions, alpha_1 = {result['alpha_1']:.3f}; P(2nd accepted | 1st rejected):")
    for name, value in rows.items():
        print(f"  {name:<28} {value:.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
