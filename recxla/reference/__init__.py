"""Plain-PyTorch references of recxla's ops: the oracle of the tests and the baseline of the
benchmarks. They favour clarity over speed and use only documented torch operations."""

from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

__all__ = ["quantize_rows_ref", "dequantize_rows_ref"]
