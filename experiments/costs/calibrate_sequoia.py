#!/usr/bin/env python
"""Measure a draft's positional acceptance vector and derive Sequoia-optimal tree shapes.

    python experiments/costs/calibrate_sequoia.py --temperature 1.0 --out experiments/results/sequoia_T1.json
    python experiments/costs/calibrate_sequoia.py --target PATH.gguf --draft DIR --chat ...   # a chat pair

1. The target samples continuations of held-out prompts (the states verification will meet).
2. At every position, p (target) and q (draft) under the sampling config. Positional
   acceptance a[k] = P(the k-th draw without replacement from q is the accepted child), estimated
   by running treespec's own verification walk on a one-level tree of K draws, many times
   (at temperature 0 exactly: the rank of argmax p in the draft's order).
3. Measured costs: t(n nodes)/t(1) of the target and c = t_draft/t_target.
4. The dynamic program (`treespec.sequoia.optimal_shape`) for every node budget, with and
   without cost weighting; shapes written as JSON (`--shape-out`: the cost-optimal one, usable
   as `treespec generate --shape FILE`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import chain_logits  # noqa: E402

from treespec import (
    DraftTree,
    Draw,
    ProposalGroup,
    SamplingConfig,
    SpeculativeDecoder,
    TokenTree,
    TorchRng,
    verify,
)
from treespec.bench.measure import forward_seconds
from treespec.request import encode_prompt
from treespec.sampling import probs
from treespec.sequoia import optimal_shape
from treespec.zoo import heldout_chats, load_prompts


def positional_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, trials: int, rng: TorchRng) -> list[float]:
    """Fraction of trials in which the j-th of k draws without replacement from q was accepted."""
    k = min(k, int((q > 0).sum()))
    hits = [0] * k
    logp = torch.log(p.double())[None]
    for _ in range(trials):
        tokens = rng.without_replacement(q, k)
        tree = TokenTree([0] + tokens, [-1] + [0] * k)
        draft = DraftTree(tree, (ProposalGroup(0, Draw.WITHOUT_REPLACEMENT, tuple(tokens), tuple(range(1, k + 1)), q),))
        walk = verify(draft, logp.expand(k + 1, -1), SamplingConfig(), rng)
        if len(walk.path) > 1:
            hits[walk.path[1] - 1] += 1
    return [h / trials for h in hits]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", type=Path, default=None, help="JSON prompts (default: bundled held-out)")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--chat", action="store_true", help="the held-out chat instructions (a chat model)")
    ap.add_argument("--positions", type=int, default=32, help="sampled continuation tokens per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-children", type=int, default=8, help="K: ranks measured")
    ap.add_argument("--trials", type=int, default=64, help="walks per position (temperature > 0)")
    ap.add_argument("--nodes", type=int, default=32, help="largest node budget for the DP")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/sequoia_calibration.json"))
    ap.add_argument("--shape-out", type=Path, default=None)
    args = ap.parse_args()

    torch.set_num_threads(max(1, torch.get_num_threads()))
    dec = SpeculativeDecoder.from_pretrained(target=args.target, draft=args.draft)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    prompts = heldout_chats(args.n_prompts) if args.chat else load_prompts(args.prompts, args.n_prompts)
    rng = TorchRng(args.seed)

    per_position: list[list[float]] = []
    for i, prompt in enumerate(prompts):
        ids = list(encode_prompt(prompt, dec.tokenizer))  # text, or a chat through its template
        cont = dec.generate(ids, args.positions, tree=None, sampling=sampling, seed=args.seed + i, ignore_eos=True).token_ids
        with torch.inference_mode():
            pl = chain_logits(dec.target_runner, ids, cont)  # [positions, V]
            ql = chain_logits(dec.draft_runner, ids, cont)
        for t in range(pl.shape[0]):
            if sampling.greedy:
                order = torch.argsort(ql[t], descending=True)[: args.max_children].tolist()
                best = int(pl[t].argmax())
                per_position.append([1.0 if x == best else 0.0 for x in order])
            else:
                p, q = probs(pl[t], sampling), probs(ql[t], sampling)
                per_position.append(positional_acceptance(p, q, args.max_children, args.trials, rng))
        print(f"prompt {i + 1}/{len(prompts)}: {len(per_position)} positions", flush=True)

    K = args.max_children
    acceptance = [statistics.fmean(a[k] if k < len(a) else 0.0 for a in per_position) for k in range(K)]
    t1 = forward_seconds(dec.target_runner)
    verify_cost = [forward_seconds(dec.target_runner, n + 1) / t1 for n in range(args.nodes + 1)]
    draft_cost = forward_seconds(dec.draft_runner) / t1

    shapes = {}
    for n in range(1, args.nodes + 1):
        s = optimal_shape(acceptance, n, args.max_depth)
        shapes[n] = {"parents": list(s.parents), "depth": s.depth, "expected_tokens_per_step": s.expected_tokens}
    best = optimal_shape(acceptance, args.nodes, args.max_depth, verify_cost=verify_cost, draft_cost=draft_cost)
    result = {
        "command": "python experiments/costs/calibrate_sequoia.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "positions": len(per_position),
        "acceptance": acceptance,
        "alpha_1": acceptance[0],
        "verify_cost": verify_cost,
        "draft_cost": draft_cost,
        "shapes_by_budget": shapes,
        "cost_optimal": {
            "parents": list(best.parents),
            "n_nodes": best.n_nodes,
            "depth": best.depth,
            "expected_tokens_per_step": best.expected_tokens,
            "expected_speedup_model": best.expected_tokens / (verify_cost[best.n_nodes] + best.depth * draft_cost),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.shape_out:
        best.save(args.shape_out)
    print("positional acceptance:", " ".join(f"{a:.3f}" for a in acceptance))
    print(f"draft cost c={draft_cost:.3f}; t(n)/t(1): " + " ".join(f"{n}:{verify_cost[n]:.2f}" for n in (1, 4, 8, 16, 32) if n < len(verify_cost)))
    for n in (1, 2, 4, 8, 16, 32):
        if n in shapes:
            print(f"budget {n:>3}: depth {shapes[n]['depth']}, expected tokens/step {shapes[n]['expected_tokens_per_step']:.3f}")
    print(f"cost-optimal: {best.n_nodes} nodes, depth {best.depth}, tokens/step {best.expected_tokens:.3f}, "
          f"model speedup {result['cost_optimal']['expected_speedup_model']:.2f}x")
    print(f"wrote {args.out}" + (f" and {args.shape_out}" if args.shape_out else ""))
    assert math.isfinite(best.expected_tokens)


if __name__ == "__main__":
    main()
