"""Shared by the tests on real (tiny, float64) Llamas: prompts, the greedy-parity pair, HF's
greedy reference, and the check that a runner's cache equals a fresh prefill."""

from __future__ import annotations

import pytest
import torch

from treespec import SamplingConfig
from treespec.backends.hf import HFRunner
from treespec.backends.native import NativeRunner

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
