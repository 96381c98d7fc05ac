"""Tree attention for the native backend: masked attention with its log-sum-exp, the LSE merge,
and the cascade (prefix + tree block) that lets flash-attn serve the prefix on CUDA.

Layout everywhere: q [B, Hq, n, D]; the KV cache k, v [B, Hkv, S, D] (Hq a multiple of Hkv,
query head h reads kv head h // (Hq // Hkv), as in HF's repeat_kv). Slots [0, prefix_len) hold
the committed prefix, which every tree query sees; the tree nodes follow and are seen through a
bool ancestor mask (True = attend).

Why the cascade is exact: for one query, softmax attention over a key set K is
    out_K = sum_j e^{s_j} v_j / Z_K,   Z_K = sum_j e^{s_j},   lse_K = log Z_K
(s_j the scaled scores). For K = A ∪ B disjoint, Z_K = Z_A + Z_B and so
    out_K = (e^{lse_A} out_A + e^{lse_B} out_B) / (e^{lse_A} + e^{lse_B}).
flash-attn ignores custom masks but returns lse, so it computes the unmasked prefix half; the
masked tree half is small (n x n) and done here; `merge_attention` combines them in float32.

flash-attn is optional: it is imported only inside `flash_available` / `flash_prefix_attention`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# (q, k, v, prefix_len) -> (out, lse): attention of every query over cache slots [0, prefix_len)
PrefixAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: low-precision inputs never do softmax math."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under a bool mask, with its log-sum-exp.

    q [B, Hq, n, D]; k, v [B, Hkv, S, D]; mask bool [n, S] or [B, n, S] (True = attend; every
    row must have at least one True, or that row's output is NaN). scale defaults to D ** -0.5.
    Returns (out [B, Hq, n, D] in q's dtype, lse [B, Hq, n]: log of the softmax normaliser of
    the scaled scores, float32, or float64 for float64 inputs).

    Scores and softmax are computed in float32 (float64 stays float64): k and v are upcast, so
    this is meant for small key sets (the tree block) and as the CPU reference, not for a long
    bf16 cache. GQA folds the g = Hq // Hkv query heads sharing a kv head into the query axis
    (q viewed as [B, Hkv, g * n, D]) instead of repeating k and v.
    """
    B, Hq, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if mask.shape[-2:] != (n, S):
        raise ValueError(f"mask is {tuple(mask.shape)}; expected [n, S] or [B, n, S], n={n}, S={S}")
    g = Hq // Hkv
    dtype = _compute_dtype(q, k, v)
    scale = D**-0.5 if scale is None else scale

    qg = q.reshape(B, Hkv, g * n, D).to(dtype)  # [B, Hkv, g*n, D]
    scores = (qg @ k.to(dtype).transpose(-1, -2)) * scale  # [B, Hkv, g*n, S]
    scores = scores.view(B, Hkv, g, n, S)
    mask = mask.reshape(-1, 1, 1, n, S)  # [1 or B, 1, 1, n, S]: same for every head
    scores = scores.masked_fill(~mask, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, g, n]
    probs = torch.exp(scores - lse.unsqueeze(-1))  # softmax, masked entries exp(-inf) = 0
    out = probs.view(B, Hkv, g * n, S) @ v.to(dtype)  # [B, Hkv, g*n, D]
    return out.view(B, Hq, n, D).to(q.dtype), lse.view(B, Hq, n)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's result.

    out_* [..., D] with lse_* [...] (e.g. [B, Hq, n, D] and [B, Hq, n]). Computes
    (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b}) in float32 (float64 stays
    float64) after subtracting max(lse_a, lse_b), so nothing overflows; a side with lse = -inf
    (no keys) gets weight 0 and its out must be finite. Exactly symmetric in (a, b).
    Returns out_a's dtype.
    """
    dtype = _compute_dtype(out_a, lse_a, out_b, lse_b)
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - m).unsqueeze(-1)  # [..., 1], in [0, 1]; the larger side is 1
    w_b = torch.exp(lse_b - m).unsqueeze(-1)
    out = (w_a * out_a.to(dtype) + w_b * out_b.to(dtype)) / (w_a + w_b)
    return out.to(out_a.dtype)


@functools.cache
def _flash_importable() -> bool:
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
    except ImportError:
        return False
    return True


def flash_available(device: torch.device | str) -> bool:
    """True iff `device` is a CUDA device of compute capability >= 8 (flash-attn 2 rejects older
    GPUs at call time) and `flash_attn` with `flash_attn_with_kvcache` imports. The import is
    tried once per process."""
    device = torch.device(device)
    if device.type != "cuda" or not _flash_importable():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def flash_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over cache slots [0, prefix_len), unmasked, via
    `flash_attn.flash_attn_with_kvcache` (flash-attn >= 2.6 for return_softmax_lse).

    q [B, Hq, n, D]; k, v [B, Hkv, S, D] with S >= prefix_len; fp16 or bf16, all one dtype;
    D <= 256. Returns (out [B, Hq, n, D] in q's dtype, lse [B, Hq, n] float32).

    flash wants [B, seq, heads, D]. The transposed views of our [B, H, S, D] tensors are passed
    as they are, without a copy: flash reads batch, row and head strides from the tensor and
    only requires stride(-1) == 1 (flash_attn/flash_attn_interface.py asserts it for the cache;
    csrc/flash_attn/flash_api.cpp mha_fwd_kvcache checks it for q, k, v). The whole cache goes
    in and `cache_seqlens` limits it to the prefix; an int is expanded by flash's wrapper to
    the int32 tensor of shape [B] the kernel needs. lse comes back as [B, Hq, n] float32.
    """
    from flash_attn import flash_attn_with_kvcache

    out, lse = flash_attn_with_kvcache(
        q.transpose(1, 2),  # [B, n, Hq, D]
        k.transpose(1, 2),  # [B, S, Hkv, D]
        v.transpose(1, 2),
        cache_seqlens=prefix_len,
        causal=False,
        return_softmax_lse=True,
    )
    return out.transpose(1, 2), lse  # [B, Hq, n, D], [B, Hq, n]


