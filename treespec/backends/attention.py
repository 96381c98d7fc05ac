"""Attention for the native backend: the per-layer attention of a forward over the KV pool
(one lane, or several lanes packed), masked attention with its log-sum-exp, the LSE merge, and
the cascade (prefix + tree block) that lets flash-attn serve the prefix on CUDA.

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
import torch.nn.functional as F

from .base import causal_visible, lanes_mask
from .kernels.attention import row_attention

# (q, k, v, prefix_len) -> (out, lse): attention of every query over cache slots [0, prefix_len)
PrefixAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def exact_rows(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a single lane's attention runs as `kernels.attention.row_attention` here: a CPU
    with AVX512 whose kernels are built (`kernels.built()`: the one-time `compile=True` step
    builds them; a load never waits for the compiler), float32 or bfloat16. A query row's result
    then depends only on the keys it sees, so a tree node scores bit for bit as its path alone.
    Elsewhere SDPA, whose rounding follows the span and the mask's layout."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    from .kernels import attention as kernel

    return kernel.available(build=False)


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


# ---- the native backend's attention over its KV pool ----------------------------------------
# The pool is one tensor kv [L, 2, R, Hkv, cap, D]: layer, (key | value), lane, kv head, slot,
# head dim. A forward builds one of the two classes below from what it feeds, then calls it once
# per layer with that layer's rotated q and k and its v side by side, qkv [T, Hq + 2 Hkv, D]
# (the fused projection's output, viewed per head); it writes k and v into the cache and returns
# the attention output [T, Hq * D]. Every per-forward decision (mask, GQA layout, the views of
# each layer's cache) is made once, in the constructor, not per layer.
#
# GQA layout: a feed of at most FOLD_MAX_QUERIES queries per lane folds the g = Hq // Hkv query
# heads that share a kv head into the query axis (q viewed as [B, Hkv, g * n, D], row j * n + t
# is query head kv * g + j at token t; a mask is repeated g times to match), which is faster
# than SDPA's enable_gqa or repeating k and v, masked or not (docs/performance.md). Longer
# feeds (prefills) keep enable_gqa: a folded mask would be g times the n x (S + n) one.
FOLD_MAX_QUERIES = 64


def _fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[T, Hq, D] -> [1, Hkv, g * T, D] (row j * T + t: head kv * g + j, token t); a view for T = 1."""
    T, Hq, D = q.shape
    g = Hq // kv_heads
    return q.view(T, kv_heads, g, D).permute(1, 2, 0, 3).reshape(1, kv_heads, g * T, D)


def _unfold_output(o: torch.Tensor, T: int) -> torch.Tensor:
    """[B, Hkv, g * n, D] -> [B * n, Hq * D], token-major (the inverse of `_fold_queries`)."""
    B, Hkv, gn, D = o.shape
    g = gn // T
    return o.view(B, Hkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, Hkv * g * D)


