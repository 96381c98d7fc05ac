"""Tree attention math of the native backend (treespec.backends.attention), on CPU.

masked_attention is checked against torch's SDPA; the cascade (prefix half + masked tree half,
merged by log-sum-exp) against masked_attention over the full mask; the flash-attn plumbing
against a fake `flash_attn` module that enforces what flash-attn's own source requires; the
forward's per-layer attention over the KV pool (one lane, packed lanes, the compiled graph's
version) against masked_attention over what each lane's cache row holds.
"""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.backends import attention
from treespec.backends.attention import (
    LaneAttention,
    PackedAttention,
    cascade_attention,
    flash_available,
    flash_prefix_attention,
    graph_lane_attention,
    masked_attention,
    merge_attention,
    reference_prefix_attention,
)
from treespec.backends.base import causal_visible, lanes_mask

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

TREES = [
    [-1],  # root alone (n = 1)
    [-1, 0, 1, 2],  # chain: linear speculation
    [-1, 0, 0, 0, 0],  # star
    [-1, 0, 0, 1, 1, 2, 3, 5],  # branching, uneven depths
]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self mask [n, n] from parent pointers, one pass (as DESIGN.md builds it)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def full_mask(prefix_len: int, tmask: torch.Tensor) -> torch.Tensor:
    """[prefix columns all True | tree mask], for [n, m] or [B, n, m] tree masks."""
    prefix = torch.ones(*tmask.shape[:-1], prefix_len, dtype=torch.bool)
    return torch.cat([prefix, tmask], dim=-1)


def qkv(B, Hkv, g, n, S, D=16, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, Hkv * g, n, D, dtype=dtype)  # [B, Hq, n, D]
    k = torch.randn(B, Hkv, S, D, dtype=dtype)  # [B, Hkv, S, D]
    v = torch.randn(B, Hkv, S, D, dtype=dtype)
    return q, k, v


@st.composite
def parents_lists(draw, max_nodes: int = 9):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


# ---------------------------------------------------------------- masked_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("batched_mask", [False, True])
def test_masked_attention_matches_sdpa(dtype, g, batched_mask):
    B, Hkv, n, S = 2, 2, 5, 11
    q, k, v = qkv(B, Hkv, g, n, S, dtype=dtype, seed=g)
    mask = torch.rand(B if batched_mask else 1, n, S) < 0.5
    mask[..., torch.arange(n), torch.arange(n)] = True  # every row attends somewhere
    mask = mask if batched_mask else mask[0]

    out, lse = masked_attention(q, k, v, mask)

    k_rep, v_rep = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [B, Hq, S, D]
    sdpa_mask = mask.unsqueeze(1) if batched_mask else mask  # broadcast over heads
    expected = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=sdpa_mask)
    scores = (q @ k_rep.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, Hq, n, S]
    expected_lse = torch.logsumexp(scores.masked_fill(~sdpa_mask, float("-inf")), dim=-1)

    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == dtype and lse.shape == (B, Hkv * g, n)
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=TOL[dtype], rtol=0)


@pytest.mark.cpu
def test_masked_attention_bf16_does_softmax_in_fp32():
    q, k, v = qkv(1, 2, 3, 4, 9, dtype=torch.bfloat16)
    mask = torch.ones(4, 9, dtype=torch.bool)
    out, lse = masked_attention(q, k, v, mask)
    ref_out, ref_lse = masked_attention(q.float(), k.float(), v.float(), mask)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)  # identical math, no bf16 step
    torch.testing.assert_close(out, ref_out.bfloat16(), atol=0, rtol=0)


