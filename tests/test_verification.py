"""Block and traversal verification: lossless by exact enumeration, greedy = the greedy walk,
and the rule applicability checks.

Same machinery as test_exact_enumeration.py: the production decoder, drafters and walks run
on table-defined toy models while every draft draw and every coin is enumerated with its
exact probability. `k = depth + 1` tokens make the first round use the tree's full depth.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from treespec import (
    Drafter,
    DraftTree,
    Draw,
    ProposalGroup,
    SamplingConfig,
    SpeculativeDecoder,
    TokenTree,
    TreeConfig,
    verify,
)
from treespec.sampling import probs, residual, weighted_residual
from treespec.sequoia import TreeShape

from .toy import PROMPT, SAMPLINGS, TableModel, TableRunner, enumerate_outcomes, max_abs_diff, pair

GREEDY = SamplingConfig(temperature=0)
SHAPE_W2D2 = TreeShape((-1, 0, 0, 1, 1, 2, 2))  # full binary tree of depth 2
SHAPE_UNEVEN = TreeShape((-1, 0, 0, 0, 1, 1, 2, 4))  # 3 / 2 / 1 children, one path of depth 3


def sequoia(shape: TreeShape) -> TreeConfig:
    return TreeConfig(depth=shape.depth, strategy="sequoia", shape=shape)


def check_lossless(tree: TreeConfig, rule: str, sampling: SamplingConfig, k: int, drafter: str = "model"):
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft), drafter=drafter)

    def run(rng):
        out = decoder.generate(
            list(PROMPT), k, tree=tree, sampling=sampling, rng=rng, ignore_eos=True, verification=rule
        )
        assert out.verification == rule
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, target.joint(PROMPT, k, sampling)) < 1e-9


CHAINS = [("iid", 1), ("iid", 2), ("iid", 3), ("without_replacement", 2), ("topk", 3)]
# The i.i.d. depth-3 chains at T=1 (~10 s and ~5 s: the most outcomes) run with -m slow; depth 3
# stays in the default run under the other two samplings and for top-k chains, T=1 at depth 2.
SLOW_CHAINS = (("iid", 3, "block", "T1"), ("iid", 3, "traversal", "T1"))


@pytest.mark.parametrize(
    "strategy,depth,rule,sampling_name",
    [
        pytest.param(*case, marks=pytest.mark.slow) if case in SLOW_CHAINS else case
        for case in (
            (strategy, depth, rule, s)
            for strategy, depth in CHAINS
            for rule in ("block", "traversal")
            for s in SAMPLINGS
        )
    ],
)
def test_chain_rules_are_lossless(strategy, depth, rule, sampling_name):
    check_lossless(TreeConfig(1, depth, strategy), rule, SAMPLINGS[sampling_name], k=depth + 1)


TREES = {  # trees traversal verification applies to: (tree, drafter, tokens enumerated)
    "sequoia-w2d2": (sequoia(SHAPE_W2D2), "model", 3),
    "sequoia-uneven": (sequoia(SHAPE_UNEVEN), "model", 3),
    "sequoia-w3d1": (sequoia(TreeShape((-1, 0, 0, 0))), "model", 2),
    "topk-w3d2": (TreeConfig(3, 2, "topk"), "model", 3),
    "dynamic-w2d3-b4": (TreeConfig(2, 3, "dynamic", budget=4), "model", 4),
    "ngram-w2d2": (TreeConfig(2, 2), "ngram", 3),
}


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("name", list(TREES))
def test_traversal_is_lossless_on_trees(name, sampling_name):
    tree, drafter, k = TREES[name]
    if sampling_name == "T1" and name == "sequoia-w2d2":
        k = 2  # the full binary tree at T=1 is the slow case (~30 s at k=3); the others cover depth 2
    check_lossless(tree, "traversal", SAMPLINGS[sampling_name], k, drafter)


def test_traversal_is_lossless_on_a_stochastic_beam():
    """Which nodes grow may depend on the draws: a 2x3 beam (the 2 best of up to 4 depth-2 nodes
    grow), k=4 so the first round has depth 3. (Top-p may shrink the support, making the beam
    deterministic; BeamDrafter below forces a random selection.)"""
    check_lossless(TreeConfig(2, 3, "without_replacement"), "traversal", SAMPLINGS["T1.4-topp0.7"], k=4)


class BeamDrafter(Drafter):
    """Root: 2 children without replacement from q; only the one the draft likes more grows,
    with 2 children of its own: the shape depends on the sibling draws (V=3, so one token is
    left out at each node and the selection is random)."""

    def __init__(self, q: TableModel):
        self.q = q

    def start(self, prompt, sampling, rng):
        self.sampling, self.rng = sampling, rng

    def propose(self, context, depth):
        ctx = tuple(context)
        q0 = probs(self.q.logits(ctx), self.sampling)
        a = self.rng.without_replacement(q0, 2)
        tokens, parents = [ctx[-1], *a], [-1, 0, 0]
        groups = [ProposalGroup(0, Draw.WITHOUT_REPLACEMENT, tuple(a), (1, 2), q0)]
        if depth >= 2:
            best = 1 if q0[a[0]] >= q0[a[1]] else 2
            q1 = probs(self.q.logits(ctx + (tokens[best],)), self.sampling)
            b = self.rng.without_replacement(q1, 2)
            tokens, parents = tokens + b, parents + [best, best]
            groups.append(ProposalGroup(best, Draw.WITHOUT_REPLACEMENT, tuple(b), (3, 4), q1))
        return DraftTree(TokenTree(tokens, parents), tuple(groups))


def test_traversal_is_lossless_when_the_shape_depends_on_sibling_draws():
    target = TableModel(3, seed=11)
    dec = SpeculativeDecoder(
        TableRunner(target), drafter=BeamDrafter(TableModel(3, seed=12, base=target, noise=0.8))
    )
    got = enumerate_outcomes(
        lambda rng: tuple(
            dec.generate(
                list(PROMPT),
                3,
                tree=TreeConfig(2, 2),
                sampling=SAMPLINGS["T1"],
                rng=rng,
                ignore_eos=True,
                verification="traversal",
            ).token_ids
        )
    )
    assert max_abs_diff(got, target.joint(PROMPT, 3, SAMPLINGS["T1"])) < 1e-9


@pytest.mark.parametrize("rule", ["block", "traversal"])
def test_enumeration_detects_a_broken_rule(monkeypatch, rule):
    """Forget the reach probability 1 - w + S after a rejection (keep the weight as it was):
    the rule accepts too often and the output is no longer the target's."""
    verify_mod = importlib.import_module("treespec.verify")
    monkeypatch.setattr(
        verify_mod, "weighted_residual", lambda m, q: residual(m, q) * m.sum(-1, keepdim=True)
    )
    monkeypatch.setattr(verify_mod, "weighted_mass", lambda mass, left: mass)  # block's stopping masses
    target, draft = pair()
    tree = TreeConfig(1, 2) if rule == "block" else sequoia(TreeShape((-1, 0, 0, 1)))
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_outcomes(
        lambda rng: tuple(
            decoder.generate(
                list(PROMPT),
                3,
                tree=tree,
                sampling=SAMPLINGS["T1"],
                rng=rng,
                ignore_eos=True,
                verification=rule,
            ).token_ids
        )
    )
    assert max_abs_diff(got, target.joint(PROMPT, 3, SAMPLINGS["T1"])) > 1e-3


