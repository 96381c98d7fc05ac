"""A lean Llama forward over a static KV cache (gpt-fast style): the native backend.

Serves what `LlamaForCausalLM`, `Qwen2ForCausalLM` and `MistralForCausalLM` (without a
sliding window) load: GQA, any head_dim, tied or untied embeddings, default or llama3 RoPE,
q/k/v(/o) biases; a handful of tensor ops per layer and no module stack. Weights come from an
HF model (`NativeRunner.from_hf`) or straight from a local safetensors checkpoint
(`NativeRunner.from_pretrained`, no transformers import). Anything else is refused by
`checkpoint.unsupported_reason(config)`, so callers fall back to the HF runner instead of
getting a wrong answer.

    model.py     the math: a layer's weights, RMSNorm, RoPE, the layer loop (`decoder_stack`)
    kv.py        the static KV cache written by slot index (`KVPool`) and its RoPE tables
    weights.py   a checkpoint's tensors in the native layout, fused, packed or quantized
    sharding.py  tensor parallel: which block of the heads and the MLP a rank holds
    runner.py    `NativeRunner`: the model and its cache behind the `Runner` seam
    compile.py   the forward as inductor graphs (`ForwardGraph`, `CompiledForward`)
    aot.py       those graphs compiled ahead of time and kept across processes (`GraphStore`)

A layer is: RMSNorm, the fused q/k/v projection, RoPE once over all of its output (v heads
untouched), attention (`attention.LaneAttention` / `PackedAttention`: k and v into the cache
with one copy, SDPA over the lane's row), the o projection and the residual, RMSNorm, the fused
gate/up projection, SiLU gate, the down projection and the residual.
"""

from .compile import (
    COMPILE_MAX_TOKENS,
    COMPILE_STATIC_MAX,
    CompiledForward,
    ForwardGraph,
    compile_unsupported_reason,
)
from .kv import KVPool
from .model import Layer, decoder_stack, rms_norm, rope_rows, rotate
from .runner import NativeRunner, split_scores

__all__ = [
    "COMPILE_MAX_TOKENS",
    "COMPILE_STATIC_MAX",
    "CompiledForward",
    "ForwardGraph",
    "KVPool",
    "Layer",
    "NativeRunner",
    "compile_unsupported_reason",
    "decoder_stack",
    "rms_norm",
    "rope_rows",
    "rotate",
    "split_scores",
]
