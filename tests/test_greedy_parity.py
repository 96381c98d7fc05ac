"""Greedy speculative decoding reproduces Hugging Face greedy `generate`, token for token.

float64 tiny models, so that the tree forward and the sequential forward cannot disagree on
an argmax through rounding. Drafts are noisy copies of the target: they agree often enough to
exercise long accepted paths, corrections and bonus tokens.
"""

from __future__ import annotations

import copy

import pytest

from treespec import SpeculativeDecoder, TreeConfig
from treespec.sequoia import optimal_shape

from .llamas import GREEDY, PROMPTS, hf_greedy, pair  # noqa: F401 (fixture)

TREES = [
    None,
    TreeConfig(1, 4),
    TreeConfig(2, 3),
    TreeConfig(4, 5),
    TreeConfig(3, 3, "without_replacement"),
    TreeConfig(3, 4, "topk"),
    TreeConfig(3, 4, "dynamic", budget=8),
    TreeConfig(2, 3, adaptive="hf", depth_min=1, depth_max=6),
    TreeConfig(2, 3, adaptive="entropy", depth_min=1, depth_max=6),
    TreeConfig(1, 3, plain_fallback=True),  # speculative and plain rounds (its warm-up tries both)
    TreeConfig(depth=4, strategy="sequoia", shape=optimal_shape((0.6, 0.2, 0.1), 10, 4)),
]


def tree_id(tree):
    if tree is None:
        return "plain"
    extra = f"-b{tree.budget}" if tree.budget else f"-{tree.adaptive}" if tree.adaptive else ""
    return f"{tree.strategy}-w{tree.width}-d{tree.depth}{extra}"


@pytest.fixture(scope="module")
def references(pair):
    """HF's greedy continuation of each prompt, computed once per pair for every tree and backend."""
    return [hf_greedy(pair[0], prompt, 40, stop_at_eos=False) for prompt in PROMPTS]


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("tree", TREES, ids=tree_id)
def test_greedy_equals_hf_generate(pair, references, tree, backend):
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, backend=backend)
    accepted = 0
    for prompt, want in zip(PROMPTS, references, strict=True):
        out = dec.generate(prompt, 40, tree=tree, sampling=GREEDY, ignore_eos=True)
        assert out.token_ids == want, f"prompt {prompt}"
        accepted += out.sources.count("accepted")
    if tree is not None:
        assert accepted > 0  # the drafts were really used


def test_greedy_stops_at_eos_like_hf(pair):
    target, draft = pair
    target = copy.deepcopy(target)
    # an EOS id the greedy continuations actually produce, mid-way through the first prompt's
    target.generation_config.eos_token_id = hf_greedy(target, PROMPTS[0], 30, stop_at_eos=False)[20]
    eos = target.generation_config.eos_token_id
    dec = SpeculativeDecoder(target, draft)
    hits = 0
    for prompt in PROMPTS:
        want = hf_greedy(target, prompt, 60)
        out = dec.generate(prompt, 60, tree=TreeConfig(2, 4), sampling=GREEDY)
        assert out.token_ids == want
        assert (out.finish_reason == "eos") == (eos in out.token_ids)
        hits += out.finish_reason == "eos"
    assert hits > 0  # some prompts really ended at EOS
