"""Llama-architecture checkpoints as the native backend reads them: config and weights.

    unsupported_reason(config)   why the native forward cannot run a model (None: it can)
    LlamaShape.from_config       the numbers the forward needs, from config.json or an HF config
    read_checkpoint(dir)         shape, weights and EOS ids of a local safetensors checkpoint

No transformers import: a local checkpoint loads without building the HF model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
BLOCKS_FILE = "blocks.safetensors"  # int4 blocks beside the float weights (`loading.gguf`)


def _as_dict(config) -> dict:
    """An HF config object or a parsed config.json, as a plain dict."""
    return dict(config) if isinstance(config, dict) else config.to_dict()


def _rope(cfg: dict) -> dict:
    """RoPE settings as one flat dict with rope_type and rope_theta, from transformers 5.x
    `rope_parameters` or the older top-level `rope_theta` + `rope_scaling`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def unsupported_reason(config) -> str | None:
    """Why the native backend cannot run this model (one line), or None if it can.

    `config`: an HF config object or the dict of a config.json."""
    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if cfg.get("quantization_config"):
        return "quantized checkpoints are not supported"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"activation {cfg.get('hidden_act')!r} (only silu)"
    if cfg.get("mlp_bias"):
        return "mlp_bias=True"
    if model_type == "mistral" and cfg.get("sliding_window") is not None:
        return "sliding-window attention"
    if model_type == "qwen2" and (
        cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or ())
    ):
        return "sliding-window attention"
    raw = cfg.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in raw.values()):
        return "per-layer-type RoPE parameters"
    rope = _rope(cfg)
    if rope["rope_type"] not in ("default", "llama3"):
        return f"rope_type {rope['rope_type']!r} (only default and llama3)"
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) not in (None, 1, 1.0):
        return "partial rotary embeddings"
    if rope["rope_type"] == "llama3":
        missing = {"factor", "low_freq_factor", "high_freq_factor"} - set(rope)
        if missing:
            return f"llama3 rope_parameters lack {sorted(missing)}"
    return None


@dataclass(frozen=True)
class LlamaShape:
    """The numbers the forward needs, read from a config (defaults as in LlamaConfig)."""

    vocab: int
    hidden: int
    layers: int
    heads: int  # query heads, Hq
    kv_heads: int  # Hkv (GQA when < Hq)
    head_dim: int  # D
    intermediate: int  # I
    eps: float
    max_positions: int | None
    tied: bool  # lm_head is the embedding matrix
    qkv_bias: bool
    o_bias: bool
    rope: dict  # rope_type, rope_theta and the llama3 parameters

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        reason = unsupported_reason(config)
        if reason:
            raise ValueError(f"the native backend cannot run this model: {reason}")
        cfg = _as_dict(config)
        heads = int(cfg["num_attention_heads"])
        qwen2 = cfg["model_type"] == "qwen2"
        bias = bool(cfg.get("attention_bias", False))  # llama: q, k, v and o; qwen2: q, k, v always
        rope = _rope(cfg)
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        return cls(
            vocab=int(cfg["vocab_size"]),
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate=int(cfg["intermediate_size"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_positions=cfg.get("max_position_embeddings"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            rope=rope,
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [D/2], float32, computed exactly as transformers does."""
        D, rope = self.head_dim, self.rope
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        if rope["rope_type"] == "llama3":  # transformers' _compute_llama3_parameters
            factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
            old_context_len = rope["original_max_position_embeddings"]
            low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
            wavelen = 2 * math.pi / inv_freq
            inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_context_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
            is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
        return inv_freq


def eos_ids(value) -> frozenset[int]:
    """An `eos_token_id` as configs spell it (None, an int or a list) as a set of ids."""
    if value is None:
        return frozenset()
    return frozenset(int(e) for e in ([value] if isinstance(value, int) else value))


def read_checkpoint(path, lazy: bool = False) -> tuple[LlamaShape, dict[str, torch.Tensor], frozenset[int]]:
    """Shape, weights (on the CPU, as stored) and EOS ids of the checkpoint in directory
    `path`: config.json, model.safetensors or a sharded model.safetensors.index.json, and
    generation_config.json's EOS where present (else config.json's); a GGUF conversion's int4
    blocks (blocks.safetensors: `<weight name>.q4`, `.q4_scales`, `.q4_zeros`) join the
    weights. `lazy`: each weight a safetensors slice instead of a tensor, read from the file
    when indexed (`w[a:b]`, `w[:, a:b]`, `w[:]`): a tensor-parallel rank reads only its blocks."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"no model directory at {str(path)!r}")
    cfg = read_json(root / "config.json")
    shape = LlamaShape.from_config(cfg)
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        files = [root / f for f in sorted(set(read_json(index).get("weight_map", {}).values()))]
    else:
        raise ValueError(f"no model.safetensors (or model.safetensors.index.json) in {root}")
    if (root / BLOCKS_FILE).is_file():  # a GGUF conversion's 4-bit blocks (quantize="int4" reads them)
        files.append(root / BLOCKS_FILE)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            if lazy:
                handle = safe_open(str(f), framework="pt", device="cpu")
                weights.update({name: handle.get_slice(name) for name in handle.keys()})
            else:
                weights.update(load_file(str(f), device="cpu"))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for corrupt files
            raise ValueError(f"cannot read weights from {f}: {e}") from e
    if shape.tied and "model.embed_tokens.weight" not in weights and "lm_head.weight" in weights:
        weights["model.embed_tokens.weight"] = weights["lm_head.weight"]  # tied, saved as the head
    eos = None
    if (root / "generation_config.json").is_file():
        eos = read_json(root / "generation_config.json").get("eos_token_id")
    return shape, weights, eos_ids(cfg.get("eos_token_id") if eos is None else eos)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"no {path.name} in {path.parent}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
