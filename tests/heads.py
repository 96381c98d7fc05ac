"""Random EAGLE-3 feature heads for tiny HF Llamas (`random_head`: a config and tensors;
`head_runner`: those as a float64 `HeadRunner`), for the head's tests and the engine's."""

from __future__ import annotations

import math

import torch

from treespec.backends.head import HeadConfig, HeadRunner, default_taps, head_weight_shapes


def random_head(target, taps=None, draft_vocab=None, seed=0, scale=0.3):
    """An EAGLE-3 config and tensors for `target` (an HF Llama): random weights, its draft
    rows a random subset of the target's ids (or all of them)."""
    c = target.config
    H, V = c.hidden_size, c.vocab_size
    taps = default_taps(c.num_hidden_layers) if taps is None else tuple(taps)
    cfg = HeadConfig(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=H // 4,
        intermediate_size=2 * H,
        vocab_size=V,
        draft_vocab_size=draft_vocab or V,
        target_hidden_size=H,
        taps=taps,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=512,
    )
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in head_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif name not in ("d2t", "t2d"):
            weights[name] = (
                scale * torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1]) * 4
            )
    ids = torch.randperm(V, generator=g)[: cfg.draft_vocab_size].sort().values
    weights["d2t"] = ids - torch.arange(cfg.draft_vocab_size)
    weights["t2d"] = torch.zeros(V, dtype=torch.bool)
    weights["t2d"][ids] = True
    return cfg, weights


def head_runner(target, cfg, weights):
    return HeadRunner(cfg, weights, target.model.embed_tokens.weight.detach(), dtype=torch.float64)
