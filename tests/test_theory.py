"""The closed forms of treespec.theory against the papers' own printed numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treespec import theory
from treespec.sequoia import tree_expected_tokens as sequoia_expected_tokens

# Leviathan et al. 2023, Table 1 (c = c_hat = 0): alpha, gamma, operations, speed
TABLE1 = [
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
]


@pytest.mark.parametrize("alpha,gamma,ops,speed", TABLE1)
def test_leviathan_table1(alpha, gamma, ops, speed):
    assert round(theory.walltime_improvement(alpha, gamma, c=0.0), 2) == speed
    assert round(theory.chain_expected_tokens(alpha, gamma), 2) == speed
    assert round(theory.operations_factor(alpha, gamma, c_hat=0.0), 2) == ops


def test_chain_expected_tokens_is_the_truncated_geometric_mean():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, g = float(rng.uniform(0, 0.99)), int(rng.integers(0, 12))
        assert theory.chain_expected_tokens(a, g) == pytest.approx(sum(a**i for i in range(g + 1)))
    assert theory.chain_expected_tokens(1.0, 4) == 5.0
    assert theory.chain_expected_tokens(0.0, 4) == 1.0


def test_walltime_and_corollary_3_9():
    for a in (0.3, 0.6, 0.9):
        for c in (0.0, 0.05, 0.2):
            # gamma = 1 attains the Cor. 3.9 bound exactly; the optimum is at least as good
            assert theory.walltime_improvement(a, 1, c) == pytest.approx(theory.improvement_lower_bound(a, c))
            g = theory.optimal_gamma(a, c)
            assert theory.walltime_improvement(a, g, c) >= theory.improvement_lower_bound(a, c) - 1e-12
    with pytest.raises(ValueError):
        theory.walltime_improvement(1.2, 2, 0.1)


def test_optimal_gamma_is_the_argmax():
    for a in np.linspace(0.05, 0.95, 19):
        for c in (0.01, 0.05, 0.1, 0.2, 0.5):
            vals = [theory.walltime_improvement(a, g, c) for g in range(1, 60)]
            assert theory.optimal_gamma(a, c) == 1 + int(np.argmax(vals))
    # Sec. 3.5 / Fig. 3 shape: more acceptance or cheaper drafts -> longer drafts
    assert theory.optimal_gamma(0.9, 0.01) > theory.optimal_gamma(0.9, 0.1) > theory.optimal_gamma(0.6, 0.1)
    assert theory.optimal_gamma(0.3, 0.9, min_gamma=0) == 0  # drafting does not pay


def test_alpha_from_distributions():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.3, 0.5])
    assert theory.alpha(p, q) == pytest.approx(0.7)
    assert theory.alpha(torch.tensor(np.stack([p, p])), torch.tensor(np.stack([q, p]))) == pytest.approx(0.85)
    assert theory.alpha(p, p) == pytest.approx(1.0)


def test_stratos_expected_accepted_length():
    assert round(theory.expected_accepted_length(0.8, T=10), 4) == 4.5705
    assert theory.expected_accepted_length([0.8] * 10) == pytest.approx(4.5705, abs=5e-5)
    assert theory.expected_accepted_length(0.8, 10) == pytest.approx(theory.chain_expected_tokens(0.8, 10))
    # position-dependent acceptance: 1 + b1 + b1 b2 + b1 b2 b3
    assert theory.expected_accepted_length([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    with pytest.raises(ValueError):
        theory.expected_accepted_length(0.8)


def test_multidraft_form():
    assert theory.multidraft_acceptance(0.8, 1) == pytest.approx(0.8)
    assert theory.multidraft_acceptance(0.8, 2) == pytest.approx(0.96)
    one, three = (theory.expected_accepted_length(theory.multidraft_acceptance(0.8, k), 10) for k in (1, 3))
    assert one == pytest.approx(4.5705, abs=5e-5) and three > one


def test_tree_forms_reuse_sequoia():
    assert theory.tree_expected_tokens is sequoia_expected_tokens
    # a chain under positional acceptance (a, 0, ...) is Eq. 1
    a = 0.7
    assert theory.tree_expected_tokens(theory.chain_parents(5), [a]) == pytest.approx(
        theory.chain_expected_tokens(a, 5)
    )
    acc = [0.6, 0.2, 0.1]
    binary = theory.kary_parents(2, 2)
    assert len(binary) == 1 + 2 + 4
    assert theory.tree_expected_tokens(binary, acc) == pytest.approx(1 + 0.8 + 0.8 * 0.8)
    assert theory.kary_parents(1, 4) == theory.chain_parents(4)
