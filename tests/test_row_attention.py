"""`row_attention` (kernels/attention.cpp): attention whose rows are independent (issue 58).

Against a float64 reference for every head-dim tail, GQA ratio and dtype; bit for bit, a row's
result is the same alone, among other rows, over a longer span, and with its keys moved to other
slots with masked ones between them; and on the default pair, greedy speculative decoding equals
greedy plain decoding token for token, eager, which torch's CPU SDPA did not give (it differed on
7 of 8 held-out chats)."""

from __future__ import annotations

import pytest
import torch

from treespec.backends.kernels import attention as kernel

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not kernel.available(), reason="row_attention needs the compiled kernels and AVX512"),
]


def case(n, S, Hq, Hkv, D, dtype, seed=0, cap=None):
    """q [n, Hq, D] (a strided view), k and v [1, Hkv, S, D] (views of a bigger cache), a random
    mask [n, S] where every row sees at least one key."""
    g = torch.Generator().manual_seed(seed)
    cap = cap or S + 5
    kv = torch.randn(2, Hkv, cap, D, generator=g).to(dtype)
    q = torch.randn(n, Hq + 2 * Hkv, D, generator=g).to(dtype)[:, :Hq]
    mask = torch.rand(n, S, generator=g) < 0.6
    mask[torch.arange(n), torch.randint(0, S, (n,), generator=g)] = True
    return q, kv[None, 0, :, :S], kv[None, 1, :, :S], mask


def reference(q, k, v, mask, scale):
    n, Hq, D = q.shape
    g = Hq // k.shape[1]
    kk, vv = k[0].double().repeat_interleave(g, 0), v[0].double().repeat_interleave(g, 0)  # [Hq, S, D]
    w = torch.einsum("nhd,hsd->nhs", q.double(), kk) * scale
    w = w.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    return torch.einsum("nhs,hsd->nhd", w, vv).reshape(n, Hq * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("D", [8, 16, 40, 64, 128])
def test_equals_a_float64_reference(D, Hq, Hkv, dtype):
    for n, S in ((1, 1), (3, 17), (5, 100)):
        q, k, v, mask = case(n, S, Hq, Hkv, D, dtype, seed=n)
        out = kernel.row_attention(q, k, v, mask, D**-0.5)
        assert out.shape == (n, Hq * D) and out.dtype == dtype
        err = (out.double() - reference(q, k, v, mask, D**-0.5)).abs().max().item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_depends_only_on_the_keys_it_sees(dtype):
    n, S, Hq, Hkv, D = 12, 203, 9, 3, 64
    q, k, v, mask = case(n, S, Hq, Hkv, D, dtype, seed=7)
    out = kernel.row_attention(q, k, v, mask, 0.125)
    for r in (0, 5, 11):
        assert torch.equal(kernel.row_attention(q[r : r + 1], k, v, mask[r : r + 1], 0.125), out[r : r + 1])
        # its visible keys packed at the front of a longer span, masked slots after them
        seen = mask[r].nonzero()[:, 0]
        m = len(seen)
        k2, v2 = torch.randn(1, Hkv, m + 45, D).to(dtype), torch.randn(1, Hkv, m + 45, D).to(dtype)
        k2[:, :, :m], v2[:, :, :m] = k[:, :, seen], v[:, :, seen]
        m2 = torch.zeros(1, m + 45, dtype=torch.bool)
        m2[0, :m] = True
        assert torch.equal(kernel.row_attention(q[r : r + 1], k2, v2, m2, 0.125), out[r : r + 1])
        # the same keys spread out, in the same order, masked keys between them
        k3, v3 = torch.randn(1, Hkv, 3 * m, D).to(dtype), torch.randn(1, Hkv, 3 * m, D).to(dtype)
        k3[:, :, 1::3], v3[:, :, 1::3] = k[:, :, seen], v[:, :, seen]
        m3 = torch.zeros(1, 3 * m, dtype=torch.bool)
        m3[0, 1::3] = True
        assert torch.equal(kernel.row_attention(q[r : r + 1], k3, v3, m3, 0.125), out[r : r + 1])
    # the other rows' order does not matter either
    perm = torch.randperm(n)
    assert torch.equal(kernel.row_attention(q[perm], k, v, mask[perm], 0.125), out[perm])
    # nor other lanes: this lane as lane 2 of 3, beside two others, its rows interleaved with theirs
    others = torch.randn(2, Hkv, S, D).to(dtype)
    k4, v4 = torch.cat([others, k]), torch.cat([others.flip(0), v])  # [3, Hkv, S, D]
    lanes = torch.tensor([2, 0, 1] * n)
    q4, m4 = q.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    out4 = kernel.row_attention(q4, k4, v4, m4, 0.125, lanes)
    assert torch.equal(out4[0::3], out)


def test_bad_inputs_are_clear_errors():
    q, k, v, mask = case(2, 10, 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="mask bool"):
        kernel.row_attention(q, k, v, mask[:, :5], 0.25)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        kernel.row_attention(q[:, :3], k, v, mask, 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.row_attention(q.double(), k, v, mask, 0.25)
    with pytest.raises(RuntimeError, match="lanes must lie in"):
        kernel.row_attention(q, k, v, mask, 0.25, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="need each row's lane"):
        kernel.row_attention(q, torch.cat([k, k]), torch.cat([v, v]), mask, 0.25)


def test_greedy_speculative_equals_greedy_plain_on_the_default_pair(monkeypatch):
    from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
    from treespec.zoo import heldout_prompt_ids

    monkeypatch.delenv("TREESPEC_PAIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dec = SpeculativeDecoder.from_pretrained(compile=False)
    assert dec.target_runner.exact_rows  # the kernels are built (the module's skipif builds them)
    greedy = SamplingConfig(temperature=0.0)
    for prompt in heldout_prompt_ids("smollm2", dec.tokenizer, 8)[:4]:
        want = dec.generate(prompt, 64, tree=None, sampling=greedy, ignore_eos=True).token_ids
        for tree in (TreeConfig(1, 3), TreeConfig(3, 3)):
            assert dec.generate(prompt, 64, tree=tree, sampling=greedy, ignore_eos=True).token_ids == want
