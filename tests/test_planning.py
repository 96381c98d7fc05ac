"""The automatic tree (`TreeConfig()`): what it plans from costs and acceptance, how a request
moves its depth, that it stays lossless, and the measured costs' cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.config import AUTO_MAX_DEPTH, AUTO_MAX_NODES
from treespec.planning import (
    AcceptanceCounts,
    AutoDepth,
    CostCache,
    Costs,
    IidLevels,
    Planner,
    files_key,
    load_acceptance,
    measure_acceptance,
    measure_iid_levels,
    planner_for,
)
from treespec.planning import cache as cost_cache
from treespec.planning import planner as planner_module
from treespec.planning import policy as policy_module
from treespec.planning.acceptance import IID_DEPTH
from treespec.planning.policy import PLAN_WEIGHT, PROBE_EVERY
from treespec.proposal import DraftTree, Draw, ProposalGroup, Walk
from treespec.sequoia import tree_expected_tokens
from treespec.timing import CpuWatch
from treespec.tree import TokenTree

from .conftest import tiny_llama
from .toy import PROMPT, SAMPLINGS, K, TableRunner, enumerate_decoder, max_abs_diff, pair

GREEDY, T1 = SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)


def costs(verify_slope: float = 0.05, draft: float = 0.05) -> Costs:
    """A machine where n tokens cost 1 + slope * (n - 1) forwards of one and c = `draft`."""
    return Costs(tuple(1 + verify_slope * n for n in range(AUTO_MAX_NODES + 1)), draft, 0.01)


def planner(acc0=(0.6, 0.15, 0.05), acc1=(0.5, 0.15, 0.05), **kw) -> Planner:
    return Planner(costs(**kw), {"T0": acc0, "T1": acc1}, "shipped")


def test_the_default_tree_is_automatic_and_a_given_field_fixes_it():
    assert TreeConfig().auto and TreeConfig(strategy="auto").auto
    fixed = TreeConfig(width=2)
    assert not fixed.auto and (fixed.width, fixed.depth, fixed.strategy) == (2, 6, "iid")
    assert TreeConfig(depth=3).width == 1 and not TreeConfig(adaptive="hf").auto
    assert not TreeConfig(plain_fallback=True).auto
    assert TreeConfig().max_depth == AUTO_MAX_DEPTH and TreeConfig().max_nodes == AUTO_MAX_NODES
    with pytest.raises(ValueError, match="chooses the shape itself; leave width unset"):
        TreeConfig(width=2, strategy="auto")


def test_the_plan_follows_the_costs_and_the_acceptance():
    # cheap verification and drafting: a tree, deeper than one level
    rich = planner().plan(GREEDY)
    assert rich.tree is not None and rich.tree.shape.n_nodes > 1 and rich.tree.shape.depth > 1
    assert rich.speedup > 1 and rich.expected_tokens > 1.5
    assert rich.describe().startswith(f"auto: {rich.tree.shape.n_nodes} draft nodes, depth")
    # a draft forward as dear as a target forward: nothing pays
    dear = planner(draft=1.0).plan(GREEDY)
    assert dear.tree is None and dear.speedup == 1 and "plain decoding" in dear.describe()
    # every extra row costs a whole forward (a compute-bound machine): a chain, not a tree
    chain = planner(verify_slope=0.3, draft=0.02).plan(GREEDY)
    assert chain.tree is not None and all(len(c) <= 1 for c in chain.tree.shape.children())
    # the temperature class picks its own vector; chain_only gives a chain whatever the costs
    assert planner().plan(T1).acceptance[0][0] == 0.5
    assert all(len(c) <= 1 for c in planner().plan(GREEDY, chain_only=True).tree.shape.children())


def test_a_plain_round_cheaper_than_the_scored_token_turns_a_marginal_plan_plain():
    """A plain step skips the tree's masks and walk: where it costs less than the scored t(1)
    (compiled graphs: 0.82), a chain that wins against a plain unit of 1 loses against it."""
    acc = {"T0": (0.45, 0.1, 0.05), "T1": (0.45, 0.1, 0.05)}
    base = dataclasses.replace(costs(verify_slope=0.07, draft=0.15), overhead={"T0": 0.14, "T1": 0.14})
    assert Planner(base, acc, "shipped").plan(GREEDY).speedup > 1
    cheap = dataclasses.replace(base, plain={"T0": 0.82, "T1": 0.82})
    cheap_plain = Planner(cheap, acc, "shipped").plan(GREEDY)
    assert cheap_plain.tree is None and "plain decoding" in cheap_plain.describe()


def test_a_shape_expected_within_the_margin_of_plain_is_not_planned(monkeypatch):
    """The cost model's round is off by 5-10 % on real grids: a shape expected less than
    PLAN_MARGIN faster than plain decoding is planned as plain decoding, one above it is not."""
    base = dataclasses.replace(costs(verify_slope=0.07, draft=0.15), overhead={"T0": 0.14, "T1": 0.14})

    def speedup(a: float) -> float:
        with monkeypatch.context() as m:
            m.setattr(planner_module, "PLAN_MARGIN", 0.0)
            return Planner(base, {"T0": (a,), "T1": (a,)}, "shipped").plan(GREEDY).speedup

    grid = [a / 200 for a in range(200)]
    near = next(a for a in grid if 1.0 < speedup(a) < 1 + planner_module.PLAN_MARGIN)
    clear = next(a for a in grid if speedup(a) > 1 + planner_module.PLAN_MARGIN)
    plan = Planner(base, {"T0": (near,), "T1": (near,)}, "shipped").plan(GREEDY)
    assert plan.tree is None and "by 5%" in plan.describe()
    assert Planner(base, {"T0": (clear,), "T1": (clear,)}, "shipped").plan(GREEDY).tree is not None


def test_per_node_costs_shrink_the_tree_of_their_class_only():
    """The T>0 walk over a node (residuals, sampling) and a tree level's extra draft rows are
    costs of their own: where the T=1 walk is dear, T=1 plans fewer nodes while T=0 keeps its
    tree, and a chain's round costs what it did (its levels are one row each)."""
    base = costs()
    dear = dataclasses.replace(base, walk={"T0": 0.0, "T1": 0.15}, node_draft=0.03)
    cheap, walked = (
        Planner(base, {"T0": (0.6, 0.15, 0.05), "T1": (0.6, 0.15, 0.05)}, "shipped"),
        Planner(dear, {"T0": (0.6, 0.15, 0.05), "T1": (0.6, 0.15, 0.05)}, "shipped"),
    )
    assert walked.plan(GREEDY).tree.shape.n_nodes > 1  # T=0's walk is cheap: still a tree
    n_cheap, n_dear = cheap.plan(T1).tree.shape.n_nodes, walked.plan(T1)
    # (a planned chain is drafted up to AUTO_MAX_DEPTH deep, from `start` levels)
    assert n_dear.tree is None or (n_dear.start or n_dear.tree.shape.n_nodes) < n_cheap
    assert dear.round_cost(3, 3, "T0") == pytest.approx(base.verify[3] + 3 * base.draft)  # a chain
    assert dear.round_cost(6, 2, "T1") == pytest.approx(base.verify[6] + 6 * 0.18 + 2 * (base.draft - 0.03))


