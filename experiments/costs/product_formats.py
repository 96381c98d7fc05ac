#!/usr/bin/env python
"""One product per weight format and compute dtype, as the native backend multiplies, on this core.

    python experiments/costs/product_formats.py --tag zen5
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python experiments/costs/product_formats.py --tag zen5_as_avx2

The second line runs torch as on an AVX2-only core (its kernels dispatched at AVX2, oneDNN
capped there, so no packed bf16): what the tests' AVX2 emulation does (docs/testing.md).

For each of SmolLM2-135M's product shapes (q/k/v 576 -> 960, the MLP's 576 -> 3072 and
1536 -> 576, the output layer 576 -> 49152) and each row count, the median microseconds of
one product over `--copies` distinct weights in turn (as a forward reads its layers' weights
from memory; one weight left in the cache would flatter the formats with more bytes), for:
dense fp32 and bf16 (`linear.Projection`: packed where oneDNN serves the dtype, else laid out
as the backend lays it), bf16 in the layout the backend used before (W^T [in, out]), int4
(`linear.Int4Projection`) and int8 (`linear.QuantizedProjection`) computing in bf16 and in
fp32. Random weights: the kernels' speed does not depend on the values. Writes
results/product_formats_<tag>.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import machine_info, write_results  # noqa: E402

from treespec.backends.linear import Int4Projection, Projection, QuantizedProjection

SHAPES = {
    "qkv 576->960": (576, 960),
    "gate_up 576->3072": (576, 3072),
    "down 1536->576": (1536, 576),
    "output 576->49152": (576, 49152),
}


def formats(weight: torch.Tensor) -> dict:
    """name -> (a product, the dtype it takes x in)."""
    bf16 = weight.bfloat16()
    old = copy.copy(Projection(bf16))
    if old.packed is None:  # unpacked bf16 as the backend laid it before: W^T contiguous [in, out]
        old.weight_t = bf16.t().contiguous()
    return {
        "fp32 dense": (Projection(weight), torch.float32),
        "bf16 dense": (Projection(bf16), torch.bfloat16),
        "bf16 dense [in, out]": (old, torch.bfloat16),
        "int4 bf16": (Int4Projection.quantize(bf16), torch.bfloat16),
        "int8 bf16": (QuantizedProjection(bf16), torch.bfloat16),
        "int4 fp32": (Int4Projection.quantize(weight), torch.float32),
        "int8 fp32": (QuantizedProjection(weight), torch.float32),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16", help="comma-separated row counts")
    ap.add_argument("--copies", type=int, default=8, help="distinct weights per shape (the output layer: 2)")
    ap.add_argument("--calls", type=int, default=9, help="timed sweeps over the copies; the median is kept")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    table = {}
    for shape, (k, n) in SHAPES.items():
        copies = 2 if n > 10_000 else args.copies
        per_copy = [formats(torch.randn(n, k, generator=g) / k**0.5) for _ in range(copies)]
        for name in per_copy[0]:
            dtype = per_copy[0][name][1]
            for r in rows:
                x = torch.randn(r, k, generator=g).to(dtype)
                products = [c[name][0] for c in per_copy]
                times = []
                for i in range(args.calls + 1):  # one warm-up sweep
                    t0 = time.perf_counter()
                    for p in products:
                        p(x)
                    if i:
                        times.append((time.perf_counter() - t0) / len(products))
                table.setdefault(shape, {}).setdefault(name, {})[r] = round(1e6 * statistics.median(times), 1)
            print(shape, name, table[shape][name], flush=True)
    out = {
        "what": "one product per weight format, microseconds, medians over distinct weights",
        "capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "machine": machine_info("cpu"),
        "us": table,
    }
    write_results(f"product_formats_{args.tag}.json", out)


if __name__ == "__main__":
    main()
