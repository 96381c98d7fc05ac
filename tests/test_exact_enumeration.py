"""Losslessness, proven by enumeration: every draft outcome and every coin, integrated exactly.

The production decoder, drafter, verification walk and cache bookkeeping run on table-defined
toy models; `enumerate_outcomes` replaces the random generator by one that walks every
possible sequence of random choices, weighting each run by its exact probability. The
emitted joint distribution of the first K tokens must equal the target's own to 1e-9.
"""

from __future__ import annotations

import importlib

import pytest

from treespec import (
    Drafter,
    DraftTree,
    Draw,
    ProposalGroup,
    SamplingConfig,
    SpeculativeDecoder,
    TokenTree,
    TreeConfig,
)
from treespec.sampling import probs

from .toy import (
    LONG_PROMPT,
    PROMPT,
    SAMPLINGS,
    K,
    TableModel,
    TableRunner,
    V,
    enumerate_decoder,
    enumerate_outcomes,
    max_abs_diff,
    pair,
)

SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]  # (width, depth)


# the two longest cases (~35 s and ~10 s); width 3 of both strategies is also enumerated at depth 1
SLOW_MODEL_CASES = (("without_replacement", 3, 2, "T1"), ("iid", 3, 2, "T1"))


@pytest.mark.parametrize(
    "strategy,width,depth,sampling_name",
    [
        pytest.param(*case, marks=pytest.mark.slow) if case in SLOW_MODEL_CASES else case
        for case in (
            (strategy, width, depth, s)
            for width, depth in SHAPES
            for strategy in ["iid", "without_replacement", "topk", "dynamic"]
            for s in SAMPLINGS
        )
    ],
)
def test_model_drafter_is_lossless(strategy, width, depth, sampling_name):
    sampling = SAMPLINGS[sampling_name]
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_decoder(decoder, TreeConfig(width=width, depth=depth, strategy=strategy), sampling)
    want = target.joint(PROMPT, K, sampling)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, want) < 1e-9


@pytest.mark.parametrize("strategy", ["iid", "without_replacement", "topk", "dynamic"])
@pytest.mark.parametrize("width,depth", SHAPES)
def test_greedy_walk_is_the_target_argmax_chain(strategy, width, depth):
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    greedy = SamplingConfig(temperature=0)
    got = enumerate_decoder(decoder, TreeConfig(width=width, depth=depth, strategy=strategy), greedy, k=4)
    assert got == pytest.approx(target.joint(PROMPT, 4, greedy))
    assert len(got) == 1


def test_plain_decoding_is_the_target():
    target, _ = pair()
    sampling = SAMPLINGS["T1"]
    got = enumerate_decoder(SpeculativeDecoder(TableRunner(target)), None, sampling)
    assert max_abs_diff(got, target.joint(PROMPT, K, sampling)) < 1e-9


def test_draft_equal_to_target_accepts_everything():
    """A sanity check that the enumeration can see acceptance: q == p accepts every proposal."""
    target = TableModel(V, seed=11)
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(target))

    def run(rng):
        out = decoder.generate(
            list(PROMPT), 3, tree=TreeConfig(1, 2), sampling=SAMPLINGS["T1"], rng=rng, ignore_eos=True
        )
        return out.stats.target_steps

    assert enumerate_outcomes(run) == pytest.approx({1: 1.0})


class MixedDrafter(Drafter):
    """Every proposal kind at once: at the root an i.i.d. group (2 draws from q1), a
    without-replacement group (2 draws from q2) and a deterministic group (the argmax of a
    third table); one level below, each child gets one i.i.d. draw. Two drafts with different
    q at one node, as a merged multi-drafter produces."""

    def __init__(self, q1: TableModel, q2: TableModel, q3: TableModel):
        self.q1, self.q2, self.q3 = q1, q2, q3

    def start(self, prompt, sampling, rng):
        self.sampling, self.rng = sampling, rng

    def propose(self, context, depth):
        ctx = tuple(context)
        dist = lambda m, c: probs(m.logits(c), self.sampling)  # noqa: E731
        tokens, parents, groups = [ctx[-1]], [-1], []

        def add_group(parent, draw, drawn, q):
            children = []
            for x in drawn:
                tokens.append(x)
                parents.append(parent)
                children.append(len(tokens) - 1)
            groups.append(ProposalGroup(parent, draw, tuple(drawn), tuple(children), q))
            return children

        q_iid, q_wr = dist(self.q1, ctx), dist(self.q2, ctx)
        kids = add_group(0, Draw.IID, self.rng.categorical(q_iid, 2), q_iid)
        kids += add_group(
            0,
            Draw.WITHOUT_REPLACEMENT,
            self.rng.without_replacement(q_wr, min(2, int((q_wr > 0).sum()))),
            q_wr,
        )
        kids += add_group(0, Draw.DETERMINISTIC, [int(self.q3.logits(ctx).argmax())], None)
        if depth >= 2:
            for c in kids:
                path = ctx + (tokens[c],)
                q = dist(self.q1, path)
                add_group(c, Draw.IID, self.rng.categorical(q, 1), q)
        # identical tokens under one parent stay separate nodes here (no merging)
        return DraftTree(TokenTree(tokens, parents), tuple(groups))


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_mixed_proposal_groups_are_lossless(sampling_name):
    sampling = SAMPLINGS[sampling_name]
    target = TableModel(V, seed=11)
    drafter = MixedDrafter(
        TableModel(V, seed=21, base=target, noise=0.7),
        TableModel(V, seed=22, base=target, noise=1.2),
        TableModel(V, seed=23, base=target, noise=0.5),
    )
    decoder = SpeculativeDecoder(TableRunner(target), drafter=drafter)
    got = enumerate_decoder(decoder, TreeConfig(width=1, depth=2), sampling, k=2)
    assert max_abs_diff(got, target.joint(PROMPT, 2, sampling)) < 1e-9