def test_counts_are_sequoias_positional_acceptance():
    """Rank k's count: walks that stood at a node with a child of rank k, and how often it was
    the accepted one (the k-th drawn child), whatever happened to the ranks before it."""
    tree = TokenTree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 3])  # root: ranks 0, 1; node 1: rank 0; node 3 ...
    counts = AcceptanceCounts()
    counts.count(tree, Walk((0, 2), 9, "bonus"))  # rank 1 of the root; node 2 is a leaf
    counts.count(tree, Walk((0, 1), 9, "correction"))  # rank 0, then node 1's child rejected
    counts.count(tree, Walk((0,), 9, "correction"))  # both of the root's children rejected
    assert counts.visits == [4, 3] and counts.hits == [1, 1]
    assert counts.vector() == (0.25, 1 / 3)
    assert counts.vector(prior=(0.5, 0.5), weight=4) == pytest.approx((3 / 8, 3 / 7))


def test_a_requests_depth_follows_its_own_acceptance_and_probes_when_plain():
    plan = planner(acc0=(0.7,)).plan(GREEDY)  # a chain, drafted up to AUTO_MAX_DEPTH deep
    assert plan.tree.shape.n_nodes == plan.tree.shape.depth == AUTO_MAX_DEPTH > plan.start > 1
    assert plan.describe().startswith(f"auto: a chain of {plan.start} (of up to {AUTO_MAX_DEPTH}")
    policy = AutoDepth(plan)
    start = policy.next_depth()
    assert start == plan.start
    chain = DraftTree(
        TokenTree([0, 1, 2], [-1, 0, 1]),
        (ProposalGroup(0, Draw.DETERMINISTIC, (1,), (1,)), ProposalGroup(1, Draw.DETERMINISTIC, (2,), (2,))),
    )
    for _ in range(200):  # everything rejected, for fewer rounds than the plan's weight outvotes
        policy.update(None, chain, Walk((0,), 5, "correction"), start)
    assert policy.depth == 1  # 0.7 x 64 / 264 = 0.17 still pays for a level on this cheap machine
    for _ in range(400):  # and for more: plain rounds
        policy.update(None, chain, Walk((0,), 5, "correction"), start)
    assert policy.depth == 0
    assert [policy.next_depth() for _ in range(PROBE_EVERY)] == [0] * (PROBE_EVERY - 1) + [1]
    for _ in range(300):  # everything accepted: deeper than it started, as deep as chains go
        policy.update(None, chain, Walk((0, 1, 2), 5, "bonus"), 2)
    assert policy.depth == AUTO_MAX_DEPTH


