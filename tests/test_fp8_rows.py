"""FP8 row codec: every backend against the PyTorch reference (recxla/reference/fp8_rows.py).

CPU kernels run here: the AVX-512 kernels (when the CPU has AVX-512) and the portable ones
(RECXLA_CPU_KERNELS=portable). The Triton kernels run in Triton's interpreter on CPU tensors and
are compiled to PTX without a GPU; the gpu-marked tests run CUDA and Triton on a GPU.
"""

import numpy as np
import pytest
import torch

import recxla
from recxla.formats import FORMATS
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

FP8 = ["e4m3", "e5m2"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, dim): empty, single, D not a multiple of 4 / 16 / 64, several column blocks.
SHAPES = [(0, 7), (6, 0), (1, 1), (33, 3), (9, 16), (5, 17), (17, 64), (4, 100), (7, 129), (3, 300)]
CPU_KERNELS = ["default", "portable"]


@pytest.fixture(params=CPU_KERNELS)
def cpu_kernels(request, monkeypatch):
    """Runs a test with the CPU kernels the machine picks, then with the portable ones."""
    if request.param == "portable":
        monkeypatch.setenv("RECXLA_CPU_KERNELS", "portable")
    else:
        monkeypatch.delenv("RECXLA_CPU_KERNELS", raising=False)
    return request.param


def random_rows(rows, dim, dtype=torch.float32, device="cpu"):
    """Gaussian rows whose magnitudes span 1e-30 .. 1e4 (fp32 subnormal products, bf16/fp16
    underflow and overflow to Inf included once cast)."""
    magnitude = torch.exp(torch.empty(rows, 1).uniform_(-69.0, 9.2))
    return (torch.randn(rows, dim) * magnitude).to(dtype).to(device)