def test_masked_attention_rejects_bad_shapes():
    q, k, v = qkv(1, 2, 2, 3, 5)
    with pytest.raises(ValueError, match="mask"):
        masked_attention(q, k, v, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple"):
        masked_attention(q[:, :3], k, v, torch.ones(3, 5, dtype=torch.bool))


# ---------------------------------------------------------------- cascade == full masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("prefix_len", [0, 1, 37])
@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("parents", TREES, ids=lambda p: f"n{len(p)}")
def test_cascade_equals_masked_attention(parents, g, prefix_len, B, dtype):
    tmask = tree_mask(parents)
    n = len(parents)
    q, k, v = qkv(B, 2, g, n, prefix_len + n, dtype=dtype, seed=n + 10 * g)

    out = cascade_attention(q, k, v, prefix_len, tmask)

    expected, _ = masked_attention(q, k, v, full_mask(prefix_len, tmask))
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    trees=st.lists(parents_lists(), min_size=2, max_size=2),
    g=st.sampled_from([1, 2, 3, 4]),
    prefix_len=st.sampled_from([0, 1, 37]),
    B=st.sampled_from([1, 2]),
    batched_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cascade_random_trees(trees, g, prefix_len, B, batched_mask, seed):
    """Random trees, float64; a [B, n, m] mask gives each batch row its own tree (the shorter
    one padded to n nodes with extra children of the root)."""
    n = max(len(t) for t in trees)
    masks = [tree_mask(t + [0] * (n - len(t))) for t in trees]
    tmask = torch.stack(masks[:B]) if batched_mask else masks[0]
    q, k, v = qkv(B, 2, g, n, prefix_len + n, dtype=torch.float64, seed=seed)

    out = cascade_attention(q, k, v, prefix_len, tmask)

    expected, _ = masked_attention(q, k, v, full_mask(prefix_len, tmask))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


@pytest.mark.cpu
@pytest.mark.parametrize("prefix_len", [0, 1, 37])
@pytest.mark.parametrize("g", [1, 3])
def test_cascade_bf16(g, prefix_len):
    """bf16 inputs: the merge runs in fp32, so the cascade is as close to the fp32 answer as a
    one-shot bf16 attention is (two roundings: the prefix half's output and the result)."""
    parents = TREES[-1]
    tmask, n = tree_mask(parents), len(parents)
    q, k, v = qkv(2, 2, g, n, prefix_len + n, dtype=torch.bfloat16, seed=g)

    out = cascade_attention(q, k, v, prefix_len, tmask)

    exact, _ = masked_attention(q.float(), k.float(), v.float(), full_mask(prefix_len, tmask))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=0)


def test_cascade_ignores_slots_past_the_tree_block():
    """A static cache longer than prefix + tree: the unused tail (NaN here) is never read."""
    parents, prefix_len = TREES[-1], 7
    tmask, n = tree_mask(parents), len(parents)
    q, k, v = qkv(2, 2, 3, n, prefix_len + n)
    tail = torch.full((2, 2, 5, q.shape[-1]), float("nan"))
    out = cascade_attention(q, torch.cat([k, tail], 2), torch.cat([v, tail], 2), prefix_len, tmask)

    expected, _ = masked_attention(q, k, v, full_mask(prefix_len, tmask))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- merge_attention


def test_merge_is_symmetric():
    torch.manual_seed(0)
    out_a, out_b = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    lse_a, lse_b = 5 * torch.randn(2, 3, 4), 5 * torch.randn(2, 3, 4)
    ab = merge_attention(out_a, lse_a, out_b, lse_b)
    assert torch.equal(ab, merge_attention(out_b, lse_b, out_a, lse_a))


def test_merge_empty_side_and_extreme_magnitudes():
    torch.manual_seed(0)
    out_a, out_b = torch.randn(3, 8), torch.randn(3, 8)
    # lse = -inf: side a has no keys (as flash reports for an empty row: out 0, lse -inf)
    empty = torch.full((3,), float("-inf"))
    torch.testing.assert_close(merge_attention(torch.zeros(3, 8), empty, out_b, torch.zeros(3)), out_b)
    torch.testing.assert_close(merge_attention(out_b, torch.zeros(3), torch.zeros(3, 8), empty), out_b)
    # e^{±1e4} overflows any float; after subtracting the max the small side weighs 0
    big, small = torch.full((3,), 1e4), torch.full((3,), -1e4)
    torch.testing.assert_close(merge_attention(out_a, big, out_b, small), out_a)
    # equal huge lse: the plain average
    torch.testing.assert_close(merge_attention(out_a, big, out_b, big), (out_a + out_b) / 2)
    # a gap of log(3): weights 3/4 and 1/4
    gap = torch.log(torch.tensor(3.0)).expand(3)
    torch.testing.assert_close(
        merge_attention(out_a, gap, out_b, torch.zeros(3)), 0.75 * out_a + 0.25 * out_b
    )


