"""Compiled CPU kernels (built on first use; see q4q8.py): int4-weight x int8-activation
products whose cost grows slowly with the number of rows M (issue 58)."""

from .q4q8 import (
    ATEN,
    ISAS,
    PackedQ4,
    PackedQ8,
    available_isas,
    compiled,
    default_isa,
    describe,
    from_gguf_blocks,
    pack_q4,
    pack_q4_offsets,
    pack_q8,
    q4q8_linear,
    quantize_activations,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
    unavailable_reason,
)

__all__ = [
    "ATEN",
    "ISAS",
    "PackedQ4",
    "PackedQ8",
    "available_isas",
    "compiled",
    "default_isa",
    "describe",
    "from_gguf_blocks",
    "pack_q4",
    "pack_q4_offsets",
    "pack_q8",
    "q4q8_linear",
    "quantize_activations",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q8_0",
    "unavailable_reason",
]
