"""FP8 row-wise quantize / dequantize with Triton (the GPU path when RECXLA_BACKEND=triton).

Same wire format and arithmetic as the CUDA and CPU kernels (csrc/include/recxla/fp8.h), so the
codes are bit-identical with theirs and with the PyTorch reference:
- amax is a max over the bits of the row's finite |x| (NaN / Inf left out);
- inv_scale = min(FP8_MAX / amax, FLT_MAX) (1 for an all-zero row), scale = 1 / inv_scale, both
  IEEE divisions (`tl.math.div_rn`: a plain `/` on the GPU is an approximate division);
- a code is encoded with integer bit operations and one fp32 addition that rounds onto the FP8
  grid (fp8.h, `anchor_bits`), never with `.to(tl.float8e4nv)`: the Triton 3.8 interpreter rounds
  that cast wrongly when the rounding carries into the next exponent (127.97 -> 64);
- kernels are launched with enable_fp_fusion=False, so no multiply and add share one rounding.

One program handles BLOCK_ROWS rows; a row wider than one column block is walked block by block
(one pass for amax, one to encode). Row offsets are int64, every load and store is masked. The
fp32 scale sits at byte offset D of each (D + 4)-byte row, which is not 4-byte aligned when
D % 4 != 0, so it is written and read as four bytes.
"""

import torch
import triton
import triton.language as tl

from recxla.formats import FLOAT_DTYPES, FP8_SCALE_BYTES, get_format

# Largest column block; wider rows loop over blocks.
MAX_BLOCK_D = 1024
# Elements one program handles per column block (rows x columns).
BLOCK_ELEMENTS = 4096

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# Per format: mantissa bits, exponent bias, fp32 bits of the largest finite value, FP8 max, and the
# codes of Inf and NaN (e4m3fn has no infinity: Inf becomes NaN).
_FORMATS = {
    "e4m3": dict(MANT=3, BIAS=7, MAX_BITS=0x43E00000, FP8_MAX=448.0,
                 INF_CODE=0x7F, NAN_CODE=0x7F),
    "e5m2": dict(MANT=2, BIAS=15, MAX_BITS=0x47600000, FP8_MAX=57344.0,
                 INF_CODE=0x7C, NAN_CODE=0x7F),
}


# Reductions go through tl.reduce with the module's own combine functions rather than tl.max /
# tl.sum: those are @triton.jit helpers of triton.language, built once when triton was imported,
# so they only run interpreted if TRITON_INTERPRET was set before that import; this module's own
# functions follow the mode it was imported in (see recxla.triton_kernels.interpreted).
@triton.jit
def _scale_value(x, inv_scale):
    """x * inv_scale per row, a NaN passed unscaled: a GPU's multiply returns a canonical
    positive NaN, and the code keeps the NaN's sign (recxla/fp8.h scale_value)."""
    return tl.where(x != x, x, x * inv_scale[:, None])


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _or_combine(a, b):
    return a | b


