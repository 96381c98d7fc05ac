"""Sampling transforms and the residual algebra."""

from __future__ import annotations

import pytest
import torch

from treespec import SamplingConfig
from treespec.sampling import check_finite, nonfinite_rows, probs, remove_token, residual

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1], dtype=torch.float64))


def test_temperature_one_is_softmax_and_float64_is_kept():
    p = probs(LOGITS, SamplingConfig())
    assert p.dtype == torch.float64
    torch.testing.assert_close(p, torch.softmax(LOGITS, -1), rtol=0, atol=1e-15)
    assert probs(LOGITS.float(), SamplingConfig()).dtype == torch.float32
    assert probs(LOGITS.bfloat16(), SamplingConfig()).dtype == torch.float32


def test_temperature_sharpens():
    p = probs(LOGITS, SamplingConfig(temperature=0.5))
    want = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1], dtype=torch.float64) ** 2
    torch.testing.assert_close(p, want / want.sum(), rtol=0, atol=1e-15)


def test_greedy_is_one_hot_argmax_ignoring_top_k_and_top_p():
    p = probs(LOGITS, SamplingConfig(temperature=0, top_k=3, top_p=0.2))
    assert p.tolist() == [0, 1, 0, 0, 0]


def test_top_k_keeps_k_most_likely():
    p = probs(LOGITS, SamplingConfig(top_k=2))
    torch.testing.assert_close(
        p, torch.tensor([0, 4 / 7, 3 / 7, 0, 0], dtype=torch.float64), rtol=0, atol=1e-15
    )


@pytest.mark.parametrize(
    "top_p,kept", [(0.39, [1]), (0.41, [1, 2]), (0.69, [1, 2]), (0.71, [1, 2, 3]), (1.0, [0, 1, 2, 3, 4])]
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, kept):
    p = probs(LOGITS, SamplingConfig(top_p=top_p))
    assert torch.nonzero(p).flatten().tolist() == kept
    assert abs(float(p.sum()) - 1) < 1e-12


def test_top_k_then_top_p_apply_to_batched_rows():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    p = probs(rows, SamplingConfig(top_k=3, top_p=0.8))
    # top-3 renormalised: .4/.85 + .3/.85 = .82 reaches .8 after two tokens
    assert torch.nonzero(p[0]).flatten().tolist() == [1, 2]
    assert torch.nonzero(p[1]).flatten().tolist() == [2, 3]


def test_residual():
    r = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    torch.testing.assert_close(residual(r, q), torch.tensor([1.0, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(residual(r, r.clone()), r)  # zero-probability rejection: keep r
    rows = torch.stack([r, q])  # batched rows: each row its own residual
    torch.testing.assert_close(
        residual(rows, torch.stack([q, r])),
        torch.tensor([[1.0, 0, 0], [0, 2 / 3, 1 / 3]], dtype=torch.float64),
    )


def test_remove_token_and_uniform_fallback():
    q = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(remove_token(q, 0), torch.tensor([0, 1.0, 0, 0], dtype=torch.float64))
    drawn = torch.tensor([False, False, False, False])
    left = remove_token(torch.tensor([1.0, 0, 0, 0], dtype=torch.float64), 0, drawn)
    torch.testing.assert_close(left, torch.tensor([0, 1 / 3, 1 / 3, 1 / 3], dtype=torch.float64))
    assert drawn.tolist() == [True, False, False, False]  # x recorded as drawn


def test_check_finite():
    check_finite(torch.tensor([0.0, float("-inf")]), "target")  # a forbidden token is fine
    for bad in ([0.0, float("nan")], [0.0, float("inf")], [float("-inf"), float("-inf")]):
        with pytest.raises(ValueError, match="target"):
            check_finite(torch.tensor(bad), "target")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_rows_flags_nan_posinf_and_all_neginf_rows(dtype):
    inf = float("inf")
    rows = torch.tensor(
        [
            [0.0, 1.0, 2.0],  # fine
            [-inf, 1.0, -inf],  # forbidden tokens are fine
            [0.0, float("nan"), 5.0],  # NaN anywhere
            [inf, 0.0, 1.0],  # +inf
            [-inf, -inf, -inf],  # nothing left to sample
            [float("nan"), -inf, -inf],
        ],
        dtype=dtype,
    )
    assert nonfinite_rows(rows).tolist() == [False, False, True, True, True, True]
    assert nonfinite_rows(rows[0]).item() is False  # a single row
    for bad in rows[2:]:
        with pytest.raises(ValueError):
            check_finite(bad[None], "target")
    check_finite(rows[:2], "target")


def test_argmax_is_torchs_first_maximum_with_nan_as_the_maximum():
    """`sampling.argmax` (numpy's vectorised argmax for CPU float32) returns what
    `torch.argmax` does: the first of tied maxima, the first NaN, rows of any shape and dtype."""
    from treespec.sampling import argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen)
    x[1, 7] = x[1, 250] = x[1].max() + 1  # a tie: the first wins
    x[2, 40] = x[2, 30] = float("nan")  # NaN counts as the maximum
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    for t in (x, x.double(), x[0], x.bfloat16()):
        got = argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))
    assert argmax(x).tolist()[1:4] == [7, 30, 0]
