"""Acceptance metrics (issue 11, item 4): acceptance rate, mean accepted length, draft forwards."""

from __future__ import annotations

import pytest

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.drafters import MergedDrafter, ModelDrafter, NgramDrafter
from treespec.stats import GenerationStats

from .conftest import tiny_llama


def test_definitions():
    s = GenerationStats(
        target_steps=4, tokens=9, tree_nodes=10, accepted_by_depth=[3, 2], attempted_by_depth=[4, 3]
    )
    assert s.accepted_tokens == 5
    assert s.acceptance_rate == 0.5  # accepted draft tokens / drafted tokens (vLLM)
    assert s.mean_accepted_length == 1.25  # accepted draft tokens per target step, bonus excluded
    empty = GenerationStats()
    assert empty.acceptance_rate == 0.0 and empty.mean_accepted_length == 0.0
    pooled = GenerationStats()
    pooled.add(s)
    pooled.add(s)
    assert pooled.acceptance_rate == 0.5 and pooled.mean_accepted_length == 1.25


@pytest.fixture(scope="module")
def models():
    return tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1)


@pytest.mark.parametrize("drafter", ["model", "merged", "ngram", "lookup"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_metrics_are_consistent_with_the_emitted_tokens(models, drafter, temperature):
    dec = SpeculativeDecoder(*models, drafter=drafter)
    out = dec.generate(
        [3, 4, 5, 6] * 4,
        40,
        tree=TreeConfig(2, 3),
        sampling=SamplingConfig(temperature),
        seed=0,
        ignore_eos=True,
    )
    s = out.stats
    # without truncation every round emits its accepted tokens plus one correction/bonus token
    assert s.tokens == 40 == s.accepted_tokens + s.target_steps
    assert s.accepted_tokens == out.sources.count("accepted")
    assert s.mean_accepted_length == pytest.approx(s.tokens_per_step - 1)
    assert 0 <= s.acceptance_rate <= 1 and s.accepted_tokens <= s.tree_nodes
    if drafter in ("model", "merged"):
        assert 0 < s.draft_forwards <= 3 * s.target_steps  # one draft forward per depth
    else:
        assert s.draft_forwards == 0


def test_draft_forwards_counted_for_drafter_instances(models):
    dec = SpeculativeDecoder(*models, drafter="merged")
    want = dec.generate(
        [3, 4, 5, 6] * 4, 24, tree=TreeConfig(2, 3), seed=1, ignore_eos=True
    ).stats.draft_forwards
    assert want > 0
    tree = TreeConfig(2, 3)
    merged = MergedDrafter([ModelDrafter(dec.draft_runner, tree), NgramDrafter(2)])
    custom = SpeculativeDecoder(
        dec.target_runner, None, drafter=merged
    )  # no draft model given to the decoder
    assert (
        custom.generate([3, 4, 5, 6] * 4, 24, tree=tree, seed=1, ignore_eos=True).stats.draft_forwards == want
    )
    twice = MergedDrafter([ModelDrafter(dec.draft_runner, tree), merged])  # one runner, counted once
    assert twice.runners() == [dec.draft_runner]


def test_linear_greedy_acceptance_rate_is_accepted_over_drafted(models):
    dec = SpeculativeDecoder(*models)
    s = dec.generate([3, 4, 5], 30, tree=TreeConfig(1, 4), sampling=SamplingConfig(0), ignore_eos=True).stats
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.tree_nodes)
    assert s.tree_nodes <= 4 * s.target_steps
