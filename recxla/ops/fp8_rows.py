"""The row codec: quantize rows of a float matrix into one contiguous wire buffer and back.

FP8 formats run recxla's kernels (`torch.ops.recxla.quantize_fp8_rows` /
`dequantize_fp8_rows`): C++ on CPU (AVX-512 kernels where the CPU has them, portable ones
elsewhere or with RECXLA_CPU_KERNELS=portable), CUDA or Triton on GPU (RECXLA_BACKEND). Every
backend writes the same bytes. The plain-cast formats (bf16, fp16, fp32) are a cast and a byte
view, which torch already does at memory speed.
"""

import torch

from recxla import _extension
from recxla.formats import FLOAT_DTYPES, get_format
from recxla.reference import fp8_rows as reference


@torch.library.register_fake("recxla::quantize_fp8_rows")
def _quantize_fp8_rows_fake(x, fmt):
    return x.new_empty((x.shape[0], x.shape[1] + 4), dtype=torch.uint8)


@torch.library.register_fake("recxla::dequantize_fp8_rows")
def _dequantize_fp8_rows_fake(packed, dim, fmt, dtype):
    return packed.new_empty((packed.shape[0], dim), dtype=dtype)


def quantize_rows(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Quantize each row of `x` into its wire bytes.

    Args:
        x: [N, D] float32, bfloat16 or float16, on CPU or CUDA. Rows may be strided.
        fmt: "e4m3", "e5m2" (FP8 with a per-row fp32 scale), or "bf16", "fp16", "fp32".
    Returns:
        uint8 [N, recxla.row_bytes(D, fmt)]. FP8 rows hold D codes then the row's fp32 scale
        (scale = amax / FP8_MAX over the row's finite values, codes rounded to nearest even,
        finite values saturating). NaN stays NaN; Inf stays Inf in e5m2 and becomes NaN in e4m3,
        which has no infinity. All-zero rows round-trip exactly.
    """
    op = "recxla.quantize_rows"
    f = get_format(fmt, op)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [rows, dim], got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if not f.is_fp8:
        return reference.quantize_rows_ref(x, fmt)
    backend = _extension.backend_for(x)
    if backend == "triton":
        from recxla.triton_kernels.fp8_rows import quantize_fp8_rows_triton

        return quantize_fp8_rows_triton(x, fmt)
    if backend == "reference":
        return reference.quantize_rows_ref(x, fmt)
    return torch.ops.recxla.quantize_fp8_rows(x, fmt)


def dequantize_rows(
    packed: torch.Tensor, dim: int, fmt: str = "e4m3", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode wire rows produced by `quantize_rows`.

    Args:
        packed: uint8 [N, recxla.row_bytes(dim, fmt)].
        dim: D, the number of values per row.
        fmt: the format the rows were quantized with.
        dtype: float32, bfloat16 or float16, the dtype of the result.
    Returns:
        [N, dim] of `dtype`: code value times the row's scale, computed in fp32.
    """
    op = "recxla.dequantize_rows"
    f = get_format(fmt, op)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{op}: packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"{op}: packed must be uint8, got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"{op}: packed must be 2-D [rows, row_bytes], got {packed.dim()}-D")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise ValueError(f"{op}: dim must be an int >= 0, got {dim!r}")
    if packed.shape[1] != f.row_bytes(dim):
        raise ValueError(
            f"{op}: packed has {packed.shape[1]} bytes per row, but dim={dim} in {fmt} needs "
            f"{f.row_bytes(dim)}"
        )
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")
    if not f.is_fp8:
        return reference.dequantize_rows_ref(packed, dim, fmt, dtype)
    backend = _extension.backend_for(packed)
    if backend == "triton":
        from recxla.triton_kernels.fp8_rows import dequantize_fp8_rows_triton

        return dequantize_fp8_rows_triton(packed, dim, fmt, dtype)
    if backend == "reference":
        return reference.dequantize_rows_ref(packed, dim, fmt, dtype)
    return torch.ops.recxla.dequantize_fp8_rows(packed, dim, fmt, dtype)
