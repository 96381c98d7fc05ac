"""Writing GGUF files as llama.cpp does, for the tests of the GGUF reader and of the 4-bit
paths: `write_gguf` (a tiny HF Llama as a GGUF file of any weight type, its model then given
the dequantised weights) and `tiny` (such a Llama)."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from transformers import LlamaForCausalLM

from .conftest import tiny_llama

Q = gguf.GGMLQuantizationType
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# byte-level BPE over 96 ids: 2 specials, the 93 characters '!'..'}', and one merge
TOKENS = ["<|im_start|>", "<|im_end|>", *map(chr, range(33, 126)), "ab"]
LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# byte offsets of the float16 scales (d, dmin) in one block of a K-quant
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


# ---- writing GGUF files like llama.cpp -------------------------------------------------------
def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's reordering of attn_q / attn_k rows (per head: halves -> pairs)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)


def random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant (gguf cannot quantise those) with small float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(4e-4 if qtype != Q.Q6_K else 5e-5).tobytes(), np.uint8)
    for offset in K_SCALES[qtype]:
        data[..., offset : offset + 2] = scale
    return data.reshape(rows, -1)


def encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, object, np.ndarray]:
    """(stored array, its type, its dequantised float32 values); 1-D tensors and rows that do
    not fill whole blocks stay F32, as llama.cpp keeps them."""
    block = GGML_QUANT_SIZES[qtype][0]
    if w.ndim == 1 or qtype == Q.F32 or w.shape[-1] % block:
        return w, Q.F32, w
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16, w.astype(np.float16).astype(np.float32)
    data = random_kquant(*w.shape, qtype, rng) if qtype in K_SCALES else gguf.quants.quantize(w, qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype)


def write_gguf(model: LlamaForCausalLM, path, qtype=Q.F32, tokenizer=True, tensors=None, **metadata) -> None:
    """Write `model` as a llama.cpp GGUF file of weight type `qtype` (plus `tensors`, and
    `metadata` through the writer's add_<key> methods), then give `model` the dequantised
    weights, so that it is the reference the converted model must reproduce."""
    c, rng = model.config, np.random.default_rng(0)
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(TOKENS)
        w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
        w.add_token_merges(["a b"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_chat_template(CHATML)
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)
    for name, data in (tensors or {}).items():
        w.add_tensor(name, data)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    if not c.tie_word_embeddings:
        names["lm_head"] = "output"
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in LAYER.items()}
    dequantised = {}
    state = model.state_dict()
    for hf, gg in names.items():
        data, dtype, dequantised[hf + ".weight"] = encode(state[hf + ".weight"].float().numpy(), qtype, rng)
        kind = gg.split(".")[-1]
        w.add_tensor(f"{gg}.weight", permute(data, heads[kind]) if kind in heads else data, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in dequantised.items()}, strict=False)


def tiny(seed=0, hidden=64, heads=4, kv_heads=2, tied=False) -> LlamaForCausalLM:
    model = tiny_llama(seed, hidden=hidden, heads=heads, kv_heads=kv_heads, dtype=torch.float32)
    model.config.tie_word_embeddings = tied
    if tied:
        model.tie_weights()
    return model
