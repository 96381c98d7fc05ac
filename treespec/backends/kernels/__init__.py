"""Compiled CPU kernels (one library, built once per machine by build.py; q4q8.py decides when)
whose cost grows slowly with the number of rows M (issue 58): int4 / int8 weights x int8
activations (q4q8.py), int4 / int8 weights x bfloat16 activations as they are (bf16.py), attention
whose rows are independent (attention.py) and a vectorised row maximum (reduce.py)."""

from . import attention, bf16, reduce
from .q4q8 import (
    ATEN,
    ISAS,
    PackedQ4,
    PackedQ8,
    available_isas,
    built,
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
    "attention",
    "bf16",
    "reduce",
    "built",
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
