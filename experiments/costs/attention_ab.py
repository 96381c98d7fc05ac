"""The default target's forward with `row_attention` against the same forward with torch's SDPA,
in one process, interleaved: t(n) after a held-out chat for trees of n nodes (issue 58).

    python experiments/costs/attention_ab.py [--eager] [--reps 15]

Both runners load the same weights; the SDPA one is built as before `kernels.attention` (its
compiled graphs are compiled in process where the store lacks them: about a minute).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import heldout_prompt_ids, machine_info, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eager", action="store_true", help="eager forwards (default: compiled)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    args = ap.parse_args()

    import torch

    import treespec.backends.native.runner as runner_module
    from treespec.backends.native import NativeRunner
    from treespec.loading import load_tokenizer
    from treespec.loading.gguf import convert, smollm2_gguf
    from treespec.tree import TokenTree

    torch.set_num_threads(2)
    path = convert(smollm2_gguf())
    prompt = heldout_prompt_ids("smollm2", load_tokenizer(path), 1)[0]
    load = lambda: NativeRunner.from_pretrained(  # noqa: E731
        path, quantize="int4", dtype=torch.bfloat16, compile=not args.eager
    )
    rows = load()
    exact = runner_module.exact_rows
    runner_module.exact_rows = lambda device, dtype: False
    sdpa = load()
    runner_module.exact_rows = exact
    if not rows.exact_rows:
        raise SystemExit("row_attention does not run here (no AVX512, or the kernels are not built)")
    rng = random.Random(0)
    sizes = [int(n) for n in args.sizes.split(",")]
    trees = {
        n: TokenTree([rng.randrange(1000) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)])
        for n in sizes
    }
    paths = {"row_attention": rows, "sdpa": sdpa}
    for r in paths.values():
        r.prefill(prompt)
        for n in sizes:  # warm-up
            r.score(trees[n])
            r.commit([])
    times = {(name, n): [] for name in paths for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            for name, r in paths.items():
                start = time.perf_counter()
                r.score(trees[n])
                times[(name, n)].append(time.perf_counter() - start)
                r.commit([])
    ms = {f"{name} {n}": statistics.median(times[(name, n)]) * 1e3 for name in paths for n in sizes}
    print("n    row_attention    sdpa  (ms, medians)")
    for n in sizes:
        print(f"{n:<4} {ms[f'row_attention {n}']:10.2f} {ms[f'sdpa {n}']:10.2f}")
    tag = "eager" if args.eager else "compiled"
    write_results(f"attention_ab_{tag}.json", {"machine": machine_info(), "reps": args.reps, "ms": ms})


if __name__ == "__main__":
    main()