def test_a_few_rejections_do_not_move_a_request_off_a_near_tie(monkeypatch):
    """The plan's depth and the one above are nearly as good: a streak of six rejections at the
    root (a short request's noise) keeps the depth; without the margin it would drop."""
    plan = planner(acc0=(0.7,), verify_slope=0.1, draft=0.1).plan(GREEDY)  # a chain of 3 to start
    depth = plan.start
    tree = TokenTree(list(range(depth + 1)), [-1] + list(range(depth)))
    chain = DraftTree(
        tree, tuple(ProposalGroup(i, Draw.DETERMINISTIC, (i + 1,), (i + 1,)) for i in range(depth))
    )

    def depths() -> list[int]:
        policy = AutoDepth(plan)
        out = [policy.next_depth()]
        for _ in range(6):
            policy.update(None, chain, Walk((0,), 5, "correction"), depth)
            out.append(policy.next_depth())
        return out

    assert depths() == [depth] * 7
    monkeypatch.setattr(policy_module, "DEPTH_MARGIN", 0.0)
    assert depths()[-1] < depth


@pytest.mark.parametrize("margin", [0.02, 0.1])
def test_a_planned_chain_starts_at_the_deepest_depth_near_the_best(monkeypatch, margin):
    """A request learns the acceptance of the levels it drafts only: a planned chain starts at
    the deepest depth within DEPTH_MARGIN of the best (the request cuts it if it is too deep)."""
    monkeypatch.setattr(planner_module, "DEPTH_MARGIN", margin)
    p = planner(acc0=(0.7,), verify_slope=0.1, draft=0.1)
    plan = p.plan(GREEDY)
    values = {
        d: tree_expected_tokens(tuple(range(-1, d)), ((0.7,),)) / p.costs.round_cost(d, d, "T0")
        for d in range(1, AUTO_MAX_DEPTH + 1)
    }
    best = max(values, key=values.get)
    assert plan.start == max(d for d, v in values.items() if v * (1 + margin) >= values[best])
    assert plan.speedup == values[plan.start] and AutoDepth(plan).depth == plan.start
    assert plan.start > best if margin == 0.1 else plan.start >= best


def test_a_chains_cuts_are_valued_as_the_general_path_values_them():
    """`AutoDepth` values a planned chain's cuts in one pass: bit for bit what
    `tree_expected_tokens` gives under the request's counts, for counts shallower and deeper
    than the plan's levels, so that the shortcut never changes a decision."""
    import random

    rng = random.Random(0)
    for acc in ((0.7,), ((0.6, 0.1), (0.9, 0.05), (0.8,)), ((0.95,), (0.2,))):
        plan = planner(acc0=acc, verify_slope=0.01, draft=0.01).plan(GREEDY, chain_only=True)
        shape = plan.tree.shape
        assert shape.n_nodes == shape.depth > 1  # a chain
        policy = AutoDepth(plan)
        tree = TokenTree(list(range(shape.depth + 1)), [-1] + list(range(shape.depth)))
        for _ in range(40):
            policy.counts.count(tree, Walk(tuple(range(rng.randint(0, shape.depth) + 1)), 9, "bonus"))
            acc_now = policy.counts.levels(plan.acceptance, PLAN_WEIGHT)
            general = [tree_expected_tokens(parents, acc_now) for _, parents, _ in policy.cuts]
            assert policy._expected_tokens() == general


def test_rank_zero_is_counted_by_level_and_plans_deeper_where_it_accepts_more():
    """A chain's walk stands at levels 0, 1, ...: rank 0's counts by level give one vector per
    level (the other ranks pooled, scaled to what rank 0 leaves); a draft that accepts more
    deeper plans deeper than its level-0 acceptance alone would."""
    chain = TokenTree([0, 1, 2, 3], [-1, 0, 1, 2])
    counts = AcceptanceCounts()
    counts.count(chain, Walk((0, 1, 2, 3), 9, "bonus"))
    counts.count(chain, Walk((0,), 9, "correction"))
    counts.count(chain, Walk((0, 1, 2), 9, "correction"))
    assert counts.level_visits == [3, 2, 2] and counts.level_hits == [2, 2, 1]
    assert counts.levels() == ((2 / 3,), (1.0,), (0.5,))
    assert counts.levels(min_visits=3) == ((2 / 3,),)  # too few walks stood deeper
    assert counts.levels(prior=((0.5, 0.4),), weight=3)[1] == pytest.approx((0.7, 0.3))
    flat = planner(acc0=(0.6, 0.1)).plan(GREEDY)
    deep = planner(acc0=((0.6, 0.1), (0.9, 0.05))).plan(GREEDY)
    assert deep.tree.shape.depth > flat.tree.shape.depth
    assert "rank 0 deeper 0.90" in deep.describe()


