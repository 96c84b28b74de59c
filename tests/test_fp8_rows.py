"""FP8 row codec on CPU: the C++ kernels against the PyTorch reference
(recxla/reference/fp8_rows.py), the codec's documented semantics, its torch.library integration
and its errors. Both CPU kernels run here: the AVX-512 ones (when the CPU has AVX-512) and the
portable ones (RECXLA_CPU_KERNELS=portable). Triton and CUDA: test_fp8_rows_triton.py.
"""

import pytest
import torch

import recxla
from fp8_rows_cases import (
    DTYPES, FP8, SHAPES, assert_same_values, fp8_grid, random_rows, with_specials,
)
from recxla.formats import FORMATS
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref


@pytest.fixture(params=["default", "portable"])
def cpu_kernels(request, monkeypatch):
    """Runs a test with the CPU kernels the machine picks, then with the portable ones."""
    if request.param == "portable":
        monkeypatch.setenv("RECXLA_CPU_KERNELS", "portable")
    else:
        monkeypatch.delenv("RECXLA_CPU_KERNELS", raising=False)
    return request.param


# ---------------------------------------------------------------- CPU kernels vs the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_quantize_matches_reference(cpu_kernels, fmt, dtype):
    for rows, dim in SHAPES:
        x = with_specials(random_rows(rows, dim, dtype))
        packed = recxla.quantize_rows(x, fmt)
        assert packed.shape == (rows, recxla.row_bytes(dim, fmt)) and packed.dtype == torch.uint8
        assert torch.equal(packed, quantize_rows_ref(x, fmt)), (rows, dim)


@pytest.mark.parametrize("fmt", FP8)
def test_every_rounding_case_matches_torch_cast(cpu_kernels, fmt):
    # A row holding +-FP8_MAX has inv_scale 1, so its codes are the plain conversion of its values,
    # which torch's own cast defines.
    f = FORMATS[fmt]
    grid = fp8_grid(fmt)
    grid = grid[torch.randperm(grid.numel())]
    dim = 61  # not a multiple of 4, 16 or 64
    pad = (-grid.numel()) % (dim - 1)
    grid = torch.cat([grid, torch.zeros(pad)]).view(-1, dim - 1)
    x = torch.cat([torch.full((grid.shape[0], 1), f.fp8_max), grid], dim=1)
    packed = recxla.quantize_rows(x, fmt)
    expected = x.to(f.wire_dtype).view(torch.uint8)
    assert torch.equal(packed[:, :dim], expected)
    assert torch.equal(packed[:, dim:].contiguous().view(torch.float32), torch.ones(x.shape[0], 1))


@pytest.mark.parametrize("fmt", FP8)
def test_subnormal_and_tiny_rows(cpu_kernels, fmt):
    # fp32 subnormal rows: amax so small that FP8_MAX / amax overflows and inv_scale saturates
    # at FLT_MAX; bf16 / fp16 subnormals; and a row mixing the smallest and ordinary values.
    bits = torch.randint(1, 0x00800000, (8, 24), dtype=torch.int32)
    sub = bits.view(torch.float32) * torch.where(torch.rand(8, 24) < 0.5, -1.0, 1.0)
    mixed = torch.randn(4, 24)
    mixed[:, ::3] = 1e-42
    for x in [sub, mixed, sub.to(torch.bfloat16) * 1e5, (torch.randn(8, 24) * 1e-6).half()]:
        assert torch.equal(recxla.quantize_rows(x, fmt), quantize_rows_ref(x, fmt))


