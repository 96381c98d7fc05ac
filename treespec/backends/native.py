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
it, so a 128k-token model does not allocate 128k slots up front, and the rows allocated double
when a lane beyond them first runs, so an engine's idle lanes cost nothing.

A layer is: RMSNorm, the fused q/k/v projection, RoPE once over all of its output (v heads
untouched), attention (`attention.LaneAttention` / `PackedAttention`: k and v into the cache
with one copy, SDPA over the lane's row), the o projection and the residual, RMSNorm, the fused
gate/up projection, SiLU gate, the down projection and the residual. Every per-forward
decision (mask, GQA layout, each layer's cache views, the RoPE rows) is made once per forward,
not per layer. With `compile=True` the forwards that need logits run as inductor graphs of the
same math (`CompiledForward`, kept across processes by `aot.GraphStore`); this module holds the
model and its cache, attention.py all the attention.

Tensor parallel (`tp=`, `treespec.parallel`): each rank holds its block of the query and KV
heads (and their cache) and of the MLP, and `decoder_stack`, the one layer loop of the eager
forward and the compiled graph, sums the o and down products over the ranks (docs/parallel.md).

Numerics mirror HF's Llama exactly where it matters for parity: RoPE cos/sin from float32
inverse frequencies, cast to the compute dtype; RMSNorm statistics in float32 (even for
float64 models) and the weight applied in the input dtype; logits in the model dtype.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import check_positive_int
from ..parallel import TensorParallel
from .aot import GraphStore, model_digest
from .attention import (
    LaneAttention,
    PackedAttention,
    flash_available,
    flash_prefix_attention,
    graph_lane_attention,
)
from .base import Feed, Runner, Scores, causal_visible, features_of, forward_grouped, tapped
from .checkpoint import LlamaShape, read_checkpoint
from .linear import (
    Int4Projection,
    Product,
    Projection,
    QuantizedProjection,
    check_quantize,
    int4_product,
    int8_product,
)

INITIAL_CAPACITY = 256  # cache slots allocated before the first growth
COMPILE_MAX_TOKENS = 64  # feeds of up to this many tokens run through the compiled graphs (compile=True)
COMPILE_STATIC_MAX = 8  # feeds of 1..this many tokens get a graph of their own size (tuned products)

log = logging.getLogger(__name__)


@dataclass
class Layer:
    """One decoder layer's weights, fused where two products read the same input; each
    projection stored as this device multiplies by it fastest (`linear.Projection`)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Product  # hidden -> (Hq + 2 Hkv) D: q, k, v side by side (+ bias)
    o: Product  # Hq D -> hidden (+ bias: llama attention_bias)
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Product  # hidden -> 2 I: gate and up side by side
    down: Product  # I -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: x32 * rsqrt(mean(x32^2) + eps) with x32 = x in float32 (whatever x's
    dtype, float64 included), then weight * (that in x's dtype). F.rms_norm without a weight
    is that very expression in one call: it computes in float32 for float32 and narrower inputs
    and returns x's dtype (bitwise equal on CPU, tests/test_native.py), so only float64 converts
    explicitly, two ops more."""
    if x.dtype == torch.float64:
        return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE as HF applies it, x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1).
    As sin = cat(s, s), rotate_half(x) * sin == roll(x, D/2) * cat(-s, s) exactly (a sign flip
    is exact), one op fewer: `sin_signed` is that cat(-s, s). The forward rotates the whole
    fused q/k/v output at once, the v heads with cos = 1 and sin = 0, which leaves them exactly
    as they were (v * 1 + roll(v) * 0 == v for finite v): one rotation per layer, and k and v
    stay side by side for the cache write."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def rope_rows(
    cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor, shape: LlamaShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin_signed ([cap, D] tables) at `positions` [T], laid out for the fused q/k/v
    heads: [T, Hq + 2 Hkv, D] each, the v heads with cos 1 and sin 0 (see `rotate`)."""
    T, qk, D = positions.shape[0], shape.heads + shape.kv_heads, shape.head_dim
    cos, sin = cos[positions][:, None], sin_signed[positions][:, None]  # [T, 1, D]
    v_cos = torch.ones(1, 1, D, dtype=cos.dtype, device=cos.device).expand(T, shape.kv_heads, D)
    return (
        torch.cat((cos.expand(T, qk, D), v_cos), dim=1),
        torch.cat((sin.expand(T, qk, D), torch.zeros_like(v_cos)), dim=1),
    )


def decoder_stack(
    x: torch.Tensor,
    layers: Iterable[Layer],
    attend: Callable[[int, torch.Tensor], torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: LlamaShape,
    taps: tuple[int, ...],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder layers over the embedded new tokens x [T, hidden]: the last layer's output
    [T, hidden] (before the final norm) and the tapped features [T, F] (or None). The one
    layer loop of the eager forward and the compiled graph alike.

    `attend(i, qkv)`: layer i's attention of the rotated q/k/v [T, Hq+2Hkv, D] (writing k and
    v into the cache) -> [T, Hq D]. `cos`, `sin`: the RoPE rows of the fed positions. `reduce`:
    tensor parallel, the sum over ranks of a row-parallel product (o and down hold this rank's
    columns, so each gives a partial sum); None in a single process."""
    T, F_qkv, D, eps = x.shape[0], shape.heads + 2 * shape.kv_heads, shape.head_dim, shape.eps
    found: dict[int, torch.Tensor] = {}  # tapped layer -> its input [T, hidden]
    for i, layer in enumerate(layers):
        tapped(x, i, taps, found)
        # attention: fused q/k/v projection, RoPE on all of it at once, k and v into the cache
        qkv = rotate(layer.qkv(rms_norm(x, layer.attn_norm, eps)).view(T, F_qkv, D), cos, sin)
        o = layer.o(attend(i, qkv))  # [T, hidden]
        x = (o if reduce is None else reduce(o)) + x

        # MLP: fused gate/up projection, SiLU gate, down projection
        gate, up = layer.gate_up(rms_norm(x, layer.mlp_norm, eps)).chunk(2, dim=-1)  # [T, I] each
        down = layer.down(F.silu(gate) * up)  # [T, hidden]
        x = (down if reduce is None else reduce(down)) + x
    tapped(x, shape.layers, taps, found)
    return x, features_of(taps, found)


# ---- the KV cache -----------------------------------------------------------------------------
def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on `device` now (Linux MemAvailable on the CPU, the CUDA
    allocator's free memory plus what its cache holds), or None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


class KVPool:
    """The static KV cache of `rows` lanes of one model, and the RoPE tables of its positions.
    Slots per lane (`capacity`) and lanes allocated (`allocated`) both grow with use: an
    engine of 64 lanes serving 3 requests holds about 3 rows, not 64."""

    def __init__(
        self, shape: LlamaShape, rows: int, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device
    ):
        self.shape, self.rows, self.inv_freq, self.dtype, self.device = shape, rows, inv_freq, dtype, device
        self.kv = torch.zeros(0, device=device, dtype=dtype)
        self.capacity = self.allocated = 0
        capacity = min(INITIAL_CAPACITY, shape.max_positions or INITIAL_CAPACITY)
        self._check_memory(rows, capacity)  # a pool that could never hold its lanes: refused now
        self.grow(capacity, 1)

    def _check_memory(self, rows: int, capacity: int) -> None:
        s = self.shape
        need = s.layers * 2 * rows * s.kv_heads * capacity * s.head_dim * self.dtype.itemsize
        free = available_memory(self.device)
        if free is not None and need > free:
            raise MemoryError(
                f"a KV cache of {rows} lane(s) x {capacity} slots needs {need / 2**30:.2f} GiB and "
                f"{free / 2**30:.2f} GiB of {self.device.type} memory is available; serve fewer requests "
                f"at once (max_live / max_kv_tokens) or shorter ones"
            )

    @torch.inference_mode(False)
    def grow(self, capacity: int, rows: int) -> None:
        """Reallocate for `rows` lanes of `capacity` slots (keeping what the cache holds) and the
        RoPE tables for positions [0, capacity): positions never exceed the slot count. A cache
        that would not fit in the memory available now is refused before anything is allocated.
        The tensors are ordinary ones wherever it grows (inside a forward's inference mode too):
        a compiled graph guards on its inputs' dispatch keys, and would recompile."""
        s, old = self.shape, self.kv
        self._check_memory(rows, capacity)
        self.kv = torch.zeros(
            s.layers, 2, rows, s.kv_heads, capacity, s.head_dim, device=self.device, dtype=self.dtype
        )
        if old.numel():
            self.kv[:, :, : old.shape[2], :, : old.shape[-2]] = old
        self.allocated = rows
        if capacity != self.capacity:
            # as HF's rotary embedding: float32 angles, cos/sin, then the compute dtype
            pos = torch.arange(capacity, device=self.device)
            freqs = pos.float()[:, None] * self.inv_freq[None]  # [cap, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [cap, D]
            self.cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # [cap, D]
            half = s.head_dim // 2
            self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [cap, D], see rotate()
            self.capacity = capacity

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_rows` of this pool's tables: indexed once per forward, shared by every layer."""
        return rope_rows(self.cos, self.sin_signed, positions, self.shape)

    def fit(self, slots: int, rows: int = 1) -> None:
        """Make room for `slots` slots per lane in lanes [0, rows) (each doubling when it grows)."""
        capacity, allocated = self.capacity, self.allocated
        if slots > capacity:
            cap = self.shape.max_positions or 2 * capacity
            capacity = max(slots, min(2 * capacity, cap))
        if rows > allocated:
            allocated = min(self.rows, max(rows, 2 * allocated))
        if (capacity, allocated) != (self.capacity, self.allocated):
            self.grow(capacity, allocated)


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
        compile: bool = False,
        quantize: str | None = None,
        tp: TensorParallel | None = None,
    ):
        """`weights`: the HF state dict names (model.layers.{i}.self_attn.q_proj.weight, ...),
        tensors or lazy safetensors slices (`read_checkpoint(lazy=True)`: only what this rank
        holds is read).
        `pack_weights`: let each projection take oneDNN's packed layout where it can
        (`linear.Projection`; False: plain BLAS products everywhere, for comparisons).
        `compile`: run forwards of up to COMPILE_MAX_TOKENS tokens that need logits (decoding,
        tree verification, drafting) through inductor graphs (`CompiledForward`): minutes of
        compilation on first use, then a faster forward. CPU and float32 / bfloat16 only;
        elsewhere it is ignored with a warning. The graphs hold their own packed copies of the
        weights, so the eager path (prefills, batched lanes) then multiplies unpacked.
        `quantize="int8"`: every projection and the output layer multiply by int8 weights with
        a scale per row (`linear.QuantizedProjection`; the embedding lookup stays in `dtype`):
        a different model, the quantized one, which is lossless for a draft and the int8
        model's own distribution for a target. Faster for one-token forwards on a CPU, slower
        for many rows (docs/performance.md).
        `quantize="int4"`: the layers' projections in int4 groups of 32 (`linear.Int4Projection`),
        a GGUF file's own Q4_0 / Q4_1 blocks where the checkpoint carries them (its conversion's
        blocks.safetensors: the file's model), else quantized by Q4_1's rule; the output layer
        int8 as above (GGUF files keep it at 8 bits or more)."""
        if quantize is not None:
            check_quantize(quantize, dtype)  # before any weight is converted
            if quantize == "int4" and tp is not None:
                raise ValueError(
                    "quantize='int4' does not split over tensor-parallel ranks yet; use int8 or None"
                )
        self.tp, self.quantize = tp, quantize
        blocks = {}  # tensor parallel: this rank's rows of q, k/v and the MLP
        if tp is not None:
            D = shape.head_dim
            heads, kv_heads, mlp = (
                tp.block(shape.heads, "the query heads"),
                tp.block(shape.kv_heads, "the key/value heads"),
                tp.block(shape.intermediate, "the MLP width"),
            )
            blocks = {
                "q": slice(heads.start * D, heads.stop * D),
                "kv": slice(kv_heads.start * D, kv_heads.stop * D),
                "mlp": mlp,
            }
            shape = dataclasses.replace(
                shape,
                heads=shape.heads // tp.world,
                kv_heads=shape.kv_heads // tp.world,
                intermediate=shape.intermediate // tp.world,
            )
        self.shape = s = shape
        self.vocab_size, self.max_positions, self.n_layers = s.vocab, s.max_positions, s.layers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device, self.dtype = torch.device(device), dtype
        reason = compile_unsupported_reason(self.device, dtype) if compile else None
        if reason:
            warnings.warn(f"treespec: compile=True ignored, {reason}", stacklevel=2)
            compile = False
        pack_weights = pack_weights and not compile

        def get(name: str, rows: str | None = None, cols: str | None = None) -> torch.Tensor:
            """Tensor `name`, or this rank's block `rows` of its rows / `cols` of its columns."""
            if name not in weights:
                raise ValueError(f"checkpoint lacks the tensor {name!r}")
            w = weights[name]
            if rows in blocks:
                w = w[blocks[rows]]
            elif cols in blocks:
                w = w[:, blocks[cols]]
            else:
                w = w[:]  # a lazy slice: read it all
            return w.to(device=self.device, dtype=dtype)

        def cat(*parts: tuple[str, str | None]) -> torch.Tensor:  # [sum of outs, in]
            return torch.cat([get(n, rows) for n, rows in parts])

        def proj(*parts: tuple[str, str | None], bias: torch.Tensor | None = None, cols: str | None = None):
            """The projection whose weight is `parts`' weights stacked (one part: its `cols`)."""
            if quantize == "int4" and all(f"{n}.q4" in weights for n, _ in parts):  # the file's blocks
                q, scales, zeros = (
                    torch.cat([weights[f"{n}.{k}"][:] for n, _ in parts])
                    for k in ("q4", "q4_scales", "q4_zeros")
                )
                return Int4Projection.from_blocks(q, scales, zeros, bias, dtype)
            weight = cat(*parts) if cols is None else get(parts[0][0], cols=cols)
            if quantize == "int4":
                return Int4Projection.quantize(weight, bias)
            if quantize == "int8":
                return QuantizedProjection(weight, bias)
            return Projection(weight, bias, pack=pack_weights)

        # tied embeddings: the lm_head multiplies by the embedding matrix; where it is packed
        # (CPU) the packed copy sits next to the plain one the lookup reads (one more V x hidden)
        self.embed = get("model.embed_tokens.weight")  # [V, hidden]
        head = self.embed if s.tied else get("lm_head.weight")
        self.lm_head = (  # hidden -> V
            QuantizedProjection(head) if quantize is not None else Projection(head, pack=pack_weights)
        )
        self.norm = get("model.norm.weight")  # [hidden]
        self.layers: list[Layer] = []
        first = tp is None or tp.rank == 0  # a row-parallel product's bias is added once, by rank 0
        for i in range(s.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = ((a + "q_proj.", "q"), (a + "k_proj.", "kv"), (a + "v_proj.", "kv"))
            self.layers.append(
                Layer(
                    attn_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                    qkv=proj(
                        *((n + "weight", rows) for n, rows in qkv),
                        bias=cat(*((n + "bias", rows) for n, rows in qkv)) if s.qkv_bias else None,
                    ),
                    o=proj(
                        (a + "o_proj.weight", None),
                        cols="q",
                        bias=get(a + "o_proj.bias") if s.o_bias and first else None,
                    ),
                    mlp_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up=proj((m + "gate_proj.weight", "mlp"), (m + "up_proj.weight", "mlp")),
                    down=proj((m + "down_proj.weight", None), cols="mlp"),
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
        # compiled graphs kept across processes, but for tensor parallel (collectives in the graph)
        store = GraphStore() if tp is None else None
        self.compiled = CompiledForward(self, store=store) if compile else None
        self._graphs_by_taps: dict[tuple[int, ...], CompiledForward] = {}  # see set_taps
        super().__init__()

    def forward_graph(self) -> _ForwardGraph:
        """This runner's forward with logits as a module for inductor (`CompiledForward`)."""
        return _ForwardGraph(self)

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls,
        model: torch.nn.Module,
        dtype: torch.dtype | None = None,
        device=None,
        pack_weights: bool = True,
        compile: bool = False,
        quantize: str | None = None,
        tp: TensorParallel | None = None,
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
            compile,
            quantize,
            tp,
        )

    @classmethod
    def from_pretrained(
        cls,
        path,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        pack_weights: bool = True,
        compile: bool = False,
        quantize: str | None = None,
        tp: TensorParallel | None = None,
    ) -> NativeRunner:
        """A local directory with config.json and model.safetensors (or a sharded
        model.safetensors.index.json); no transformers import (`checkpoint.read_checkpoint`).
        With `tp`, each rank reads only its blocks of the weights from the files."""
        # read lazily where only part of the file is used: a rank's blocks, or (int4) the float
        # weights of the layers whose 4-bit blocks replace them
        shape, weights, eos_ids = read_checkpoint(path, lazy=tp is not None or quantize == "int4")
        return cls(shape, weights, eos_ids, dtype, device, pack_weights, compile, quantize, tp)

    def input_embeddings(self) -> torch.Tensor:
        return self.embed

    def set_taps(self, taps) -> None:
        before = self.taps
        super().set_taps(taps)
        if self.compiled is not None and self.taps != before:
            # the graphs return the taps they were traced with: one set of graphs per taps, kept
            # (decoders sharing this runner, with and without a head, do not recompile in turn)
            graphs = self._graphs_by_taps
            graphs.setdefault(before, self.compiled)
            if self.taps not in graphs:
                graphs[self.taps] = CompiledForward(self, self.compiled.custom_config, self.compiled.store)
            self.compiled = graphs[self.taps]

    # ---- the KV cache ---------------------------------------------------------------------
    @property
    def kv(self) -> torch.Tensor:
        """This lane's cache, [L, 2, 1, Hkv, cap, D] (a view of its pool)."""
        return self.pool.kv[:, :, self.row : self.row + 1]

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def lanes_match_solo(self) -> bool:
        return self.compiled is None  # the compiled graphs serve one-lane pools only

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
    ) -> list[Scores]:
        """Feed every lane's new tokens (lanes of this runner's pool) in one forward; logits
        [n_i, V] (and the tapped features [n_i, F]) per lane. T = the new tokens of all lanes,
        packed."""
        s, pool = self.shape, self.pool
        ns, starts = [f.tokens.shape[0] for f in feeds], [lane.filled for lane in lanes]
        for f, S, n in zip(feeds, starts, ns):
            if f.visible is not None and f.visible.shape[-1] != S + n:
                raise RuntimeError(f"mask covers {f.visible.shape[-1]} slots, the cache holds {S} + {n} new")
        one = len(lanes) == 1
        if one and need_logits and self.compiled is not None:
            scores = self.compiled(self, feeds[0], starts[0])
            if scores is not None:
                self.filled = starts[0] + ns[0]
                return [scores]
        tokens, positions, attend = self._packed_inputs(lanes, feeds, starts, ns)
        cos, sin = pool.rope(positions)  # [T, Hq+2Hkv, D] each
        reduce = None if self.tp is None else self.tp.reduce
        x, features = decoder_stack(self._embed(tokens), self.layers, attend, cos, sin, s, self.taps, reduce)
        for lane, S, n in zip(lanes, starts, ns):
            lane.filled = S + n
        logits = self.lm_head(rms_norm(x, self.norm, s.eps)) if need_logits else None  # [T, V]
        return split_scores(logits, features, ns)

    def _packed_inputs(self, lanes: list[NativeRunner], feeds: list[Feed], starts: list[int], ns: list[int]):
        """What an eager packed forward over `lanes` (this runner's pool) needs: the cache grown
        to fit, the new tokens and positions of every lane packed ([T] each), and the attention
        over each lane's cache row (a single lane's cascade-capable one, or the padded one)."""
        pool = self.pool
        pool.fit(max(S + n for S, n in zip(starts, ns)), max(lane.row for lane in lanes) + 1)
        if len(lanes) == 1:
            feed = feeds[0]
            attend = LaneAttention(
                pool.kv,
                self.row,
                starts[0],
                ns[0],
                self.shape.heads,
                feed.visible,
                self.n_committed,
                self.flash,
                self.prefix_attention,
            )
            return feed.tokens, feed.positions, attend
        rows, visibles = [lane.row for lane in lanes], [f.visible for f in feeds]
        attend = PackedAttention(pool.kv, rows, starts, ns, self.shape.heads, visibles)
        return torch.cat([f.tokens for f in feeds]), torch.cat([f.positions for f in feeds]), attend

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, hidden]."""
        return F.embedding(tokens, self.embed)


def split_scores(logits: torch.Tensor | None, features: torch.Tensor | None, ns: list[int]) -> list[Scores]:
    """One packed forward's logits [T, V] and features [T, F] (either None) as each lane's
    `Scores` (n_i rows each)."""
    if len(ns) == 1:
        return [Scores(logits, features)]
    parts = [None if t is None else t.split(ns) for t in (logits, features)]
    return [Scores(*(None if p is None else p[b] for p in parts)) for b in range(len(ns))]


# ---- the compiled forward (compile=True) ---------------------------------------------------------
def compile_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `NativeRunner(compile=True)` cannot compile here, or None."""
    if device.type != "cpu":
        return f"compiled forwards are built for CPU only, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"compiled forwards run float32 and bfloat16 only, not {dtype}"
    return None


class _ForwardGraph(torch.nn.Module):
    """The one-lane forward with logits, written for inductor: the weights are buffers (frozen
    into the graph as constants); the fed tokens, their positions and cache slots, the attention
    pattern, the RoPE tables and the KV pool (written in place) are inputs. The math is the
    eager forward's, layer for layer."""

    def __init__(self, runner: NativeRunner):
        super().__init__()
        self.shape, self.taps, self.tp = runner.shape, runner.taps, runner.tp
        self.register_buffer("embed", runner.embed)
        self.register_buffer("norm", runner.norm)
        self._register("lm_head", runner.lm_head)
        for i, layer in enumerate(runner.layers):
            for name in ("attn_norm", "mlp_norm"):
                self.register_buffer(f"{name}_{i}", getattr(layer, name))
            for name in ("qkv", "o", "gate_up", "down"):
                self._register(f"{name}_{i}", getattr(layer, name))
                self._buffer(f"{name}_bias_{i}", getattr(layer, name).bias)

    def _register(self, name: str, projection: Product) -> None:
        """The projection's weight as buffer `name`, with what its product reads besides as
        `name`_scales: int8's scale per row, int4's scales and offsets per group (its weight
        packed), None for a float weight."""
        if isinstance(projection, QuantizedProjection):
            self._buffer(name, projection.weight_int8)
            self._buffer(f"{name}_scales", projection.scales)
        elif isinstance(projection, Int4Projection):
            self._buffer(name, projection.packed)
            self._buffer(f"{name}_scales", projection.scales_and_zeros)
        else:
            self._buffer(name, projection.weight)
            self._buffer(f"{name}_scales", None)

    def _buffer(self, name: str, tensor: torch.Tensor | None) -> None:
        """A weight as a buffer; a missing one (no bias, no scales) as a plain None, which
        torch.export takes where it refuses None buffers."""
        if tensor is None:
            setattr(self, name, None)
        else:
            self.register_buffer(name, tensor)

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight, scales = getattr(self, name), getattr(self, f"{name}_scales")
        if scales is None:
            return F.linear(x, weight, bias)
        y = int4_product(x, weight, scales) if scales.dim() == 3 else int8_product(x, weight, scales)
        return y if bias is None else y + bias

    def layer(self, i: int) -> Layer:
        """Layer i, its products reading the buffers (read as attributes: inductor freezes them)."""
        w = lambda name: getattr(self, name)  # noqa: E731
        product = lambda name: functools.partial(self._linear, name=f"{name}_{i}", bias=w(f"{name}_bias_{i}"))  # noqa: E731
        return Layer(
            w(f"attn_norm_{i}"),
            product("qkv"),
            product("o"),
            w(f"mlp_norm_{i}"),
            product("gate_up"),
            product("down"),
        )

    FED = 4  # the inputs per fed token (the attention mask last), then the pool's tables and cache

    @staticmethod
    def inputs(feed: Feed, slots: torch.Tensor, mask: torch.Tensor, pool: KVPool) -> tuple:
        """`forward`'s inputs for `feed`, written to `slots` under `mask`."""
        return (feed.tokens, feed.positions, slots, mask, pool.cos, pool.sin_signed, pool.kv)

    def forward(self, tokens, positions, slots, mask, cos_table, sin_table, kv):
        s = self.shape
        cos, sin = rope_rows(cos_table, sin_table, positions, s)  # [T, Hq+2Hkv, D] each
        layers = (self.layer(i) for i in range(s.layers))
        attend = lambda i, qkv: graph_lane_attention(kv, i, qkv, slots, mask, s.heads)  # noqa: E731 - [T, Hq*D]
        reduce = None if self.tp is None else self.tp.reduce
        x, features = decoder_stack(
            F.embedding(tokens, self.embed), layers, attend, cos, sin, s, self.taps, reduce
        )
        return self._linear(rms_norm(x, self.norm, s.eps), "lm_head"), features  # [T, V], [T, F]


@contextlib.contextmanager
def _quiet_compiler():
    """Inductor's autotuner warns of a deprecation inside torch (TypedStorage): not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def _two_rows(inputs: tuple, fed: int) -> tuple:
    """A one-token graph's inputs as two tokens' (its first `fed` inputs, the mask last among
    them, are per fed token), to export a graph for any number of tokens from: export traces
    them as fakes, so only their sizes matter, and nothing is computed or written."""
    *rows, mask = inputs[:fed]
    mask = torch.ones(2, mask.shape[1] + 1, dtype=mask.dtype, device=mask.device)  # [2, span + 1]
    return (*(torch.cat([t, t]) for t in rows), mask, *inputs[fed:])


class CompiledForward:
    """A lane's forwards that need logits, of 1 to COMPILE_MAX_TOKENS tokens, as inductor graphs.

    Graphs compiled on first use (about a minute each on a small CPU): one per feed size from 1
    to `static_max` tokens (the decode step; with float32 or int8 weights also a chain's
    verification and small trees, each with products tuned for its row count) and one for
    larger feeds up to COMPILE_MAX_TOKENS (the row count dynamic; with int4 weights, where the
    graph comes from the store, that one graph serves every feed: `static_max` 0); all take the attended span
    and the cache capacity as dynamic sizes, so none recompiles as the sequence or the cache
    grows. Which products each graph gets depends on the weights (`products`). Inductor
    freezes the weights into the graphs, packs them for the products it picked and fuses the
    norms, RoPE, SiLU gate and residual adds into a few C++ kernels; the wrapper that calls
    them replaces ~30 eager ops per layer.
    Attention is SDPA over the lane's cache row under an explicit mask
    (`attention.graph_lane_attention`). The math is the eager forward's; fused
    kernels keep float32 intermediates where eager rounds bf16 after each op, so bf16 logits
    differ in the last bits, as any two kernels for one op may (float32 agrees with HF to 1e-4,
    tests/test_native.py). What the graphs do not serve runs eagerly: prefills (no logits),
    longer feeds, lanes of a pool of several rows, a first token with an empty cache.

    With a `store` (`aot.GraphStore`, what NativeRunner(compile=True) gives but under tensor
    parallel), each graph is compiled ahead of time once for this machine and model and kept on
    disk; a later process loads it in ~0.1 s instead of tracing and capturing it again (~13 s a
    graph for SmolLM2). Without one, or where compiling ahead of time fails (reported once; the
    store remembers), the graph is compiled in process by `torch.compile`. A graph that fails to
    compile at all (no C++ compiler, an unsupported torch) is reported once and not tried again;
    the eager forward takes over. Measurements: docs/performance.md.
    """

    # inductor settings, patched in around the call that compiles a graph (its first): freezing is read
    # outside what torch.compile(options=...) patches, and setting it process-wide would change
    # every other torch.compile of the process. AUTOTUNED: max-autotune picks, per product,
    # inductor's C++ GEMM template or the library's kernel; PACKED: the library's products
    # (oneDNN's packed ones for float weights), no autotuning.
    # autotuning reports nothing on stderr (its tables would bury treespec's progress lines)
    AUTOTUNED = {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP,ATEN",
        "autotune_num_choices_displayed": 0,
        "max_autotune_report_choices_stats": False,
    }
    PACKED = {"freezing": True, "max_autotune": False}
    # TEMPLATES: inductor's C++ GEMM template for every product and no timing. Where max-autotune
    # picks that template anyway (int4, at every row count), timing the choices only costs
    # compile time: ~20 s of a SmolLM2 graph's ~90 s (Zen 4). A product the template cannot take
    # has no choice left under it; such a graph is compiled under AUTOTUNED instead (`candidates`).
    TEMPLATES = {**AUTOTUNED, "max_autotune_gemm_backends": "CPP"}
    # dynamo: a size seen twice must not turn dynamic by itself (each static size keeps its
    # graph), and there is room for every static size plus the dynamic graph
    DYNAMO = {"automatic_dynamic_shapes": False, "recompile_limit": COMPILE_STATIC_MAX + 4}

    def __init__(self, runner: NativeRunner, config: dict | None = None, store: GraphStore | None = None):
        """`config`: inductor settings for every graph instead of AUTOTUNED / PACKED (tests use
        cheap ones). `store`: where graphs are kept across processes as AOTInductor packages
        (`aot.GraphStore`); None: each process compiles its own in process (`torch.compile`)."""
        # dynamo keeps compiled graphs, and counts its recompile limit, per code object: a
        # forward of its own keeps this runner's graphs apart from every other runner's (a
        # target and its draft, or two dtypes, would share one cache and exhaust the limit)
        self.module = runner.forward_graph().eval()
        forward = type(self.module).forward
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__)
        # its module's buffers are the frozen weights, never reassigned: dynamo need not guard
        # them (~0.1 ms of guard checks a call on a 30-layer model); inputs keep their guards
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        self.graph = torch.compile(
            types.MethodType(own, self.module),
            fullgraph=True,
            options=None if skip is None else {"guard_filter_fn": skip},
        )
        self.custom_config = config
        static, dynamic, self.static_max = self.products(runner.quantize, runner.dtype)
        if config is not None:
            static = dynamic = config
        self.config = {"static": dict(static), "dynamic": dict(dynamic)}
        self.dynamo = {k: v for k, v in self.DYNAMO.items() if hasattr(torch._dynamo.config, k)}
        self.compiled: set[int | str] = set()  # graphs compiled: static feed sizes, "dynamic"
        self.failed = False
        self.store, self.model = store, None  # model: its digest, once a package is sought
        self.packages: dict[int | str, Callable] = {}  # graphs loaded from `store`

    @classmethod
    def products(cls, quantize: str | None, dtype: torch.dtype) -> tuple[dict, dict, int]:
        """(the static graphs' settings, the dynamic graph's, the largest feed with a graph of
        its own) for weights in `quantize` computing in `dtype`; each choice the faster inside
        the model on a Zen 5 core (docs/performance.md, "Which products a compiled graph
        gets"). Int4: inductor's micro-kernel at every row count (tuned at one, it holds at the
        others), so one dynamic graph for every feed, taking it untimed (TEMPLATES: a cold
        start compiles one graph in ~70 s, where an autotuned one-token graph and an autotuned
        dynamic one took ~180 s, and decodes as fast). bf16 weights: oneDNN's packed products
        (the bf16 template autotuning picks, fast on one cached matrix, is 1.5x slower inside
        the model), so nothing to tune per size. float32 and int8: a tuned
        graph per small feed size, and oneDNN's / torch's products for longer feeds (a float
        template tuned at one row count loses at others)."""
        if quantize == "int4":
            return cls.TEMPLATES, cls.TEMPLATES, 0
        if quantize is None and dtype == torch.bfloat16:
            return cls.PACKED, cls.PACKED, 1
        return cls.AUTOTUNED, cls.PACKED, COMPILE_STATIC_MAX

    def __call__(self, runner: NativeRunner, feed: Feed, S: int) -> Scores | None:
        """The `Scores` of `feed` after the S slots `runner` holds (its cache written), or None
        where the graphs do not serve it."""
        n, pool = feed.tokens.shape[0], runner.pool
        if self.failed or pool.rows != 1 or S < 1 or n > COMPILE_MAX_TOKENS:
            return None
        span = S + n
        # capacity > span: the first call of a graph fixes which dynamic sizes are one symbol,
        # and a span equal to the capacity there would tie the two for good
        pool.fit(span + 1)
        if feed.visible is not None:
            mask = feed.visible.clone()  # [n, span]; made here, as the other masks (the graph checks how)
        elif n == 1:
            mask = torch.ones(1, span, dtype=torch.bool, device=runner.device)
        else:
            mask = causal_visible(n, S, runner.device)
        slots = torch.arange(S, span, device=runner.device)
        inputs = self.module.inputs(feed, slots, mask, pool)
        # static_max 0: the dynamic graph serves every feed where it comes from the store; in
        # process, dynamo keeps no dimension of size 1 dynamic, so one token gets a graph of its own
        static = n <= self.static_max or (n == 1 and 1 in self.compiled)
        graph = n if static else "dynamic"
        candidates = self.candidates(self.config["static" if static else "dynamic"])
        what = f"{n} tokens" if static else "longer feeds" if self.static_max else "every feed"  # for the log
        try:
            if graph in self.compiled:
                # compiled: the dynamic sizes and settings are read only while compiling, and
                # marking and patching cost ~0.1 ms a call
                return Scores(*self.packages.get(graph, self.graph)(*inputs))
            package = self._package(graph, inputs, candidates, what) if self.store is not None else None
            if package is not None:
                self.packages[graph] = package
                self.compiled.add(graph)
                return Scores(*package(*inputs))
            if n == 1 and not static:  # in process: the one-token graph (above)
                static, graph, what = True, 1, "1 tokens"
            if not static:
                for t in inputs[: self.module.FED]:
                    torch._dynamo.mark_dynamic(t, 0, min=max(self.static_max, 1) + 1, max=COMPILE_MAX_TOKENS)
            torch._dynamo.mark_dynamic(mask, 1)
            for t, dim in ((pool.kv, 4), (pool.cos, 0), (pool.sin_signed, 0)):
                torch._dynamo.mark_dynamic(t, dim)
            log.info("compiling the forward for %s (once per process; seconds to minutes)", what)
            with (
                torch._inductor.config.patch(candidates[-1]),  # the settings every product takes
                torch._dynamo.config.patch(self.dynamo),
                _quiet_compiler(),
            ):
                scores = Scores(*self.graph(*inputs))
            self.compiled.add(graph)
            return scores
        except Exception as e:  # noqa: BLE001 - any compile failure means: run eagerly from now on
            self.failed = True
            warnings.warn(
                f"treespec: the compiled forward failed ({type(e).__name__}: {e}); running eagerly",
                stacklevel=2,
            )
            return None

    @classmethod
    def candidates(cls, settings: dict) -> list[dict]:
        """The settings to compile a graph under, in order: `settings`, then AUTOTUNED where
        `settings` leaves a product no kernel but the C++ template (TEMPLATES)."""
        templates_only = settings.get("max_autotune_gemm_backends") == "CPP"
        return [settings, cls.AUTOTUNED] if templates_only else [settings]

    def digest(self) -> str:
        """What these graphs compute (`aot.model_digest`: weights, shape, taps), computed once."""
        if self.model is None:
            self.model = model_digest(self.module, shape=self.module.shape, taps=self.module.taps)
        return self.model

    def _package(self, graph: int | str, inputs: tuple, candidates: list[dict], what: str) -> Callable | None:
        """Graph `graph` (`what` it serves, for the log) from the store, under the first of the
        inductor settings `candidates` it compiles under: loaded (~0.1 s), or compiled ahead of
        time once for this machine and model and kept there; None where it cannot be (the graph
        is then compiled in process, as without a store, and later processes do not try again)."""
        failure = None
        for settings in candidates:
            key = self.store.key(self.digest(), graph, settings)
            if self.store.refused(key):
                continue
            package = self.store.load(key)
            if package is not None:
                log.info("loaded the compiled forward for %s from %s", what, self.store.root)
                return package
            try:
                return self._build(key, graph, inputs, settings, what)
            except Exception as e:  # noqa: BLE001 - the next settings, then the in-process compiler
                self.store.refuse(key, e)
                failure = e
        if failure is not None:
            warnings.warn(
                f"treespec: compiling the forward ahead of time failed ({type(failure).__name__}: "
                f"{failure}); compiling it in this process instead",
                stacklevel=3,
            )
        return None

    def _build(self, key: str, graph: int | str, inputs: tuple, settings: dict, what: str) -> Callable:
        """Compile graph `graph` ahead of time under `settings` into the store, as `key`."""
        # the sizes free in every graph: the attended span, the RoPE tables' rows, the cache's
        # capacity; and in the dynamic graph the fed tokens
        Dim = torch.export.Dim  # noqa: N806 - torch's name
        span, rope, cap = Dim("span", min=2), Dim("rope", min=2), Dim("cap", min=3)
        rows = {0: Dim("n", min=self.static_max + 1, max=COMPILE_MAX_TOKENS)} if graph == "dynamic" else None
        fed = self.module.FED
        dims = ((rows,) * (fed - 1)) + ({1: span, **(rows or {})}, {0: rope}, {0: rope}, {4: cap})
        if rows is not None and inputs[0].shape[0] == 1:
            inputs = _two_rows(inputs, fed)  # export keeps no dimension of size 1 dynamic
        log.info(
            "compiling the forward for %s ahead of time (once for this machine and model, kept in %s; "
            "about a minute)", what, self.store.root,
        )  # fmt: skip
        with _quiet_compiler():
            return self.store.build(key, self.module, inputs, dims, settings)