def iid_planner(**kw) -> Planner:
    """A draft whose positional acceptance is poor but whose 3 i.i.d. draws are often accepted
    (a flat q: the measured case of dense bf16 SmolLM2 at T=1, where i.i.d. trees ran fastest)."""
    levels = IidLevels(3, (0.6, 0.5, 0.45, 0.4), (1.8, 2.0, 2.2, 2.3))
    acc = {"T0": (0.3, 0.05), "T1": (0.3, 0.05), "iid": (levels,)}
    return Planner(costs(**{"verify_slope": 0.02, "draft": 0.02, **kw}), acc, "shipped")


def test_iid_trees_compete_at_temperature_one_where_they_were_measured():
    p = iid_planner()
    plan = p.plan(T1)
    levels, d = p.iid[0], plan.tree.depth
    assert plan.iid and (plan.tree.strategy, plan.tree.width) == ("iid", 3) and d >= 2
    tokens, nodes = levels.cut(d)
    assert tokens == pytest.approx(
        1 + 0.6 + 0.6 * 0.5 + (0.6 * 0.5 * 0.45 if d > 2 else 0) + (0.054 if d > 3 else 0)
    )
    assert plan.expected_tokens == tokens and plan.level_nodes == levels.nodes[:d]
    assert plan.speedup == pytest.approx(tokens / p.costs.round_cost(nodes, d, "T1"))
    assert plan.acceptance == tuple((a,) for a in levels.acceptance[:d])
    assert plan.describe().startswith(
        f"auto: 3 i.i.d. sequences, depth {d} ({nodes:.1f} draft nodes expected)"
    )
    # never at T=0 (a greedy draft's i.i.d. draws are one chain), for a rule that cannot verify
    # i.i.d. siblings, or for a drafter of chains; and not where none was measured
    assert not p.plan(GREEDY).iid and not p.plan(T1, iid=False).iid and not p.plan(T1, chain_only=True).iid
    assert p.plan(T1, iid=False).tree.strategy == "sequoia"
    unmeasured = Planner(p.costs, {"T0": (0.3, 0.05), "T1": (0.3, 0.05)}, "shipped")
    assert not unmeasured.plan(T1).iid
    # an expected count of nodes is scored between the whole counts around it
    c = dataclasses.replace(costs(), walk={"T0": 0.0, "T1": 0.1})
    assert c.round_cost(2.5, 1) == pytest.approx((c.round_cost(2, 1) + c.round_cost(3, 1)) / 2)


def test_an_iid_plan_cuts_its_levels_by_the_requests_own_acceptance():
    """An i.i.d. tree's request counts, at each level, whether one of the children was accepted;
    a cut at depth d keeps the first d levels at their expected nodes."""
    plan = iid_planner().plan(T1)
    policy = AutoDepth(plan)
    d = plan.tree.depth
    assert policy.next_depth() == d and [cut[0] for cut in policy.cuts] == list(range(1, d + 1))
    assert policy.cuts[1][2] == pytest.approx(plan.round_cost(sum(plan.level_nodes[:2]), 2))
    # three i.i.d. draws at the root, two of them equal: two nodes, each continued
    tree = TokenTree([0, 5, 6, 7, 8], [-1, 0, 0, 1, 2])
    q = torch.full((10,), 0.1)
    groups = [ProposalGroup(0, Draw.IID, (5, 6, 5), (1, 2, 1), q)]
    groups += [ProposalGroup(1, Draw.IID, (7, 7), (3, 3), q), ProposalGroup(2, Draw.IID, (8,), (4,), q)]
    draft = DraftTree(tree, tuple(groups))
    policy.update(None, draft, Walk((0, 2, 4), 9, "bonus"), d)  # both levels accepted
    policy.update(None, draft, Walk((0, 1), 9, "correction"), d)  # the second level rejected
    assert policy.counts.level_visits == [2, 2] and policy.counts.level_hits == [2, 1]
    assert policy.counts.visits == []  # no positional counts: i.i.d. ranks mean nothing
    for _ in range(2000):  # every root rejected: plain rounds
        policy.update(None, draft, Walk((0,), 9, "correction"), d)
    assert policy.depth == 0


