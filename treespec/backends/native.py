"""A lean Llama forward over a static KV cache (gpt-fast style): the native backend.

Serves what `LlamaForCausalLM`, `Qwen2ForCausalLM` and `MistralForCausalLM` (without a
sliding window) load: GQA, any head_dim, tied or untied embeddings, default or llama3 RoPE,
q/k/v(/o) biases; a handful of tensor ops per layer and no module stack. Weights come from an
HF model (`NativeRunner.from_hf`) or straight from a local safetensors checkpoint
(`NativeRunner.from_pretrained`, no transformers import).
Anything else is refused by `checkpoint.unsupported_reason(config)`, so callers fall back to
the HF runner instead of getting a wrong answer.

The KV cache is one preallocated tensor (a `KVPool`)

    kv [L, 2, R, Hkv, cap, D]     layer, (key | value), lane, kv head, slot, head dim

written by slot index. `kv[l, 0]` / `kv[l, 1]` are layer l's keys / values as [R, Hkv, cap, D],
the layout SDPA reads; moving slots (commit) is one gather over every layer at once. A runner
is one lane (row) of a pool: a single sequence has a pool of one; `runner.lanes(R)` makes R
runners over one pool of R rows, one per request of a batch, and their forwards run as ONE
packed forward (`_forward_many`): the new tokens of every lane go through the projections and
the MLP as one [T, hidden] matrix, only attention pads them to [R, n_max] against each lane's
own cache row. The capacity doubles (capped near max_positions) when a forward would overflow
it, so a 128k-token model does not allocate 128k slots up front.

Numerics mirror HF's Llama exactly where it matters for parity: RoPE cos/sin from float32
inverse frequencies, cast to the compute dtype; RMSNorm statistics in float32 (even for
float64 models) and the weight applied in the input dtype; logits in the model dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import check_positive_int
from .attention import cascade_attention, flash_available, flash_prefix_attention
from .base import Feed, Runner, causal_visible, forward_grouped
from .checkpoint import LlamaShape, read_checkpoint
from .linear import Projection

INITIAL_CAPACITY = 256  # cache slots allocated before the first growth
FOLD_MAX_QUERIES = 64  # feeds of at most this many tokens fold GQA heads into the query axis


@dataclass
class Layer:
    """One decoder layer's weights, fused where two products read the same input; each
    projection stored as this device multiplies by it fastest (`linear.Projection`)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Projection  # hidden -> (Hq + 2 Hkv) D: q, k, v side by side (+ bias: qwen2, attention_bias)
    o: Projection  # Hq D -> hidden (+ bias: llama attention_bias)
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Projection  # hidden -> 2 I: gate and up side by side
    down: Projection  # I -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: x32 * rsqrt(mean(x32^2) + eps) with x32 = x in float32 (whatever x's
    dtype, float64 included), then weight * (that in x's dtype). F.rms_norm without a weight
    is that very expression in one kernel (bitwise equal on CPU; the float64 tests check it)."""
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE as HF applies it, x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1).
    As sin = cat(s, s), rotate_half(x) * sin == roll(x, D/2) * cat(-s, s) exactly (a sign flip
    is exact), one op fewer: `sin_signed` is that cat(-s, s)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


# ---- the KV cache -----------------------------------------------------------------------------
class KVPool:
    """The static KV cache of `rows` lanes of one model, and the RoPE tables of its positions."""

    def __init__(
        self, shape: LlamaShape, rows: int, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device
    ):
        self.shape, self.rows, self.inv_freq, self.dtype, self.device = shape, rows, inv_freq, dtype, device
        self.kv = torch.zeros(0, device=device, dtype=dtype)
        self.capacity = 0
        self.grow(min(INITIAL_CAPACITY, shape.max_positions or INITIAL_CAPACITY))

    def grow(self, capacity: int) -> None:
        """Reallocate for `capacity` slots per lane (keeping what the cache holds) and the RoPE
        tables for positions [0, capacity): positions never exceed the slot count."""
        s, old = self.shape, self.kv
        self.kv = torch.zeros(
            s.layers, 2, self.rows, s.kv_heads, capacity, s.head_dim, device=self.device, dtype=self.dtype
        )
        if old.numel():
            self.kv[..., : old.shape[-2], :] = old
        # as HF's rotary embedding: float32 angles, cos/sin, then the compute dtype
        pos = torch.arange(capacity, device=self.device)
        freqs = pos.float()[:, None] * self.inv_freq[None]  # [cap, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [cap, D]
        self.cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # [cap, D]
        half = s.head_dim // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [cap, D], see rotate()
        # per-layer views of the cache, [R, Hkv, cap, D] each: no indexing chain in the hot loop
        self.k_cache, self.v_cache = list(self.kv[:, 0]), list(self.kv[:, 1])
        self.capacity = capacity

    def fit(self, slots: int) -> None:
        """Make room for `slots` slots per lane."""
        if slots > self.capacity:
            cap = self.shape.max_positions or 2 * self.capacity
            self.grow(max(slots, min(2 * self.capacity, cap)))


# ---- the runner ------------------------------------------------------------------------------
class NativeRunner(Runner):
    """A Llama-architecture causal LM as plain tensors over a static KV cache."""

    def __init__(
        self,
        shape: LlamaShape,
        weights: dict[str, torch.Tensor],
        eos_token_ids: frozenset[int] = frozenset(),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack_weights: bool = True,
    ):
        """`weights`: the HF state dict names (model.layers.{i}.self_attn.q_proj.weight, ...).
        `pack_weights`: let each projection take oneDNN's packed layout where it can
        (`linear.Projection`; False: plain BLAS products everywhere, for comparisons)."""
        self.shape = s = shape
        self.vocab_size, self.max_positions = s.vocab, s.max_positions
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device, self.dtype = torch.device(device), dtype

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint lacks the tensor {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        def cat(*names: str) -> torch.Tensor:  # [sum of outs, in]
            return torch.cat([get(n) for n in names])

        def proj(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Projection:
            return Projection(weight, bias, pack=pack_weights)

        # tied embeddings: the lm_head multiplies by the embedding matrix; where it is packed
        # (CPU) the packed copy sits next to the plain one the lookup reads (one more V x hidden)
        self.embed = get("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = proj(self.embed if s.tied else get("lm_head.weight"))  # hidden -> V
        self.norm = get("model.norm.weight")  # [hidden]
        self.layers: list[Layer] = []
        for i in range(s.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            self.layers.append(
                Layer(
                    attn_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                    qkv=proj(
                        cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                        cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if s.qkv_bias else None,
                    ),
                    o=proj(get(a + "o_proj.weight"), get(a + "o_proj.bias") if s.o_bias else None),
                    mlp_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up=proj(cat(m + "gate_proj.weight", m + "up_proj.weight")),
                    down=proj(get(m + "down_proj.weight")),
                )
            )
        for name, got, want in (
            ("the output projection", self.lm_head, (s.vocab, s.hidden)),
            ("q/k/v projections", self.layers[0].qkv, ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden)),
            ("gate/up projections", self.layers[0].gate_up, (2 * s.intermediate, s.hidden)),
        ):
            got = (got.out_features, got.in_features)
            if got != want:
                raise ValueError(f"weights do not match the config: {name} {tuple(got)}, expected {want}")
        self.inv_freq = s.inv_freq().to(self.device)  # [D/2] float32
        # flash-attn serves the committed prefix of tree forwards on CUDA (fp16/bf16); the tree
        # block is a small masked attention merged by log-sum-exp (attention.cascade_attention).
        self.flash = dtype in (torch.float16, torch.bfloat16) and flash_available(self.device)
        self.prefix_attention = flash_prefix_attention
        self.pool, self.row = (
            KVPool(s, 1, self.inv_freq, dtype, self.device),
            0,
        )  # this runner's cache: row 0 of a pool of one
        super().__init__()

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls, model: torch.nn.Module, dtype: torch.dtype | None = None, device=None, pack_weights: bool = True
    ) -> NativeRunner:
        """The weights of an HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `MistralForCausalLM`,
        copied into the runner's layout (norms and biases shared where dtype and device agree;
        float64 shares everything). dtype/device default to the model's."""
        from .hf import eos_token_ids

        param = next(model.parameters())
        shape = LlamaShape.from_config(model.config)
        return cls(
            shape,
            model.state_dict(),
            eos_token_ids(model),
            dtype or param.dtype,
            device or param.device,
            pack_weights,
        )

    @classmethod
    def from_pretrained(
        cls, path, dtype: torch.dtype = torch.float32, device="cpu", pack_weights: bool = True
    ) -> NativeRunner:
        """A local directory with config.json and model.safetensors (or a sharded
        model.safetensors.index.json); no transformers import (`checkpoint.read_checkpoint`)."""
        shape, weights, eos_ids = read_checkpoint(path)
        return cls(shape, weights, eos_ids, dtype, device, pack_weights)

    # ---- the KV cache ---------------------------------------------------------------------
    @property
    def kv(self) -> torch.Tensor:
        """This lane's cache, [L, 2, 1, Hkv, cap, D] (a view of its pool)."""
        return self.pool.kv[:, :, self.row : self.row + 1]

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def lanes(self, n: int) -> list[NativeRunner]:
        """`n` runners sharing this one's weights over a new pool of `n` rows: their forwards
        in `extend_many` / `prefill_many` run as one packed forward."""
        check_positive_int("lanes(n)", n)
        pool = KVPool(self.shape, n, self.inv_freq, self.dtype, self.device)
        out = []
        for row in range(n):
            lane = copy.copy(self)  # weights shared; bookkeeping reset below
            lane.pool, lane.row, lane.forwards = pool, row, 0
            lane.reset()
            out.append(lane)
        return out

    def _reset_cache(self) -> None:
        self.filled = 0  # slots [0, filled) hold keys and values

    @torch.inference_mode()
    def _keep(self, nodes: list[int]) -> None:
        # pending index -> slot c + index; gather every layer's keys and values at once (a copy),
        # then write them right after the committed prefix
        c, k = self.n_committed, len(nodes)
        idx = torch.tensor(nodes, dtype=torch.long, device=self.device) + c  # [k]
        kv = self.pool.kv[:, :, self.row]  # [L, 2, Hkv, cap, D]
        kv[..., c : c + k, :] = kv.index_select(-2, idx)

    def _truncate(self, n_slots: int) -> None:
        self.filled = n_slots  # a static cache just forgets the rest

    # ---- the forward ----------------------------------------------------------------------
    def _forward(self, tokens, positions, visible, need_logits):
        return self._forward_many([self], [Feed(tokens, positions, visible)], need_logits)[0]

    @classmethod
    def _forward_many(cls, runners, feeds, need_logits):
        """Lanes of one pool run as one packed forward; lanes of different pools one forward each."""

        def pool_forward(lanes: list[NativeRunner], lane_feeds: list[Feed]) -> list[torch.Tensor | None]:
            if len({lane.row for lane in lanes}) < len(lanes):
                raise RuntimeError("one forward cannot feed the same lane twice")
            return lanes[0]._packed_forward(lanes, lane_feeds, need_logits)

        return forward_grouped(runners, feeds, lambda r: id(r.pool), pool_forward)

    @torch.inference_mode()
    def _packed_forward(
        self, lanes: list[NativeRunner], feeds: list[Feed], need_logits: bool
    ) -> list[torch.Tensor | None]:
        """Feed every lane's new tokens (lanes of this runner's pool) in one forward; logits
        [n_i, V] per lane. T = the new tokens of all lanes, packed."""
        s, pool = self.shape, self.pool
        ns, starts = [f.tokens.shape[0] for f in feeds], [lane.filled for lane in lanes]
        for f, S, n in zip(feeds, starts, ns):
            if f.visible is not None and f.visible.shape[-1] != S + n:
                raise RuntimeError(f"mask covers {f.visible.shape[-1]} slots, the cache holds {S} + {n} new")
        pool.fit(max(S + n for S, n in zip(starts, ns)))
        Hq, Hkv, D = s.heads, s.kv_heads, s.head_dim
        one = len(lanes) == 1
        tokens = feeds[0].tokens if one else torch.cat([f.tokens for f in feeds])  # [T]
        positions = feeds[0].positions if one else torch.cat([f.positions for f in feeds])  # [T]
        attend = (
            self._lane_attention(feeds[0], starts[0]) if one else _PackedAttention(lanes, feeds, starts, Hq)
        )
        T = tokens.shape[0]

        cos, sin = pool.cos[positions][:, None], pool.sin_signed[positions][:, None]  # [T, 1, D]
        x = self._embed(tokens)  # [T, hidden]
        for layer, k_cache, v_cache in zip(self.layers, pool.k_cache, pool.v_cache):
            # attention: fused q/k/v projection, RoPE on q and k together, k and v into the cache
            h = rms_norm(x, layer.attn_norm, s.eps)
            qkv = layer.qkv(h).view(T, Hq + 2 * Hkv, D)  # [T, Hq+2Hkv, D]
            qk = rotate(qkv[:, : Hq + Hkv], cos, sin)  # [T, Hq+Hkv, D]
            o = attend(qk[:, :Hq], qk[:, Hq:], qkv[:, Hq + Hkv :], k_cache, v_cache)  # [T, Hq*D]
            x = x + layer.o(o)

            # MLP: fused gate/up projection, SiLU gate, down projection
            h = rms_norm(x, layer.mlp_norm, s.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)  # [T, I] each
            x = x + layer.down(F.silu(gate) * up)
        for lane, S, n in zip(lanes, starts, ns):
            lane.filled = S + n
        if not need_logits:
            return [None] * len(lanes)
        logits = self.lm_head(rms_norm(x, self.norm, s.eps))  # [T, V]
        return [logits] if one else list(logits.split(ns))

    def _lane_attention(self, feed: Feed, S: int):
        """Attention of one lane's n new tokens over its slots [0, S+n): keys and values written
        into its cache row, SDPA over the row. A node continuing the committed prefix with
        nothing else pending sees everything: no mask (the decode fast path). A prefill is
        causal after the S cached slots. Trees bring their ancestor mask."""
        n, r, Hq, Hkv, D = (
            feed.tokens.shape[0],
            self.row,
            self.shape.heads,
            self.shape.kv_heads,
            self.shape.head_dim,
        )
        g = Hq // Hkv  # query heads per kv head
        mask, cascade = None, False
        if feed.visible is None:
            if n > 1:
                mask = causal_visible(n, S, self.device)  # [n, S+n]
        elif n > 1 or S != self.n_committed:
            mask = feed.visible  # [n, S+n]
            cascade = self.flash and self.n_committed > 0

        fold = n <= FOLD_MAX_QUERIES
        if fold and mask is not None and not cascade:
            mask = mask.repeat(g, 1)  # [g*n, S+n]: row j*n + t is token t's, see attend

        def attend(q, k, v, k_cache, v_cache):  # q [n, Hq, D], k and v [n, Hkv, D]
            k_cache[r, :, S : S + n] = k.transpose(0, 1)
            v_cache[r, :, S : S + n] = v.transpose(0, 1)
            q = q.transpose(0, 1)[None]  # [1, Hq, n, D]
            keys, values = k_cache[r : r + 1, :, : S + n], v_cache[r : r + 1, :, : S + n]  # [1, Hkv, S+n, D]
            # GQA by folding the g query heads that share a kv head into the query axis (row
            # j*n + t is head kv*g + j, token t; the mask repeated g times to match), the fastest
            # of three on the 2-core AMD EPYC, masked or not; us per call over a 250-slot prefix,
            # heads 8/2 x 64: n=7 masked bf16 39.7 folded vs 60.6 enable_gqa vs 64.0
            # repeat_interleave (fp32 39.1 / 55.0 / 56.4); n=1 unmasked bf16 13.4 vs 85.2; eight
            # lanes of a packed forward, n=1: bf16 93 vs 648. (An earlier session's Intel Xeon
            # had masked n=17 within 10% either way.) Prefill-sized feeds keep enable_gqa: a
            # folded mask would be g times the n x (S+n) one.
            if cascade:  # flash over the committed prefix + the masked tree block, merged by LSE
                c = self.n_committed
                o = cascade_attention(q, keys, values, c, mask[:, c:], prefix_attention=self.prefix_attention)
            elif fold:
                qg = q.reshape(1, Hkv, g * n, D)  # [1, Hkv, g*n, D]
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=D**-0.5)
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=D**-0.5, enable_gqa=True
                )
            return o.view(Hq, n, D).transpose(0, 1).reshape(n, Hq * D)  # [n, Hq*D]

        return attend

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, hidden]."""
        return F.embedding(tokens, self.embed)


class _PackedAttention:
    """Attention for several lanes' packed tokens: keys and values written into each lane's
    row at its own slots; queries padded to [B, n_max] (the only padding in a packed forward)
    with each lane's mask over its own row; outputs unpadded back to [T, Hq*D]."""

    def __init__(self, lanes: list[NativeRunner], feeds: list[Feed], starts: list[int], heads: int):
        device, ns = lanes[0].device, [f.tokens.shape[0] for f in feeds]
        B, n_max = len(lanes), max(ns)
        self.span = max(S + n for S, n in zip(starts, ns))  # key slots any lane reads
        rows = [lane.row for lane in lanes]
        idx = torch.tensor(
            [[rows[b], S + i, b * n_max + i] for b, (S, n) in enumerate(zip(starts, ns)) for i in range(n)],
            device=device,
        ).T  # [3, T]: lane row, cache slot and padded index of every new token
        self.row_of, self.slot_of = idx[0], idx[1]
        self.padded = None if min(ns) == n_max else idx[2]  # equal sizes: no padding at all
        self.rows = (
            slice(rows[0], rows[0] + B)
            if rows == list(range(rows[0], rows[0] + B))
            else torch.tensor(rows, device=device)
        )
        # every lane causal after its S cached slots (row i sees slots <= S + i); a padding row
        # (i >= n) sees slot 0 only, so it has no NaN, and its output is dropped; a tree feed's
        # own pattern replaces its causal one. Built in a few ops for all lanes at once.
        S_n = torch.tensor([starts, ns], device=device)[:, :, None, None]  # [2, B, 1, 1]
        i = torch.arange(n_max, device=device)[:, None]  # [n_max, 1]
        j = torch.arange(self.span, device=device)  # [span]
        self.mask = torch.where(i < S_n[1], j <= S_n[0] + i, j == 0)[:, None]  # [B, 1, n_max, span]
        for b, (f, S, n) in enumerate(zip(feeds, starts, ns)):
            if f.visible is not None:
                self.mask[b, 0, :n, : S + n] = f.visible
        self.B, self.n_max, self.heads = B, n_max, heads
        self.g = (
            heads // lanes[0].shape.kv_heads if n_max <= FOLD_MAX_QUERIES else 1
        )  # GQA folding, see _lane_attention
        self.mask = self.mask.repeat(1, 1, self.g, 1)  # [B, 1, g*n_max, span]

    def __call__(self, q, k, v, k_cache, v_cache):  # q [T, Hq, D], k and v [T, Hkv, D]
        B, n_max, Hq, D = self.B, self.n_max, self.heads, q.shape[-1]
        k_cache[self.row_of, :, self.slot_of] = k
        v_cache[self.row_of, :, self.slot_of] = v
        keys, values = (
            k_cache[self.rows, :, : self.span],
            v_cache[self.rows, :, : self.span],
        )  # [B, Hkv, span, D]
        if self.padded is not None:
            q = q.new_zeros(B * n_max, Hq, D).index_copy_(0, self.padded, q)
        q = (
            q.view(B, n_max, Hq, D).transpose(1, 2).reshape(B, Hq // self.g, self.g * n_max, D)
        )  # [B, Hkv, g*n_max, D]
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=self.mask, scale=D**-0.5, enable_gqa=self.g == 1
        )
        o = o.view(B, Hq, n_max, D).transpose(1, 2).reshape(B * n_max, Hq * D)  # [B*n_max, Hq*D]
        return o if self.padded is None else o.index_select(0, self.padded)  # [T, Hq*D]
