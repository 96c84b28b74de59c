"""The row codec's memory: empty inputs in every format, `out=` (results and checks), the reusable
CPU buffers its results come from (reused only once nothing references them, no page faults in a
steady loop) and the streaming stores of large dequantize outputs. Values are checked against
the PyTorch reference (recxla/reference/fp8_rows.py)."""

import resource

import numpy as np
import pytest
import torch

import recxla
from fp8_rows_cases import DTYPES, FP8, assert_same_values, bits, random_rows, with_specials
from recxla.formats import FORMATS
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

FMTS = sorted(FORMATS)


@pytest.fixture(params=["default", "portable"])
def cpu_kernels(request, monkeypatch):
    """Runs a test with the CPU kernels the machine picks, then with the portable ones."""
    if request.param == "portable":
        monkeypatch.setenv("RECXLA_CPU_KERNELS", "portable")
    else:
        monkeypatch.delenv("RECXLA_CPU_KERNELS", raising=False)
    return request.param


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs_in_every_format(fmt, dtype):
    # quantize_rows(torch.empty(0, 5), "bf16") used to raise "cannot reshape tensor of 0
    # elements", and dequantize_rows of a [3, 0] uint8 in bf16 a stride error.
    for rows, dim in [(0, 5), (3, 0), (0, 0)]:
        x = torch.empty(rows, dim, dtype=dtype)
        packed = recxla.quantize_rows(x, fmt)
        assert packed.shape == (rows, recxla.row_bytes(dim, fmt)) and packed.dtype == torch.uint8
        assert torch.equal(packed, quantize_rows_ref(x, fmt))
        y = recxla.dequantize_rows(packed, dim, fmt, dtype)
        assert y.shape == (rows, dim) and y.dtype == dtype
        wide = torch.empty(rows, 3 * recxla.row_bytes(dim, fmt), dtype=torch.uint8)
        y = recxla.dequantize_rows(wide[:, ::3], dim, fmt, dtype)  # a strided view
        assert y.shape == (rows, dim)
    if not FORMATS[fmt].is_fp8:
        assert recxla.dequantize_rows(torch.empty(3, 0, dtype=torch.uint8), 0, fmt, dtype).shape \
            == (3, 0)
    # Rows of D = 0 in FP8 still carry their scale.
    assert recxla.quantize_rows(torch.empty(3, 0, dtype=dtype), "e4m3").shape == (3, 4)


def test_numpy_integers_are_sizes():
    assert recxla.row_bytes(np.int64(7), "e4m3") == 11 == recxla.row_bytes(7, "e4m3")
    packed = recxla.quantize_rows(random_rows(4, 7))
    assert recxla.dequantize_rows(packed, np.int32(7)).shape == (4, 7)
    with pytest.raises(TypeError, match=r"dequantize_rows: dim must be an int >= 0, got 7.0"):
        recxla.dequantize_rows(packed, 7.0)
    with pytest.raises(TypeError, match=r"row_bytes: dim must be an int >= 0, got True"):
        recxla.row_bytes(True)


# ---------------------------------------------------------------- out=


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_gives_the_same_result(cpu_kernels, fmt, dtype):
    for rows, dim in [(0, 7), (5, 0), (33, 3), (7, 129)]:
        x = with_specials(random_rows(2 * rows, 2 * dim, dtype))[::2, ::2]  # strided rows
        out = torch.randint(0, 256, (rows, recxla.row_bytes(dim, fmt)), dtype=torch.uint8)
        assert recxla.quantize_rows(x, fmt, out=out) is out
        assert torch.equal(out, quantize_rows_ref(x, fmt))
        y = torch.full((rows, dim), 7.0, dtype=dtype)
        assert recxla.dequantize_rows(out, dim, fmt, out=y) is y  # dtype from out
        assert_same_values(y, dequantize_rows_ref(out, dim, fmt, dtype))