@pytest.mark.cpu
def test_merge_bf16_in_fp32_returns_out_a_dtype():
    torch.manual_seed(0)
    out_a, out_b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8)
    lse_a, lse_b = torch.randn(4), torch.randn(4)
    merged = merge_attention(out_a, lse_a, out_b, lse_b)
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # e^a / (e^a + e^b)
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged, (w * out_a.float() + (1 - w) * out_b).bfloat16(), atol=0, rtol=0)


# ---------------------------------------------------------------- flash-attn plumbing (fake)


class FakeFlash:
    """Stands in for flash_attn.flash_attn_with_kvcache (flash-attn 2.8, read in
    flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp::mha_fwd_kvcache):
    enforces its input contract, computes the answer with masked_attention, and returns it in
    flash's layout: out [B, n, Hq, D] in q's dtype, lse [B, Hq, n] float32."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens=None, causal=False, return_softmax_lse=False):
        self.calls.append((q, k_cache, v_cache))
        B, n, Hq, D = q.shape
        Bc, S, Hkv, _ = k_cache.shape
        # what flash checks
        assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
        assert k_cache.dtype == v_cache.dtype == q.dtype
        assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "contiguous last dim"
        assert k_cache.shape == v_cache.shape and k_cache.shape[-1] == D and D <= 256
        assert Hq % Hkv == 0 and Bc >= B
        if isinstance(cache_seqlens, int):  # the Python wrapper's conversion
            cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (B,)
        assert cache_seqlens.is_contiguous() and int(cache_seqlens.max()) <= S
        # what the cascade needs from it
        assert causal is False and return_softmax_lse is True

        out = torch.empty_like(q)  # flash: out = empty_like(q), q's strides kept
        lse = torch.empty(B, Hq, n, dtype=torch.float32)
        for b, length in enumerate(cache_seqlens.tolist()):
            keys = torch.ones(n, length, dtype=torch.bool)
            o, lse[b] = masked_attention(
                q[b : b + 1].transpose(1, 2).float(),  # [1, Hq, n, D]
                k_cache[b : b + 1, :length].transpose(1, 2),  # [1, Hkv, length, D]
                v_cache[b : b + 1, :length].transpose(1, 2),
                keys,
            )
            out[b] = o[0].transpose(0, 1)  # [n, Hq, D]
        return out, lse


@pytest.fixture
def fake_flash(monkeypatch):
    fake = FakeFlash()
    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = fake
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return fake


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("prefix_len", [1, 37])
@pytest.mark.parametrize("g", [1, 3])
def test_cascade_with_fake_flash(fake_flash, g, prefix_len, B, dtype):
    parents = TREES[-1]
    tmask, n = tree_mask(parents), len(parents)
    q, k, v = qkv(B, 2, g, n, prefix_len + n + 3, dtype=dtype, seed=prefix_len)  # 3 spare slots

    out = cascade_attention(q, k, v, prefix_len, tmask, prefix_attention=flash_prefix_attention)

    ((fq, fk, fv),) = fake_flash.calls
    assert fk.data_ptr() == k.data_ptr() and fv.data_ptr() == v.data_ptr()  # the cache, not a copy
    assert fq.shape == (B, n, 2 * g, q.shape[-1]) and fk.shape == (B, k.shape[2], 2, k.shape[-1])
    reference = cascade_attention(q, k, v, prefix_len, tmask, prefix_attention=reference_prefix_attention)
    torch.testing.assert_close(out, reference, atol=0, rtol=0)
    short_k, short_v = k[:, :, : prefix_len + n], v[:, :, : prefix_len + n]
    exact, _ = masked_attention(q.float(), short_k.float(), short_v.float(), full_mask(prefix_len, tmask))
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=0)


def test_flash_prefix_attention_layout(fake_flash):
    q, k, v = qkv(2, 2, 3, 4, 20, dtype=torch.bfloat16)
    out, lse = flash_prefix_attention(q, k, v, 13)
    ref_out, ref_lse = reference_prefix_attention(q, k, v, 13)
    assert out.shape == q.shape and lse.shape == (2, 6, 4) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


def test_cascade_default_uses_flash_only_where_available(fake_flash, monkeypatch):
    tmask = tree_mask(TREES[-1])
    q, k, v = qkv(1, 2, 2, len(TREES[-1]), 20, dtype=torch.bfloat16)
    cascade_attention(q, k, v, 12, tmask)
    assert not fake_flash.calls  # CPU: the reference prefix
    monkeypatch.setattr(attention, "flash_available", lambda device: True)
    cascade_attention(q, k, v, 12, tmask)
    assert len(fake_flash.calls) == 1
    cascade_attention(q.float(), k.float(), v.float(), 12, tmask)
    assert len(fake_flash.calls) == 1  # flash is fp16/bf16 only: fp32 stays on the reference


def test_flash_unavailable_on_cpu():
    assert flash_available(torch.device("cpu")) is False
    assert flash_available("cpu") is False


# ---------------------------------------------------------------- attention over the KV pool
L_, HKV, D_ = 2, 2, 16  # layers, kv heads, head dim of the pools below


def pool(rows: int, cap: int = 96, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    """A KV pool [L, 2, R, Hkv, cap, D] of random keys and values (every slot filled)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L_, 2, rows, HKV, cap, D_, generator=g, dtype=dtype)


