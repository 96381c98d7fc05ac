"""The SmolLM2 feature head against the independent draft and plain decoding, in one process.

Held-out chats, every method run on the same prompt one after another (interleaved), an
untimed warm-up first; per temperature: tokens/s (median over prompts), tokens/step and
acceptance by depth (pooled over prompts), the cost ratio c (a draft forward against a target
forward, from the rounds' own timings), against treespec's plain decoding with the same target
runner, the automatic tree (`TreeConfig()`), Hugging Face `generate()` on the same weights and,
with `--llama-cpp DIR`, llama.cpp's plain decoding of the same GGUF file and its own EAGLE-3
speculation with the head (converted by `treespec.bench.llamacpp.head_to_gguf`).

    python experiments/head_bench.py --head treespec/zoo/smollm2/head --n-prompts 6 \
        --max-new-tokens 128 --head-trees 1x1 1x2 1x3 2x2 2x3 --draft-trees 1x1 1x2 --tag amx \
        [--llama-cpp DIR] [--quantize auto|int8|int4] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, machine_info, write_results

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.backends.head import load_head_runner
from treespec.bench.llamacpp import LlamaCpp, LlamaCppBench, head_to_gguf
from treespec.config import QUANTIZATIONS
from treespec.loading import checkpoint, load_runner, load_tokenizer, resolve_device, resolve_dtype
from treespec.loading.gguf import smollm2_gguf
from treespec.request import encode_prompt
from treespec.zoo import ZOO, heldout_chats, pair


def shape(text: str) -> TreeConfig:
    w, d = (int(x) for x in text.split("x"))
    return TreeConfig(w, d)


def summarise(outs, seconds) -> dict:
    """Tokens/s per prompt (median), pooled tokens/step, acceptance by depth and c."""
    acc, att = [], []
    for o in outs:
        for i, (a, t) in enumerate(zip(o.stats.accepted_by_depth, o.stats.attempted_by_depth)):
            while len(acc) <= i:
                acc.append(0)
                att.append(0)
            acc[i] += a
            att[i] += t
    tokens = sum(o.stats.tokens for o in outs)
    steps = sum(o.stats.target_steps for o in outs)
    draft_forwards = sum(o.stats.draft_forwards for o in outs)
    draft_s = sum(o.stats.draft_seconds for o in outs)
    verify_s = sum(o.stats.verify_seconds for o in outs)
    return {
        "tokens_per_second": round(statistics.median(o.stats.tokens / s for o, s in zip(outs, seconds)), 2),
        "tokens_per_step": round(tokens / steps, 3) if steps else None,
        "acceptance_by_depth": [round(a / t, 3) if t else None for a, t in zip(acc, att)],
        "draft_ms_per_forward": round(1000 * draft_s / draft_forwards, 3) if draft_forwards else None,
        "verify_ms_per_step": round(1000 * verify_s / steps, 3) if steps else None,
        "c": round((draft_s / draft_forwards) / (verify_s / steps), 3) if draft_forwards and steps else None,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=ZOO / "smollm2" / "head")
    ap.add_argument("--draft", type=Path, default=None, help="the independent draft (default: the pair's)")
    ap.add_argument("--dtype", default="auto", help="the target's dtype (auto: as from_pretrained picks)")
    ap.add_argument("--head-dtype", default=None, help="the head's dtype (default: the target's)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--quantize", choices=("auto", *QUANTIZATIONS), default=None, help="the target's weights (default: dense)"
    )
    ap.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR", help="llama.cpp's build dir")
    ap.add_argument("--llama-draft-max", type=int, default=3, help="llama.cpp's EAGLE-3 chain length")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--head-trees", nargs="+", default=["1x1", "1x2", "1x3", "2x2", "2x3"])
    ap.add_argument("--draft-trees", nargs="+", default=["1x1", "1x2"])
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate()")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()

    device = resolve_device(None)
    dtype = resolve_dtype(args.dtype, device, "target")
    gguf = smollm2_gguf()
    tokenizer = load_tokenizer(gguf)
    target = load_runner(gguf, dtype, device, "native", args.compile, args.quantize)
    head_dtype = dtype if args.head_dtype is None else getattr(torch, args.head_dtype)
    head = load_head_runner(args.head, target, head_dtype, device)
    if head is None:
        raise SystemExit(f"no EAGLE-3 head in {args.head}")
    draft = load_runner(args.draft or pair("smollm2")[1], torch.float32, device, "native", args.compile)
    with_head = SpeculativeDecoder(target, head, tokenizer)
    with_draft = SpeculativeDecoder(target, draft, tokenizer)
    hf_model = None
    if not args.no_hf:
        from treespec.backends import hf

        hf_model = hf.load_model(checkpoint(gguf), dtype, device)
    prompts = [list(encode_prompt(chat, tokenizer)) for chat in heldout_chats(args.n_prompts)]
    llama = None
    if args.llama_cpp is not None:
        found = LlamaCpp.find(args.llama_cpp)
        work = RESULTS.parent / "work" / "head_bench"
        work.mkdir(parents=True, exist_ok=True)
        llama = LlamaCppBench(
            found, gguf, head_gguf=head_to_gguf(args.head, checkpoint(gguf), work, found.convert_script)
        )
    methods: dict[str, tuple] = {"plain": (with_head, None), "head auto": (with_head, TreeConfig())}
    methods.update({f"draft {t}": (with_draft, shape(t)) for t in args.draft_trees})
    methods.update({f"head {t}": (with_head, shape(t)) for t in args.head_trees})
    out = {
        "what": "SmolLM2-135M-Instruct: its feature head vs its independent draft vs plain decoding",
        "command": " ".join(sys.argv),
        "head": str(args.head),
        "draft": str(args.draft or pair("smollm2")[1]),
        "dtype": str(dtype),
        "head_dtype": str(head_dtype),
        "compile": args.compile,
        "quantize": target.quantize,
        "machine": machine_info("cpu"),
        "runs": {},
    }
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        outs = {name: [] for name in methods}
        secs = {name: [] for name in methods}
        hf_secs, hf_tokens = [], []
        llama_runs = {m: [] for m in (llama.methods if llama else [])}
        for dec, tree in methods.values():  # warm-up: every method once, untimed
            dec.generate(prompts[0], 16, tree=tree, sampling=sampling, seed=99)
        for i, prompt in enumerate(prompts):
            for name, (dec, tree) in methods.items():
                t0 = time.perf_counter()
                o = dec.generate(prompt, args.max_new_tokens, tree=tree, sampling=sampling, seed=i)
                secs[name].append(time.perf_counter() - t0)
                outs[name].append(o)
            if hf_model is not None:
                kw = (
                    {"do_sample": False}
                    if temperature == 0
                    else {"do_sample": True, "temperature": temperature}
                )
                t0 = time.perf_counter()
                with torch.no_grad():
                    g = hf_model.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=args.max_new_tokens,
                        top_k=None,
                        top_p=None,
                        **kw,
                    )
                hf_secs.append(time.perf_counter() - t0)
                hf_tokens.append(g.shape[1] - len(prompt))
            for m in llama_runs:
                text = tokenizer.decode(prompt, skip_special_tokens=False)
                llama_runs[m].append(
                    llama.run(m, text, args.max_new_tokens, temperature, i, args.llama_draft_max)
                )
            print(f"\rT={temperature} prompt {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
        run = {name: summarise(outs[name], secs[name]) for name in methods}
        if hf_secs:
            run["hf generate"] = {
                "tokens_per_second": round(statistics.median(t / s for t, s in zip(hf_tokens, hf_secs)), 2)
            }
        for m, rs in llama_runs.items():
            drafted = sum(r.drafted or 0 for r in rs)
            run[m] = {
                "tokens_per_second": round(statistics.median(r.tokens_per_second for r in rs), 2),
                "acceptance_rate": round(sum(r.accepted or 0 for r in rs) / drafted, 3) if drafted else None,
                "prompt_tokens_mismatch": sum(r.prompt_tokens != len(p) for r, p in zip(rs, prompts)),
            }
        plain = run["plain"]["tokens_per_second"]
        for r in run.values():
            r["vs_plain"] = round(r["tokens_per_second"] / plain, 3)
        out["runs"][f"T={temperature}"] = run
        print(f"\rT={temperature}", file=sys.stderr)
        for name, r in run.items():
            depth = r.get("acceptance_by_depth")
            print(
                f"  {name:12s} {r['tokens_per_second']:7.1f} tok/s ({r['vs_plain']:.2f}x plain)"
                + (f"  tau {r['tokens_per_step']}  acc {depth}  c {r['c']}" if depth else "")
            )
    write_results(f"head_bench_{args.tag}.json", out)


if __name__ == "__main__":
    main()
