"""Collectives on quantized rows: the wire format is the row codec's output (recxla.formats)."""

from recxla.distributed.quantized_all_to_all import (
    QuantizedAllToAllHandle,
    quantized_all_to_all,
)

__all__ = ["QuantizedAllToAllHandle", "quantized_all_to_all"]
