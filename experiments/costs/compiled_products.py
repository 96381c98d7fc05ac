#!/usr/bin/env python
"""Which products a compiled graph should get: the same weights compiled with max-autotune
(`CompiledForward.AUTOTUNED`) and without (`PACKED`), beside the eager forward.

    python experiments/costs/compiled_products.py --quantize int4            # SmolLM2 from its GGUF
    python experiments/costs/compiled_products.py --quantize none --dtype bfloat16
    python experiments/costs/compiled_products.py --model treespec/zoo/pycode/target --quantize none

Every variant gets a static graph per feed size (as float32 and int8 weights do), so the
products alone differ. One process; the variants and sizes interleaved, medians of `--rounds`
rounds of 20 forwards after a 128-token prefix (`native_overhead.forward_ms`), in ms. The
table of docs/performance.md ("Which products a compiled graph gets") came from these runs;
`CompiledForward.products` holds the choice.

The row "products" is the floor the forwards are compared with: the eager runner's products
alone (every layer's q/k/v, o, gate/up and down, then the output layer, each a [n, in] input
through its `Projection` in the forward's order, the weights streamed from memory as in a
forward), nothing else of the forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from native_overhead import forward_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import machine_info  # noqa: E402

from treespec.backends.native import COMPILE_STATIC_MAX, CompiledForward, NativeRunner
from treespec.config import QUANTIZATIONS


def products_ms(runner: NativeRunner, n: int, repeats: int) -> float:
    """Median ms of a forward's products alone for n rows: each projection of each layer, then
    the output layer, in order (see the module docstring)."""
    projections = [p for layer in runner.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    projections.append(runner.lm_head)
    inputs = {p.in_features: torch.randn(n, p.in_features, dtype=runner.dtype) for p in projections}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):  # two warm-up calls
            t0 = time.perf_counter()
            for p in projections:
                p(inputs[p.in_features])
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a native model directory (default: SmolLM2's GGUF)")
    ap.add_argument("--quantize", choices=("none", *QUANTIZATIONS), default="none")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--sizes", default="1,4", help="comma-separated feed sizes (each <= 8)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.model is None:
        from treespec.loading.gguf import convert, smollm2_gguf

        args.model = str(convert(smollm2_gguf()))
    quantize, dtype = None if args.quantize == "none" else args.quantize, getattr(torch, args.dtype)

    def runner(config: dict | None) -> NativeRunner:
        compile = config is not None
        r = NativeRunner.from_pretrained(args.model, dtype=dtype, compile=compile, quantize=quantize)
        if compile:
            r.compiled = CompiledForward(r, config)
            r.compiled.static_max = COMPILE_STATIC_MAX  # a graph per size: only the products differ
        return r

    runners = {
        "autotuned": runner(CompiledForward.AUTOTUNED),
        "untuned": runner(CompiledForward.PACKED),
        "eager": runner(None),
    }
    compile_s = {}
    for name, r in runners.items():
        for n in sizes:  # the first call of each graph compiles it
            t0 = time.perf_counter()
            forward_ms(r, n, time.perf_counter, repeats=1)
            compile_s[f"{name} n={n}"] = round(time.perf_counter() - t0, 1)
    times = {name: {n: [] for n in sizes} for name in (*runners, "products")}
    for _ in range(args.rounds):
        for n in sizes:
            for name, r in runners.items():
                times[name][n].append(forward_ms(r, n, time.perf_counter, repeats=20))
            times["products"][n].append(products_ms(runners["eager"], n, repeats=20))
    medians = {name: {n: round(statistics.median(t), 3) for n, t in d.items()} for name, d in times.items()}
    for name, d in medians.items():
        print(f"{name:9s} " + "  ".join(f"t({n}) {ms:.2f} ms" for n, ms in d.items()))
    result = {"config": vars(args), "machine": machine_info("cpu"), "compile_s": compile_s, "ms": medians}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