class LaneAttention:
    """Attention of ONE lane's n new tokens over its own cache row, layer by layer.

    `kv` is the pool [L, 2, R, Hkv, cap, D], the lane its row `row`; slots [0, S) hold what the
    lane has cached, the new tokens go to [S, S + n). `visible` is the feed's attention pattern,
    bool [n, S + n] (True = attend), or None: causal after the S cached slots (a prefill, a
    chain). `committed` is how many of the S slots are the committed prefix (the rest are
    pending tree nodes). A single token that continues the committed prefix with nothing else
    pending sees every slot and gets no mask at all (the decode path). With `flash` (CUDA,
    fp16/bf16, flash-attn importable) a masked feed after a committed prefix runs as the cascade:
    `prefix_attention` over the committed slots + the masked tree block, merged by LSE. With
    `exact` (`exact_rows`) a feed of at most FOLD_MAX_QUERIES tokens runs `row_attention`, each
    row over its own visible keys (longer feeds, prefills, keep SDPA).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        row: int,
        S: int,
        n: int,
        heads: int,
        visible: torch.Tensor | None,
        committed: int,
        flash: bool = False,
        prefix_attention: PrefixAttention | None = None,
        exact: bool = False,
    ):
        Hkv, D = kv.shape[3], kv.shape[5]
        self.n, self.heads, self.kv_heads, self.scale = n, heads, Hkv, D**-0.5
        mask, self.cascade = None, 0
        if visible is None:
            if n > 1:
                mask = causal_visible(n, S, kv.device)  # [n, S+n]
        elif n > 1 or S != committed:
            mask = visible  # [n, S+n]
            self.cascade = committed if flash else 0
        self.exact = None  # row_attention's mask [n, S+n], where it runs
        if exact and n <= FOLD_MAX_QUERIES and not self.cascade:
            everything = mask is None  # a decode step: every slot
            self.exact = torch.ones(n, S + n, dtype=torch.bool, device=kv.device) if everything else mask
        self.fold = n <= FOLD_MAX_QUERIES and not self.cascade
        if self.fold and mask is not None and self.exact is None:
            mask = mask.repeat(heads // Hkv, 1)  # [g*n, S+n]: row j*n + t is token t's
        self.mask, self.prefix_attention = mask, prefix_attention
        # per layer: where the new keys and values go, [n, 2, Hkv, D] (a view of the pool, token
        # first, as the projection lays them out), and the keys / values seen, [1, Hkv, S+n, D]
        self.new = kv[:, :, row, :, S : S + n].permute(0, 3, 1, 2, 4).unbind(0)
        self.keys = kv[:, 0, row : row + 1, :, : S + n].unbind(0)
        self.values = kv[:, 1, row : row + 1, :, : S + n].unbind(0)

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:  # [n, Hq+2Hkv, D] -> [n, Hq*D]
        n, Hq, Hkv = self.n, self.heads, self.kv_heads
        D = qkv.shape[-1]
        self.new[layer].copy_(qkv[:, Hq:].view(n, 2, Hkv, D))  # k and v: one copy
        keys, values = self.keys[layer], self.values[layer]  # [1, Hkv, S+n, D]
        if self.exact is not None:
            return row_attention(qkv[:, :Hq], keys, values, self.exact, self.scale)  # [n, Hq*D]
        if n == 1 and self.fold:  # folding one token is a view: q [1, Hkv, g, D], output [1, Hq*D]
            q = qkv[:, :Hq].view(1, Hkv, Hq // Hkv, D)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=self.scale)
            return o.reshape(1, Hq * D)
        if self.fold:
            o = F.scaled_dot_product_attention(
                _fold_queries(qkv[:, :Hq], Hkv), keys, values, attn_mask=self.mask, scale=self.scale
            )  # [1, Hkv, g*n, D]
            return _unfold_output(o, n)
        q = qkv[:, :Hq].transpose(0, 1)[None]  # [1, Hq, n, D]
        if self.cascade:  # flash over the committed prefix + the masked tree block, merged by LSE
            c = self.cascade
            o = cascade_attention(
                q, keys, values, c, self.mask[:, c:], prefix_attention=self.prefix_attention
            )
        else:
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=self.mask, scale=self.scale, enable_gqa=True
            )
        return o[0].transpose(0, 1).reshape(n, Hq * D)  # [n, Hq*D]


class PackedAttention:
    """Attention of several lanes' packed new tokens (T in all), each over its own cache row.

    `rows`, `starts` (S_b) and `ns` (n_b) per lane, `visibles` as `LaneAttention`'s `visible`.
    Keys and values are written into each lane's row at its own slots; queries are padded to
    [B, n_max] (the only padding in a packed forward) with each lane's mask over its own row;
    outputs are unpadded back to [T, Hq * D]. With `exact` (`exact_rows`) and at most
    FOLD_MAX_QUERIES tokens a lane, `row_attention` instead, unpadded: every row as it would be
    in its lane alone.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        rows: list[int],
        starts: list[int],
        ns: list[int],
        heads: int,
        visibles: list[torch.Tensor | None],
        exact: bool = False,
    ):
        device, Hkv, D = kv.device, kv.shape[3], kv.shape[5]
        B, n_max = len(rows), max(ns)
        self.span = span = max(S + n for S, n in zip(starts, ns))  # key slots any lane reads
        idx = torch.tensor(
            [[rows[b], S + i, b * n_max + i] for b, (S, n) in enumerate(zip(starts, ns)) for i in range(n)],
            device=device,
        ).T  # [3, T]: lane row, cache slot and padded index of every new token
        self.row_of, self.slot_of = idx[0], idx[1]
        self.padded = None if min(ns) == n_max else idx[2]  # equal sizes: no padding at all
        self.layers = kv.unbind(0)  # per layer [2, R, Hkv, cap, D]
        if rows == list(range(rows[0], rows[0] + B)):  # consecutive rows: the keys are views
            seen = kv[:, :, rows[0] : rows[0] + B, :, :span]  # [L, 2, B, Hkv, span, D]
            self.keys, self.values = seen[:, 0].unbind(0), seen[:, 1].unbind(0)
            self.rows = None
        else:  # gathered per layer, after the layer's keys are written
            self.rows = torch.tensor(rows, device=device)
        mask = lanes_mask(starts, ns, visibles, device)[:, None]  # [B, 1, n_max, span]
        self.exact = None  # row_attention's (mask [T, span], lane [T]), where it runs
        if exact and n_max <= FOLD_MAX_QUERIES:
            lane = torch.tensor([b for b, n in enumerate(ns) for _ in range(n)], device=device)
            self.exact = (mask.view(B * n_max, span)[idx[2]], lane)
        self.g = heads // Hkv if n_max <= FOLD_MAX_QUERIES else 1  # GQA folding (see above)
        self.mask = None if self.exact else mask.repeat(1, 1, self.g, 1)  # [B, 1, g*n_max, span]
        self.B, self.n_max, self.heads, self.kv_heads, self.scale = B, n_max, heads, Hkv, D**-0.5

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:  # [T, Hq+2Hkv, D] -> [T, Hq*D]
        B, n_max, Hq, Hkv, D = self.B, self.n_max, self.heads, self.kv_heads, qkv.shape[-1]
        T = qkv.shape[0]
        kv = self.layers[layer]
        kv[:, self.row_of, :, self.slot_of] = qkv[:, Hq:].view(T, 2, Hkv, D)
        if self.rows is None:
            keys, values = self.keys[layer], self.values[layer]  # [B, Hkv, span, D]
        else:
            keys, values = kv[:, self.rows, :, : self.span]  # [B, Hkv, span, D] each
        if self.exact is not None:
            mask, lane = self.exact
            return row_attention(qkv[:, :Hq], keys, values, mask, self.scale, lane)  # [T, Hq*D]
        q = qkv[:, :Hq]
        if self.padded is not None:
            q = q.new_zeros(B * n_max, Hq, D).index_copy_(0, self.padded, q)
        q = q.view(B, n_max, Hq, D).transpose(1, 2).reshape(B, Hq // self.g, self.g * n_max, D)
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=self.mask, scale=self.scale, enable_gqa=self.g == 1
        )  # [B, Hkv, g*n_max, D]
        o = o.view(B, Hq, n_max, D).transpose(1, 2).reshape(B * n_max, Hq * D)  # [B*n_max, Hq*D]
        return o if self.padded is None else o.index_select(0, self.padded)  # [T, Hq*D]