def test_enumeration_detects_a_biased_walk(monkeypatch):
    """The test above can fail: skip the residual update and the output is no longer p."""
    verify_mod = importlib.import_module("treespec.verify")
    monkeypatch.setattr(verify_mod, "residual", lambda r, q: r)
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_decoder(decoder, TreeConfig(width=2, depth=1), SAMPLINGS["T1"], k=2)
    assert max_abs_diff(got, target.joint(PROMPT, 2, SAMPLINGS["T1"])) > 1e-3


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS) + ["greedy"])
@pytest.mark.parametrize("drafter", ["ngram", "lookup", "merged"])
@pytest.mark.parametrize("width,depth", [(1, 2), (2, 2), (3, 1)])
def test_model_free_and_merged_drafters_are_lossless(drafter, width, depth, sampling_name):
    sampling = SAMPLINGS.get(sampling_name, SamplingConfig(temperature=0))
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft), drafter=drafter)
    used = []

    def run(rng):
        out = decoder.generate(
            list(LONG_PROMPT), K, tree=TreeConfig(width, depth), sampling=sampling, rng=rng, ignore_eos=True
        )
        used.append(out.stats.tree_nodes)
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target.joint(LONG_PROMPT, K, sampling)) < 1e-9
    assert max(used) > 0  # the drafter proposed something in some runs


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize(
    "tree",
    [
        TreeConfig(2, 2, "dynamic", budget=3),
        TreeConfig(2, 1, adaptive="hf", depth_min=1, depth_max=2),
        TreeConfig(1, 2, "without_replacement", adaptive="entropy", depth_min=1, depth_max=2, ema_beta=0.5),
    ],
    ids=["dynamic-budget3", "adaptive-hf", "adaptive-entropy"],
)
def test_budgets_and_adaptive_depth_are_lossless(tree, sampling_name):
    sampling = SAMPLINGS[sampling_name]
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_decoder(decoder, tree, sampling, k=4)
    assert max_abs_diff(got, target.joint(PROMPT, 4, sampling)) < 1e-9


@pytest.mark.parametrize("sampling_name", ["T1", "greedy"])
@pytest.mark.parametrize("adaptive", ["hf", "entropy"])
@pytest.mark.parametrize("drafter", ["ngram", "lookup"])
def test_adaptive_depth_moves_for_model_free_drafters(drafter, adaptive, sampling_name):
    """The loop decides the depth for every drafter: with n-gram and lookup drafters the depth
    really changes between rounds (entropy mode: from the rejection-rate fallback), and the
    output is still exactly the target's."""
    from treespec.drafters import NgramDrafter, PromptLookupDrafter

    sampling = SAMPLINGS.get(sampling_name, SamplingConfig(temperature=0))
    target, _ = pair()
    depths = set()

    class Recording(NgramDrafter if drafter == "ngram" else PromptLookupDrafter):
        def propose(self, context, depth):
            depths.add(depth)
            return super().propose(context, depth)

    decoder = SpeculativeDecoder(TableRunner(target), drafter=Recording(2))
    tree = TreeConfig(2, 1, adaptive=adaptive, depth_min=1, depth_max=4, ema_beta=0.0)
    prompt = (1, 0, 2, 1, 0, 2, 1, 0)

    def run(rng):
        out = decoder.generate(list(prompt), 5, tree=tree, sampling=sampling, rng=rng, ignore_eos=True)
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target.joint(prompt, 5, sampling)) < 1e-9
    if not sampling.greedy:  # (greedy: one run, whose n-gram guesses this toy target never takes)
        assert max(depths) > tree.depth  # deeper than it started (the length cap only lowers it)