def test_the_automatic_iid_tree_is_lossless_by_enumeration_and_runs_the_token_rule():
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    decoder.planner = iid_planner(draft=0.01)
    assert decoder.planner.plan(T1).iid
    got = enumerate_decoder(decoder, TreeConfig(), T1)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, target.joint(PROMPT, K, T1)) < 1e-9
    out = decoder.generate(PROMPT, 4, sampling=T1, seed=0)
    assert out.verification == "token" and "i.i.d. sequences" in out.plan
    traversal = decoder.generate(PROMPT, 4, sampling=T1, seed=0, verification="traversal")
    assert traversal.verification == "traversal" and "i.i.d." not in traversal.plan


def test_iid_levels_are_measured_shipped_and_read(tmp_path):
    dec = SpeculativeDecoder(tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))
    levels, counts = measure_iid_levels(dec, [[3, 4, 5], [6, 7]], 3, max_new_tokens=16)
    assert levels.width == 3 and len(levels.acceptance) == len(levels.nodes) == IID_DEPTH
    assert all(1 <= n <= 3 for n in levels.nodes) and all(0 <= a <= 1 for a in levels.acceptance)
    assert (
        counts.level_visits[0] > 0 and levels.acceptance[0] == counts.level_hits[0] / counts.level_visits[0]
    )
    record = {c: {"acceptance": [0.5]} for c in ("T0", "T1")}
    record["T1"]["iid"] = [levels.to_json(counts.level_visits)]
    (tmp_path / "acceptance.json").write_text(json.dumps(record))
    (read,) = load_acceptance(tmp_path)["iid"]
    assert read.width == 3 and read.acceptance == pytest.approx(levels.acceptance, abs=1e-4)
    record["T1"]["iid"][0]["nodes"][0] = 4.0  # more distinct nodes than sequences: not measured
    (tmp_path / "acceptance.json").write_text(json.dumps(record))
    assert load_acceptance(tmp_path) is None


def test_a_shipped_acceptance_by_level_is_read_and_a_planned_chain_runs_block(tmp_path):
    """A shipped acceptance by level is read; a planned chain runs the block rule, and a plan of
    plain decoding runs exactly as `tree=None` does (the token rule, the same draws)."""
    (tmp_path / "acceptance.json").write_text(
        json.dumps({c: {"acceptance": [0.6, 0.3], "by_level": [0.6, 0.9]} for c in ("T0", "T1")})
    )
    assert [list(v) for v in load_acceptance(tmp_path)["T1"]] == [[0.6, 0.3], pytest.approx([0.9, 0.1])]
    (tmp_path / "acceptance.json").write_text(
        json.dumps({"T0": {"acceptance": [0.7]}, "T1": {"acceptance": [0.5]}})
    )
    assert load_acceptance(tmp_path)["T1"] == ((0.5,),)  # written before levels were counted
    assert load_acceptance(tmp_path)["iid"] == ()  # ... or i.i.d. trees measured
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    decoder.planner = Planner(costs(verify_slope=0.3, draft=0.01), {"T0": (0.8,), "T1": (0.8,)}, "shipped")
    shape = decoder.planner.plan(T1).tree.shape
    assert shape.n_nodes == shape.depth > 1  # a chain ...
    out = decoder.generate(PROMPT, 4, sampling=T1, seed=0)
    assert out.verification == "block"  # ... verified by the rule that accepts the most on chains
    decoder.planner = Planner(costs(verify_slope=0.3, draft=0.01), {"T0": (0.0,), "T1": (0.0,)}, "shipped")
    assert decoder.planner.plan(T1).tree is None  # plain decoding: a lone root walked the cheapest way
    out = decoder.generate(PROMPT, 4, sampling=T1, seed=0)
    assert (
        out.verification == "token"
        and out.token_ids == decoder.generate(PROMPT, 4, tree=None, sampling=T1, seed=0).token_ids
    )