def new_qkv(n: int, heads: int, dtype=torch.float64, seed: int = 1) -> torch.Tensor:
    """A layer's rotated q, k and its v side by side: [n, Hq + 2 Hkv, D]."""
    return torch.randn(n, heads + 2 * HKV, D_, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def expected(kv, layer, row, S, n, qkv, heads, visible):
    """What a lane's attention must return, from first principles: the lane's row with the new k
    and v in slots [S, S+n), masked_attention of q over slots [0, S+n) under `visible`."""
    k = kv[layer, 0, row].clone()  # [Hkv, cap, D]
    v = kv[layer, 1, row].clone()
    k[:, S : S + n] = qkv[:, heads : heads + HKV].transpose(0, 1)
    v[:, S : S + n] = qkv[:, heads + HKV :].transpose(0, 1)
    q = qkv[:, :heads].transpose(0, 1)[None]  # [1, Hq, n, D]
    mask = causal_visible(n, S, kv.device) if visible is None else visible
    out, _ = masked_attention(q, k[None, :, : S + n], v[None, :, : S + n], mask)
    return out[0].transpose(0, 1).reshape(n, heads * D_), k, v


def random_visible(n: int, S: int, seed: int) -> torch.Tensor:
    """A tree's pattern: every cached slot, then the ancestors (random parents) and self."""
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return torch.cat([torch.ones(n, S, dtype=torch.bool), tree_mask(parents)], dim=1)


@pytest.mark.parametrize("fold_max", [0, attention.FOLD_MAX_QUERIES])
@pytest.mark.parametrize("n, pattern", [(1, "none"), (1, "tree"), (4, "causal"), (4, "tree"), (70, "causal")])
@pytest.mark.parametrize("g", [1, 3])
def test_lane_attention(g, n, pattern, fold_max, monkeypatch):
    """One lane (row 1 of 3) of n new tokens after S = 9 cached slots: the output is attention
    over the row with the new keys and values, which are written to slots [S, S+n) of that
    layer and row only. n = 1 with no pattern: the decode step (no mask); 70 > 64: enable_gqa."""
    monkeypatch.setattr(attention, "FOLD_MAX_QUERIES", fold_max)
    heads, S, row = HKV * g, 9, 1
    kv = pool(3)
    before = kv.clone()
    visible = random_visible(n, S, seed=n) if pattern == "tree" else None
    qkv = new_qkv(n, heads)
    attend = LaneAttention(kv, row, S, n, heads, visible, committed=S)
    for layer in range(L_):
        want, k, v = expected(before, layer, row, S, n, qkv, heads, visible)
        torch.testing.assert_close(attend(layer, qkv), want, atol=1e-12, rtol=0)
        assert torch.equal(kv[layer, 0, row], k) and torch.equal(kv[layer, 1, row], v)
    rows = [0, 2]
    assert torch.equal(kv[:, :, rows], before[:, :, rows])  # other lanes untouched


def test_lane_attention_single_node_after_pending_nodes_is_masked():
    """A single new node with pending nodes before it (S != committed) is not the decode step:
    its pattern applies, here one that skips the pending slot 8."""
    heads, S = 2 * HKV, 9
    kv = pool(1)
    before = kv.clone()
    visible = torch.ones(1, S + 1, dtype=torch.bool)
    visible[0, 8] = False
    attend = LaneAttention(kv, 0, S, 1, heads, visible, committed=8)
    qkv = new_qkv(1, heads)
    want, _, _ = expected(before, 0, 0, S, 1, qkv, heads, visible)
    torch.testing.assert_close(attend(0, qkv), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0]], ids=["consecutive", "gathered"])
