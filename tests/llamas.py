"""Shared by the tests on real (tiny) Llamas: prompts, the greedy-parity pair, HF's greedy
reference, the check that a runner's cache equals a fresh prefill, random tiny HF models of each
supported variant (`build`), random trees, and the cheap compiled runner."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from treespec import SamplingConfig
from treespec.backends.hf import HFRunner
from treespec.backends.native import CompiledForward, NativeRunner
from treespec.tree import TokenTree

from .conftest import VOCAB, perturbed, tiny_llama

GREEDY = SamplingConfig(temperature=0)


PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(1 + (i * 5) % 13)] for i in range(10)]


@pytest.fixture(scope="module", params=["llama", "llama32-shaped"])
def pair(request):
    if request.param == "llama":
        target = tiny_llama(0)
    else:
        target = tiny_llama(2, hidden=48, heads=6, kv_heads=2, layers=3, llama32=True)
    return target, perturbed(target, noise=0.3, seed=1)


def hf_greedy(model, prompt, n, stop_at_eos=True):
    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def tol(model) -> float:
    # HF's eager attention takes its softmax in float32 even for float64 models
    return 1e-6 if model.config._attn_implementation == "eager" else 1e-9


def committed_kv(runner) -> list[torch.Tensor]:
    """Keys and values of the committed slots, per layer ([B, Hkv, C, D] each)."""
    c = runner.n_committed
    if isinstance(runner, NativeRunner):
        assert runner.filled == c
        return [runner.kv[layer, kv, ..., :c, :] for layer in range(runner.kv.shape[0]) for kv in (0, 1)]
    assert runner.cache.get_seq_length() == c
    return [t for layer in runner.cache.layers for t in (layer.keys, layer.values)]


def assert_cache_equals_prefill(runner, model) -> None:
    fresh = type(runner).from_hf(model) if isinstance(runner, NativeRunner) else HFRunner(model)
    fresh.prefill(runner.committed)
    for got, want in zip(committed_kv(runner), committed_kv(fresh), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=tol(model) / 10)


def record_feeds(monkeypatch) -> list[int]:
    """From now on (until `monkeypatch.undo()`), every runner's feed of every forward appends its
    token count to the returned list, in the order the forwards run."""
    import treespec.backends.base as base

    fed: list[int] = []
    run = base._run

    def counting(runners, feeds, need_logits):
        fed.extend(len(f.tokens) for f in feeds)
        return run(runners, feeds, need_logits)

    monkeypatch.setattr(base, "_run", counting)
    return fed


# ---- random tiny models of every supported variant, trees, the compiled runner ----------------
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so test positions reach the scaled band
}
VARIANTS = {
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_parameters=LLAMA3_ROPE),
    "head_dim_16": dict(head_dim=16),  # != hidden / heads = 8
    "attention_bias": dict(attention_bias=True),  # llama: q, k, v and o biases
    "qwen2_bias": dict(model_type="qwen2"),  # q, k, v biases, no o bias
    "mistral": dict(model_type="mistral", sliding_window=None),
}


CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def build(variant: str, dtype=torch.float32, seed: int = 0, max_positions: int = 512, **overrides):
    """A random tiny Llama (or Qwen2, Mistral) with every parameter, biases included, nonzero."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=[1, 2],
        attn_implementation="sdpa",
    )
    kw.update(VARIANTS[variant])
    kw.update(overrides)
    config_cls, model_cls = CLASSES[kw.pop("model_type", "llama")]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # zeros / ones at init: make them matter
                p.add_(torch.randn_like(p) * 0.1)
        model.model.embed_tokens.weight.mul_(4.0)  # sharper distributions than the random init
    return model.to(dtype)


def random_tree(rng: random.Random, size: int) -> TokenTree:
    return TokenTree(
        [rng.randrange(VOCAB) for _ in range(size)], [-1] + [rng.randrange(i) for i in range(1, size)]
    )


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return (a.double() - b.double()).abs().max().item()


# Compiling takes tens of seconds even for a 2-layer model: tests compile small models with
# inductor's cheapest settings.
CHEAP = {"freezing": True}  # no max-autotune: inductor's default products, the same graph otherwise


def compiled_runner(model, config=None, **kw):
    runner = NativeRunner.from_hf(model, compile=True, **kw)
    assert runner.compiled is not None
    if config is not None:
        runner.compiled = CompiledForward(runner, config)
    return runner
