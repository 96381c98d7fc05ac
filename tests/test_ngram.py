"""NgramDrafter and PromptLookupDrafter: tables, window, matching, trees."""

from __future__ import annotations

import pytest

from treespec import NgramDrafter, PromptLookupDrafter, SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.drafters import DrafterFactory
from treespec.proposal import Draw

from .conftest import tiny_llama
from .llamas import PROMPTS, hf_greedy


def test_hash_buckets_are_deterministic_and_orders_separate():
    d = NgramDrafter(orders=(2, 3))
    assert d._bucket([5, 6]) == d._bucket((5, 6)) and 0 <= d._bucket([5, 6]) < d.n_buckets
    d.extend([1, 2, 3, 1, 2, 4])
    assert d.tables[2][d._bucket([2])] == {3: 1, 4: 1}  # bigram context "2"
    assert d.tables[3][d._bucket([1, 2])] == {3: 1, 4: 1}
    assert d.tables[3][d._bucket([2, 3])] == {1: 1}


def test_longest_context_is_preferred():
    d = NgramDrafter(orders=(2, 3))
    d.extend([7, 1, 2, 9, 1, 2, 9, 8, 2, 5, 8, 2, 5])
    # bigram "2" -> 9 twice, 5 twice (9 first seen); trigram "8 2" -> 5 only
    assert d.predict([4, 8, 2])[0] == (5, 1.0)
    assert [t for t, _ in d.predict([4, 3, 2])] == [9, 5]  # unseen trigram: fall back to bigram
    assert d.predict([6]) == []


def test_window_evicts_old_ngrams():
    d = NgramDrafter(orders=(2,), window=4)
    d.extend([1, 2, 3, 4])
    assert d.predict([1]) == [(2, 1.0)]
    d.extend([5])  # the bigram (1, 2) starts before the window now
    assert d.predict([1]) == []
    assert d.predict([4]) == [(5, 1.0)]
    assert sum(sum(c.values()) for c in d.tables[2].values()) == 3  # (2,3) (3,4) (4,5)


def test_chaining_and_branching():
    d = NgramDrafter(width=2, orders=(2,))
    d.start([1, 2, 3, 1, 2, 4, 2, 3], SamplingConfig(), None)
    tree = d.propose([1, 2, 3, 1, 2, 4, 2, 3, 1], depth=3).tree
    # from "1": 2 (always), then "2" -> 3 (2x) or 4, then chained on
    paths = [[tree.tokens[n] for n in p[1:]] for p in tree.paths()]
    assert paths[0] == [2, 3, 1] and [2, 4, 2] in paths
    dchain = NgramDrafter(width=1, orders=(2,))
    dchain.start([5, 6, 7], SamplingConfig(), None)
    chain = dchain.propose([5, 6, 7, 5], depth=4).tree
    assert chain.tokens == (5, 6, 7, 5, 6) and chain.parents == (-1, 0, 1, 2, 3)


def test_no_match_gives_a_root_only_tree():
    d = NgramDrafter()
    d.start([1, 2, 3], SamplingConfig(), None)
    draft = d.propose([1, 2, 3, 9], depth=4)
    assert len(draft.tree) == 1 and not draft.groups


def test_prompt_lookup_prefers_long_matches_and_branches_on_recent_ones():
    d = PromptLookupDrafter(width=2, max_ngram=2)
    ctx = [7, 8, 1, 2, 3, 4, 9, 1, 2, 5, 6, 8, 1, 2]
    assert d.lookup(ctx, 3) == [[5, 6, 8], [3, 4, 9]]  # "1 2" matched twice, most recent first
    draft = d.propose(ctx, 3)
    assert all(g.draw is Draw.DETERMINISTIC for g in draft.groups)
    assert d.lookup([1, 2, 3], 2) == []


def test_a_factory_gives_its_options_to_each_drafter():
    ctx = [5, 1, 2, 9, 3, 2]  # the last token, 2, follows 1 earlier; no earlier "3 2"
    assert DrafterFactory("lookup").make(TreeConfig(1, 2), None).lookup(ctx, 2) == [[9, 3]]
    longer = DrafterFactory("lookup", options={"min_ngram": 2}).make(TreeConfig(1, 2), None)
    assert longer.lookup(ctx, 2) == [] and longer.width == 1
    with pytest.raises(ValueError, match="options are for the 'ngram' and 'lookup' kinds"):
        DrafterFactory("model", options={"min_ngram": 2})


def test_model_free_drafters_match_hf_greedy():
    target = tiny_llama(0)
    for drafter in ("ngram", "lookup"):
        dec = SpeculativeDecoder(target, drafter=drafter)
        accepted = 0
        for prompt in PROMPTS[:5]:
            out = dec.generate(
                prompt * 3, 30, tree=TreeConfig(2, 4), sampling=SamplingConfig(temperature=0), ignore_eos=True
            )
            assert out.token_ids == hf_greedy(target, prompt * 3, 30, stop_at_eos=False)
            assert out.stats.draft_forwards == 0
            accepted += out.sources.count("accepted")
        assert accepted > 0


def test_merged_drafter_matches_hf_greedy():
    target = tiny_llama(0)
    from .conftest import perturbed

    dec = SpeculativeDecoder(target, perturbed(target, 0.3, 1), drafter="merged")
    for prompt in PROMPTS[:5]:
        out = dec.generate(
            prompt * 2, 30, tree=TreeConfig(2, 3), sampling=SamplingConfig(temperature=0), ignore_eos=True
        )
        assert out.token_ids == hf_greedy(target, prompt * 2, 30, stop_at_eos=False)
