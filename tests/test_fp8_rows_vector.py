"""The FP8 row codec's vector GPU kernels (variants vector_warp_per_row and vector_rows_per_warp of
the families fp8_quantize / fp8_dequantize) without a GPU, and with one (`make gpu-campaign`).

Without a GPU: tests/fp8_rows_vector_harness.cpp, built here with g++, runs the kernels' own lane
code (csrc/include/recxla/fp8_vector.h) on the CPU, every lane of every warp of a small grid, with
the warp's shuffles replayed, into poisoned buffers with guard bytes; the results must equal the
PyTorch reference bit for bit. The launch plans (which lanes per row, how many chunks per lane,
and when a call falls back to warp_per_row) are tested through the same library.
With a GPU: every variant of both families against the reference, the fallback cases included.
"""

import ctypes

import pytest
import torch

import cpu_harness
import recxla
from fp8_rows_cases import DTYPES, FP8, assert_same_values, random_rows, with_specials
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FMT_CODE = {"e4m3": 0, "e5m2": 1}
# recxla::fp8::vec::Kernel and Fallback.
WARP_PER_ROW, VECTOR_WARP_PER_ROW, VECTOR_ROWS_PER_WARP = 0, 1, 2
VECTORS = [VECTOR_WARP_PER_ROW, VECTOR_ROWS_PER_WARP]
NONE, ASKED, DIM_NOT_MULTIPLE, TOO_WIDE, MISALIGNED = 0, 1, 2, 3, 4
GUARD = 64  # bytes after every output buffer that must stay as they were
POISON = 0xA5

# numpy warns on Inf results that the reference forms on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    lib = cpu_harness.build("fp8_rows_vector_harness.cpp", tmp_path_factory.mktemp("fp8_vector"))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.plan_quantize.argtypes = [i32, i64, i32, ctypes.c_uint64, i64, ctypes.c_uint64,
                                  ctypes.POINTER(i32), ctypes.POINTER(i32)]
    lib.plan_dequantize.argtypes = [i32, i64, i32, ctypes.c_uint64, ctypes.c_uint64,
                                    ctypes.POINTER(i32)]
    lib.replay_quantize_rows.argtypes = [i32, i32, i32, ptr, i64, i64, i64, ptr, i64]
    lib.replay_dequantize_rows.argtypes = [i32, i32, i32, ptr, i64, i64, ptr, i64]
    lib.decode_all_codes.argtypes = [i32, ptr, ptr]
    return lib


def quantize_plan(lib, kernel, dim, dtype, x_addr, x_row_stride, out_addr):
    lanes, chunks = ctypes.c_int(), ctypes.c_int()
    why = lib.plan_quantize(kernel, dim, DTYPE_CODE[dtype], x_addr, x_row_stride, out_addr,
                            ctypes.byref(lanes), ctypes.byref(chunks))
    return why, 1 << lanes.value, chunks.value


def dequantize_plan(lib, kernel, dim, dtype, in_addr, y_addr):
    lanes = ctypes.c_int()
    why = lib.plan_dequantize(kernel, dim, DTYPE_CODE[dtype], in_addr, y_addr, ctypes.byref(lanes))
    return why, 1 << lanes.value


def guarded(shape, dtype, offset_bytes=0):
    """(view of `shape`, whole buffer) where the view starts `offset_bytes` into a poisoned
    buffer with GUARD poisoned bytes after it."""
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.full((offset_bytes + n + GUARD + 64,), POISON, dtype=torch.uint8)
    start = offset_bytes + (-raw.data_ptr()) % 64  # 64-byte aligned, then the offset
    view = raw[start:start + n].view(dtype).view(shape) if n else \
        torch.empty(shape, dtype=dtype)
    return view, raw, start + n


def replay_quantize(lib, kernel, x, fmt, warps, out_offset=0):
    rows, dim = x.shape
    out, raw, end = guarded((rows, dim + 4), torch.uint8, out_offset)
    why = lib.replay_quantize_rows(kernel, DTYPE_CODE[x.dtype], FMT_CODE[fmt], x.data_ptr(), rows,
                                   dim, x.stride(0), out.data_ptr(), warps)
    assert torch.all(raw[end:end + GUARD] == POISON), "a lane wrote past the output"
    return why, out