def with_specials(x):
    """x with NaN, +Inf, -Inf and an all-zero row at random places (needs >= 4 rows)."""
    x = x.clone()
    rows, dim = x.shape
    if rows >= 4 and dim >= 1:
        r = torch.randperm(rows)[:4]
        x[r[0], torch.randint(dim, ())] = float("nan")
        x[r[1], torch.randint(dim, ())] = float("inf")
        x[r[2], torch.randint(dim, ())] = -float("inf")
        x[r[3]] = 0
    return x


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_values(actual, expected):
    """Same dtype and shape, NaN at the same places, every other value bit for bit."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(bits(actual)[~nan], bits(expected)[~nan])


def fp8_grid(fmt):
    """fp32 values that probe every rounding decision of `fmt`: each FP8 magnitude, the midpoints
    between neighbours (ties to even), one fp32 ulp either side, and the fp32 subnormals below the
    smallest FP8 step; both signs. All within +-FP8_MAX."""
    f = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.uint8).view(f.wire_dtype).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    near = torch.cat([values, mids])
    up = torch.nextafter(near, torch.tensor(float("inf")))
    down = torch.nextafter(near, torch.tensor(0.0))
    tiny = torch.tensor([1e-45, 1e-40, 1.1754942e-38, 1e-10])
    grid = torch.cat([near, up, down, tiny]).clamp(max=f.fp8_max)
    return torch.cat([grid, -grid])


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
    with pytest.raises(TypeError, match=r"quantize_rows: x must be float32, bfloat16 or float16, got torch.int32"):
        recxla.quantize_rows(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"quantize_rows: fmt must be one of .*, got 'e3m4'"):
        recxla.quantize_rows(x, "e3m4")
    packed = recxla.quantize_rows(x)
    with pytest.raises(ValueError, match=r"packed has 8 bytes per row, but dim=5 in e4m3 needs 9"):
        recxla.dequantize_rows(packed, 5)
    with pytest.raises(TypeError, match=r"dequantize_rows: packed must be uint8, got torch.float32"):
        recxla.dequantize_rows(x, 4)
    with pytest.raises(ValueError, match=r"dequantize_rows: packed must be 2-D"):
        recxla.dequantize_rows(packed.view(-1), 4)
    with pytest.raises(TypeError, match=r"dequantize_rows: dtype must be float32, bfloat16 or float16"):
        recxla.dequantize_rows(packed, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"row_bytes: dim must be an int >= 0, got -1"):
        recxla.row_bytes(-1)


def test_op_errors():
    # The ops themselves check too (C++ TORCH_CHECK_VALUE / TORCH_CHECK_TYPE).
    q = torch.ops.recxla.quantize_fp8_rows
    d = torch.ops.recxla.dequantize_fp8_rows
    with pytest.raises(ValueError, match=r"recxla::quantize_fp8_rows: x must be 2-D \[rows, dim\], got 1-D"):
        q(torch.randn(4), "e4m3")
    with pytest.raises(TypeError, match=r"recxla::quantize_fp8_rows: x must be float32, bfloat16 or float16"):
        q(torch.randn(2, 4).double(), "e4m3")
    with pytest.raises(ValueError, match=r"recxla::quantize_fp8_rows: fmt must be 'e4m3' or 'e5m2', got 'bf16'"):
        q(torch.randn(2, 4), "bf16")
    packed = q(torch.randn(2, 4), "e4m3")
    with pytest.raises(ValueError, match=r"recxla::dequantize_fp8_rows: packed has 8 bytes per row but dim=3 needs 7"):
        d(packed, 3, "e4m3", torch.float32)
    with pytest.raises(ValueError, match=r"recxla::dequantize_fp8_rows: dim must be >= 0, got -2"):
        d(packed, -2, "e4m3", torch.float32)
    with pytest.raises(TypeError, match=r"recxla::dequantize_fp8_rows: packed must be uint8"):
        d(packed.float(), 4, "e4m3", torch.float32)
    with pytest.raises(TypeError, match=r"recxla::dequantize_fp8_rows: dtype must be float32, bfloat16 or float16"):
        d(packed, 4, "e4m3", torch.int8)
    with pytest.raises(ValueError, match=r"recxla::dequantize_fp8_rows: fmt must be 'e4m3' or 'e5m2', got 'x'"):
        d(packed, 4, "x", torch.float32)


# ---------------------------------------------------------------- Triton kernels

# numpy, which runs the interpreter, warns on Inf results (the kernels form them on purpose).
interpreter_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def triton_interpreted():
    pytest.importorskip("triton")
    from recxla.triton_kernels import interpreted

    return interpreted("fp8_rows")


# (rows, dim, block_d): one column block, several (block_d forced small), empty shapes.
TRITON_SHAPES = [(0, 5, None), (4, 0, None), (7, 1, None), (9, 37, None), (6, 37, 16), (5, 130, 64)]


@interpreter_warnings
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_triton_interpreted_quantize(triton_interpreted, fmt, dtype):
    for rows, dim, block_d in TRITON_SHAPES:
        x = with_specials(random_rows(rows, dim, dtype))
        packed = triton_interpreted.quantize_fp8_rows_triton(x, fmt, block_d=block_d)
        assert torch.equal(packed, quantize_rows_ref(x, fmt)), (rows, dim, block_d)
    strided = random_rows(12, 50, dtype)[::2, 3:40]
    assert torch.equal(triton_interpreted.quantize_fp8_rows_triton(strided, fmt),
                       quantize_rows_ref(strided.contiguous(), fmt))


@interpreter_warnings
@pytest.mark.parametrize("fmt", FP8)
def test_triton_interpreted_rounding_cases(triton_interpreted, fmt):
    # Ties and carries into the next exponent: where the interpreter's own fp8 cast goes wrong.
    f = FORMATS[fmt]
    grid = fp8_grid(fmt)
    dim = 127
    grid = torch.cat([grid, torch.zeros((-grid.numel()) % (dim - 1))]).view(-1, dim - 1)
    x = torch.cat([torch.full((grid.shape[0], 1), f.fp8_max), grid], dim=1)
    packed = triton_interpreted.quantize_fp8_rows_triton(x, fmt)
    assert torch.equal(packed[:, :dim], x.to(f.wire_dtype).view(torch.uint8))


@interpreter_warnings
@pytest.mark.parametrize("fmt", FP8)
def test_triton_interpreted_dequantize(triton_interpreted, fmt):
    for rows, dim, block_d in TRITON_SHAPES:
        packed = quantize_rows_ref(random_rows(rows, dim), fmt)
        packed[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
        for dtype in DTYPES:
            y = triton_interpreted.dequantize_fp8_rows_triton(packed, dim, fmt, dtype, block_d=block_d)
            assert_same_values(y, dequantize_rows_ref(packed, dim, fmt, dtype))


def test_triton_launcher_errors(triton_interpreted):
    tk = triton_interpreted
    with pytest.raises(ValueError, match=r"quantize_fp8_rows_triton: fmt must be 'e4m3' or 'e5m2', got 'bf16'"):
        tk.quantize_fp8_rows_triton(torch.randn(2, 3), "bf16")
    with pytest.raises(ValueError, match=r"quantize_fp8_rows_triton: x must be 2-D"):
        tk.quantize_fp8_rows_triton(torch.randn(3), "e4m3")
    with pytest.raises(TypeError, match=r"quantize_fp8_rows_triton: x must be float32, bfloat16 or float16"):
        tk.quantize_fp8_rows_triton(torch.ones(2, 3, dtype=torch.int64), "e4m3")
    with pytest.raises(ValueError, match=r"dequantize_fp8_rows_triton: packed has 7 bytes per row, but dim=4 needs 8"):
        tk.dequantize_fp8_rows_triton(torch.zeros(2, 7, dtype=torch.uint8), 4, "e4m3")


def test_triton_kernels_compile_for_gpu_without_one():
    """The kernels lower to PTX for sm_90 on this machine (no GPU needed), with IEEE division,
    no fused multiply-add and no flush-to-zero: the arithmetic the bit-exactness relies on."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from recxla.triton_kernels import fp8_rows as tk

    pointers = {"x_ptr": "*bf16", "out_ptr": "*u8", "in_ptr": "*u8", "y_ptr": "*fp16"}
    cases = [
        (tk._quantize_kernel, dict(BLOCK_ROWS=4, BLOCK_D=64, ONE_BLOCK=False, **tk._FORMATS["e4m3"],
                                   IN_BF16=True)),
        (tk._dequantize_kernel, dict(BLOCK_ROWS=4, BLOCK_D=64, MANT=2, BIAS=15,
                                     SUBNORMAL_STEP=2.0 ** -16, OUT_BF16=False)),
    ]
    for kernel, constexprs in cases:
        signature = {name: pointers.get(name, "i64" if "stride" in name else "i32")
                     for name in kernel.arg_names if name not in constexprs}
        signature.update({name: "constexpr" for name in constexprs})
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"enable_fp_fusion": False})
        except (RuntimeError, ImportError) as e:  # no NVIDIA backend / ptxas in this install
            pytest.skip(f"Triton cannot compile for CUDA here: {e}")
        ptx = compiled.asm["ptx"]
        assert "fma." not in ptx and ".ftz" not in ptx
        if kernel is tk._quantize_kernel:
            assert ptx.count("div.rn.f32") >= 2 and "div.full" not in ptx and "div.approx" not in ptx


