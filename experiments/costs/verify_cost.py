"""What a sampled round's verification walk costs on a large vocabulary: `verify()` of one chain
per rule, deterministic proposals (prompt lookup, n-gram, forced tokens) and drawn ones (a
draft's q), at T=1 over SmolLM2's 49,152 tokens, medians of many calls, the accepted length as
the random target makes it (every rule sees the same logits and coins' seed).

    python experiments/costs/verify_cost.py [--threads 2] [--calls 300]

Prints microseconds per call; writes experiments/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine_info, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--lengths", default="1,3,5,8")
    args = ap.parse_args()

    import torch

    from treespec.config import SamplingConfig
    from treespec.proposal import DraftTree, Draw, ProposalGroup
    from treespec.rng import TorchRng
    from treespec.tree import TokenTree
    from treespec.verify import verify

    torch.set_num_threads(args.threads)
    V, sampling = args.vocab, SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = [7] + [11 + i for i in range(n)]
        logits = torch.randn(n + 1, V, generator=g) * 3
        logits[torch.arange(n), torch.tensor(tokens[1:])] += 6  # a likely draft, as a good one is
        q = torch.softmax(torch.randn(n, V, generator=g) * 3, -1)
        q[torch.arange(n), torch.tensor(tokens[1:])] += 0.5
        q = q / q.sum(-1, keepdim=True)
        tree = TokenTree(tokens, [-1] + list(range(n)))
        drafts = {
            "deterministic": DraftTree.from_paths(tokens[0], [tokens[1:]]),
            "drawn": DraftTree(
                tree, tuple(ProposalGroup(i, Draw.IID, (tokens[i + 1],), (i + 1,), q[i]) for i in range(n))
            ),
        }
        for kind, draft in drafts.items():
            for rule in ("token", "block"):
                rng, times = TorchRng(0), []
                for i in range(args.calls + 20):
                    start = time.perf_counter()
                    verify(draft, logits, sampling, rng, rule, check_structure=False)
                    if i >= 20:  # warm-up
                        times.append(time.perf_counter() - start)
                us = statistics.median(times) * 1e6
                out[f"{kind} {rule} {n}"] = us
                print(f"chain of {n}, {kind:13s} {rule:5s} {us:7.0f} us", flush=True)
    write_results("verify_cost.json", {"machine": machine_info(), "threads": args.threads, "us": out})


if __name__ == "__main__":
    main()