def test_a_round_costs_its_parts_and_its_fixed_cost_in_plain_rounds():
    base = dataclasses.replace(costs(), node_draft=0.02, walk={"T0": 0.0, "T1": 0.1}, chain_walk=0.04)
    timed = dataclasses.replace(base, overhead={"T0": 0.3, "T1": 0.3}, plain={"T0": 1.2, "T1": 1.2})
    assert timed.round_cost(0, 0) == base.round_cost(0, 0) == 1.0  # plain decoding is the unit
    assert timed.round_cost(3, 3, "T1") == pytest.approx((base.verify[3] + 3 * (0.05 + 0.04) + 0.3) / 1.2)
    assert timed.round_cost(4, 2, "T1") == pytest.approx((base.verify[4] + 2 * 0.03 + 4 * 0.12 + 0.3) / 1.2)
    assert timed.verify_with_nodes("T1")[4] == pytest.approx(timed.round_cost(4, 0, "T1"))
    # a tree level's further row dearer than a chain's whole level (a tiny draft's sampling per
    # node): a chain still costs c a level, a tree c a level and node_draft a further row
    dear_rows = dataclasses.replace(base, node_draft=0.2)
    assert dear_rows.round_cost(3, 3, "T0") == pytest.approx(base.verify[3] + 3 * 0.05)
    assert dear_rows.round_cost(4, 2, "T0") == pytest.approx(base.verify[4] + 2 * 0.05 + 2 * 0.2)
    assert Costs.from_json(timed.to_json()) == timed
    # a greedy round's fixed cost and plain round are its own (no sampling, no block rule)
    greedy = dataclasses.replace(timed, overhead={"T0": 0.1, "T1": 0.3}, plain={"T0": 1.0, "T1": 1.2})
    assert greedy.round_cost(3, 3, "T1") == timed.round_cost(3, 3, "T1")
    assert greedy.round_cost(3, 3, "T0") == pytest.approx(base.verify[3] + 3 * 0.05 + 0.1)
    with pytest.raises(ValueError, match="version"):  # a record of one fixed cost for both classes
        Costs.from_json({**timed.to_json(), "overhead": 0.3, "plain": 1.2})
    # a chain is scored under the causal pattern, at its own measured price; a tree under a mask
    causal = dataclasses.replace(base, chain=tuple(0.9 * v for v in base.verify[: AUTO_MAX_DEPTH + 1]))
    assert causal.round_cost(3, 3, "T1") == pytest.approx(base.round_cost(3, 3, "T1") - 0.1 * base.verify[3])
    assert causal.round_cost(4, 2, "T1") == base.round_cost(4, 2, "T1")
    assert Costs.from_json(causal.to_json()) == causal


@pytest.mark.parametrize("sampling_name", ["T1", "T0.6-topk2"])
def test_the_automatic_tree_is_lossless_by_enumeration(sampling_name):
    """A planned tree (two children at the root, deeper chains) whose depth moves with the
    request's acceptance: the emitted joint distribution is the target's."""
    sampling = SAMPLINGS[sampling_name]
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    decoder.planner = Planner(costs(draft=0.01), {"T0": (0.5, 0.3), "T1": (0.5, 0.3)}, "shipped")
    shape = decoder.planner.plan(sampling).tree.shape
    assert shape.n_nodes > shape.depth > 1  # a tree, not a chain
    got = enumerate_decoder(decoder, TreeConfig(), sampling)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, target.joint(PROMPT, K, sampling)) < 1e-9


def test_greedy_automatic_trees_give_the_targets_argmax_and_say_what_they_chose():
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    decoder.planner = planner()
    got = enumerate_decoder(decoder, TreeConfig(), GREEDY, k=4)
    assert got == pytest.approx(target.joint(PROMPT, 4, GREEDY)) and len(got) == 1
    out = decoder.generate(list(PROMPT), 4, sampling=GREEDY)
    assert out.plan == decoder.planner.plan(GREEDY).describe() and out.verification == "traversal"
    assert decoder.generate(list(PROMPT), 4, sampling=GREEDY, verification="block").verification == "block"


def test_a_batch_of_automatic_trees_equals_each_request_alone():
    dec = SpeculativeDecoder(tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))
    dec.planner = planner()
    prompts = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]
    batch = dec.generate_batch(prompts, 12, sampling=T1, seeds=[0, 1, 2])
    for prompt, seed, out in zip(prompts, [0, 1, 2], batch):
        assert out.token_ids == dec.generate(prompt, 12, sampling=T1, seed=seed).token_ids


