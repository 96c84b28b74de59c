"""The row codec: quantize rows of a float matrix into one contiguous wire buffer and back.

FP8 formats run recxla's kernels (`torch.ops.recxla.quantize_fp8_rows` /
`dequantize_fp8_rows`, and their `_out` forms that write into a given tensor): C++ on CPU
(AVX-512 kernels where the CPU has them, portable ones elsewhere or with
RECXLA_CPU_KERNELS=portable), CUDA or Triton on GPU (RECXLA_BACKEND); without the compiled
extension they raise a RuntimeError saying to reinstall. Every backend writes the same bytes (the
tests compare each with their oracle, recxla/reference/fp8_rows.py). The plain-cast formats
(bf16, fp16, fp32) are a cast into the wire bytes, which torch already does at memory speed.

Memory: without `out=`, a CPU result comes from recxla's reusable buffers
(csrc/cpu/fp8_rows_buffers.h): once nothing references a result any more, its memory serves the
next call that needs the same size, so a loop pays no page faults after its first call.
"""

from typing import Optional, Sequence

import torch

from recxla import _extension
from recxla.formats import FLOAT_DTYPES, as_count, get_format


@_extension.register_fake("recxla::quantize_fp8_rows")
def _quantize_fp8_rows_fake(x, fmt):
    return x.new_empty((x.shape[0], x.shape[1] + 4), dtype=torch.uint8)


@_extension.register_fake("recxla::quantize_fp8_rows_out")
def _quantize_fp8_rows_out_fake(x, fmt, out):
    return None


@_extension.register_fake("recxla::dequantize_fp8_rows")
def _dequantize_fp8_rows_fake(packed, dim, fmt, dtype):
    return packed.new_empty((packed.shape[0], dim), dtype=dtype)


@_extension.register_fake("recxla::dequantize_fp8_rows_out")
def _dequantize_fp8_rows_out_fake(packed, dim, fmt, out):
    return None


@_extension.register_fake("recxla::empty_reusable")
def _empty_reusable_fake(size, dtype):
    return torch.empty(size, dtype=dtype, device="cpu")


def empty_buffer(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized contiguous tensor of `shape` and `dtype` on `device`.

    On CPU (with the compiled extension) it comes from recxla's reusable buffers: its memory is
    reused by a later request of the same size once nothing references this tensor (no view, no
    autograd node, no in-flight collective). Elsewhere it is `torch.empty` (the CUDA caching
    allocator already reuses memory).
    """
    device = torch.device(device)
    if device.type == "cpu" and _extension.HAVE_EXTENSION:
        return torch.ops.recxla.empty_reusable([int(s) for s in shape], dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the byte ranges a and b span on one device intersect (conservative)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t):
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check_out(op: str, out, shape, dtype: torch.dtype, source: torch.Tensor, source_name: str):
    """The checks every `out=` passes: a tensor of `shape` and `dtype` on source's device,
    contiguous, sharing no memory with `source`."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{op}: out must be {dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out must have shape {list(shape)}, got {list(out.shape)}")
    if out.device != source.device:
        raise ValueError(f"{op}: out must be on {source.device} like {source_name}, got "
                         f"{out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{op}: out must be contiguous (it is written as one dense buffer)")
    if _shares_memory(out, source):
        raise ValueError(f"{op}: out must not share memory with {source_name}")


