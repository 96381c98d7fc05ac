"""Greedy speculative output against greedy plain output on the default pair's held-out chats:
where the first token differs, per chat and tree (issue 58: a tree node must score bit for bit as
its path alone, which torch's CPU SDPA does not give).

    python experiments/costs/greedy_parity.py [--eager] [--sdpa] [--n-prompts 8] [--tokens 96]
        [--dynamic 16]

`--dynamic N` adds an EAGLE-2 dynamic tree of N nodes (top-4 children, depth 4): at temperature 0
the i.i.d. trees merge into chains, and this one scores N + 1 rows a forward (10 and more take the
AMX tiles where the CPU has them).

`--sdpa` runs attention as before `kernels.attention.row_attention` (eager only: the compiled
graphs are stored with the kernel in them). Writes results/greedy_parity_<tag>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import heldout_prompt_ids, machine_info, write_results  # noqa: E402

TREES = ((1, 1), (1, 3), (3, 3), None)  # (width, depth); None: the automatic tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eager", action="store_true", help="the eager forward (default: compiled where kept)")
    ap.add_argument("--sdpa", action="store_true", help="torch's SDPA instead of row_attention (eager)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--dynamic", type=int, default=0, help="also a dynamic tree of this many nodes")
    args = ap.parse_args()

    import treespec.backends.head as head
    import treespec.backends.native.runner as runner
    from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig

    if args.sdpa:
        args.eager = True
        runner.exact_rows = head.exact_rows = lambda device, dtype: False
    dec = SpeculativeDecoder.from_pretrained(compile=False if args.eager else "auto")
    target = dec.target_runner
    forward = "compiled" if target.compiled is not None else "eager"
    path = f"{forward}, {'row_attention' if target.exact_rows else 'SDPA'}"
    print(f"target: {target.quantize}, {target.dtype}, {path}")
    greedy = SamplingConfig(temperature=0.0)
    rows, differ, nodes = [], 0, {}  # nodes: the largest mean tree a round scored, per tree
    for i, prompt in enumerate(heldout_prompt_ids("smollm2", dec.tokenizer, args.n_prompts)):
        want = dec.generate(prompt, args.tokens, tree=None, sampling=greedy, ignore_eos=True).token_ids
        first = {}
        for shape in TREES + ((("dynamic", args.dynamic),) if args.dynamic else ()):
            if shape is None:
                tree, name = TreeConfig(), "auto"
            elif shape[0] == "dynamic":
                tree, name = (
                    TreeConfig(width=4, depth=4, strategy="dynamic", budget=shape[1]),
                    f"dynamic{shape[1]}",
                )
            else:
                tree, name = TreeConfig(*shape), f"{shape[0]}x{shape[1]}"
            out = dec.generate(prompt, args.tokens, tree=tree, sampling=greedy, ignore_eos=True)
            got = out.token_ids
            nodes[name] = max(nodes.get(name, 0), round(out.stats.tree_nodes / out.stats.target_steps, 1))
            first[name] = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        differ += any(v is not None for v in first.values())
        rows.append({"prompt": i, "first_difference": first})
        print(f"chat {i}: first differing token per tree {first}")
    print(f"{differ} of {len(rows)} chats differ ({path}); mean nodes a round, largest over chats: {nodes}")
    write_results(
        f"greedy_parity_{args.tag}.json",
        {
            "machine": machine_info(),
            "path": path,
            "tokens": args.tokens,
            "chats_differing": differ,
            "mean_nodes_per_round": nodes,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