# ---------------------------------------------------------------- GPU (make gpu-check)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_gpu_backends_match_reference(monkeypatch, backend, fmt, dtype):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    for rows, dim in SHAPES + [(4096, 128), (3, 5000)]:
        x = with_specials(random_rows(rows, dim, dtype))
        packed = recxla.quantize_rows(x.cuda(), fmt)
        assert packed.is_cuda
        assert torch.equal(packed.cpu(), quantize_rows_ref(x, fmt)), (rows, dim)
        packed_cpu = quantize_rows_ref(x, fmt)
        packed_cpu[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
        for out_dtype in DTYPES:
            y = recxla.dequantize_rows(packed_cpu.cuda(), dim, fmt, out_dtype)
            assert_same_values(y.cpu(), dequantize_rows_ref(packed_cpu, dim, fmt, out_dtype))
    strided = random_rows(64, 300, dtype).cuda()[::2, 5:200]
    assert torch.equal(recxla.quantize_rows(strided, fmt).cpu(),
                       quantize_rows_ref(strided.cpu().contiguous(), fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8)
def test_gpu_rounding_cases(fmt):
    f = FORMATS[fmt]
    grid = fp8_grid(fmt)
    grid = torch.cat([grid, torch.zeros((-grid.numel()) % 127)]).view(-1, 127)
    x = torch.cat([torch.full((grid.shape[0], 1), f.fp8_max), grid], dim=1)
    from recxla.triton_kernels.fp8_rows import quantize_fp8_rows_triton

    expected = x.to(f.wire_dtype).view(torch.uint8)
    assert torch.equal(quantize_fp8_rows_triton(x.cuda(), fmt)[:, :128].cpu(), expected)
    if recxla.built_with_cuda():
        assert torch.equal(torch.ops.recxla.quantize_fp8_rows(x.cuda(), fmt)[:, :128].cpu(), expected)