def test_weighted_residual_with_weight_one_is_the_residual():
    g = torch.Generator().manual_seed(0)
    r, q = torch.softmax(torch.randn(2, 7, generator=g, dtype=torch.float64), -1)
    assert torch.allclose(weighted_residual(r, q), residual(r, q))
    m = 0.4 * r  # mass S / (1 - w + S) <= w's complement-adjusted share, never above 1
    left = weighted_residual(m, q)
    s = torch.clamp(m - q, min=0).sum()
    assert torch.isclose(left.sum(), s / (1 - 0.4 + s))


# ---- one round, on explicit drafts: traversal = block on chains, and the gain over token ----
def random_chain(depth: int, seed: int, vocab: int = 4):
    """A chain whose tokens are drawn from random q's, with random target logits."""
    g = torch.Generator().manual_seed(seed)
    tokens, groups = [0], []
    for i in range(depth):
        q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64), -1)
        x = int(torch.multinomial(q, 1, generator=g))
        tokens.append(x)
        groups.append(ProposalGroup(i, Draw.IID, (x,), (i + 1,), q))
    draft = DraftTree(TokenTree(tokens, list(range(-1, depth))), tuple(groups))
    return draft, torch.randn(depth + 1, vocab, generator=g, dtype=torch.float64) * 1.5


