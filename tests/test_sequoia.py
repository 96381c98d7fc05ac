"""Sequoia: the dynamic program equals brute force; drafting along a shape is lossless."""

from __future__ import annotations

import itertools

import pytest

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.sequoia import TreeShape, optimal_shape, tree_expected_tokens

from .toy import PROMPT, SAMPLINGS, TableRunner, enumerate_decoder, max_abs_diff, pair

ACCEPTANCES = [(0.6, 0.2, 0.1), (0.8, 0.1), (0.3, 0.25, 0.2, 0.15), (0.9,)]


def all_shapes(n: int):
    """Every tree with n draft nodes as parent lists (rank = sibling order), isomorphs included."""
    for parents in itertools.product(*[range(i) for i in range(1, n + 1)]):
        yield (-1,) + parents


def depth_of(parents):
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return max(d)


@pytest.mark.parametrize("acc", ACCEPTANCES)
@pytest.mark.parametrize("n", range(0, 7))
@pytest.mark.parametrize("max_depth", [1, 2, 3, 6])
def test_dynamic_program_equals_brute_force(acc, n, max_depth):
    best = max(
        tree_expected_tokens(p, acc) for m in range(n + 1) for p in all_shapes(m) if depth_of(p) <= max_depth
    )
    shape = optimal_shape(acc, n, max_depth)
    assert shape.expected_tokens == pytest.approx(best, abs=1e-12)
    assert tree_expected_tokens(shape.parents, acc) == pytest.approx(best, abs=1e-12)
    assert shape.n_nodes <= n and shape.depth <= max_depth


@pytest.mark.parametrize("levels", [((0.5, 0.3), (0.9,)), ((0.8, 0.1), (0.4, 0.3), (0.95,))])
@pytest.mark.parametrize("n", [3, 5, 6])
def test_acceptance_by_level_equals_brute_force(levels, n):
    """One vector per level of the node drawn from (the last for deeper ones): the DP still
    finds the best shape, and a draft that accepts more deeper gets deeper shapes."""
    best = max(
        tree_expected_tokens(p, levels) for m in range(n + 1) for p in all_shapes(m) if depth_of(p) <= 4
    )
    shape = optimal_shape(levels, n, 4)
    assert shape.expected_tokens == pytest.approx(best, abs=1e-12)
    assert tree_expected_tokens(shape.parents, levels) == pytest.approx(best, abs=1e-12)
    assert tree_expected_tokens((-1, 0, 1), levels) == pytest.approx(1 + levels[0][0] * (1 + levels[1][0]))
    flat = optimal_shape(levels[0], n, 4)
    assert shape.depth >= flat.depth


def test_cost_weighting_against_brute_force():
    acc = (0.6, 0.2, 0.1)
    verify_cost = [1.0 + 0.15 * n for n in range(9)]
    shape = optimal_shape(acc, 8, 4, verify_cost=verify_cost, draft_cost=0.1)

    def rate(p):
        return tree_expected_tokens(p, acc) / (verify_cost[len(p) - 1] + depth_of(p) * 0.1)

    best = max(rate(p) for m in range(7) for p in all_shapes(m) if depth_of(p) <= 4)
    assert rate(shape.parents) >= best - 1e-12  # brute force to 6 nodes; the DP searched to 8


def test_shape_round_trips_through_json(tmp_path):
    shape = optimal_shape((0.7, 0.2), 6, 3)
    shape.save(tmp_path / "shape.json")
    loaded = TreeShape.load(tmp_path / "shape.json")
    assert loaded.parents == shape.parents and loaded.expected_tokens == pytest.approx(shape.expected_tokens)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot read a tree shape"):
        TreeShape.load(tmp_path / "bad.json")


def test_invalid_inputs():
    with pytest.raises(ValueError, match="summing"):
        optimal_shape((0.8, 0.5), 4, 2)
    with pytest.raises(ValueError, match="shape is required"):
        TreeConfig(strategy="sequoia")
    with pytest.raises(ValueError, match="topological"):
        TreeShape((-1, 2, 0))


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS) + ["greedy"])
@pytest.mark.parametrize("parents", [(-1, 0, 0, 1), (-1, 0, 1, 0)], ids=["wide-then-deep", "deep-first"])
def test_drafting_along_a_shape_is_lossless(parents, sampling_name):
    sampling = SAMPLINGS.get(sampling_name, SamplingConfig(temperature=0))
    target, draft = pair()
    decoder = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    tree = TreeConfig(depth=2, strategy="sequoia", shape=TreeShape(parents))
    got = enumerate_decoder(decoder, tree, sampling)
    assert max_abs_diff(got, target.joint(PROMPT, 3, sampling)) < 1e-9
