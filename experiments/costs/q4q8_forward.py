#!/usr/bin/env python
"""The default SmolLM2 target's whole native forward with int4 and q4q8 weights (issue 58).

    nice -n 5 python experiments/costs/q4q8_forward.py [--reps 5] [--chats 8] [--threads 2]
        [--choices int4/bfloat16,q4q8/float32,q4q8/float32/compiled] [--no-agreement | --no-costs]
        [--agreement-choices q4q8/float32,q4q8/bfloat16,int4/bfloat16,llama.cpp] [--tag TAG]

1. Costs: after a held-out chat as prefix, the forward of a random tree of n nodes for
   n = 1..32, each path in turn per repeat (interleaved), medians; printed as t(n) in ms and
   t(n)/t(1) per path. Paths (`--choices`): int4/bfloat16 (torch's int4 kernel, aten's
   int4pack, or treespec's bf16 tiles where they run; int4/bfloat16/compiled its inductor
   forward), int4/float32, q4q8/float32 (the q4q8 kernel; its products take
   float32 and return float32), q4q8/bfloat16 (the same products, bf16 around them), and the
   /compiled paths (the inductor forward, compile=True, its graphs from the store where cached,
   else compiled first: minutes).
2. What int8 activations change: on `--chats` held-out chats, the continuation the float
   reference decodes greedily (`--new` tokens), teacher-forced through each model: how often
   each `--agreement-choices` path's argmax agrees with the reference's, and the mean
   KL(reference || path) per position.
   References: the same weights dequantized, computing in float32 (q4q8's own weights, the
   file's Q4 blocks and its Q8_0 output layer: the file's model, only the activations' rounding
   differs), and the int4 runner in float32 (the default 4-bit target; its output layer int8).
Writes results/q4q8_forward[_costs | _agreement][_TAG].json. On a shared machine the times are
indicative only; --threads 1 (the default) there, as OpenMP's spinning threads on a busy core
make every multithreaded product many times slower.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import heldout_prompt_ids, machine_info, write_results  # noqa: E402

from treespec.backends import kernels
from treespec.backends.linear import Projection
from treespec.backends.native import NativeRunner
from treespec.tree import TokenTree

CHOICES = {  # path -> (quantize, dtype, compile)
    "int4/bfloat16": ("int4", torch.bfloat16, False),
    "int4/bfloat16/compiled": ("int4", torch.bfloat16, True),
    "int4/float32": ("int4", torch.float32, False),
    "q4q8/float32": ("q4q8", torch.float32, False),
    "q4q8/float32/compiled": ("q4q8", torch.float32, True),
    "q4q8/bfloat16": ("q4q8", torch.bfloat16, False),
    "q4q8/bfloat16/compiled": ("q4q8", torch.bfloat16, True),
}
DEFAULT_CHOICES = "int4/bfloat16,q4q8/float32,q4q8/float32/compiled"
SUMMARY = (1, 2, 4, 8, 16, 32)  # the sizes of the summary table


def dequantized(runner: NativeRunner) -> NativeRunner:
    """`runner` with each product replaced by a float32 one of its dequantized weight."""
    runner.lm_head = Projection(runner.lm_head.weight.float(), runner.lm_head.bias)
    for layer in runner.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            p = getattr(layer, name)
            setattr(layer, name, Projection(p.weight.float(), p.bias))
    return runner


def tree_costs(runners: dict, prompt: list[int], sizes: list[int], reps: int) -> dict:
    """{choice: {n: median seconds of one forward of a random n-node tree after `prompt`}}."""
    rng = random.Random(0)
    trees = {
        n: TokenTree([rng.randrange(1000) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)])
        for n in sizes
    }
    times = {c: {n: [] for n in sizes} for c in runners}
    for r in runners.values():
        r.reset()
        r.prefill(prompt)
        for n in sizes:  # warm-up (a compiled runner's graphs: loaded or compiled here)
            r.score(trees[n])
            r.commit([])
    for _ in range(reps):
        for n in sizes:
            for c, r in runners.items():
                start = time.perf_counter()
                r.score(trees[n])
                times[c][n].append(time.perf_counter() - start)
                r.commit([])
        print(".", end="", file=sys.stderr, flush=True)
    return {c: {n: statistics.median(v) for n, v in t.items()} for c, t in times.items()}


def teacher_forced(runner: NativeRunner, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """Log-probabilities [len(cont), V] predicting each token of `cont` after `prompt`."""
    runner.reset()
    runner.prefill(prompt[:-1])
    logits = runner.extend([prompt[-1]] + cont[:-1], list(range(-1, len(cont) - 1)))
    runner.commit([])
    return logits.float().log_softmax(-1)


def greedy(runner: NativeRunner, prompt: list[int], n: int) -> list[int]:
    runner.reset()
    runner.prefill(prompt[:-1])
    out, token = [], prompt[-1]
    for _ in range(n):
        token = int(runner.extend([token], [-1])[0].argmax())
        runner.commit([0])
        out.append(token)
    return out


class LlamaCppForward:
    """llama.cpp's own forward of the default GGUF file, through llama-cpp-python (importable:
    `pip install llama-cpp-python`, or its source on PYTHONPATH with LLAMA_CPP_LIB_PATH naming a
    build's libllama.so): the log-probabilities `teacher_forced` gives, for the agreement table."""

    def __init__(self, threads: int):
        import llama_cpp

        from treespec.loading.gguf import smollm2_gguf

        self.model = llama_cpp.Llama(
            model_path=str(smollm2_gguf()), logits_all=True, n_ctx=4096, n_threads=threads, verbose=False
        )

    def teacher_forced(self, prompt: list[int], cont: list[int]) -> torch.Tensor:
        self.model.reset()
        self.model.eval(prompt + cont[:-1])
        rows = self.model.scores[len(prompt) - 1 : len(prompt) - 1 + len(cont)]  # [len(cont), V]
        return torch.from_numpy(rows.copy()).float().log_softmax(-1)


