"""A feature head (EAGLE-3): one decoder layer that drafts from the target's hidden states.

At committed position t the head reads the target's features f_t (the inputs of a few target
layers, concatenated: EAGLE-3's {2, N/2, N-3}) projected by `fc` to the head's width, together
with the target's own (frozen) embedding of token t+1, and predicts token t+2:

    e = input_norm(embed(x_{t+1}))                 h = fc(f_t)         (or the head's own state)
    a = o(attn(qkv(cat[e, hidden_norm(h)]))) + h   the layer's residual stream starts at h
    s = down(silu(gate) * up)(post_norm(a)) + a    the output state: fed below a drafted node
    logits = lm_head(norm(s))                      over the head's K draft rows; row r is the
                                                   target id r + d2t[r] (-inf everywhere else)

Slot t of the head's KV cache holds (f_t, x_{t+1}) at position t. Deeper tree levels have no
target features yet: a node drafted below slot u is fed with u's output state s instead of
fc(f) (EAGLE's own-feature drafting). `HeadRunner` is that layer as a `NativeRunner` over one
layer of a static cache, so lanes, commits and the tree mask are the native backend's; its
feeds carry the hidden state of every token (`Feed.hidden`) and its `Scores.features` are the
output states.

The checkpoint format is EAGLE-3's, as vLLM and SGLang load it: config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size` and the target layers in
`eagle_aux_hidden_state_layer_ids`; model.safetensors with `fc.weight`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t` (target id - draft row, per row) and `t2d` (a bool
per target id), and `embed_tokens.weight` only when the head has an embedding of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import exact_rows, graph_lane_attention
from .base import Feed, Scores
from .checkpoint import LlamaShape
from .linear import Int4Projection, Projection, Q4Q8Projection, QuantizedProjection, check_quantize
from .native.aot import GraphStore
from .native.compile import ForwardGraph, compiled_forward, resolve_compile
from .native.kv import KVPool
from .native.model import Layer, rms_norm, rope_rows, rotate
from .native.runner import NativeRunner, split_scores

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what save_head writes
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # what a head's config may name (vLLM's alias)


def default_taps(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers: early, middle, late (vLLM's default, (2, N // 2, N - 3))."""
    return tuple(sorted({min(2, target_layers - 1), target_layers // 2, max(target_layers - 3, 0)}))


@dataclass(frozen=True)
class HeadConfig:
    """The numbers of a feature head (EAGLE-3's config.json fields, named as there)."""

    hidden_size: int  # the head's width; its embedding is the target's, so the target's too
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # K: the rows the head proposes
    target_hidden_size: int  # width of one tapped target state
    taps: tuple[int, ...]  # target layers read (eagle_aux_hidden_state_layer_ids)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if not self.taps:
            raise ValueError("a feature head needs at least one target layer to read")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads do not split into "
                f"{self.num_key_value_heads} kv groups"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must lie in [1, {self.vocab_size}]")

    @property
    def shape(self) -> LlamaShape:
        """The head's one layer as the native forward sees it (q/k/v read 2 * hidden_size)."""
        return LlamaShape(
            vocab=self.draft_vocab_size,
            hidden=self.hidden_size,
            layers=1,
            heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate_size,
            eps=self.rms_norm_eps,
            max_positions=self.max_position_embeddings,
            tied=False,
            qkv_bias=False,
            o_bias=False,
            rope={"rope_type": "default", "rope_theta": self.rope_theta},
        )

    def to_json(self) -> dict:
        """config.json as EAGLE-3 checkpoints write it."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": list(self.taps),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.taps),
                "use_aux_hidden_state": True,
            },
        }

    @classmethod
    def from_json(cls, cfg: dict, target_layers: int | None = None) -> HeadConfig:
        """An EAGLE-3 config.json; taps from `eagle_aux_hidden_state_layer_ids` (top level or in
        `eagle_config`), else EAGLE-3's default for a target of `target_layers` layers."""
        archs = cfg.get("architectures") or []
        if not set(archs) & set(ARCHITECTURES):
            raise ValueError(f"not an EAGLE-3 head: architectures {archs}, expected [{ARCHITECTURE!r}]")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"EAGLE-3 heads with {cfg['num_hidden_layers']} layers are not supported (1 only)"
            )
        taps = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if taps is None:
            if target_layers is None:
                raise ValueError("the head names no target layers; give the target's layer count")
            taps = default_taps(target_layers)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            taps=tuple(int(t) for t in taps),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        )


def head_weight_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an EAGLE-3 checkpoint and its shape (embed_tokens is optional)."""
    H, D, K = cfg.hidden_size, cfg.head_dim, cfg.draft_vocab_size
    q, kv, inter = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.intermediate_size
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return {
        "fc.weight": (H, len(cfg.taps) * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        a + "q_proj.weight": (q, 2 * H),
        a + "k_proj.weight": (kv, 2 * H),
        a + "v_proj.weight": (kv, 2 * H),
        a + "o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        m + "gate_proj.weight": (inter, H),
        m + "up_proj.weight": (inter, H),
        m + "down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (K, H),
        "d2t": (K,),
        "t2d": (cfg.vocab_size,),
    }


def check_head_weights(cfg: HeadConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor present with its shape, and d2t a map into the target's vocabulary."""
    for name, shape in head_weight_shapes(cfg).items():
        if name not in weights:
            raise ValueError(f"the EAGLE-3 checkpoint lacks the tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(weights[name].shape)}, the config says {shape}")
    ids = torch.arange(cfg.draft_vocab_size) + weights["d2t"].long()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(torch.unique(ids)) != len(ids):
        raise ValueError("d2t must map the draft rows to distinct target ids")


def save_head(directory, cfg: HeadConfig, weights: dict[str, torch.Tensor]) -> Path:
    """Write an EAGLE-3 checkpoint (config.json + model.safetensors) to `directory`."""
    from safetensors.torch import save_file

    check_head_weights(cfg, weights)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def is_head(directory) -> bool:
    """Whether `directory` holds an EAGLE-3 head (its config.json names the architecture)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return False
    archs = json.loads(path.read_text()).get("architectures") or []
    return bool(set(archs) & set(ARCHITECTURES))


def load_head(directory, target_layers: int | None = None) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """An EAGLE-3 checkpoint's config and tensors (checked), from a local directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = HeadConfig.from_json(json.loads((directory / "config.json").read_text()), target_layers)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors file in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        # owned copies: safetensors' tensors sit at arbitrary offsets of the file's buffer, and a
        # CPU's BLAS may round a product differently for unaligned operands, so the same weights
        # would not give the same logits bit for bit
        weights.update({name: t.clone() for name, t in load_file(str(f)).items()})
    check_head_weights(cfg, weights)
    return cfg, weights


class HeadRunner(NativeRunner):
    """A feature head's one layer over a static cache, fed (token, hidden state) pairs; logits
    over the target's V ids (-inf outside its K rows), `Scores.features` its output states."""

    takes_hidden = True

    def __init__(
        self,
        cfg: HeadConfig,
        weights: dict[str, torch.Tensor],
        embed: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantize: str | None = None,
        compile: bool | str = False,
    ):
        """`embed`: the target's embedding matrix [V, hidden] (EAGLE-3 heads share it), unless
        `weights` holds an `embed_tokens.weight` of the head's own. `quantize` ("int8", "int4",
        "q4q8"): the head's products weight-only quantized (`linear.QuantizedProjection`,
        `linear.Int4Projection`, `linear.Q4Q8Projection`: fc, the layer and lm_head, each
        needing inputs in whole groups of 32, else a ValueError naming the weight's shape); a
        head's q only proposes, so the output stays lossless.
        `compile`: its forwards with logits as an inductor graph (`native.compile.CompiledForward`,
        kept across processes as the target's are; "auto": loaded where stored, as the target's)."""
        check_head_weights(cfg, weights)
        if quantize is not None:
            check_quantize(quantize, dtype, device)
        self.quantize = quantize
        self.cfg = cfg
        self.shape = s = cfg.shape
        self.device, self.dtype = torch.device(device), dtype
        self.vocab_size, self.max_positions, self.n_layers = cfg.vocab_size, s.max_positions, None
        self.eos_token_ids = frozenset()

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def product(weight: torch.Tensor):
            if quantize == "int8":  # bf16 rows through the tiles where the kernels are built
                return QuantizedProjection(weight, tiles=True)
            if quantize == "q4q8":  # a ValueError where a product's inputs are not whole groups of 32
                return Q4Q8Projection.quantize(weight)
            return Int4Projection.quantize(weight, tiles=True) if quantize == "int4" else Projection(weight)

        own = weights.get("embed_tokens.weight")
        self.embed = (own if own is not None else embed).to(device=self.device, dtype=dtype)  # [V, hidden]
        if tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"the head needs an embedding of {cfg.vocab_size} x {cfg.hidden_size}, the target's is "
                f"{tuple(self.embed.shape)} (a head made for another target?)"
            )
        a, m = "midlayer.self_attn.", "midlayer.mlp."
        self.fc = product(get("fc.weight"))  # taps * target hidden -> hidden
        self.hidden_norm = get("midlayer.hidden_norm.weight")  # [hidden]
        self.layers = [
            Layer(
                attn_norm=get("midlayer.input_layernorm.weight"),  # the embedding's norm
                qkv=product(
                    torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
                ),
                o=product(get(a + "o_proj.weight")),
                mlp_norm=get("midlayer.post_attention_layernorm.weight"),
                gate_up=product(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])),
                down=product(get(m + "down_proj.weight")),
            )
        ]
        self.norm = get("norm.weight")
        self.lm_head = product(get("lm_head.weight"))  # hidden -> K
        self.ids = (
            torch.arange(cfg.draft_vocab_size, device=self.device) + weights["d2t"].to(self.device).long()
        )  # [K]
        self.inv_freq = s.inv_freq().to(self.device)
        self.flash, self.prefix_attention = False, None
        self.exact_rows = exact_rows(self.device, dtype)
        self.pool, self.row = KVPool(s, 1, self.inv_freq, dtype, self.device), 0
        self.taps = ()
        self.compile_setting = resolve_compile(compile, self.device, dtype, quantize)
        self.compiled = compiled_forward(self, self.compile_setting, GraphStore())
        super(NativeRunner, self).__init__()

    def forward_graph(self) -> HeadGraph:
        return HeadGraph(self)

    @property
    def target_taps(self) -> tuple[int, ...]:
        """The target layers whose features this head reads."""
        return self.cfg.taps

    def set_taps(self, taps) -> None:
        raise ValueError("a feature head has no layers to tap; set the taps on its target")

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, taps * target hidden] -> the hidden states the head reads [n, H]."""
        return self.fc(features.to(self.dtype))

    @torch.inference_mode()
    def _packed_forward(self, lanes: list[HeadRunner], feeds: list[Feed], need_logits: bool) -> list[Scores]:
        """The one layer over every lane's (token, hidden) pairs in one forward."""
        s, pool = self.shape, self.pool
        ns, starts = [f.tokens.shape[0] for f in feeds], [lane.filled for lane in lanes]
        scores = self._compiled_forward(lanes, feeds, starts, need_logits)
        if scores is not None:
            return scores
        tokens, positions, attend = self._packed_inputs(lanes, feeds, starts, ns)
        h = torch.cat([f.hidden for f in feeds]).to(self.dtype)  # [T, hidden]
        cos, sin = pool.rope(positions)  # [T, Hq+2Hkv, D] each
        out = head_layer(tokens, h, self.embed, self.hidden_norm, self.layers[0], attend, cos, sin, s)
        for lane, S, n in zip(lanes, starts, ns):
            lane.filled = S + n
        logits = (
            head_logits(out, self.norm, self.lm_head, self.ids, self.vocab_size, s.eps)
            if need_logits
            else None
        )
        return split_scores(logits, out, ns)