@pytest.mark.parametrize("seed", range(6))
def test_traversal_equals_block_on_chains(seed):
    draft, logits = random_chain(4, seed)
    walks = {
        rule: enumerate_outcomes(
            lambda rng: (lambda w: (w.path, w.token, w.kind))(
                verify(draft, logits, SAMPLINGS["T1"], rng, rule)
            )
        )
        for rule in ("block", "traversal")
    }
    assert max_abs_diff(walks["block"], walks["traversal"]) < 1e-12


def expected_accepted(tree: TreeConfig, rule: str, sampling: SamplingConfig, depth: int) -> float:
    """E[draft tokens accepted in the first round], over every draft and coin."""
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))

    def run(rng):
        out = decoder.generate(
            list(PROMPT), depth + 1, tree=tree, sampling=sampling, rng=rng, ignore_eos=True, verification=rule
        )
        return next((i for i, s in enumerate(out.sources) if s != "accepted"), len(out.sources))

    return sum(n * p for n, p in enumerate_outcomes(run).items())


@pytest.mark.parametrize("sampling_name", ["T0.6-topk2", "T1.4-topp0.7"])  # T1 takes ~1 min here
def test_block_accepts_more_than_token_on_chains(sampling_name):
    """Block verification is optimal on a chain: it accepts at least as much as token by token."""
    tree, sampling = TreeConfig(1, 3), SAMPLINGS[sampling_name]
    token, block = (expected_accepted(tree, r, sampling, 3) for r in ("token", "block"))
    assert block >= token - 1e-12
    assert block > token + 1e-4


# ---- greedy: every rule is the greedy walk ----
@pytest.mark.parametrize("rule", ["block", "traversal"])
@pytest.mark.parametrize(
    "tree",
    [TreeConfig(1, 3), TreeConfig(2, 3, "topk"), sequoia(SHAPE_UNEVEN)],
    ids=["chain", "topk", "sequoia"],
)
def test_greedy_is_the_target_argmax_chain_under_every_rule(tree, rule):
    if rule == "block" and tree.width > 1 or rule == "block" and tree.strategy == "sequoia":
        pytest.skip("block needs a chain")
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    got = enumerate_outcomes(
        lambda rng: tuple(
            decoder.generate(
                list(PROMPT), 4, tree=tree, sampling=GREEDY, rng=rng, ignore_eos=True, verification=rule
            ).token_ids
        )
    )
    assert got == pytest.approx(target.joint(PROMPT, 4, GREEDY))


@pytest.mark.parametrize("rule", ["block", "traversal"])
def test_one_hot_p_reduces_the_sampled_rules_to_the_greedy_walk(rule):
    """Not only by dispatch: the block/traversal walks themselves, fed one-hot p and q,
    stop where the greedy walk stops and emit its token, with probability 1."""
    verify_mod = importlib.import_module("treespec.verify")
    for seed in range(8):
        draft, logits = random_chain(4, seed)
        greedy = verify_mod._verify_greedy(draft, logits)
        onehot = probs(logits, GREEDY)
        hot = DraftTree(
            draft.tree,
            tuple(ProposalGroup(g.parent, Draw.DETERMINISTIC, g.tokens, g.children) for g in draft.groups),
        )
        walk = {"block": verify_mod._verify_block, "traversal": verify_mod._verify_traversal}[rule]
        got = enumerate_outcomes(lambda rng: (lambda w: (w.path, w.token))(walk(hot, onehot, rng)))
        assert got == pytest.approx({(greedy.path, greedy.token): 1.0})


# ---- which rule applies ----
def test_default_rule_is_the_best_that_applies():
    target, draft = pair()
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    run = lambda tree: dec.generate(list(PROMPT), 3, tree=tree, sampling=SAMPLINGS["T1"], seed=0).verification  # noqa: E731
    assert run(TreeConfig(1, 2)) == "block"
    assert run(sequoia(SHAPE_W2D2)) == "traversal"
    assert run(TreeConfig(2, 2, "topk")) == "traversal"
    assert run(TreeConfig(2, 2)) == "token"  # i.i.d. tree
    assert run(TreeConfig(2, 2, "without_replacement")) == "traversal"  # stochastic beam
    assert run(None) == "token"


