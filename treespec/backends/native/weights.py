"""A checkpoint's tensors in the native layout: `WeightLoader`.

The loader reads HF state-dict names (model.layers.{i}.self_attn.q_proj.weight, ...) from
tensors or lazy safetensors slices (only what this rank holds is read), fuses q/k/v and
gate/up, and makes each projection as asked: packed for oneDNN (`linear.Projection`), int8
with a scale per row (`linear.QuantizedProjection`), int4 in groups of 32
(`linear.Int4Projection`) or q4q8 (`linear.Q4Q8Projection`), the last two from a GGUF file's
own Q4_0 / Q4_1 blocks where the checkpoint carries them (after the loader's q/k row order),
else quantized by Q4_1's rule once, at load.
"""

from __future__ import annotations

import torch

from ..checkpoint import LlamaShape
from ..linear import Int4Projection, Product, Projection, Q4Q8Projection, QuantizedProjection
from .model import Layer
from .sharding import Blocks

Part = tuple[str, str | None]  # a tensor name and the block of its rows this rank holds (None: all)


class WeightLoader:
    """The tensors `weights` as one rank of the model holds them, on `device` in `dtype`."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        blocks: Blocks,
        device: torch.device,
        dtype: torch.dtype,
        quantize: str | None,
        pack: bool,
    ):
        """`blocks`: this rank's blocks of rows / columns (`sharding.rank_shape`; {} for all).
        `quantize`: None, "int8", "int4" or "q4q8". `pack`: float projections in oneDNN's packed layout
        where it serves them."""
        self.weights, self.blocks, self.device, self.dtype = weights, blocks, device, dtype
        self.quantize, self.pack = quantize, pack

    def tensor(self, name: str, rows: str | None = None, cols: str | None = None) -> torch.Tensor:
        """Tensor `name`, or this rank's block `rows` of its rows / `cols` of its columns."""
        if name not in self.weights:
            raise ValueError(f"checkpoint lacks the tensor {name!r}")
        w = self.weights[name]
        if rows in self.blocks:
            w = w[self.blocks[rows]]
        elif cols in self.blocks:
            w = w[:, self.blocks[cols]]
        else:
            w = w[:]  # a lazy slice: read it all
        return w.to(device=self.device, dtype=self.dtype)

    def stacked(self, *parts: Part) -> torch.Tensor:
        """The tensors of `parts` (this rank's rows of each) stacked: [sum of outs, in]."""
        return torch.cat([self.tensor(name, rows) for name, rows in parts])

    def projection(self, *parts: Part, bias: torch.Tensor | None = None, cols: str | None = None) -> Product:
        """The projection whose weight is `parts`' weights stacked (one part: its block `cols`
        of columns), as `quantize` and `pack` ask."""
        four_bit = self.quantize in ("int4", "q4q8")
        if four_bit and all(f"{n}.q4" in self.weights for n, _ in parts):  # the file's blocks
            q, scales, zeros = (
                torch.cat([self.weights[f"{n}.{k}"][:] for n, _ in parts])
                for k in ("q4", "q4_scales", "q4_zeros")
            )
            if self.quantize == "int4":  # bf16 rows through the tiles where the kernels are built
                return Int4Projection.from_blocks(q, scales, zeros, bias, self.dtype, tiles=True)
            return Q4Q8Projection.from_blocks(q, scales, zeros, bias, self.dtype)
        weight = self.stacked(*parts) if cols is None else self.tensor(parts[0][0], cols=cols)
        if self.quantize == "int4":
            return Int4Projection.quantize(weight, bias, tiles=True)
        if self.quantize == "q4q8":
            return Q4Q8Projection.quantize(weight, bias)
        if self.quantize == "int8":
            return QuantizedProjection(weight, bias, tiles=True)
        return Projection(weight, bias, pack=self.pack)

    def output(self, shape: LlamaShape) -> tuple[torch.Tensor, Product, torch.Tensor]:
        """The embedding [V, hidden], the output projection (hidden -> V; int8 under int8 and
        int4, as GGUF files keep it at 8 bits or more; under q4q8 the file's 4-bit blocks
        where it has them, else Q8_0 x Q8 products: the file's Q8_0 blocks where it kept
        them, as llama.cpp multiplies them) and the final norm
        [hidden]. Tied embeddings: the output layer multiplies by the embedding matrix; where it
        is packed (CPU) the packed copy sits next to the plain one the lookup reads."""
        embed = self.tensor("model.embed_tokens.weight")  # [V, hidden]
        name = "model.embed_tokens.weight" if shape.tied else "lm_head.weight"
        head = embed if shape.tied else self.tensor(name)
        if self.quantize == "q4q8":
            blocks = f"{name}.q4" in self.weights
            lm_head = self.projection((name, None)) if blocks else Q4Q8Projection.quantize8(head)
            return embed, lm_head, self.tensor("model.norm.weight")
        if self.quantize is not None:  # a tree's rows through tiles (float32 logits), or the wide copy
            lm_head = QuantizedProjection(head, wide=self.pack, tiles=True, float_out=True)
        else:
            lm_head = Projection(head, pack=self.pack)
        return embed, lm_head, self.tensor("model.norm.weight")

    def layer(self, i: int, shape: LlamaShape, adds_bias: bool) -> Layer:
        """Decoder layer i; `adds_bias`: whether this rank adds the o projection's bias (a
        row-parallel product's, `sharding.adds_bias`)."""
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = ((a + "q_proj.", "q"), (a + "k_proj.", "kv"), (a + "v_proj.", "kv"))
        qkv_bias = self.stacked(*((n + "bias", rows) for n, rows in qkv)) if shape.qkv_bias else None
        o_bias = self.tensor(a + "o_proj.bias") if shape.o_bias and adds_bias else None
        return Layer(
            attn_norm=self.tensor(f"model.layers.{i}.input_layernorm.weight"),
            qkv=self.projection(*((n + "weight", rows) for n, rows in qkv), bias=qkv_bias),
            o=self.projection((a + "o_proj.weight", None), cols="q", bias=o_bias),
            mlp_norm=self.tensor(f"model.layers.{i}.post_attention_layernorm.weight"),
            gate_up=self.projection((m + "gate_proj.weight", "mlp"), (m + "up_proj.weight", "mlp")),
            down=self.projection((m + "down_proj.weight", None), cols="mlp"),
        )


def check_shapes(lm_head: Product, layer: Layer, shape: LlamaShape) -> None:
    """The projections' sizes against the config's (a checkpoint of another model: an error)."""
    s = shape
    for name, got, want in (
        ("the output projection", lm_head, (s.vocab, s.hidden)),
        ("q/k/v projections", layer.qkv, ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden)),
        ("gate/up projections", layer.gate_up, (2 * s.intermediate, s.hidden)),
    ):
        got = (got.out_features, got.in_features)
        if got != want:
            raise ValueError(f"weights do not match the config: {name} {tuple(got)}, expected {want}")