GRAPH_DECODE_REDUCTION = True  # one-token graphs: attention as reductions (False: SDPA)


def graph_lane_attention(
    kv: torch.Tensor,
    layer: int,
    qkv: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    heads: int,
    exact: bool = False,
) -> torch.Tensor:
    """`LaneAttention`'s folded path written for a compiled graph (`native.CompiledForward`):
    one lane in row 0 of the pool, every shape taken from the inputs, nothing decided per call.

    kv [L, 2, 1, Hkv, cap, D] (written in place: index_put_ on the pool itself, which inductor
    does in place, where a write through a view of an input would copy the whole pool); qkv
    [n, Hq + 2 Hkv, D] as `LaneAttention` takes it; slots [n] the cache slots of the new tokens;
    mask bool [n, span] over slots [0, span) (True = attend). Returns [n, Hq * D]. One token
    (a graph of its own) is attended by plain reductions (`GRAPH_DECODE_REDUCTION`), which
    inductor fuses into its own loops; more tokens by SDPA with the folded GQA layout. `exact`
    (`exact_rows`): every feed by `row_attention` (the op in the graph), as the eager forward.
    """
    n, Hkv, D = qkv.shape[0], kv.shape[3], kv.shape[5]
    layer_idx = torch.tensor([layer], device=kv.device)
    row0 = torch.zeros(1, dtype=torch.long, device=kv.device)
    torch.ops.aten.index_put_(kv, [layer_idx, None, row0, None, slots], qkv[:, heads:].view(n, 2, Hkv, D))
    span = mask.shape[1]
    if exact:
        keys, values = kv[layer, 0, 0:1, :, :span], kv[layer, 1, 0:1, :, :span]  # [1, Hkv, span, D]
        return row_attention(qkv[:, :heads], keys, values, mask, D**-0.5)
    if n == 1 and GRAPH_DECODE_REDUCTION:
        # one query row per head: two reductions and a softmax, which inductor fuses into a few
        # loops of its own (in float32, or float64), cheaper than a call of SDPA's kernel
        g, dtype = heads // Hkv, _compute_dtype(qkv)
        q = qkv[0, :heads].view(Hkv, g, 1, D).to(dtype)
        k, v = kv[layer, 0, 0, :, :span].to(dtype), kv[layer, 1, 0, :, :span].to(dtype)  # [Hkv, span, D]
        scores = (q * k[:, None]).sum(-1) * D**-0.5  # [Hkv, g, span]
        p = torch.softmax(scores.masked_fill(~mask[0], float("-inf")), dim=-1)
        o = (p[..., None] * v[:, None]).sum(-2)  # [Hkv, g, D]
        return o.to(qkv.dtype).view(1, heads * D)
    o = F.scaled_dot_product_attention(
        _fold_queries(qkv[:, :heads], Hkv),
        kv[layer, 0, 0:1, :, :span],
        kv[layer, 1, 0:1, :, :span],
        attn_mask=mask.repeat(heads // Hkv, 1),
        scale=D**-0.5,
    )  # [1, Hkv, g*n, D]
    return _unfold_output(o, n)
