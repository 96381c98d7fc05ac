"""Tiny random Llamas built in-process (no downloads), shared by the integration tests."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96

# Tiny models: threads only add synchronisation cost (8x slower on 2 busy cores).
torch.set_num_threads(1)

# Run as on an AVX2 core (tests/test_cpu_kinds.py, docs/testing.md): inductor vectorises for
# the real CPU unless told, and its AVX512 code beside torch's AVX2 kernels is no CPU's mix.
if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 256

# Tests that load "the default pair" (CLI runs without --pair, from_pretrained() with no
# models) use the small pycode pair; test_bundled.py checks the real default on its own.
os.environ.setdefault("TREESPEC_PAIR", "pycode")
# Compiled graphs the machine keeps would make `compile="auto"` (the default) run them: tests
# see an empty store of their own unless told otherwise (tests/test_aot.py builds in tmp dirs).
os.environ.setdefault("TREESPEC_GRAPHS", tempfile.mkdtemp(prefix="treespec-graphs-"))


def tiny_llama(
    seed: int,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = VOCAB,
    dtype: torch.dtype = torch.float64,
    attn: str = "sdpa",
    llama32: bool = False,
    max_positions: int = 512,
) -> LlamaForCausalLM:
    """A random LlamaForCausalLM; `llama32=True` shapes it like Llama-3.2 (GQA, tied
    embeddings, llama3 rope scaling with theta 500k)."""
    torch.manual_seed(seed)
    extra = {}
    if llama32:
        extra = dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation=attn,
        **extra,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    # sharper, more structured distributions than the near-uniform random init
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not llama32 else model.model.embed_tokens.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def target64():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft64():
    return tiny_llama(seed=1, hidden=16, layers=1, heads=2, kv_heads=1)


def perturbed(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with `model` often but not always: its weights plus Gaussian noise."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std())
    return draft


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `treespec serve` of the pycode pair in float32, one per test module that asks (a
    module with servers of its own defines its own `server`)."""
    from .servers import start_server

    yield from start_server(tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's `server`."""
    from .servers import openai_client

    with openai_client(server) as c:
        yield c
