#!/usr/bin/env python
"""Forward costs and tokens/s of Llama-3.2-1B/3B-*shaped* models with random weights.

    python experiments/costs/shaped_bench.py --shape llama-3.2-1b --dtype bfloat16 --device cpu
    python experiments/costs/shaped_bench.py --shape llama-3.2-3b --dtype bfloat16 --device cuda    # on a GPU

No download: the model is `LlamaForCausalLM(config)` with the real dimensions (vocabulary,
hidden size, layers, GQA heads, llama3 RoPE, tied embeddings) and random weights. So what
it measures is the engine at the real sizes, not a pair's acceptance:

- forward costs through each backend's runner (synchronised on CUDA): t(n) for a tree of n
  nodes over a `--prefix`-token prefix, t(n)/t(1), and the floor (weight bytes / measured
  copy bandwidth) as a fraction of t(1);
- tokens/s, in one process, interleaved, medians: HF `generate()` plain and assisted, and
  treespec autoregressive / linear / tree on both backends, with the target as its own draft
  (alpha = 1 at T = 0: every draft token is accepted, so tokens/step is depth + 1 and the
  numbers are the ceiling of what speculation can gain at these sizes, draft cost included).

Writes experiments/results/shaped_{shape}_{device}_{dtype}.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/common.py
from common import machine_info  # noqa: E402

from treespec import SamplingConfig, TreeConfig
from treespec.backends.hf import HFRunner, quiet_transformers
from treespec.backends.native import NativeRunner
from treespec.bench.harness import run_bench
from treespec.bench.measure import forward_seconds, memory_bandwidth
from treespec.bench.results import result_table

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {  # the published configs' dimensions
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128),
}


def random_llama(shape: str, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, bos_token_id=128000,
                         eos_token_id=[128001, 128008, 128009], attn_implementation="sdpa", **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nodes", default="1,4,16,64", help="tree sizes whose forward cost is measured")
    ap.add_argument("--prefix", type=int, default=128, help="committed tokens before the measured forwards")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--methods", default="hf,hf-assisted,autoregressive,linear,tree")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    quiet_transformers()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out = args.out or Path(f"experiments/results/shaped_{args.shape}_{device.type}_{args.dtype}.json")

    model = random_llama(args.shape, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = memory_bandwidth(device)
    floor = weight_bytes / bandwidth
    print(f"{args.shape}: {weight_bytes / 2**30:.2f} GiB of {args.dtype} weights on {device}; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, floor {floor * 1e3:.2f} ms per forward", file=sys.stderr)

    # 1. forward costs through each backend's runner
    nodes = [int(n) for n in args.nodes.split(",")]
    costs = {}
    for name, make in (("native", lambda: NativeRunner.from_hf(model)), ("hf", lambda: HFRunner(model))):
        runner = make()
        t = {n: forward_seconds(runner, n, prefix_len=args.prefix, repeats=10) for n in nodes}
        costs[name] = {f"t({n})_ms": t[n] * 1e3 for n in nodes}
        costs[name].update({f"t({n})/t(1)": t[n] / t[nodes[0]] for n in nodes[1:]})
        costs[name]["floor/t(1)"] = floor / t[nodes[0]]
        print(f"cost [{name}]: " + ", ".join(f"{k}={v:.3g}" for k, v in costs[name].items()), file=sys.stderr)
        del runner

    # 2. tokens/s with the target as its own draft (alpha = 1 at T = 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (args.prompt_len,), generator=g).tolist() for _ in range(args.n_prompts)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    result = run_bench(model, model, None, prompts, args.max_new_tokens, TreeConfig(args.width, args.depth),
                       SamplingConfig(temperature=0.0), args.repeats, methods)
    print(result_table(result))
    report = result.to_json()
    report["config"] = {**vars(args), "out": str(out), "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth,
                        **machine_info(device), "draft": "the target itself (alpha = 1 at T = 0)"}
    report["forward_costs"] = costs
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
