"""HFRunner: the tree forward equals sequential decoding, and compaction keeps the cache exact."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec import HFRunner, SamplingConfig, SpeculativeDecoder, TokenTree, TreeConfig

from .conftest import VOCAB, tiny_llama
from .test_tree import trees

PREFIX = [3, 17, 42, 8, 25, 60, 11]

MODELS = {
    "llama-sdpa": lambda: tiny_llama(0),
    "llama-eager": lambda: tiny_llama(0, attn="eager"),
    "llama32-shaped": lambda: tiny_llama(2, llama32=True),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def tol(model) -> float:
    # HF's eager attention takes its softmax in float32 even for float64 models
    return 1e-6 if model.config._attn_implementation == "eager" else 1e-9


def sequential_logits(model, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after `tokens`, from a plain full forward with no cache."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def feed_tree(runner: HFRunner, tree: TokenTree) -> torch.Tensor:
    base = runner.n_slots
    return runner.forward(tree.tokens, [-1] + [base + p for p in tree.parents[1:]])


def assert_cache_equals_prefill(runner: HFRunner, model) -> None:
    fresh = HFRunner(model)
    fresh.prefill(runner.committed)
    assert runner.cache.get_seq_length() == len(runner.committed)
    for got, want in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=tol(model) / 10)
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=tol(model) / 10)


def test_tree_logits_equal_each_path_run_sequentially(model):
    tree = TokenTree.from_choices(5, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]], [[9, 4, 77], [30, 2], [51]])
    runner = HFRunner(model)
    runner.prefill(PREFIX)
    logits = feed_tree(runner, tree)
    for i in range(len(tree)):
        path_tokens = [tree.tokens[n] for n in tree.path_to(i)]
        torch.testing.assert_close(logits[i], sequential_logits(model, PREFIX + path_tokens), rtol=0, atol=tol(model))


def test_tree_built_over_two_forwards(model):
    """Level-by-level drafting feeds a tree in several calls; later nodes see earlier pending ones."""
    runner = HFRunner(model)
    runner.prefill(PREFIX)
    base = runner.n_slots
    root = runner.forward([5], [-1])
    kids = runner.forward([9, 4], [base, base])
    grandkids = runner.forward([30, 31, 2], [base + 1, base + 1, base + 2])
    torch.testing.assert_close(root[0], sequential_logits(model, PREFIX + [5]), rtol=0, atol=tol(model))
    torch.testing.assert_close(kids[1], sequential_logits(model, PREFIX + [5, 4]), rtol=0, atol=tol(model))
    torch.testing.assert_close(grandkids[1], sequential_logits(model, PREFIX + [5, 9, 31]), rtol=0, atol=tol(model))
    torch.testing.assert_close(grandkids[2], sequential_logits(model, PREFIX + [5, 4, 2]), rtol=0, atol=tol(model))
    runner.commit([base, base + 1, base + 4])
    assert runner.committed == PREFIX + [5, 9, 31]
    assert_cache_equals_prefill(runner, model)


@pytest.mark.parametrize("strategy", ["iid", "without_replacement", "topk"])
def test_cache_after_20_rounds_equals_fresh_prefill(model, strategy):
    draft = tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1)
    dec = SpeculativeDecoder(model, draft)
    out = dec.generate(PREFIX, 60, tree=TreeConfig(3, 3, strategy), sampling=SamplingConfig(temperature=1.0), seed=0, ignore_eos=True)
    assert out.stats.target_steps >= 20
    assert dec._target.committed == PREFIX + out.token_ids[:-1]
    assert_cache_equals_prefill(dec._target, model)
    # the draft cache is a (possibly lagging) prefix of the same sequence
    d = dec._draft
    assert d.committed == (PREFIX + out.token_ids)[: d.n_committed]
    assert_cache_equals_prefill(d, draft)


@given(tree=trees(max_nodes=10), pick=st.integers(0, 10**6), prefix=st.integers(1, 6))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_compaction_of_any_root_to_node_path(tree, pick, prefix):
    model = _shared_model()
    runner = HFRunner(model)
    runner.prefill(PREFIX[:prefix])
    tokens = [t % VOCAB for t in tree.tokens]
    tree = TokenTree(tokens, tree.parents)
    base = runner.n_slots
    feed_tree(runner, tree)
    path = tree.path_to(pick % len(tree))
    runner.commit([base + n for n in path])
    assert runner.committed == PREFIX[:prefix] + [tokens[n] for n in path]
    assert_cache_equals_prefill(runner, model)


_MODEL = []


def _shared_model():
    if not _MODEL:
        _MODEL.append(tiny_llama(0))
    return _MODEL[0]


def test_eager_mask_is_additive_float_and_sdpa_mask_is_bool():
    visible = torch.tensor([[True, False], [True, True]])
    sdpa, eager = HFRunner(tiny_llama(0)), HFRunner(tiny_llama(0, attn="eager"))
    assert sdpa._mask(visible).dtype == torch.bool
    m = eager._mask(visible)
    assert m.dtype == torch.float64 and m.shape == (1, 1, 2, 2)
    assert m[0, 0, 0, 0] == 0 and m[0, 0, 0, 1] == torch.finfo(torch.float64).min


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "flex_attention"])
def test_attention_that_ignores_4d_masks_is_rejected(impl):
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=impl, vocab_size=8))
    with pytest.raises(ValueError, match="sdpa"):
        HFRunner(fake)


def test_commit_rejects_a_non_chain():
    runner = HFRunner(_shared_model())
    runner.prefill(PREFIX)
    base = runner.n_slots
    feed_tree(runner, TokenTree([1, 2, 3], [-1, 0, 0]))
    with pytest.raises(ValueError, match="chain"):
        runner.commit([base, base + 1, base + 2])
