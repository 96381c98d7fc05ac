"""Dynamic (budgeted) trees and adaptive depth: the shapes they produce."""

from __future__ import annotations

from treespec import ModelDrafter, SamplingConfig, TreeConfig
from treespec.drafters import draft_tree
from treespec.planning import DepthPolicy
from treespec.proposal import Walk
from treespec.rng import TorchRng

from .toy import TableModel, TableRunner

V = 6
GREEDY = SamplingConfig(temperature=0)


def drafter(tree: TreeConfig, model: TableModel) -> ModelDrafter:
    d = ModelDrafter(TableRunner(model), tree)
    d.start([1, 2, 3], SamplingConfig(temperature=1.0), TorchRng(0))
    return d


def test_dynamic_tree_keeps_the_budget_most_probable_nodes():
    model = TableModel(V, seed=5)
    full = draft_tree(drafter(TreeConfig(3, 3, "dynamic", budget=100), model), [1, 2, 3], 3)
    pruned = draft_tree(drafter(TreeConfig(3, 3, "dynamic", budget=5), model), [1, 2, 3], 3)
    assert len(full.tree) == 1 + 3 + 9 + 9 and len(pruned.tree) == 6

    # the kept nodes are the 5 best token paths of the full tree
    def paths(d):
        return {tuple(d.tree.tokens[n] for n in d.tree.path_to(i)[1:]) for i in range(1, len(d.tree))}

    assert paths(pruned) <= paths(full)


def test_hf_adaptive_depth_grows_when_all_accepted_and_shrinks_otherwise():
    cfg = TreeConfig(1, 2, adaptive="hf", depth_min=1, depth_max=6)
    d, policy = drafter(cfg, TableModel(V, seed=5)), DepthPolicy(cfg)
    ctx = [1, 2, 3]
    depths = []
    for _ in range(3):  # everything accepted: +2 per round, capped at 6
        draft = draft_tree(d, ctx, policy.depth)
        assert draft.tree.max_depth == policy.depth
        path = tuple(draft.tree.path_to(draft.tree.leaves()[0]))
        walk = Walk(path, 0, "bonus")
        d.observe(draft, walk)
        policy.update(d, draft, walk, policy.depth)
        ctx = ctx + [draft.tree.tokens[n] for n in path[1:]] + [0]
        depths.append(policy.depth)
    assert depths == [4, 6, 6]
    for _ in range(7):  # nothing accepted: -1 per round, floored at 1
        draft = draft_tree(d, ctx, policy.depth)
        walk = Walk((0,), 0, "correction")
        d.observe(draft, walk)
        step = policy.update(d, draft, walk, policy.depth)
        ctx = ctx + [0]
    assert policy.depth == 1 and step.next_depth == 1


def test_entropy_adaptive_depth_follows_draft_confidence():
    cfg = TreeConfig(1, 3, adaptive="entropy", depth_min=1, depth_max=8, ema_beta=0.0)
    depths = {}
    for name, scale in (("sharp", 30), ("flat", 0.01)):
        d, policy = drafter(cfg, TableModel(V, seed=5, scale=scale)), DepthPolicy(cfg)
        draft = draft_tree(d, [1, 2, 3], policy.depth)
        walk = Walk((0,), 0, "correction")
        d.observe(draft, walk)
        step = policy.update(d, draft, walk, policy.depth)
        assert step.from_drafter and step.depth == 3
        depths[name] = policy.depth
    assert depths["sharp"] >= 7 and depths["flat"] == 1


def test_sequoia_drafter_reproduces_the_shape():
    from treespec.sequoia import optimal_shape

    shape = optimal_shape((0.5, 0.3, 0.1), 9, 3)
    d = drafter(TreeConfig(depth=3, strategy="sequoia", shape=shape), TableModel(50, seed=5))
    draft = draft_tree(d, [1, 2, 3], 3)

    def rank_paths(parents):  # each node as its path of sibling ranks: order-independent
        kids, out = {}, {0: ()}
        for i, p in enumerate(parents[1:], start=1):
            kids.setdefault(p, []).append(i)
            out[i] = out[p] + (len(kids[p]) - 1,)
        return sorted(out.values())

    assert rank_paths(draft.tree.parents) == rank_paths(shape.parents)