@pytest.mark.parametrize("fold_max", [0, attention.FOLD_MAX_QUERIES])
def test_packed_attention(rows, fold_max, monkeypatch):
    """Several lanes' tokens packed: ragged sizes (padding), own starts, own patterns (None:
    causal); each lane gets what it would get alone, its own row written, no other."""
    monkeypatch.setattr(attention, "FOLD_MAX_QUERIES", fold_max)
    heads = 3 * HKV
    kv = pool(4)
    before = kv.clone()
    starts, ns = [9, 30, 2][: len(rows)], [5, 1, 3][: len(rows)]
    visibles = [random_visible(5, 9, seed=3), None, random_visible(3, 2, seed=4)][: len(rows)]
    qkvs = [new_qkv(n, heads, seed=10 + b) for b, n in enumerate(ns)]
    attend = PackedAttention(kv, rows, starts, ns, heads, visibles)
    for layer in range(L_):
        got = attend(layer, torch.cat(qkvs)).split(ns)
        for b, (row, S, n) in enumerate(zip(rows, starts, ns)):
            want, k, v = expected(before, layer, row, S, n, qkvs[b], heads, visibles[b])
            torch.testing.assert_close(got[b], want, atol=1e-12, rtol=0)
            assert torch.equal(kv[layer, 0, row], k) and torch.equal(kv[layer, 1, row], v)
    idle = [r for r in range(4) if r not in rows]
    assert torch.equal(kv[:, :, idle], before[:, :, idle])


@pytest.mark.parametrize("reduction", [True, False])
@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize("g", [1, 3])
def test_graph_lane_attention_equals_lane_attention(g, n, reduction, monkeypatch):
    """The compiled graph's attention (index_put_ into the pool, explicit [n, span] mask) run
    eagerly: the same outputs and cache as `LaneAttention` for a single node (by reductions or
    by SDPA; masked, beside a pending node) and a tree."""
    monkeypatch.setattr(attention, "GRAPH_DECODE_REDUCTION", reduction)
    heads, S = HKV * g, 11
    kv, kv_graph = pool(1), pool(1)
    qkv = new_qkv(n, heads)
    visible = random_visible(n, S, seed=n) if n > 1 else torch.ones(1, S + 1, dtype=torch.bool)
    if n == 1:
        visible[0, 8] = False  # a single node beside a pending one (slot 8): masked
    attend = LaneAttention(kv, 0, S, n, heads, visible, committed=8)
    mask = visible
    for layer in range(L_):
        got = graph_lane_attention(kv_graph, layer, qkv, torch.arange(S, S + n), mask, heads)
        torch.testing.assert_close(got, attend(layer, qkv), atol=1e-12, rtol=0)
    assert torch.equal(kv, kv_graph)


@pytest.mark.parametrize("layout", ["own row", "after the padded cache"])
def test_lanes_mask(layout):
    """The one multi-lane mask (native's packed lanes and HF's batched cache): each lane's rows
    see exactly its cached slots and its new tokens by its pattern (causal or a tree), wherever
    the layout puts them; padding rows see column 0 only; nothing else is visible."""
    starts, ns = [5, 0, 9, 3], [3, 1, 4, 4]
    visibles = [None, None, random_visible(4, 9, seed=1), random_visible(4, 3, seed=2)]
    S = max(starts)
    new_at = starts if layout == "own row" else [S] * len(starts)
    mask = lanes_mask(
        starts, ns, visibles, torch.device("cpu"), new_at=None if layout == "own row" else new_at
    )
    assert mask.shape == (4, max(ns), max(a + n for a, n in zip(new_at, ns)))
    for b, (S_b, n, a, visible) in enumerate(zip(starts, ns, new_at, visibles)):
        visible = causal_visible(n, S_b, torch.device("cpu")) if visible is None else visible
        expected = torch.zeros(n, mask.shape[2], dtype=torch.bool)
        expected[:, :S_b], expected[:, a : a + n] = visible[:, :S_b], visible[:, S_b:]
        assert torch.equal(mask[b, :n], expected)
        assert torch.equal(mask[b, n:], torch.zeros_like(mask[b, n:]).index_fill_(1, torch.tensor([0]), True))
