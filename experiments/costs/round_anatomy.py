#!/usr/bin/env python
"""Where a decode round's time goes, per tree: forwards, drafting Python, verification, the rest.

    python experiments/costs/round_anatomy.py --trees iid:1x6,sequoia:16x8 --temperature 1 \
        --sequoia experiments/results/sequoia_T1.json --out experiments/results/round_anatomy_T1_epyc.json
    python experiments/costs/round_anatomy.py --pair smollm2 --compile --quantize int8 --chat \
        --trees plain,iid:1x1,iid:1x2,iid:2x1 --temperature 0 --max-new-tokens 128

Each part is timed by wrapping the engine's calls to it (a wrapper adds about a microsecond
per call): the target's and the draft's forwards (`NativeRunner._packed_forward`; prefills,
the forwards that need no logits, apart), drafting (`propose_many`, its draft forwards taken out: what is
left is the drafter's Python and small ops), verification (`verify`), and the rest of
`Engine.step` (tree masks, commits, stats, emission). Milliseconds per round, medians over the
repeats; the trees are interleaved per prompt so that a slow minute of a shared machine does
not land on one of them. Native backend only (the forwards are the native runner's). `plain`
is plain decoding (no draft), timed the same way: its round is one target forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import heldout_prompt_ids, machine_info, parse_tree  # noqa: E402

import treespec.engine as engine
from treespec import SamplingConfig, SpeculativeDecoder
from treespec.backends.head import HeadRunner
from treespec.backends.native import NativeRunner
from treespec.config import QUANTIZATIONS
from treespec.loading import quantize_setting
from treespec.zoo import PAIRS, load_prompts, pair, pair_draft

PARTS = ("target_forward", "target_prefill", "draft_forwards", "draft_prefill", "drafting_python", "verify", "rest")


class Timers:
    """Seconds spent in each wrapped call since the last `reset()`."""

    def __init__(self, target: NativeRunner) -> None:
        self.target, self.seconds = target, defaultdict(float)

    def reset(self) -> None:
        self.seconds.clear()

    def wrap(self, owner, name: str, key) -> None:
        """Replace `owner.name` by a timed call; `key(args)` names the part it counts toward."""
        original, seconds = getattr(owner, name), self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            seconds[key(args)] += time.perf_counter() - t0
            return out

        setattr(owner, name, timed)

    def install(self) -> None:
        def forward_part(args) -> str:
            runner, need_logits = args[0], args[3]  # a prefill is the one forward that needs no logits
            role = "target" if runner.pool is self.target.pool else "draft"
            return f"{role}_prefill" if not need_logits else ("target_forward" if role == "target" else "draft_forwards")

        self.wrap(NativeRunner, "_packed_forward", forward_part)
        self.wrap(HeadRunner, "_packed_forward", forward_part)
        self.wrap(engine, "propose_many", lambda _: "propose")
        self.wrap(engine, "verify", lambda _: "verify")
        self.wrap(engine.Engine, "step", lambda _: "step")

    def parts(self, rounds: int) -> dict[str, float]:
        """Milliseconds per round of every part."""
        s = self.seconds
        drafting = s["propose"] - s["draft_forwards"]
        rest = s["step"] - s["propose"] - s["verify"] - sum(s[k] for k in ("target_forward", "target_prefill", "draft_prefill"))
        out = {k: s[k] for k in ("target_forward", "target_prefill", "draft_forwards", "draft_prefill", "verify")}
        out.update(drafting_python=drafting, rest=rest)
        return {k: 1e3 * out[k] / rounds for k in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default="iid:1x6,sequoia:16x8", help="strategy:WIDTHxDEPTH or sequoia:NODESxDEPTH, comma-separated")
    ap.add_argument("--sequoia", type=Path, default=None, help="calibrate_sequoia.py output (for sequoia:NODESxDEPTH)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pair", default="pycode", choices=PAIRS)
    ap.add_argument("--chat", action="store_true", help="the pair's held-out chat instructions (smollm2)")
    ap.add_argument("--compile", action="store_true", help="inductor graphs for target and draft")
    ap.add_argument("--quantize", choices=("auto", "none", *QUANTIZATIONS), default="none", help="the target's weights")
    ap.add_argument("--drafter", default=None, help="model or head (default: what the pair drafts with)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    acceptance = json.loads(args.sequoia.read_text())["acceptance"] if args.sequoia else None
    trees = {spec: None if spec == "plain" else parse_tree(spec, acceptance) for spec in args.trees.split(",")}
    dec = SpeculativeDecoder.from_pretrained(
        pair(args.pair)[0],
        pair_draft(args.pair, args.drafter),
        dtype=args.dtype,
        backend="native",
        compile=args.compile,
        quantize=quantize_setting(args.quantize),
    )
    prompts = heldout_prompt_ids(args.pair, dec.tokenizer, args.n_prompts) if args.chat else [
        dec.tokenizer(p)["input_ids"] for p in load_prompts(n=args.n_prompts)
    ]
    sampling = SamplingConfig(temperature=args.temperature)
    timers = Timers(dec.target_runner)
    timers.install()
    for tree in trees.values():  # warm-up (with --compile: every feed size a tree needs, compiled)
        dec.generate(prompts[0], 32, tree=tree, sampling=sampling)

    runs = {name: [] for name in trees}  # one dict per (repeat, prompt)
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, tree in trees.items():
                timers.reset()
                t0 = time.perf_counter()
                out = dec.generate(prompt, args.max_new_tokens, tree=tree, sampling=sampling, seed=1000 * rep + i, ignore_eos=True)
                wall = time.perf_counter() - t0
                rounds = out.stats.target_steps
                runs[name].append({**timers.parts(rounds), "round": 1e3 * wall / rounds,
                                   "tokens_per_step": out.stats.tokens_per_step, "tokens_per_second": len(out.token_ids) / wall})

    rows = []
    for name, rs in runs.items():
        row = {"tree": name}
        for k in (*PARTS, "round"):
            row[f"{k}_ms"] = statistics.median(r[k] for r in rs)
        row["tokens_per_step"] = statistics.mean(r["tokens_per_step"] for r in rs)
        row["tokens_per_second"] = statistics.median(r["tokens_per_second"] for r in rs)
        rows.append(row)

    cols = [f"{k}_ms" for k in (*PARTS, "round")]
    print(f"{'tree':<16}" + "".join(f"{c.removesuffix('_ms'):>16}" for c in cols) + f"{'tokens/step':>13}{'tokens/s':>10}")
    for r in rows:
        print(f"{r['tree']:<16}" + "".join(f"{r[c]:>16.2f}" for c in cols) + f"{r['tokens_per_step']:>13.2f}{r['tokens_per_second']:>10.1f}")
    if args.out:
        runner = dec.target_runner
        config = dict(vars(args), out=str(args.out), sequoia=args.sequoia and str(args.sequoia), dtype=str(runner.dtype),
                      machine=machine_info("cpu"),
                      draft_dtype=str(dec.draft_runner.dtype), threads=torch.get_num_threads(), torch=torch.__version__)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