@pytest.mark.parametrize("fmt", FP8)
def test_strided_rows(cpu_kernels, fmt):
    base = random_rows(40, 150)
    views = [
        base[:, 7:7 + 61],  # a column slice: row stride 150, dense rows
        base[::3, :33],  # every third row
        base[:20, :33].t().contiguous().t(),  # column-major: elements of a row are strided
        base[:0, :5],
    ]
    for x in views:
        assert torch.equal(recxla.quantize_rows(x, fmt), quantize_rows_ref(x.contiguous(), fmt))


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_dequantize_matches_reference(cpu_kernels, fmt, out_dtype):
    for rows, dim in SHAPES:
        packed = quantize_rows_ref(with_specials(random_rows(rows, dim)), fmt)
        # Every byte is a valid code (NaN / Inf codes included).
        packed[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
        y = recxla.dequantize_rows(packed, dim, fmt, out_dtype)
        assert_same_values(y, dequantize_rows_ref(packed, dim, fmt, out_dtype))


def test_dequantize_arbitrary_scales(cpu_kernels):
    # Scale bytes written by another producer: huge, subnormal, negative, zero.
    packed = torch.randint(0, 256, (32, 37), dtype=torch.uint8)
    scales = torch.tensor([3e38, 1e-40, -2.5, 0.0] * 8).view(32, 1)
    packed[:, 33:] = scales.view(torch.uint8)
    for fmt in FP8:
        for dtype in DTYPES:
            assert_same_values(recxla.dequantize_rows(packed, 33, fmt, dtype),
                               dequantize_rows_ref(packed, 33, fmt, dtype))


# ---------------------------------------------------------------- semantics


@pytest.mark.parametrize("fmt", FP8)
def test_nan_and_inf_do_not_disturb_other_values(fmt):
    x = random_rows(6, 40)
    x[2, 5], x[2, 17], x[4, 0] = float("nan"), float("inf"), -float("inf")
    special = ~torch.isfinite(x)
    packed = recxla.quantize_rows(x, fmt)
    # The other values of those rows get the codes and scale they get without NaN / Inf (which
    # do not enter the row's amax), and other rows do not notice.
    clean = recxla.quantize_rows(torch.where(special, 0.0, x), fmt)
    codes_special = torch.cat([special, torch.zeros(6, 4, dtype=torch.bool)], dim=1)
    assert torch.equal(packed[~codes_special], clean[~codes_special])
    for row in [0, 1, 3, 5]:
        assert torch.equal(packed[row], recxla.quantize_rows(x[row:row + 1], fmt)[0])
    # NaN -> NaN code; Inf -> Inf code in e5m2, NaN code in e4m3 (which has no infinity).
    inf_code = 0x7C if fmt == "e5m2" else 0x7F
    assert packed[2, 5] & 0x7F == 0x7F
    assert packed[2, 17] == inf_code and packed[4, 0] == inf_code | 0x80
    y = recxla.dequantize_rows(packed, 40, fmt)
    assert torch.isnan(y[2, 5])
    if fmt == "e5m2":
        assert y[2, 17] == float("inf") and y[4, 0] == -float("inf")
    else:
        assert torch.isnan(y[2, 17]) and torch.isnan(y[4, 0])
    assert torch.isfinite(y[~special]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_a_nan_keeps_its_sign_in_the_code(fmt, dtype):
    """c10's casts keep a NaN's sign, and so does the code. A GPU's multiply returns a
    canonical positive NaN whatever its operand, which once made every GPU path encode -NaN as
    0x7F (found by the GPU campaign: torch's CPU cast of a float NaN to bfloat16 gives 0xFFFF,
    a negative NaN); the kernels pass a NaN through unscaled (recxla/fp8.h scale_value)."""
    x = random_rows(3, 9).to(dtype)
    bits = x.view(torch.int16 if dtype != torch.float32 else torch.int32)
    negative_nan = {torch.float32: -0x400000, torch.bfloat16: -1, torch.float16: -1}[dtype]
    bits[1, 4] = negative_nan  # 0xFFC00000 / 0xFFFF: sign set, all-ones or quiet payload
    bits[2, 0] = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}[dtype]
    want = quantize_rows_ref(x, fmt)
    assert want[1, 4] == 0xFF and want[2, 0] == 0x7F
    assert torch.equal(recxla.quantize_rows(x, fmt), want)


@pytest.mark.parametrize("fmt", FP8)
def test_zero_rows_round_trip_exactly(fmt):
    x = random_rows(5, 19)
    x[[1, 3]] = 0
    packed = recxla.quantize_rows(x, fmt)
    assert torch.equal(packed[[1, 3], :19], torch.zeros(2, 19, dtype=torch.uint8))
    assert torch.equal(packed[[1, 3], 19:].contiguous().view(torch.float32), torch.ones(2, 1))
    assert torch.equal(recxla.dequantize_rows(packed, 19, fmt)[[1, 3]], torch.zeros(2, 19))


@pytest.mark.parametrize("fmt,min_db", [("e4m3", 25.0), ("e5m2", 19.0)])
def test_sqnr_on_gaussian_rows(fmt, min_db):
    # e4m3 keeps 3 mantissa bits (about 31 dB on Gaussian rows), e5m2 2 bits (about 25 dB).
    x = torch.randn(256, 128) * torch.exp(torch.randn(256, 1) * 3)
    y = recxla.dequantize_rows(recxla.quantize_rows(x, fmt), 128, fmt)
    noise = (y.double() - x.double()).pow(2).sum(dim=1)
    sqnr_db = 10 * torch.log10(x.double().pow(2).sum(dim=1) / noise)
    assert sqnr_db.min() >= min_db, sqnr_db.min()


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pass_through_formats_round_trip(fmt, dtype):
    x = random_rows(11, 13, dtype)
    wire = FORMATS[fmt].wire_dtype
    packed = recxla.quantize_rows(x, fmt)
    assert packed.shape == (11, recxla.row_bytes(13, fmt)) and packed.dtype == torch.uint8
    assert_same_values(recxla.dequantize_rows(packed, 13, fmt, dtype), x.to(wire).to(dtype))


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "e4m3"])
def test_one_column_with_a_stride_round_trips(fmt):
    """A transposed row ([1, N].t(): [N, 1], stride N in its last dim) counts as contiguous, but
    its bytes cannot be viewed in place: it is copied (a cast format once tried the view and
    raised)."""
    n = int(torch.randint(2, 40, (1,)))
    for x in (random_rows(1, n, torch.float32).t(),
              torch.randn(2 * n).as_strided((n, 1), (1, 2))):
        assert x.is_contiguous() and x.stride(-1) != 1
        packed = recxla.quantize_rows(x, fmt)
        assert packed.shape == (n, recxla.row_bytes(1, fmt))
        assert torch.equal(packed, recxla.quantize_rows(x.clone(memory_format=torch.
                                                                contiguous_format), fmt))


