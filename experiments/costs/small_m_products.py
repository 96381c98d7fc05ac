"""Small-M products on this CPU (issue 58): does a product's cost stay flat as the number of rows
M (tree nodes scored at once) grows?

For the product shapes of the default target (SmolLM2-135M: qkv 576->960, gate_up 576->3072,
down 1536->576, output 576->49152) and M in 1, 2, 4, 8, 16, 32: microseconds (median of many
runs, 2 threads) and t(M)/t(1) for torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16
activations, group 32), its weight-only int8 (`_weight_int8pack_mm`, bf16), torch's int8 x int8
`_int_mm`, treespec's q4q8 kernel (treespec/backends/kernels) on every path this CPU runs, and
its bf16 tile kernels for the int4 and int8 matrices (`kernels.bf16`, AVX512-BF16 cores). `forward` is every product of one
target forward in turn (30 layers of qkv, o 576->576, gate_up, down, each layer its own weights,
so they stream from memory as in a real forward; then the output): the products' share of
t(M)/t(1) for the whole model. Writes results/small_m_products.json.

    python experiments/costs/small_m_products.py [--threads 2] [--ms 300] [--ms-large 1500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import machine_info, write_results  # noqa: E402

from treespec.backends import kernels  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "output": (49152, 576)}  # (N, K)
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS = 30
MS = (1, 2, 4, 8, 16, 32)


def median_us(fn, budget_s: float, clock=time.perf_counter, min_runs: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < budget_s:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) >= 5000:
            break
    return statistics.median(times) * 1e6


def formats(n: int, k: int, isas: list[str], seed: int) -> dict:
    """One weight [n, k] in every format: name -> a function of x [M, k] float32."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    packed = kernels.quantize_q4_1(w)
    q, d, m = packed.unpack()
    # torch int4: w = (q - 8) s + z per group: s = d, z = m + 8 d; bf16 activations
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([d.float().t(), (m.float() + 8 * d.float()).t()], dim=-1).to(torch.bfloat16).contiguous()
    s8 = w.abs().amax(dim=1) / 127
    w8 = (w / s8[:, None]).round().to(torch.int8)  # [N, K]
    out = {
        "torch_int4pack": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, 32, sz),
        "torch_int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, s8.to(torch.bfloat16)),
        "torch_int_mm": lambda x: torch._int_mm(x, w8.t()),
    }
    if kernels.bf16.available():
        tiles4 = kernels.bf16.pack_q4s(q, d.float(), m.float() + 8 * d.float())
        tiles8 = kernels.bf16.pack_q8s(w8, s8)
        out["q4bf16"] = lambda x: torch.ops.treespec.q4bf16_linear(x, tiles4, None, n)
        out["q8bf16"] = lambda x: torch.ops.treespec.q8bf16_linear(x, tiles8, None, n)
    for isa in isas:
        out[f"q4q8_{isa}"] = partial(kernels.q4q8_linear, packed=packed, isa=isa)
    return out


def input_for(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "torch_int_mm":
        return (x * 20).round().clamp(-127, 127).to(torch.int8)
    if name in ("torch_int4pack", "torch_int8pack", "q4bf16", "q8bf16"):
        return x.to(torch.bfloat16)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", type=float, default=300, help="timing budget per (kernel, shape, M), ms")
    ap.add_argument("--ms-large", type=float, default=1500, help="the budget for output and forward, ms")
    ap.add_argument("--shapes", default=",".join([*SHAPES, "forward"]))
    ap.add_argument("--out", default="small_m_products.json")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time (with --threads 1): indicative numbers on a busy machine",
    )
    ap.add_argument("--scalar", action="store_true", help="the scalar path in output, forward too (slow)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    print(kernels.describe())
    isas = [i for i in kernels.available_isas() if i != kernels.ATEN]
    rows = []
    for shape in args.shapes.split(","):
        budget = (args.ms_large if shape in ("output", "forward") else args.ms) / 1000
        if shape == "forward":
            layers = [formats(n, k, isas, seed=i) for i, (n, k) in enumerate(LAYER * LAYERS)]
            layers.append(formats(*SHAPES["output"], isas, seed=len(layers)))
            ks = [k for _, k in LAYER * LAYERS] + [SHAPES["output"][1]]

            def forward(x, name, layers=layers, ks=ks):
                for fns, k in zip(layers, ks):
                    fns[name](x[k])

            names = [name for name in layers[0] if args.scalar or name != "q4q8_scalar"]
            products = {name: partial(forward, name=name) for name in names}
        else:
            n, k = SHAPES[shape]
            products = formats(n, k, isas, seed=0)
            if shape == "output" and not args.scalar:
                products.pop("q4q8_scalar", None)
        for name, fn in products.items():
            times = {}
            for mm in MS:
                if shape == "forward":
                    xin = {k: input_for(name, torch.randn(mm, k)) for k in (576, 1536)}
                else:
                    xin = input_for(name, torch.randn(mm, SHAPES[shape][1]))
                with torch.inference_mode():
                    times[mm] = median_us(partial(fn, xin), budget, clock)
            rows.append(
                {
                    "shape": shape,
                    "kernel": name,
                    "us": {str(mm): round(t, 1) for mm, t in times.items()},
                    "ratio": {str(mm): round(t / times[1], 2) for mm, t in times.items()},
                }
            )
            us = " ".join(f"{times[mm]:8.0f}" for mm in MS)
            ratio = " ".join(f"{times[mm] / times[1]:5.2f}" for mm in MS)
            print(f"{shape:8s} {name:18s} us {us}   t(M)/t(1) {ratio}", flush=True)
        if shape == "forward":
            del layers, products
    write_results(
        args.out,
        {
            "machine": machine_info(),
            "clock": "thread CPU time" if args.cpu_time else "wall",
            "kernel": kernels.describe(),
            "m": list(MS),
            "note": "median microseconds; q4q8 includes quantizing x per row; forward: all products of "
            "SmolLM2-135M (30 x qkv, o, gate_up, down with their own weights, then the output)",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