@pytest.mark.parametrize(
    "drafter,tree,rule,names",
    [
        ("model", TreeConfig(2, 2), "block", "'token'"),
        ("model", TreeConfig(2, 2, "topk"), "block", "'token' or 'traversal'"),
        ("model", TreeConfig(2, 2), "traversal", "'token'"),
        ("model", TreeConfig(2, 3, "without_replacement"), "block", "'token' or 'traversal'"),
        ("merged", TreeConfig(1, 2), "block", "'token'"),
    ],
)
def test_a_rule_that_does_not_apply_is_refused(drafter, tree, rule, names):
    target, draft = pair()
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft), drafter=drafter)
    with pytest.raises(ValueError, match=f"verification='{rule}' does not apply.*here {names} applies"):
        dec.generate(list(PROMPT), 3, tree=tree, verification=rule)
    with pytest.raises(ValueError, match="verification must be one of token, block, traversal"):
        dec.generate(list(PROMPT), 3, tree=tree, verification="blocks")


def test_each_round_is_checked_against_the_rule():
    target = TableModel(3, seed=11)
    tree = DraftTree.from_paths(0, [[1, 2], [2, 1]])
    logits = torch.stack([target.logits((i,)) for i in range(len(tree.tree))])
    with pytest.raises(ValueError, match="block verification needs a chain"):
        verify(tree, logits, SAMPLINGS["T1"], None, "block")
    q = torch.full((3,), 1 / 3, dtype=torch.float64)
    iid = DraftTree(TokenTree([0, 1, 2], [-1, 0, 0]), (ProposalGroup(0, Draw.IID, (1, 2), (1, 2), q),))
    with pytest.raises(ValueError, match="traversal verification needs siblings drawn without replacement"):
        verify(iid, logits[:3], SAMPLINGS["T1"], None, "traversal")


def test_one_table_says_which_rules_apply():
    """`treespec.rules` owns the decision: how a drafter kind draws a tree's siblings, the rules
    lossless there (worst to best), and the one a request runs."""
    from treespec.rules import Siblings, choose_rule, rules_for, siblings_of

    cases = [  # drafter, tree, siblings
        ("model", TreeConfig(1, 3), Siblings.CHAIN),
        ("model", TreeConfig(2, 2), Siblings.IID),
        ("model", TreeConfig(2, 2, "topk"), Siblings.DISTINCT),
        ("model", sequoia(SHAPE_W2D2), Siblings.DISTINCT),
        ("model", TreeConfig(), Siblings.DISTINCT),  # an automatic tree plans Sequoia shapes
        ("ngram", TreeConfig(), Siblings.CHAIN),  # ... or chains, for drafters of chains
        ("lookup", TreeConfig(3, 2), Siblings.DISTINCT),
        ("merged", TreeConfig(1, 2), Siblings.MERGED),
        ("custom", TreeConfig(2, 2), Siblings.CUSTOM),
        ("model", None, Siblings.CUSTOM),  # plain decoding
    ]
    for drafter, tree, siblings in cases:
        assert siblings_of(tree, drafter) is siblings, (drafter, tree)
    assert siblings_of(TreeConfig(), "model", "block") is Siblings.CHAIN
    assert rules_for("chain") == ("token", "traversal", "block") and rules_for(Siblings.IID) == ("token",)
    assert [choose_rule(s, None) for s in ("chain", "distinct", "iid", "merged", "custom")] == [
        "block", "traversal", "token", "token", "token",
    ]  # fmt: skip
    assert choose_rule("chain", "auto") == "block" and choose_rule("distinct", "token") == "token"
    with pytest.raises(ValueError, match="verification='traversal' does not apply.*here 'token' applies"):
        choose_rule("iid", "traversal")


# ---- real (tiny) Llamas: chi-square against the target's joint, greedy parity with HF ----
from collections import Counter  # noqa: E402

from treespec.sequoia import optimal_shape  # noqa: E402