def fbgemm_fp8_row_bytes(dim):
    """FBGEMM's FloatToFP8RowwiseQuantized row: the codes padded to a multiple of 4 bytes, then
    two floats (fbgemm_gpu quantize_fp8_rowwise.cu: ncols_aligned + 2 * sizeof(float))."""
    return (dim + 3) // 4 * 4 + 8


def test_row_bytes_never_exceeds_fbgemm():
    for fmt in FP8:
        for dim in range(301):
            assert recxla.row_bytes(dim, fmt) == dim + 4 <= fbgemm_fp8_row_bytes(dim)
    try:
        import fbgemm_gpu  # noqa: F401
        op = torch.ops.fbgemm.FloatToFP8RowwiseQuantized
    except (ImportError, AttributeError, RuntimeError):
        pytest.skip("fbgemm_gpu's FP8 row-wise quantizer is not installed")
    # Its CPU build has no FP8 kernel ("fp8 is not supported by CPU"), but the meta kernel gives
    # the output shape.
    for dim in [1, 3, 4, 5, 13, 64, 127, 300]:
        out = op(torch.empty(2, dim, device="meta"), True)
        assert out.shape[1] == fbgemm_fp8_row_bytes(dim)


# ---------------------------------------------------------------- torch.library integration


def test_opcheck():
    x = random_rows(6, 21)
    for fmt in FP8:
        torch.library.opcheck(torch.ops.recxla.quantize_fp8_rows.default, (x, fmt))
        packed = recxla.quantize_rows(x, fmt)
        for dtype in DTYPES:
            torch.library.opcheck(
                torch.ops.recxla.dequantize_fp8_rows.default, (packed, 21, fmt, dtype))