def test_costs_are_measured_once_per_key_and_kept_on_disk(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return costs(draft=0.1 * len(calls))

    cache = CostCache(tmp_path)
    settings = {"target": ["t", 1], "dtypes": ["bf16"]}
    first = cache.get(settings, measure)
    assert cache.get(settings, measure) == first and len(calls) == 1  # memory
    assert CostCache(tmp_path).get(settings, measure) == first and len(calls) == 1  # disk, a new process
    other = CostCache(tmp_path).get({**settings, "dtypes": ["fp32"]}, measure)  # other settings
    assert other != first and len(calls) == 2
    # another machine: the key changes
    real = cost_cache.machine_key
    try:
        cost_cache.machine_key = lambda: {**real(), "cpu": "another"}
        assert CostCache(tmp_path).get(settings, measure) != first and len(calls) == 3
    finally:
        cost_cache.machine_key = real
    # a corrupt or truncated entry is measured again, never an error
    path = tmp_path / f"{CostCache.key(settings)}.json"
    path.write_text("{not json")
    assert CostCache(tmp_path).get(settings, measure).draft == pytest.approx(0.4) and len(calls) == 4
    assert json.loads(path.read_text())["draft"] == pytest.approx(0.4)
    path.write_text(json.dumps({"verify": [1.0], "draft": 0.1, "t1": 0.0}))  # an older layout
    assert CostCache(tmp_path).get(settings, measure).draft == pytest.approx(0.5)
    # a cache that cannot be written: measured, and used
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert CostCache(blocked / "sub").get(settings, measure).draft == pytest.approx(0.6)


def test_a_models_key_follows_its_weights_and_config_not_the_files_beside_them(tmp_path):
    """Editing a README or acceptance.json beside a model keeps its measured costs; new weights,
    a new config or another file of the model measure them again."""
    import os

    model = tmp_path / "head"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"1234")
    (model / "README.md").write_text("a head")
    key = files_key(model)
    assert [f[0] for f in key[1:]] == ["config.json", "model.safetensors"]
    (model / "README.md").write_text("a head, measured again")
    (model / "acceptance.json").write_text("{}")
    assert files_key(model) == key
    (model / "model.safetensors").write_bytes(b"12345")  # new weights
    assert files_key(model) != key
    key = files_key(model)
    os.utime(model / "config.json", (1, 1))  # the config rewritten
    assert files_key(model) != key
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert files_key(gguf)[1] == ["m.gguf", 4, int(gguf.stat().st_mtime)]
    assert files_key("org/model") == ["org/model"] and files_key(None) is None


def test_the_first_measurement_written_wins(tmp_path):
    """Two processes that measure one key at once keep the first one written."""
    settings = {"target": ["t", 1]}
    a, b = CostCache(tmp_path), CostCache(tmp_path)
    first = a.get(settings, lambda: costs(draft=0.1))
    assert b.get(settings, lambda: costs(draft=0.2)) == first  # read from disk

    c, d = CostCache(tmp_path / "x"), CostCache(tmp_path / "x")
    path = tmp_path / "x" / f"{CostCache.key(settings)}.json"

    def slow_second():  # d measures while c writes
        c.get(settings, lambda: costs(draft=0.3))
        return costs(draft=0.4)

    assert d.get(settings, slow_second).draft == pytest.approx(0.3) and path.is_file()


def test_measured_costs_and_acceptance_of_a_real_decoder():
    dec = SpeculativeDecoder(tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))
    c = dec.planner.costs
    assert len(c.verify) == AUTO_MAX_NODES + 1 and c.verify[0] == 1.0
    assert all(b >= a for a, b in zip(c.verify[1:], c.verify[2:])) and c.draft > 0 and c.t1 > 0
    assert set(c.walk) == {"T0", "T1"} and min(c.walk.values()) >= 0 and c.node_draft >= 0
    assert set(c.plain) == set(c.overhead) == {"T0", "T1"} and min(c.plain.values()) > 0
    assert min(c.overhead.values()) >= 0
    assert len(c.chain) == AUTO_MAX_DEPTH + 1 and c.chain[0] == 1.0
    assert all(b >= a for a, b in zip(c.chain[1:], c.chain[2:]))
    assert Costs.from_json(json.loads(json.dumps(c.to_json()))) == c
    counts = measure_acceptance(dec, [[3, 4, 5], [6, 7]], T1, max_new_tokens=12)
    assert len(counts.visits) == 4 and counts.visits[0] > 0 and all(0 <= a <= 1 for a in counts.vector())


def test_acceptance_is_remembered_for_later_processes(tmp_path, monkeypatch):
    """A pair with no shipped acceptance plans with the prior, and its requests' counts are kept
    for the next process (this decoder keeps its vectors: a batch equals each request alone)."""
    monkeypatch.setattr(cost_cache, "COSTS", CostCache(tmp_path))
    dec = SpeculativeDecoder(tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))
    settings = {"target": ["a"], "draft": ["b"]}
    first = planner_for(costs, settings)
    assert first.sources == {"T0": "prior", "T1": "prior"}
    dec.planner = first
    dec.generate([3, 4, 5], 24, sampling=GREEDY)
    assert first.sources["T0"] == "prior"  # unchanged in this process
    later = planner_for(costs, settings)
    assert later.sources == {"T0": "measured", "T1": "prior"} and later.vectors["T0"] != first.vectors["T0"]
    shipped = planner_for(costs, settings, {"T0": (0.9,), "T1": (0.8,)})
    assert shipped.sources["T1"] == "shipped" and shipped.record is None