from .llamas import PROMPTS as GREEDY_PROMPTS  # noqa: E402
from .llamas import hf_greedy  # noqa: E402
from .llamas import pair as llama_pair  # noqa: E402, F401  (fixture)
from .mc import PROMPT as MC_PROMPT  # noqa: E402
from .mc import K as MC_K  # noqa: E402
from .mc import N as MC_N  # noqa: E402
from .mc import (  # noqa: E402
    chi2_pvalue,
    exact_joint,
    models,  # noqa: E402, F401  (fixture)
)

MC_CASES = {  # name: (tree, rule, sampling)
    "block-linear-T1": (TreeConfig(1, 2), "block", SamplingConfig(temperature=1.0)),
    "traversal-sequoia-topk": (
        sequoia(TreeShape((-1, 0, 0, 1))),
        "traversal",
        SamplingConfig(temperature=1.2, top_k=5),
    ),
    "traversal-topk-w2-topp": (
        TreeConfig(2, 2, "topk"),
        "traversal",
        SamplingConfig(temperature=0.9, top_p=0.9),
    ),
}


# One chi-square per rule in the default run (block on a chain, traversal on a top-k tree);
# traversal on a Sequoia tree (~5 s), enumerated exactly above, runs with -m slow.
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c == "traversal-sequoia-topk" else c for c in MC_CASES],
)
def test_sampled_output_matches_target_joint(models, case):  # noqa: F811
    target, draft = models
    tree, rule, sampling = MC_CASES[case]
    dec = SpeculativeDecoder(target, draft, backend="native")
    counts, accepted = Counter(), 0
    for seed in range(MC_N):
        out = dec.generate(
            MC_PROMPT, MC_K, tree=tree, sampling=sampling, seed=seed, ignore_eos=True, verification=rule
        )
        counts[tuple(out.token_ids)] += 1
        accepted += out.sources.count("accepted")
    assert accepted > MC_N // 10  # the drafts were really used
    assert chi2_pvalue(counts, exact_joint(target, sampling), MC_N) > 1e-3
    other = SamplingConfig(temperature=sampling.temperature * 1.6, top_k=sampling.top_k, top_p=sampling.top_p)
    assert chi2_pvalue(counts, exact_joint(target, other), MC_N) < 1e-3  # power check


GREEDY_TREES = {
    "chain-block": (TreeConfig(1, 4), "block"),
    "topk-traversal": (TreeConfig(3, 4, "topk"), "traversal"),
    "sequoia-traversal": (
        TreeConfig(depth=4, strategy="sequoia", shape=optimal_shape((0.6, 0.2, 0.1), 10, 4)),
        "traversal",
    ),
}


@pytest.mark.parametrize("name", list(GREEDY_TREES))
def test_greedy_equals_hf_generate_under_every_rule(llama_pair, name):  # noqa: F811
    target, draft = llama_pair
    tree, rule = GREEDY_TREES[name]
    dec = SpeculativeDecoder(target, draft, backend="native")
    accepted = 0
    for prompt in GREEDY_PROMPTS:
        out = dec.generate(prompt, 40, tree=tree, sampling=GREEDY, ignore_eos=True, verification=rule)
        assert out.token_ids == hf_greedy(target, prompt, 40, stop_at_eos=False), f"prompt {prompt}"
        accepted += out.sources.count("accepted")
    assert accepted > 0


TOKEN_TREES = {  # where "token" is no longer the default, it must stay lossless when asked for
    "chain-d2": TreeConfig(1, 2),
    "wor-w2d2": TreeConfig(2, 2, "without_replacement"),
    "topk-w3d2": TreeConfig(3, 2, "topk"),
    "sequoia-w3d1": sequoia(TreeShape((-1, 0, 0, 0))),
}


@pytest.mark.parametrize(
    "name,sampling_name",
    [
        pytest.param(n, s, marks=pytest.mark.slow) if (n, s) == ("wor-w2d2", "T1") else (n, s)  # ~40 s
        for s in SAMPLINGS
        for n in TOKEN_TREES
    ],
)
def test_token_rule_stays_lossless_where_it_is_not_the_default(name, sampling_name):
    check_lossless(TOKEN_TREES[name], "token", SAMPLINGS[sampling_name], k=3)