def test_torch_compile_fullgraph():
    def round_trip(x):
        packed = recxla.quantize_rows(x, "e4m3")
        return recxla.dequantize_rows(packed, x.shape[1], "e4m3", x.dtype)

    x = random_rows(8, 20)
    compiled = torch.compile(round_trip, fullgraph=True)
    assert torch.equal(compiled(x), round_trip(x))


# ---------------------------------------------------------------- errors


def test_python_api_errors():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"quantize_rows: x must be 2-D \[rows, dim\], got 3-D"):
        recxla.quantize_rows(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match=r"quantize_rows: "
                       r"x must be float32, bfloat16 or float16, got torch.int32"):
        recxla.quantize_rows(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"quantize_rows: fmt must be one of .*, got 'e3m4'"):
        recxla.quantize_rows(x, "e3m4")
    packed = recxla.quantize_rows(x)
    with pytest.raises(ValueError, match=r"packed has 8 bytes per row, but dim=5 in e4m3 needs 9"):
        recxla.dequantize_rows(packed, 5)
    with pytest.raises(
            TypeError, match=r"dequantize_rows: packed must be uint8, got torch.float32"):
        recxla.dequantize_rows(x, 4)
    with pytest.raises(ValueError, match=r"dequantize_rows: packed must be 2-D"):
        recxla.dequantize_rows(packed.view(-1), 4)
    with pytest.raises(
            TypeError, match=r"dequantize_rows: dtype must be float32, bfloat16 or float16"):
        recxla.dequantize_rows(packed, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"row_bytes: dim must be an int >= 0, got -1"):
        recxla.row_bytes(-1)


def test_op_errors():
    # The ops themselves check too (C++ TORCH_CHECK_VALUE / TORCH_CHECK_TYPE).
    q = torch.ops.recxla.quantize_fp8_rows
    d = torch.ops.recxla.dequantize_fp8_rows
    with pytest.raises(
            ValueError, match=r"recxla::quantize_fp8_rows: x must be 2-D \[rows, dim\], got 1-D"):
        q(torch.randn(4), "e4m3")
    with pytest.raises(
            TypeError, match=r"recxla::quantize_fp8_rows: x must be float32, bfloat16 or float16"):
        q(torch.randn(2, 4).double(), "e4m3")
    with pytest.raises(ValueError, match=r"recxla::quantize_fp8_rows: "
                       r"fmt must be 'e4m3' or 'e5m2', got 'bf16'"):
        q(torch.randn(2, 4), "bf16")
    packed = q(torch.randn(2, 4), "e4m3")
    with pytest.raises(ValueError, match=r"recxla::dequantize_fp8_rows: "
                       r"packed has 8 bytes per row but dim=3 needs 7"):
        d(packed, 3, "e4m3", torch.float32)
    with pytest.raises(ValueError, match=r"recxla::dequantize_fp8_rows: dim must be >= 0, got -2"):
        d(packed, -2, "e4m3", torch.float32)
    with pytest.raises(TypeError, match=r"recxla::dequantize_fp8_rows: packed must be uint8"):
        d(packed.float(), 4, "e4m3", torch.float32)
    with pytest.raises(TypeError, match=r"recxla::dequantize_fp8_rows: "
                       r"dtype must be float32, bfloat16 or float16"):
        d(packed, 4, "e4m3", torch.int8)
    with pytest.raises(ValueError, match=r"recxla::dequantize_fp8_rows: "
                       r"fmt must be 'e4m3' or 'e5m2', got 'x'"):
        d(packed, 4, "x", torch.float32)