@triton.jit
def _encode(v, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
            INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr):
    """fp32 -> FP8 code (uint8), fp8.h's `encode`: round to nearest even, finite values saturate."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    a = bits ^ sign
    clamped = tl.minimum(a, MAX_BITS)
    # The anchor 2^(E + 23 - MANT), E the exponent of |v| clamped to the smallest normal one: the
    # fp32 spacing at the anchor is the FP8 spacing at |v|, so |v| + anchor rounds |v| onto the FP8
    # grid (normals and subnormals alike, carries included) and the sum's low bits count the steps.
    anchor = (tl.maximum(clamped, (128 - BIAS) << 23) & 0x7F800000) + ((23 - MANT) << 23)
    # bits(|v| + anchor) - offset is the code: the steps plus the FP8 exponent field of the
    # anchor's binade, less the implicit leading one.
    offset = anchor - (anchor >> (23 - MANT)) + (((23 - MANT + 127 - BIAS) << MANT) + (1 << MANT))
    total = clamped.to(tl.float32, bitcast=True) + anchor.to(tl.float32, bitcast=True)
    code = total.to(tl.uint32, bitcast=True) - offset
    special = tl.where(a > 0x7F800000, NAN_CODE, INF_CODE).to(tl.uint32)
    code = tl.where(a >= 0x7F800000, special, code)
    return (code | (sign >> 24)).to(tl.uint8)


@triton.jit
def _decode(code, MANT: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """FP8 code (uint8) -> fp32, exact. fp8.h rescales a subnormal fp32 pattern by a power of
    two; here a subnormal code is mantissa * SUBNORMAL_STEP (2^(1 - BIAS - MANT)) instead, the same
    value without an fp32 subnormal, whatever the GPU's denormal mode."""
    c = code.to(tl.uint32)
    magnitude = c & 0x7F
    mantissa = magnitude & ((1 << MANT) - 1)
    # Normal codes: exponent and mantissa moved into place, the exponent rebiased from BIAS to 127.
    normal = (magnitude << (23 - MANT)) + ((127 - BIAS) << 23)
    subnormal = (mantissa.to(tl.float32) * SUBNORMAL_STEP).to(tl.uint32, bitcast=True)
    bits = tl.where((magnitude >> MANT) == 0, subnormal, normal)
    if MANT == 3:  # e4m3fn: only S.1111.111 is NaN, there is no infinity
        bits = tl.where(magnitude == 0x7F, 0x7FC00000, bits)
    else:  # e5m2: S.11111.00 is Inf, S.11111.xx NaN
        bits = tl.where(magnitude == 0x7C, 0x7F800000, bits)
        bits = tl.where(magnitude > 0x7C, 0x7FC00000, bits)
    return (bits | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    """Values as fp32; bfloat16 widened through its bits (exact, as fp8.h's CPU path does)."""
    if IN_BF16:
        raw = tl.load(ptrs, mask=mask, other=0.0).to(tl.uint16, bitcast=True)
        return (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, n_rows, dim, x_row_stride, out_row_stride,
                     BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr,
                     FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                     MAX_BITS: tl.constexpr, INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                     IN_BF16: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows[:, None] * x_row_stride
    out_rows = out_ptr + rows[:, None] * out_row_stride

    # amax as the max of |x|'s bits (non-negative floats order like their bits); masked-off and
    # non-finite elements count as 0.
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols[None, :] < dim)
        x = _load_f32(x_rows + cols[None, :], mask, IN_BF16)
        a = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
        amax_bits = tl.reduce(tl.where(a < 0x7F800000, a, 0), 1, _max_combine)
    else:
        amax_bits = tl.full((BLOCK_ROWS,), 0, tl.uint32)
        for start in range(0, dim, BLOCK_D):
            mask = row_mask[:, None] & (start + cols[None, :] < dim)
            xb = _load_f32(x_rows + start + cols[None, :], mask, IN_BF16)
            ab = xb.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
            amax_bits = tl.maximum(
                amax_bits, tl.reduce(tl.where(ab < 0x7F800000, ab, 0), 1, _max_combine))
    amax = amax_bits.to(tl.float32, bitcast=True)
    # An all-zero row divides by 1 (its inv_scale is 1 anyway): no Inf is formed on the way.
    positive = amax > 0
    fp8_max = tl.full((BLOCK_ROWS,), FP8_MAX, tl.float32)
    ratio = tl.math.div_rn(fp8_max, tl.where(positive, amax, 1.0))
    inv_scale = tl.where(positive, tl.minimum(ratio, _FLT_MAX), 1.0)
    scale = tl.math.div_rn(tl.full((BLOCK_ROWS,), 1.0, tl.float32), inv_scale)

    if ONE_BLOCK:
        codes = _encode(_scale_value(x, inv_scale), MANT, BIAS, MAX_BITS, INF_CODE, NAN_CODE)
        tl.store(out_rows + cols[None, :], codes, mask=mask)
    else:
        for start in range(0, dim, BLOCK_D):
            mask = row_mask[:, None] & (start + cols[None, :] < dim)
            xb = _load_f32(x_rows + start + cols[None, :], mask, IN_BF16)
            codes = _encode(_scale_value(xb, inv_scale), MANT, BIAS, MAX_BITS, INF_CODE,
                            NAN_CODE)
            tl.store(out_rows + start + cols[None, :], codes, mask=mask)

    # The scale's four bytes, little-endian, after the codes.
    byte = tl.arange(0, 4)
    scale_bits = scale.to(tl.uint32, bitcast=True)
    scale_bytes = ((scale_bits[:, None] >> (8 * byte[None, :])) & 0xFF).to(tl.uint8)
    tl.store(out_rows + dim + byte[None, :], scale_bytes, mask=row_mask[:, None])


@triton.jit
def _dequantize_kernel(in_ptr, y_ptr, n_rows, dim, in_row_stride,
                       BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                       MANT: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL_STEP: tl.constexpr,
                       OUT_BF16: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    in_rows = in_ptr + rows[:, None] * in_row_stride
    y_rows = y_ptr + rows[:, None] * dim

    byte = tl.arange(0, 4)
    scale_bytes = tl.load(in_rows + dim + byte[None, :], mask=row_mask[:, None], other=0)
    scale_bits = tl.reduce(
        scale_bytes.to(tl.uint32) << (8 * byte[None, :]).to(tl.uint32), 1, _or_combine)
    scale = scale_bits.to(tl.float32, bitcast=True)

    for start in range(0, dim, BLOCK_D):
        mask = row_mask[:, None] & (start + cols[None, :] < dim)
        codes = tl.load(in_rows + start + cols[None, :], mask=mask, other=0)
        y = _decode(codes, MANT, BIAS, SUBNORMAL_STEP) * scale[:, None]
        if OUT_BF16:
            # Rounded to nearest even with integer operations, NaN -> 0x7FC0, as c10 does: the
            # interpreter's fp32 -> bf16 cast truncates instead.
            u = y.to(tl.uint32, bitcast=True)
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            h = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded).to(tl.uint16)
            tl.store(y_rows + start + cols[None, :], h.to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(y_rows + start + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _blocks(n_rows: int, dim: int, block_d):
    """(BLOCK_ROWS, BLOCK_D): a power-of-two column block covering the row when it fits, and
    enough rows that one program handles about BLOCK_ELEMENTS values."""
    if block_d is None:
        block_d = min(triton.next_power_of_2(max(dim, 1)), MAX_BLOCK_D)
    block_rows = max(1, min(BLOCK_ELEMENTS // block_d, triton.next_power_of_2(max(n_rows, 1))))
    return block_rows, block_d


def quantize_fp8_rows_triton(
    x: torch.Tensor, fmt: str = "e4m3", block_d=None, out=None
) -> torch.Tensor:
    """Quantize each row of `x` to FP8 codes plus the row's fp32 scale.

    Args:
        x: [N, D] float32, bfloat16 or float16 (CUDA, or CPU under the Triton interpreter).
            Rows may be strided; a row's elements are made dense if they are not.
        fmt: "e4m3" or "e5m2".
        block_d: column block (a power of two); None picks one. Tests use small blocks to walk
            the multi-block path.
        out: optional uint8 [N, D + 4] to write into, contiguous, on x's device (checked by the
            public recxla.quantize_rows).
    Returns:
        uint8 [N, D + 4] (`out` when given): D codes, then the scale's 4 bytes (little-endian
        fp32).
    """
    op = "recxla.triton_kernels.quantize_fp8_rows_triton"
    f = get_format(fmt, op)
    if not f.is_fp8:
        raise ValueError(f"{op}: fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [rows, dim], got {x.dim()}-D")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    n_rows, dim = x.shape
    if out is None:
        out = torch.empty((n_rows, dim + FP8_SCALE_BYTES), dtype=torch.uint8, device=x.device)
    if n_rows == 0:
        return out
    block_rows, block_d = _blocks(n_rows, dim, block_d)
    grid = (triton.cdiv(n_rows, block_rows),)
    params = _FORMATS[fmt]
    _quantize_kernel[grid](
        x, out, n_rows, dim, x.stride(0), out.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, ONE_BLOCK=dim <= block_d, **params,
        IN_BF16=x.dtype == torch.bfloat16,
        enable_fp_fusion=False,
    )
    return out


def dequantize_fp8_rows_triton(
    packed: torch.Tensor, dim: int, fmt: str = "e4m3", dtype: torch.dtype = torch.float32,
    block_d=None, out=None,
) -> torch.Tensor:
    """Decode rows written by `quantize_fp8_rows_triton` (or any recxla FP8 backend).

    Args:
        packed: uint8 [N, dim + 4].
        dim: D, the number of values per row.
        fmt: "e4m3" or "e5m2".
        dtype: float32, bfloat16 or float16, the dtype of the result.
        block_d: column block (a power of two); None picks one.
        out: optional [N, dim] of `dtype` to write into, contiguous, on packed's device (checked
            by the public recxla.dequantize_rows).
    Returns:
        [N, dim] of `dtype` (`out` when given): code value times the row's scale in fp32, then
        rounded to `dtype`.
    """
    op = "recxla.triton_kernels.dequantize_fp8_rows_triton"
    f = get_format(fmt, op)
    if not f.is_fp8:
        raise ValueError(f"{op}: fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(
            f"{op}: packed must be a 2-D uint8 tensor, got {packed.dim()}-D {packed.dtype}")
    if packed.shape[1] != dim + FP8_SCALE_BYTES:
        raise ValueError(
            f"{op}: packed has {packed.shape[1]} bytes per row, but dim={dim} needs "
            f"{dim + FP8_SCALE_BYTES}"
        )
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")
    packed = packed.contiguous()
    n_rows = packed.shape[0]
    y = torch.empty((n_rows, dim), dtype=dtype, device=packed.device) if out is None else out
    if n_rows == 0 or dim == 0:
        return y
    block_rows, block_d = _blocks(n_rows, dim, block_d)
    grid = (triton.cdiv(n_rows, block_rows),)
    params = _FORMATS[fmt]
    _dequantize_kernel[grid](
        packed, y, n_rows, dim, packed.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, MANT=params["MANT"], BIAS=params["BIAS"],
        SUBNORMAL_STEP=2.0 ** (1 - params["BIAS"] - params["MANT"]),
        OUT_BF16=dtype == torch.bfloat16,
        enable_fp_fusion=False,
    )
    return y
