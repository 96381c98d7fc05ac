"""`NativeRunner`: the native model over its static KV cache, behind the `Runner` seam.

A runner is one lane (row) of a `KVPool`: a single sequence has a pool of one;
`runner.lanes(R)` makes R runners over one pool of R rows, one per request of a batch, and
their forwards run as ONE packed forward (`forward_many`): the new tokens of every lane go
through the projections and the MLP as one [T, hidden] matrix, only attention pads them to
[R, n_max] against each lane's own cache row. Every per-forward decision (mask, GQA layout,
each layer's cache views, the RoPE rows) is made once per forward, not per layer. With
`compile=True` the forwards that need logits run as inductor graphs of the same math
(compile.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ...config import check_positive_int
from ...parallel import TensorParallel
from ..attention import LaneAttention, PackedAttention, exact_rows, flash_available, flash_prefix_attention
from ..base import Feed, Runner, Scores, forward_grouped
from ..checkpoint import LlamaShape, read_checkpoint
from ..linear import check_quantize
from .aot import GraphStore
from .compile import CompiledForward, ForwardGraph, compiled_forward, resolve_compile
from .kv import KVPool
from .model import Layer, decoder_stack, rms_norm
from .sharding import adds_bias, rank_shape
from .weights import WeightLoader, check_shapes


def check_options(
    quantize: str | None, dtype: torch.dtype, tp: TensorParallel | None, device: torch.device | str = "cpu"
) -> None:
    """Refuse a weight format this dtype, device or tensor parallel cannot run (before any
    weight is read)."""
    if quantize is None:
        return
    check_quantize(quantize, dtype, device)
    if quantize in ("int4", "q4q8") and tp is not None:
        raise ValueError(
            f"quantize={quantize!r} does not split over tensor-parallel ranks yet; use int8 or None"
        )


class NativeRunner(Runner):
    """A Llama-architecture causal LM as plain tensors over a static KV cache."""

    tp: TensorParallel | None = None  # this rank's place in a tensor-parallel model (None: alone)

    def __init__(
        self,
        shape: LlamaShape,
        weights: dict[str, torch.Tensor],
        eos_token_ids: frozenset[int] = frozenset(),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack_weights: bool = True,
        compile: bool | str = False,
        quantize: str | None = None,
        tp: TensorParallel | None = None,
    ):
        """`weights`: the HF state dict names (model.layers.{i}.self_attn.q_proj.weight, ...),
        tensors or lazy safetensors slices (`read_checkpoint(lazy=True)`: only what this rank
        holds is read).
        `pack_weights`: let each projection take oneDNN's packed layout where it can
        (`linear.Projection`; False: plain BLAS products everywhere, for comparisons).
        `compile`: run forwards of up to COMPILE_MAX_TOKENS tokens that need logits (decoding,
        tree verification, drafting) through inductor graphs (`CompiledForward`): compiled on
        first use, then a faster forward. CPU and float32 / bfloat16 only; elsewhere it is
        ignored with a warning. The graphs hold their own packed copies of the weights, so the
        eager path (prefills, batched lanes) then multiplies unpacked. "auto": the graphs the
        store already holds for this machine and model (quantized weights; `resolve_compile`),
        never compiling one; a feed whose graph is not there runs eagerly.
        `quantize="int8"`: every projection and the output layer multiply by int8 weights with
        a scale per row (`linear.QuantizedProjection`; the embedding lookup stays in `dtype`):
        a different model, the quantized one, which is lossless for a draft and the int8
        model's own distribution for a target. Faster for one-token forwards on a CPU, slower
        for many rows (docs/performance.md).
        `quantize="int4"`: the layers' projections in int4 groups of 32 (`linear.Int4Projection`),
        a GGUF file's own Q4_0 / Q4_1 blocks where the checkpoint carries them (its conversion's
        blocks.safetensors: the file's model), else quantized by Q4_1's rule; the output layer
        int8 as above (GGUF files keep it at 8 bits or more).
        `quantize="q4q8"`: every projection and the output layer multiply by 4-bit weights as
        int4's, times activations rounded to int8 per row and group of 32 (`linear.Q4Q8Projection`,
        `kernels.q4q8`): another model again, whose rows never depend on each other. CPU only.
        `tp`: this rank of a tensor-parallel model (sharding.py)."""
        check_options(quantize, dtype, tp, device)
        self.tp, self.quantize = tp, quantize
        shape, blocks = rank_shape(shape, tp)
        self._set_shape(shape, eos_token_ids, torch.device(device), dtype)
        compile = resolve_compile(compile, self.device, self.dtype, quantize, tp)
        # eager layouts (oneDNN packing, a quantized product's extra copies) but under compile=True;
        # "auto" keeps them for the feeds no kept graph serves (all of them where none is kept)
        loader = WeightLoader(
            weights, blocks, self.device, dtype, quantize, pack_weights and compile is not True
        )
        self._load_weights(loader)
        self._init_cache()
        # compiled graphs kept across processes, but for tensor parallel (collectives in the graph)
        # compile_setting: as resolved (True, False, "auto"); compiled: the graphs, or None (eager)
        self.compile_setting, self._store = compile, GraphStore() if tp is None else None
        self.compiled = compiled_forward(self, compile, self._store)
        self._graphs_by_taps: dict[tuple[int, ...], CompiledForward | None] = {}  # see set_taps
        super().__init__()

    def _set_shape(
        self, shape: LlamaShape, eos_token_ids: frozenset[int], device: torch.device, dtype: torch.dtype
    ) -> None:
        """The model's numbers as the `Runner` seam reads them."""
        self.shape = shape
        self.vocab_size, self.max_positions, self.n_layers = shape.vocab, shape.max_positions, shape.layers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device, self.dtype = device, dtype

    def _load_weights(self, loader: WeightLoader) -> None:
        """The embedding, output layer, final norm and decoder layers, checked against the shape."""
        s = self.shape
        self.embed, self.lm_head, self.norm = loader.output(s)  # [V, hidden], hidden -> V, [hidden]
        self.layers: list[Layer] = [loader.layer(i, s, adds_bias(self.tp)) for i in range(s.layers)]
        check_shapes(self.lm_head, self.layers[0], s)

    def _init_cache(self) -> None:
        """This runner's cache (row 0 of a pool of one), its RoPE frequencies and attention."""
        self.inv_freq = self.shape.inv_freq().to(self.device)  # [D/2] float32
        # flash-attn serves the committed prefix of tree forwards on CUDA (fp16/bf16); the tree
        # block is a small masked attention merged by log-sum-exp (attention.cascade_attention).
        self.flash = self.dtype in (torch.float16, torch.bfloat16) and flash_available(self.device)
        self.prefix_attention = flash_prefix_attention
        self.exact_rows = exact_rows(self.device, self.dtype)  # row_attention: rows independent
        self.pool, self.row = KVPool(self.shape, 1, self.inv_freq, self.dtype, self.device), 0

    def forward_graph(self) -> ForwardGraph:
        """This runner's forward with logits as a module for inductor (`CompiledForward`)."""
        return ForwardGraph(self)

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
        from ..hf import eos_token_ids

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
        # read lazily where only part of the file is used: a rank's blocks, or (4 bits) the float
        # weights of the layers whose 4-bit blocks replace them
        shape, weights, eos_ids = read_checkpoint(path, lazy=tp is not None or quantize in ("int4", "q4q8"))
        return cls(shape, weights, eos_ids, dtype, device, pack_weights, compile, quantize, tp)

    def input_embeddings(self) -> torch.Tensor:
        return self.embed

    def set_taps(self, taps) -> None:
        before = self.taps
        super().set_taps(taps)
        if self.compile_setting and self.taps != before:
            # the graphs return the taps they were traced with: one set of graphs per taps, kept
            # (decoders sharing this runner, with and without a head, do not recompile in turn);
            # "auto" asks the store again, for the graphs of these taps
            graphs, now = self._graphs_by_taps, self.compiled
            graphs.setdefault(before, now)
            if self.taps not in graphs:
                config, store = (None, self._store) if now is None else (now.custom_config, now.store)
                graphs[self.taps] = compiled_forward(self, self.compile_setting, store, config)
            self.compiled = graphs[self.taps]

    def load_graphs(self) -> None:
        if self.compiled is not None and not self.compiled.build:
            self.compiled.load_stored()

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

    @property
    def filled(self) -> int:
        """Slots [0, filled) of this lane hold keys and values (kept by the pool, which trims
        itself to what its lanes hold)."""
        return self.pool.filled[self.row]

    @filled.setter
    def filled(self, n: int) -> None:
        self.pool.filled[self.row] = n

    def reset_cache(self) -> None:
        self.filled = 0

    def release(self) -> None:
        """A reset, and the pool gives back the memory its lanes no longer hold (`KVPool.trim`)."""
        super().release()
        self.pool.trim()

    @torch.inference_mode()
    def keep_slots(self, nodes: list[int]) -> None:
        # pending index -> slot c + index; gather every layer's keys and values at once (a copy),
        # then write them right after the committed prefix
        c, k = self.n_committed, len(nodes)
        idx = torch.tensor(nodes, dtype=torch.long, device=self.device) + c  # [k]
        kv = self.pool.kv[:, :, self.row]  # [L, 2, Hkv, cap, D]
        kv[..., c : c + k, :] = kv.index_select(-2, idx)

    def truncate(self, n_slots: int) -> None:
        self.filled = n_slots  # a static cache just forgets the rest

    # ---- the forward ----------------------------------------------------------------------
    def forward(self, tokens, positions, visible, need_logits):
        return self.forward_many([self], [Feed(tokens, positions, visible)], need_logits)[0]

    @classmethod
    def forward_many(cls, runners, feeds, need_logits):
        """Lanes of one pool run as one packed forward; lanes of different pools one forward each."""

        def pool_forward(lanes: list[NativeRunner], lane_feeds: list[Feed]) -> list[Scores]:
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
        packed. A subclass with another layer stack overrides this (`head.HeadRunner`)."""
        s, pool = self.shape, self.pool
        ns, starts = [f.tokens.shape[0] for f in feeds], [lane.filled for lane in lanes]
        for f, S, n in zip(feeds, starts, ns):
            if f.visible is not None and f.visible.shape[-1] != S + n:
                raise RuntimeError(f"mask covers {f.visible.shape[-1]} slots, the cache holds {S} + {n} new")
        scores = self._compiled_forward(lanes, feeds, starts, need_logits)
        if scores is not None:
            return scores
        tokens, positions, attend = self._packed_inputs(lanes, feeds, starts, ns)
        cos, sin = pool.rope(positions)  # [T, Hq+2Hkv, D] each
        reduce = None if self.tp is None else self.tp.reduce
        x, features = decoder_stack(self._embed(tokens), self.layers, attend, cos, sin, s, self.taps, reduce)
        for lane, S, n in zip(lanes, starts, ns):
            lane.filled = S + n
        logits = self.lm_head(rms_norm(x, self.norm, s.eps)) if need_logits else None  # [T, V]
        return split_scores(logits, features, ns)

    def _compiled_forward(
        self, lanes: list[NativeRunner], feeds: list[Feed], starts: list[int], need_logits: bool
    ) -> list[Scores] | None:
        """The one lane's `Scores` from the compiled graphs (its cache written), or None where
        they do not serve this forward (several lanes, no logits, no graph)."""
        if len(lanes) != 1 or not need_logits or self.compiled is None:
            return None
        scores = self.compiled(self, feeds[0], starts[0])
        if scores is None:
            return None
        self.filled = starts[0] + feeds[0].tokens.shape[0]
        return [scores]

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
                self.exact_rows,
            )
            return feed.tokens, feed.positions, attend
        rows, visibles = [lane.row for lane in lanes], [f.visible for f in feeds]
        attend = PackedAttention(pool.kv, rows, starts, ns, self.shape.heads, visibles, self.exact_rows)
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