def quantize_rows(
    x: torch.Tensor, fmt: str = "e4m3", out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Quantize each row of `x` into its wire bytes.

    Args:
        x: [N, D] float32, bfloat16 or float16, on CPU or CUDA. Rows may be strided. N or D may
            be 0.
        fmt: "e4m3", "e5m2" (FP8 with a per-row fp32 scale), or "bf16", "fp16", "fp32".
        out: optional uint8 [N, recxla.row_bytes(D, fmt)], contiguous, on x's device, sharing no
            memory with x: the result is written there (a loop then allocates nothing).
    Returns:
        uint8 [N, recxla.row_bytes(D, fmt)] (`out` when given). FP8 rows hold D codes then the
        row's fp32 scale (scale = amax / FP8_MAX over the row's finite values, codes rounded to
        nearest even, finite values saturating). NaN stays NaN; Inf stays Inf in e5m2 and
        becomes NaN in e4m3, which has no infinity. All-zero rows round-trip exactly. Without
        `out`, a cast format whose wire dtype is x's own dtype returns a view of a contiguous x
        (no copy): do not modify x while the bytes are in use.
    """
    op = "recxla.quantize_rows"
    f = get_format(fmt, op)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [rows, dim], got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    shape = (x.shape[0], f.row_bytes(x.shape[1]))
    if out is not None:
        _check_out(op, out, shape, torch.uint8, x, "x")
    if not f.is_fp8:
        if out is None:
            # A view needs unit stride in the last dim, which is_contiguous() does not promise
            # for a last dim of size 1 (a transposed row [1, N].t() is [N, 1] with stride N).
            if x.dtype == f.wire_dtype and x.is_contiguous() and x.numel() and \
                    x.stride(-1) == 1:
                return x.view(torch.uint8)
            out = empty_buffer(shape, torch.uint8, x.device)
        if out.numel():  # a dtype view of a tensor without elements may fail on its strides
            out.view(f.wire_dtype).copy_(x)
        return out
    backend = _extension.backend_for(x, op)
    if backend == "triton":
        from recxla.triton_kernels.fp8_rows import quantize_fp8_rows_triton

        return quantize_fp8_rows_triton(x, fmt, out=out)
    if out is None:
        return torch.ops.recxla.quantize_fp8_rows(x, fmt)
    torch.ops.recxla.quantize_fp8_rows_out(x, fmt, out)
    return out


def dequantize_rows(
    packed: torch.Tensor,
    dim: int,
    fmt: str = "e4m3",
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode wire rows produced by `quantize_rows`.

    Args:
        packed: uint8 [N, recxla.row_bytes(dim, fmt)]; N may be 0.
        dim: D, the number of values per row (any integer >= 0, numpy integers included).
        fmt: the format the rows were quantized with.
        dtype: float32, bfloat16 or float16, the dtype of the result; None: out's dtype when
            `out` is given, else float32.
        out: optional [N, dim] float32/bfloat16/float16, contiguous, on packed's device, sharing
            no memory with packed: the result is written there.
    Returns:
        [N, dim] of `dtype` (`out` when given): code value times the row's scale, computed in
        fp32, then rounded to `dtype`.
    """
    op = "recxla.dequantize_rows"
    f = get_format(fmt, op)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{op}: packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"{op}: packed must be uint8, got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"{op}: packed must be 2-D [rows, row_bytes], got {packed.dim()}-D")
    dim = as_count(dim, op, "dim")
    if packed.shape[1] != f.row_bytes(dim):
        raise ValueError(
            f"{op}: packed has {packed.shape[1]} bytes per row, but dim={dim} in {fmt} needs "
            f"{f.row_bytes(dim)}"
        )
    if dtype is None:
        dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")
    shape = (packed.shape[0], dim)
    if out is not None:
        _check_out(op, out, shape, dtype, packed, "packed")
    if not f.is_fp8:
        if out is None:
            out = empty_buffer(shape, dtype, packed.device)
        if out.numel():
            out.copy_(packed.contiguous().view(f.wire_dtype))
        return out
    backend = _extension.backend_for(packed, op)
    if backend == "triton":
        from recxla.triton_kernels.fp8_rows import dequantize_fp8_rows_triton

        return dequantize_fp8_rows_triton(packed, dim, fmt, dtype, out=out)
    if out is None:
        return torch.ops.recxla.dequantize_fp8_rows(packed, dim, fmt, dtype)
    torch.ops.recxla.dequantize_fp8_rows_out(packed, dim, fmt, out)
    return out

