"""TokenTree: structure derived from parent pointers, constructors, validation."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec import TokenTree

from .toy import trees


def brute_ancestors(tree: TokenTree, i: int) -> set[int]:
    out = {i}
    while tree.parents[i] != -1:
        i = tree.parents[i]
        out.add(i)
    return out


@given(trees(), st.integers(0, 1000))
def test_mask_positions_and_paths(tree, prefix_len):
    n = len(tree)
    mask = tree.ancestor_mask
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == brute_ancestors(tree, i)
        assert mask[i, i]  # every row sees itself: no fully masked SDPA row
    pos = tree.positions(prefix_len)
    assert pos[0] == prefix_len
    for i in range(1, n):
        assert pos[i] == pos[tree.parents[i]] + 1
    # root-to-leaf paths: one per leaf, each a parent chain, covering every node
    paths = tree.paths()
    assert len(paths) == len(tree.leaves())
    for path in paths:
        assert path[0] == 0 and tree.is_leaf(path[-1])
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))
    assert {v for p in paths for v in p} == set(range(n))


@given(trees())
def test_networkx_export_is_an_arborescence(tree):
    g = tree.to_networkx()
    assert g.number_of_nodes() == len(tree)
    assert nx.is_arborescence(g)
    assert all(g.nodes[i]["token"] == tree.tokens[i] and g.nodes[i]["depth"] == tree.depths[i] for i in g)


@given(trees(max_nodes=12))
@settings(max_examples=50)
def test_from_choices_round_trip(tree):
    # the rank of a node among its siblings is its index in children(parent)
    choices, tokens_at = [], {}
    rank_path = {0: ()}
    for i in range(1, len(tree)):
        rank = tree.children(tree.parents[i]).index(i)
        rank_path[i] = rank_path[tree.parents[i]] + (rank,)
        choices.append(list(rank_path[i]))
        tokens_at[(len(rank_path[i]) - 1, rank)] = tokens_at.get(
            (len(rank_path[i]) - 1, rank), tree.tokens[i]
        )
    # Medusa candidates are per (depth, rank); only consistent when every node at a
    # (depth, rank) has the same token, so rebuild the expected tree from the candidates
    max_rank = max((r for (_, r) in tokens_at), default=0) + 1
    candidates = [[tokens_at.get((d, r), 0) for r in range(max_rank)] for d in range(tree.max_depth)]
    built = TokenTree.from_choices(tree.tokens[0], choices, candidates)
    assert built.parents == tree.parents
    assert all(
        built.tokens[i] == candidates[len(rank_path[i]) - 1][rank_path[i][-1]] for i in range(1, len(tree))
    )


def test_chain_and_small_examples():
    chain = TokenTree.chain([5, 6, 7])
    assert chain.parents == (-1, 0, 1) and chain.depths == (0, 1, 2) and chain.paths() == [[0, 1, 2]]
    t = TokenTree.from_choices(7, [[0], [1], [0, 0]], [[3, 5], [9]])
    assert t.tokens == (7, 3, 5, 9) and t.parents == (-1, 0, 0, 1)
    assert t.positions(10).tolist() == [10, 11, 11, 12]
    assert t.ancestor_mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


@pytest.mark.parametrize(
    "tokens,parents,match",
    [
        ([], [], "at least the root"),
        ([1, 2], [-1], "parent pointers"),
        ([1, 2], [0, 0], "root"),
        ([1, 2, 3], [-1, 2, 1], "topological"),  # a cycle 1 <-> 2
        ([1, 2], [-1, 1], "topological"),  # self-loop
        ([1, -4], [-1, 0], "token id"),
    ],
)
def test_invalid_trees_are_rejected(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        TokenTree(tokens, parents)


def test_token_outside_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        TokenTree([1, 99], [-1, 0], vocab_size=50)


@pytest.mark.parametrize(
    "choices,candidates,match",
    [
        ([[0, 0]], [[1], [2]], "prefix"),
        ([[0], [0]], [[1]], "twice"),
        ([[2]], [[1]], "rank"),
        ([[]], [[1]], "empty"),
    ],
)
def test_invalid_choices_are_rejected(choices, candidates, match):
    with pytest.raises(ValueError, match=match):
        TokenTree.from_choices(0, choices, candidates)