def head_layer(tokens, h, embed, hidden_norm, layer: Layer, attend, cos, sin, s: LlamaShape) -> torch.Tensor:
    """The head's layer (the module docstring's first three lines), eager and compiled alike:
    the output states [T, hidden] of the fed `tokens` [T] read with hidden states `h` [T, hidden];
    `attend(0, qkv)` its attention over the cache, `cos`, `sin` the RoPE rows [T, Hq+2Hkv, D]."""
    T, D, eps = tokens.shape[0], s.head_dim, s.eps
    e = rms_norm(F.embedding(tokens, embed), layer.attn_norm, eps)  # [T, hidden]
    x = torch.cat([e, rms_norm(h, hidden_norm, eps)], dim=-1)  # [T, 2 hidden]
    qkv = rotate(layer.qkv(x).view(T, s.heads + 2 * s.kv_heads, D), cos, sin)
    a = layer.o(attend(0, qkv)) + h  # the residual stream starts at the hidden state
    gate, up = layer.gate_up(rms_norm(a, layer.mlp_norm, eps)).chunk(2, dim=-1)
    return layer.down(F.silu(gate) * up) + a  # [T, hidden]: the output state


def head_logits(out, norm, lm_head, ids, vocab_size: int, eps: float) -> torch.Tensor:
    """Logits [T, V] of output states `out` [T, hidden]: the head's K rows at target ids `ids`,
    -inf everywhere else."""
    rows = lm_head(rms_norm(out, norm, eps))  # [T, K]
    return rows.new_full((out.shape[0], vocab_size), float("-inf")).index_copy(1, ids, rows)