def agreement(path, tokenizer, chats: int, new: int, candidates: list[str], threads: int = 1) -> dict:
    """Each of `candidates` (eager paths of CHOICES, or "llama.cpp": `LlamaCppForward`) against
    each float32 reference."""
    models = {  # each candidate's teacher-forced log-probabilities, (prompt, cont) -> [len(cont), V]
        c: LlamaCppForward(threads).teacher_forced
        if c == "llama.cpp"
        else functools.partial(
            teacher_forced, NativeRunner.from_pretrained(path, dtype=CHOICES[c][1], quantize=CHOICES[c][0])
        )
        for c in candidates
    }
    references = {
        "dequantized q4q8 weights (float32)": dequantized(
            NativeRunner.from_pretrained(path, quantize="q4q8")
        ),
        "int4 runner (float32)": NativeRunner.from_pretrained(path, quantize="int4"),
    }
    out = {}
    for name, ref in references.items():
        counts = {c: [0, 0, []] for c in candidates}  # agreeing, positions, KL per position
        for prompt in heldout_prompt_ids("smollm2", tokenizer, chats):
            cont = greedy(ref, prompt, new)
            p = teacher_forced(ref, prompt, cont)
            for c, forced in models.items():
                q = forced(prompt, cont)
                counts[c][0] += int((p.argmax(-1) == q.argmax(-1)).sum())
                counts[c][1] += len(cont)
                counts[c][2].append((p.exp() * (p - q)).sum(-1))
        for c, (agree, total, kl) in counts.items():
            kl = torch.cat(kl)
            key = name if c == "q4q8/float32" else f"{c} vs {name}"  # the first key: as before
            out[key] = {
                "greedy_agreement": agree / total,
                "kl_mean": kl.mean().item(),
                "kl_max": kl.max().item(),
                "positions": total,
            }
            print(
                f"{c} vs {name}: argmax agreement {agree / total:.4f}, "
                f"KL mean {kl.mean():.2e}, max {kl.max():.2e}"
            )
    return out


def print_costs(costs: dict, sizes: list[int]) -> None:
    """t(n) in ms and t(n)/t(1) per path, every n, then the summary sizes in one table."""
    print("n  " + "  ".join(f"{c:>26}" for c in costs))
    for n in sizes:
        print(
            f"{n:<3}"
            + "  ".join(f"{costs[c][n] * 1e3:12.2f} ms {costs[c][n] / costs[c][1]:8.2f}x   " for c in costs)
        )
    shown = [n for n in SUMMARY if n in sizes]
    print("\n| path | " + " | ".join(f"t({n})" for n in shown) + " |")
    print("|---|" + "---|" * len(shown))
    for c, t in costs.items():
        cells = [f"{t[n] * 1e3:.1f}" + ("" if n == 1 else f" ({t[n] / t[1]:.2f})") for n in shown]
        print(f"| {c} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a converted checkpoint (default: SmolLM2-135M's GGUF)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-n", type=int, default=32)
    ap.add_argument("--choices", default=DEFAULT_CHOICES, help=f"comma-separated, of {', '.join(CHOICES)}")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--new", type=int, default=48, help="greedy tokens per chat for the agreement")
    ap.add_argument("--no-agreement", action="store_true", help="costs only")
    ap.add_argument("--no-costs", action="store_true", help="agreement only (writes q4q8_agreement.json)")
    ap.add_argument(
        "--agreement-choices",
        default="q4q8/float32",
        help="eager paths compared with the references, and llama.cpp (its forward of the default GGUF file)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine's fair share)")
    ap.add_argument("--tag", default="", help="a suffix for the results file's name")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from treespec.loading import load_tokenizer

    if args.model is not None and "llama.cpp" in args.agreement_choices.split(","):
        ap.error("llama.cpp's agreement reads the default GGUF file: drop --model")
    if args.model is None:
        from treespec.loading.gguf import convert, smollm2_gguf

        args.model = str(convert(smollm2_gguf()))
    tokenizer = load_tokenizer(args.model)
    print(kernels.describe())
    runners = {}
    for c in [] if args.no_costs else args.choices.split(","):
        q, d, compiled = CHOICES[c]
        runners[c] = NativeRunner.from_pretrained(args.model, dtype=d, quantize=q, compile=compiled)
    sizes = list(range(1, args.max_n + 1))
    prompt = heldout_prompt_ids("smollm2", tokenizer, 1)[0]
    costs = tree_costs(runners, prompt, sizes, args.reps)
    if runners:
        print_costs(costs, sizes)
    candidates = args.agreement_choices.split(",")
    result = {
        "what": "SmolLM2-135M's whole native forward, t(n) and t(n)/t(1) per path, and q4q8's greedy "
        "agreement and KL against float references",
        "command": " ".join(sys.argv),
        "machine": machine_info("cpu"),
        "threads": args.threads,
        "kernel": kernels.describe(),
        "prefix_tokens": len(prompt),
        "seconds": {c: {str(n): t for n, t in v.items()} for c, v in costs.items()},
        "ratio": {c: {str(n): t / v[1] for n, t in v.items()} for c, v in costs.items()},
        "agreement": None
        if args.no_agreement
        else agreement(args.model, tokenizer, args.chats, args.new, candidates, args.threads),
        "note": "indicative on a shared machine (run under nice)",
    }
    name = (
        "q4q8_agreement" if args.no_costs else "q4q8_forward_costs" if args.no_agreement else "q4q8_forward"
    )
    write_results(f"{name}{'_' + args.tag if args.tag else ''}.json", result)


if __name__ == "__main__":
    main()