def replay_dequantize(lib, kernel, packed, dim, fmt, dtype, warps):
    y, raw, end = guarded((packed.shape[0], dim), dtype)
    why = lib.replay_dequantize_rows(kernel, DTYPE_CODE[dtype], FMT_CODE[fmt], packed.data_ptr(),
                                     packed.shape[0], dim, y.data_ptr(), warps)
    assert torch.all(raw[end:end + GUARD] == POISON), "a lane wrote past the output"
    return why, y


def vector_dims(dtype):
    """Dims the vector quantize kernels take for `dtype`: multiples of the values in 16 bytes,
    from one chunk to the widest row kept in registers (every chunks-per-lane template)."""
    per_chunk = 16 // torch.empty(0, dtype=dtype).element_size()
    return [per_chunk * c for c in (1, 2, 3, 5, 16, 31, 32, 33, 64, 100, 256)]


# ---------------------------------------------------------------- lane code vs the reference


@pytest.mark.parametrize("kernel", VECTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_quantize_lanes_match_reference(harness, kernel, fmt, dtype):
    for dim in vector_dims(dtype):
        # A grid of 3 warps over 37 rows: several rows per warp, a last group past the end.
        for rows, warps in [(37, 3), (5, 64), (1, 1)]:
            x = with_specials(random_rows(rows, dim, dtype))
            why, out = replay_quantize(harness, kernel, x, fmt, warps)
            assert why == NONE, (dim, why)
            assert torch.equal(out, quantize_rows_ref(x, fmt)), (rows, dim, warps)


@pytest.mark.parametrize("kernel", VECTORS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_lanes_zero_columns(harness, kernel, dtype):
    # D=0 with 16-byte aligned rows (a slice of no columns): every row is its scale alone, 1.0.
    x = random_rows(41, 8, dtype)[:, :0]
    why, out = replay_quantize(harness, kernel, x, "e4m3", warps=2)
    assert why == NONE
    assert torch.equal(out, quantize_rows_ref(x, "e4m3"))


@pytest.mark.parametrize("kernel", VECTORS)
@pytest.mark.parametrize("fmt", FP8)
def test_quantize_lanes_strided_rows_and_wire_offset(harness, kernel, fmt):
    # Rows 16-byte aligned but apart by more than D (a column slice), and an output that starts
    # 4 bytes into its buffer, as the quantized all-to-all's send[lo:] does.
    base = random_rows(40, 132)
    x = base[:, 4:4 + 64]
    why, out = replay_quantize(harness, kernel, x, fmt, warps=5, out_offset=4 * 68)
    assert why == NONE
    assert torch.equal(out, quantize_rows_ref(x.contiguous(), fmt))


@pytest.mark.parametrize("kernel", VECTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_dequantize_lanes_match_reference(harness, kernel, fmt, dtype):
    for dim in [4, 8, 12, 60, 64, 124, 128, 132, 256, 1024, 4100]:
        for rows, warps in [(37, 3), (6, 64)]:
            packed = quantize_rows_ref(with_specials(random_rows(rows, dim)), fmt)
            # Every byte a valid code, NaN / Inf codes included.
            packed[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
            why, y = replay_dequantize(harness, kernel, packed, dim, fmt, dtype, warps)
            assert why == NONE, (dim, why)
            assert_same_values(y, dequantize_rows_ref(packed, dim, fmt, dtype))


@pytest.mark.parametrize("fmt", FP8)
def test_decode_select_is_decode(harness, fmt):
    # The branch-free decoder the vector kernels use, on every code, against fp8.h's decode and
    # against torch's own fp8 dtypes.
    plain, selected = torch.empty(256), torch.empty(256)
    harness.decode_all_codes(FMT_CODE[fmt], plain.data_ptr(), selected.data_ptr())
    assert torch.equal(plain.view(torch.int32), selected.view(torch.int32))
    wire = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    assert_same_values(selected, torch.arange(256, dtype=torch.uint8).view(wire).float())


# ---------------------------------------------------------------- launch plans


def test_quantize_plans_lanes_and_chunks(harness):
    f32, bf16 = torch.float32, torch.bfloat16
    aligned = 1 << 20

    def plan(kernel, dim, dtype=f32):
        return quantize_plan(harness, kernel, dim, dtype, aligned, dim, aligned)

    # vector_rows_per_warp: about two chunks per lane, so every lane of a D=64 / D=128 row works.
    assert plan(VECTOR_ROWS_PER_WARP, 128) == (NONE, 16, 2)
    assert plan(VECTOR_ROWS_PER_WARP, 64) == (NONE, 8, 2)
    assert plan(VECTOR_ROWS_PER_WARP, 128, bf16) == (NONE, 8, 2)
    assert plan(VECTOR_ROWS_PER_WARP, 4) == (NONE, 1, 1)
    assert plan(VECTOR_ROWS_PER_WARP, 1024) == (NONE, 32, 8)
    # vector_warp_per_row: 32 lanes, chunks per lane a power of two covering the row.
    assert plan(VECTOR_WARP_PER_ROW, 64) == (NONE, 32, 1)
    assert plan(VECTOR_WARP_PER_ROW, 128) == (NONE, 32, 1)
    assert plan(VECTOR_WARP_PER_ROW, 132) == (NONE, 32, 2)
    assert plan(VECTOR_WARP_PER_ROW, 1024) == (NONE, 32, 8)
    assert plan(VECTOR_WARP_PER_ROW, 2048, bf16) == (NONE, 32, 8)
    for kernel in VECTORS:
        for dim in range(0, 1100, 4):
            why, lanes, chunks = plan(kernel, dim)
            if dim > 1024:
                assert why == TOO_WIDE
                continue
            assert why == NONE and lanes * chunks * 4 >= dim and chunks in (1, 2, 4, 8)


def test_quantize_plans_fall_back(harness):
    f32, bf16 = torch.float32, torch.bfloat16
    a = 1 << 20
    assert quantize_plan(harness, WARP_PER_ROW, 128, f32, a, 128, a)[0] == ASKED
    for kernel in VECTORS:
        assert quantize_plan(harness, kernel, 127, f32, a, 127, a)[0] == DIM_NOT_MULTIPLE
        assert quantize_plan(harness, kernel, 1, f32, a, 1, a)[0] == DIM_NOT_MULTIPLE
        assert quantize_plan(harness, kernel, 12, bf16, a, 12, a)[0] == DIM_NOT_MULTIPLE
        assert quantize_plan(harness, kernel, 1028, f32, a, 1028, a)[0] == TOO_WIDE
        assert quantize_plan(harness, kernel, 2056, bf16, a, 2056, a)[0] == TOO_WIDE
        assert quantize_plan(harness, kernel, 64, f32, a + 4, 64, a)[0] == MISALIGNED
        assert quantize_plan(harness, kernel, 64, f32, a, 66, a)[0] == MISALIGNED  # 264 B rows
        assert quantize_plan(harness, kernel, 64, bf16, a, 68, a)[0] == MISALIGNED  # 136 B rows
        assert quantize_plan(harness, kernel, 64, f32, a, 64, a + 2)[0] == MISALIGNED
        assert quantize_plan(harness, kernel, 64, f32, a, 64, a + 68)[0] == NONE


def test_quantize_fallback_writes_nothing(harness):
    # A misaligned x (a slice one float in) must not reach the vector kernel at all.
    x = random_rows(8, 68)[:, 1:65]
    why, out = replay_quantize(harness, VECTOR_ROWS_PER_WARP, x, "e4m3", warps=2)
    assert why == MISALIGNED and torch.all(out == POISON)


def test_dequantize_plans(harness):
    f32, f16 = torch.float32, torch.float16
    a = 1 << 20
    assert dequantize_plan(harness, VECTOR_ROWS_PER_WARP, 128, f32, a, a) == (NONE, 16)
    assert dequantize_plan(harness, VECTOR_ROWS_PER_WARP, 64, f32, a, a) == (NONE, 8)
    assert dequantize_plan(harness, VECTOR_ROWS_PER_WARP, 4, f32, a, a) == (NONE, 1)
    assert dequantize_plan(harness, VECTOR_ROWS_PER_WARP, 5000, f32, a, a) == (NONE, 32)
    assert dequantize_plan(harness, VECTOR_WARP_PER_ROW, 64, f32, a, a) == (NONE, 32)
    assert dequantize_plan(harness, WARP_PER_ROW, 64, f32, a, a)[0] == ASKED
    for kernel in VECTORS:
        assert dequantize_plan(harness, kernel, 63, f32, a, a)[0] == DIM_NOT_MULTIPLE
        assert dequantize_plan(harness, kernel, 64, f32, a + 2, a)[0] == MISALIGNED
        assert dequantize_plan(harness, kernel, 64, f32, a + 68, a)[0] == NONE  # recv[lo:]
        assert dequantize_plan(harness, kernel, 64, f32, a, a + 8)[0] == MISALIGNED
        assert dequantize_plan(harness, kernel, 64, f16, a, a + 8)[0] == NONE
        assert dequantize_plan(harness, kernel, 64, f16, a, a + 4)[0] == MISALIGNED


# ---------------------------------------------------------------- on a GPU (make gpu-campaign)


def poisoned_like(shape, dtype, pattern):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    if t.numel():
        t.view(torch.uint8).fill_(pattern)
    return t


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["fp8_quantize", "fp8_dequantize"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_gpu_variants_match_reference(family, fmt, dtype):
    from recxla.ops.gpu_variants import use_variant, variants

    if not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    # Vector shapes, fallback shapes (odd D, too wide), empty ones, the trainer's messages.
    shapes = [(0, 64), (5, 0), (1, 1), (33, 3), (37, 127), (4096, 128), (3745, 64), (70, 4),
              (9, 1024), (7, 1028), (5, 2048), (3, 5000), (65, 132)]
    for variant in variants(family):
        with use_variant(family, variant):
            for rows, dim in shapes:
                x = with_specials(random_rows(rows, dim, dtype))
                packed_ref = quantize_rows_ref(x, fmt)
                if family == "fp8_quantize":
                    for pattern in (0x5A, 0xA5):  # two poisons: no unwritten byte passes both
                        out = poisoned_like((rows, dim + 4), torch.uint8, pattern)
                        torch.ops.recxla.quantize_fp8_rows_out(x.cuda(), fmt, out)
                        assert torch.equal(out.cpu(), packed_ref), (variant, rows, dim, pattern)
                else:
                    packed_ref[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
                    expected = dequantize_rows_ref(packed_ref, dim, fmt, dtype)
                    for pattern in (0x5A, 0xA5):
                        y = poisoned_like((rows, dim), dtype, pattern)
                        torch.ops.recxla.dequantize_fp8_rows_out(packed_ref.cuda(), dim, fmt, y)
                        assert_same_values(y.cpu(), expected)
            # Misaligned buffers take the fallback and still write the same bytes.
            x = random_rows(64, 200, dtype).cuda()[:, 1:129]
            if family == "fp8_quantize":
                assert torch.equal(recxla.quantize_rows(x, fmt).cpu(),
                                   quantize_rows_ref(x.cpu().contiguous(), fmt))
            else:
                packed = quantize_rows_ref(x.cpu().contiguous(), fmt)
                wire = torch.empty(64 * 132 + 2, dtype=torch.uint8, device="cuda")
                view = wire[2:].view(64, 132)
                view.copy_(packed)
                y = recxla.dequantize_rows(view, 128, fmt, dtype)
                assert_same_values(y.cpu(), dequantize_rows_ref(packed, 128, fmt, dtype))