def test_cli_show_tree_says_which_tree_was_chosen(tmp_path, capsys, monkeypatch):
    from treespec import cli

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    cli.main(["generate", "def f(x):", "--max-new-tokens", "8", "--show-tree", "--temperature", "0"])
    assert "\ntree: auto: " in capsys.readouterr().out


def test_measurement_leaves_the_decoders_own_caches_alone():
    dec = SpeculativeDecoder(tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))
    dec.target_runner.prefill([3, 4, 5])
    before = (list(dec.target_runner.committed), dec.target_runner.n_slots)
    dec.planner.costs  # noqa: B018 - measures
    assert (list(dec.target_runner.committed), dec.target_runner.n_slots) == before
    assert torch.get_num_threads() >= 1


def test_a_measurement_is_announced_once_and_the_cli_shows_it(tmp_path, caplog, capsys):
    from treespec.cli import show_progress

    settings = {"target": "t"}
    measure = lambda: Costs(verify=(1.0,) * (AUTO_MAX_NODES + 1), draft=0.1, t1=0.01)  # noqa: E731
    with caplog.at_level("INFO", logger="treespec"):
        CostCache(tmp_path).get(settings, measure)
        CostCache(tmp_path).get(settings, measure)  # a later process: read from disk, silent
    assert [r.getMessage() for r in caplog.records] == [
        f"measuring this machine's costs for the automatic tree (once; kept in {tmp_path})"
    ]
    capsys.readouterr()  # (an earlier test's main() may have shown them already)
    show_progress()
    show_progress()  # main() twice in one process: still one line a message
    logging.getLogger("treespec.planning.cache").info("measuring")
    assert capsys.readouterr().err == "treespec: measuring\n"


def test_planning_time_is_not_counted_as_prefill():
    """The first request of a process may measure the costs (seconds): its own line in the
    stats (`plan_seconds`), neither prefill nor decode, so tokens/s stays the decode's."""
    import time

    dec = SpeculativeDecoder(tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))

    def slow():
        time.sleep(0.4)
        return costs()

    dec.planner = Planner(slow, {"T0": (0.6, 0.1), "T1": (0.5, 0.1)}, "shipped")
    out = dec.generate([3, 4, 5], 8, sampling=GREEDY)
    s = out.stats
    assert s.prefill_seconds < 0.3 <= s.plan_seconds < s.total_seconds and s.other_seconds < 0.3
    assert s.tokens_per_second == pytest.approx(
        s.tokens / (s.total_seconds - s.prefill_seconds - s.plan_seconds)
    )


def test_costs_measured_while_the_machine_is_busy_are_kept_for_a_while_only(tmp_path, monkeypatch, caplog):
    calls = []

    def measure():
        calls.append(1)
        return costs(draft=0.1 * len(calls))

    settings = {"target": ["t", 1]}
    monkeypatch.setattr(cost_cache, "CpuWatch", lambda: Watch(busy=True, others=0.6))
    with caplog.at_level(logging.WARNING, logger="treespec.planning.cache"):
        first = CostCache(tmp_path).get(settings, measure)
    assert "60% of the CPUs" in caplog.text
    # processes started meanwhile plan with the same costs
    assert CostCache(tmp_path).get(settings, measure) == first and len(calls) == 1
    (path,) = tmp_path.glob("*.json")
    old = path.stat().st_mtime - cost_cache.BUSY_KEEP_SECONDS - 1
    os.utime(path, (old, old))  # later ones measure again, and keep a quiet measurement for good
    monkeypatch.setattr(cost_cache, "CpuWatch", lambda: Watch(busy=False, others=0.01))
    assert CostCache(tmp_path).get(settings, measure).draft == pytest.approx(0.2) and len(calls) == 2
    os.utime(path, (old, old))
    assert CostCache(tmp_path).get(settings, measure).draft == pytest.approx(0.2) and len(calls) == 2


@dataclasses.dataclass
class Watch:
    busy: bool = False
    others: float | None = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def describe(self):
        return f"{self.others:.0%}"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="reads Linux's /proc/stat")
def test_cpu_watch_counts_another_process_and_not_this_one():
    mine = sorted(os.sched_getaffinity(0))
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.4: pass\n"
    with CpuWatch() as watch:  # another process spins on one of this process's CPUs
        child = subprocess.Popen(
            [sys.executable, "-c", spin], preexec_fn=lambda: os.sched_setaffinity(0, mine[:1])
        )
        child.wait()
    assert (
        watch.others is not None
        and watch.others >= 0.7 / len(mine)
        and watch.busy == (watch.others > watch.threshold)
    )
    with CpuWatch() as short:  # too short to judge
        pass
    assert short.others is None and not short.busy
