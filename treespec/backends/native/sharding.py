"""Tensor parallel for the native backend (`treespec.parallel`, Megatron-style).

Each rank holds its block of the query and KV heads (and their cache) and of the MLP: the
q/k/v and gate/up projections by rows (column-parallel), the o and down projections by columns
(row-parallel, each rank's product a partial sum that `decoder_stack` reduces over the ranks).
A row-parallel product's bias is added once, by rank 0. See docs/parallel.md.
"""

from __future__ import annotations

import dataclasses

from ...parallel import TensorParallel
from ..checkpoint import LlamaShape

# which block of a checkpoint tensor a rank holds: its query heads' rows "q" ([Hq D, ...]), its
# key/value heads' rows "kv" ([Hkv D, ...]), its MLP rows "mlp" ([I, ...]); a row-parallel
# weight takes the same block of its columns
Blocks = dict[str, slice]


def rank_shape(shape: LlamaShape, tp: TensorParallel | None) -> tuple[LlamaShape, Blocks]:
    """The model's shape as rank `tp.rank` holds it (its heads and MLP width) and the blocks of
    the checkpoint's tensors it reads; `shape` and no blocks in a single process."""
    if tp is None:
        return shape, {}
    D = shape.head_dim
    heads = tp.block(shape.heads, "the query heads")
    kv_heads = tp.block(shape.kv_heads, "the key/value heads")
    mlp = tp.block(shape.intermediate, "the MLP width")
    blocks = {
        "q": slice(heads.start * D, heads.stop * D),
        "kv": slice(kv_heads.start * D, kv_heads.stop * D),
        "mlp": mlp,
    }
    local = dataclasses.replace(
        shape,
        heads=shape.heads // tp.world,
        kv_heads=shape.kv_heads // tp.world,
        intermediate=shape.intermediate // tp.world,
    )
    return local, blocks


def adds_bias(tp: TensorParallel | None) -> bool:
    """Whether this rank adds a row-parallel product's bias (rank 0 only: the ranks' partial
    sums are added up)."""
    return tp is None or tp.rank == 0