def reference_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `flash_prefix_attention` computes, by `masked_attention` (any device and dtype):
    every query over slots [0, prefix_len). Returns (out [B, Hq, n, D], lse [B, Hq, n])."""
    n = q.shape[2]
    everything = torch.ones(n, prefix_len, dtype=torch.bool, device=q.device)  # [n, prefix_len]
    return masked_attention(q, k[:, :, :prefix_len], v[:, :, :prefix_len], everything)


def _default_prefix_attention(q: torch.Tensor) -> PrefixAttention:
    if q.dtype in (torch.float16, torch.bfloat16) and flash_available(q.device):
        return flash_prefix_attention
    return reference_prefix_attention


def cascade_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor,
    prefix_attention: PrefixAttention | None = None,
) -> torch.Tensor:
    """Tree attention as prefix half + tree half, merged by log-sum-exp.

    q [B, Hq, n, D]; k, v [B, Hkv, S, D]; tree_mask bool [n, m] or [B, n, m] over the tree
    block, slots [prefix_len, prefix_len + m) (m = S - prefix_len when the cache is cut to
    size; slots past the block, e.g. unused static-cache capacity, are never read).
    Equals masked_attention with the mask [prefix columns all True | tree_mask].
    prefix_attention(q, k, v, prefix_len) -> (out, lse) computes the unmasked prefix half;
    default: `flash_prefix_attention` when flash_available(q.device) and q is fp16/bf16, else
    `reference_prefix_attention`. prefix_len == 0 -> the tree block alone.
    Returns out [B, Hq, n, D] in q's dtype.
    """
    m = tree_mask.shape[-1]
    tree_k = k[:, :, prefix_len : prefix_len + m]  # [B, Hkv, m, D], a view
    tree_v = v[:, :, prefix_len : prefix_len + m]
    if prefix_len == 0:
        return masked_attention(q, tree_k, tree_v, tree_mask)[0]
    # The tree half stays in float32 until the merge (q is upcast: masked_attention would
    # compute in float32 anyway, this only skips rounding its output to bf16 first).
    tree_out, tree_lse = masked_attention(q.to(_compute_dtype(q)), tree_k, tree_v, tree_mask)
    prefix_attention = prefix_attention or _default_prefix_attention(q)
    prefix_out, prefix_lse = prefix_attention(q, k, v, prefix_len)  # [B, Hq, n, D], [B, Hq, n]
    return merge_attention(prefix_out, prefix_lse, tree_out, tree_lse).to(q.dtype)