class HeadGraph(ForwardGraph):
    """The head's layer with logits, written for inductor as `native.compile.ForwardGraph` is:
    fed (token, hidden state) pairs; the math is `HeadRunner._packed_forward`'s. Its `taps`
    (what its digest covers) are the target layers the head reads."""

    FED = 5  # tokens, hidden states, positions, slots, the mask

    def __init__(self, runner: HeadRunner):
        super().__init__(runner)
        self.taps, self.vocab_size = runner.cfg.taps, runner.vocab_size
        self.register_buffer("hidden_norm", runner.hidden_norm)
        self.register_buffer("ids", runner.ids)

    @staticmethod
    def inputs(feed: Feed, slots: torch.Tensor, mask: torch.Tensor, pool: KVPool) -> tuple:
        hidden = feed.hidden.to(pool.kv.dtype)  # [n, hidden]: in the head's dtype, as the graph was made
        return (feed.tokens, hidden, feed.positions, slots, mask, pool.cos, pool.sin_signed, pool.kv)

    def forward(self, tokens, hidden, positions, slots, mask, cos_table, sin_table, kv):
        s = self.shape
        cos, sin = rope_rows(cos_table, sin_table, positions, s)  # [T, Hq+2Hkv, D] each
        attend = lambda i, qkv: graph_lane_attention(kv, i, qkv, slots, mask, s.heads, self.exact_rows)  # noqa: E731
        out = head_layer(tokens, hidden, self.embed, self.hidden_norm, self.layer(0), attend, cos, sin, s)
        logits = head_logits(out, self.norm, self.lm_head, self.ids, self.vocab_size, s.eps)
        return logits, out  # [T, V], [T, hidden]


def load_head_runner(
    path, target, dtype: torch.dtype, device, quantize: str | None = None, compile: bool | str = False
) -> HeadRunner | None:
    """A `HeadRunner` for the EAGLE-3 checkpoint in the local directory `path`, over the
    embedding of `target` (a runner), its products `quantize`d (None, "int8", "int4"; what
    "auto" means is decided by `treespec.loading.resolve_quantize` before this is called), its
    forwards compiled with `compile` (`HeadRunner`); None when `path` is not a head."""
    if not isinstance(path, (str, Path)) or not is_head(path):
        return None
    embed = target.input_embeddings()
    if embed is None:
        raise ValueError(
            f"a feature head needs its target's embedding; {type(target).__name__} has none to share"
        )
    cfg, weights = load_head(path, target.n_layers)
    return HeadRunner(cfg, weights, embed, dtype=dtype, device=device, quantize=quantize, compile=compile)