def test_out_errors_name_the_argument_and_the_limit():
    x = random_rows(6, 10)
    packed = recxla.quantize_rows(x)
    q, dq = recxla.quantize_rows, recxla.dequantize_rows
    u8 = torch.uint8
    cases = [
        (lambda: q(x, out=torch.empty(6, 13, dtype=u8)), ValueError,
         r"quantize_rows: out must have shape \[6, 14\], got \[6, 13\]"),
        (lambda: q(x, out=torch.empty(6, 14)), TypeError,
         r"quantize_rows: out must be torch.uint8, got torch.float32"),
        (lambda: q(x, out=torch.empty(6, 14, dtype=u8, device="meta")), ValueError,
         r"quantize_rows: out must be on cpu like x, got meta"),
        (lambda: q(x, out=torch.empty(14, 6, dtype=u8).t()), ValueError,
         r"quantize_rows: out must be contiguous"),
        (lambda: q(x, "bf16", out=x.view(u8)[:, :20]), ValueError,
         r"quantize_rows: out must (be contiguous|not share memory with x)"),
        (lambda: q(x, "fp32", out=x.view(u8)), ValueError,
         r"quantize_rows: out must not share memory with x"),
        (lambda: q(x, out=[0] * 84), TypeError, r"quantize_rows: out must be a torch.Tensor"),
        (lambda: dq(packed, 10, out=torch.empty(6, 11)), ValueError,
         r"dequantize_rows: out must have shape \[6, 10\], got \[6, 11\]"),
        (lambda: dq(packed, 10, dtype=torch.float32, out=torch.empty(6, 10).half()), TypeError,
         r"dequantize_rows: out must be torch.float32, got torch.float16"),
        (lambda: dq(packed, 10, out=torch.empty(6, 10, dtype=torch.int32)), TypeError,
         r"dequantize_rows: dtype must be float32, bfloat16 or float16, got torch.int32"),
        (lambda: dq(recxla.quantize_rows(x, "fp32"), 10, "fp32", out=x), ValueError,
         r"dequantize_rows: out must not share memory with packed"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_out_ops_check_too():
    # The C++ ops behind out= check for themselves (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE).
    x = random_rows(4, 8)
    q, dq = torch.ops.recxla.quantize_fp8_rows_out, torch.ops.recxla.dequantize_fp8_rows_out
    with pytest.raises(ValueError, match=r"recxla::quantize_fp8_rows_out: out must have shape "
                                         r"\[4, 12\], got \[4, 11\]"):
        q(x, "e4m3", torch.empty(4, 11, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"recxla::quantize_fp8_rows_out: out must be Byte"):
        q(x, "e4m3", torch.empty(4, 12, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"quantize_fp8_rows_out: out must not share memory"):
        q(x, "e4m3", x.view(torch.uint8).view(-1)[:48].view(4, 12))
    packed = recxla.quantize_rows(x)
    with pytest.raises(TypeError, match=r"dequantize_fp8_rows_out: out must be float32, "
                                        r"bfloat16 or float16, got Double"):
        dq(packed, 8, "e4m3", torch.empty(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dequantize_fp8_rows_out: out must be contiguous"):
        dq(packed, 8, "e4m3", torch.empty(8, 4).t())


def test_opcheck_out_ops():
    x = random_rows(6, 21)
    for fmt, dtype in zip(FP8, (torch.float32, torch.bfloat16)):
        out = torch.empty(6, 25, dtype=torch.uint8)
        torch.library.opcheck(torch.ops.recxla.quantize_fp8_rows_out.default, (x, fmt, out))
        y = torch.empty(6, 21, dtype=dtype)
        torch.library.opcheck(
            torch.ops.recxla.dequantize_fp8_rows_out.default, (out, 21, fmt, y))


# ---------------------------------------------------------------- reusable buffers


def test_buffers_are_reused_only_once_nothing_references_them():
    packed = recxla.quantize_rows(random_rows(4096, 64))  # results of 1 MiB: pooled
    first = recxla.dequantize_rows(packed, 64)
    address = first.data_ptr()
    view = first[1:]
    del first
    # A view keeps the memory in use: a new result must not land on it.
    second = recxla.dequantize_rows(packed, 64)
    assert second.data_ptr() != address
    expected = dequantize_rows_ref(packed, 64)
    assert torch.equal(view, expected[1:])
    del view
    third = recxla.dequantize_rows(packed, 64)
    assert third.data_ptr() == address  # released: reused, and fully rewritten
    assert torch.equal(third, expected) and torch.equal(second, expected)
    # Memory that autograd saved for backward is in use too.
    w = torch.randn(64, requires_grad=True)
    saved = recxla.dequantize_rows(packed, 64)
    address = saved.data_ptr()
    loss = (saved * w).sum()  # mul saves `saved` for w's gradient
    del saved
    assert recxla.dequantize_rows(packed, 64).data_ptr() != address
    loss.backward()
    assert torch.equal(w.grad, expected.sum(0))
    in_use, idle, n_in_use, n_idle = torch.ops.recxla.buffer_pool_stats()
    assert n_in_use >= 1 and in_use >= (4096 * 64 * 4) and idle >= 0 and n_idle >= 0


def test_a_steady_codec_loop_has_no_page_faults():
    # 65536 x 128 float32: 32 MiB results, which glibc maps afresh on every call by default.
    x = random_rows(65536, 128)
    counts = []
    for _ in range(6):
        before = minor_faults()
        packed = recxla.quantize_rows(x)
        y = recxla.dequantize_rows(packed, 128)
        del packed, y
        counts.append(minor_faults() - before)
    # The first call faults in its new buffers (huge pages: a few hundred faults, not 10k).
    assert sum(counts[2:]) <= 64, counts


def test_a_loop_of_varying_sizes_keeps_a_bounded_pool():
    # Deduplicated rows vary from step to step: without size classes every new row count mapped
    # a new buffer and the pool filled up to its capacity with idle storages (a leak in effect).
    torch.ops.recxla.release_idle_buffers()
    x = random_rows(5000, 128)

    def step(rows: int) -> int:
        packed = recxla.quantize_rows(x[:rows])
        y = recxla.dequantize_rows(packed, 128)
        assert torch.equal(y, dequantize_rows_ref(packed, 128))
        del packed, y
        in_use, idle, _, _ = torch.ops.recxla.buffer_pool_stats()
        return in_use + idle

    # Every size class between 3000 and 5000 rows, then random sizes: the pool must not grow.
    warm = max(step(rows) for rows in [*range(3000, 5001, 97), 5000])
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    pooled = [step(int(torch.randint(3000, 5001, (), generator=gen))) for _ in range(40)]
    assert max(pooled) <= warm, (warm, pooled)
    # Classes are 1.14-1.25x apart: at most four of them per output span 3000..5000 rows.
    largest = 5000 * 128 * 4 + 5000 * recxla.row_bytes(128, "e4m3")
    assert warm <= 4 * largest, warm


# ---------------------------------------------------------------- streaming stores


@pytest.mark.parametrize("fmt", FP8)
def test_large_outputs_streamed_match_the_blockwise_result(fmt):
    """Outputs of 16 MiB or more are written with non-temporal stores (when rows are whole cache
    lines); they must equal the same rows decoded a block at a time with ordinary stores, which
    the other tests check against the reference."""
    rows, dim = 65536, 128
    packed = torch.randint(0, 256, (rows, dim + 4), dtype=torch.uint8)  # NaN/Inf codes too
    packed[:, dim:] = (torch.rand(rows, 1) * 10).view(torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):  # 32 and 16 MiB: both streamed
        y = recxla.dequantize_rows(packed, dim, fmt, dtype)
        blocks = torch.cat([recxla.dequantize_rows(p, dim, fmt, dtype)
                            for p in packed.split(2048)])
        assert torch.equal(bits(y), bits(blocks))  # one kernel: NaN bits agree too
        assert_same_values(y[:64], dequantize_rows_ref(packed[:64], dim, fmt, dtype))
