"""recxla::copy_runs (recxla.ops.copy_runs): the C++ kernel, the Triton kernels (interpreted on
CPU) and, on a GPU, the CUDA kernel against the plain-PyTorch reference on fresh random runs:
column runs that tile a target, add runs on top (the row-sharded sums), contiguous blocks; the
errors that name the op, the run and the limit; PackRuns' gradient against torch.cat's."""

import random

import pytest
import torch

import recxla
from recxla import _extension
from recxla.ops.copy_runs import (ColumnRange, JoinColumns, PackRuns, Run, check_runs,
                                   copy_runs, pack, row_span, rows_in_place)
from recxla.reference.copy_runs import copy_runs_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_case(dtype, device="cpu", adds=True):
    """(sources, target shapes, runs): a [rows, width] target whose columns are tiled by copy
    runs in a random order, each from a random source at a random offset and stride (0
    included: one row read for every row), then add runs over random column ranges."""
    rows, width = random.randint(0, 9), random.randint(1, 40)
    sources = [torch.randn(random.randint(1, 400), dtype=torch.float32).to(dtype).to(device)
               for _ in range(random.randint(1, 3))]
    cuts = sorted(random.sample(range(1, width), random.randint(0, min(5, width - 1))))
    ranges = list(zip([0] + cuts, cuts + [width]))
    random.shuffle(ranges)
    runs = []

    def run_from_some_source(lo, hi, add):
        span = hi - lo
        fits = [s for s, t in enumerate(sources) if t.numel() >= span]
        if not fits:
            sources.append(torch.randn(span + rows * span + 1).to(dtype).to(device))
            fits = [len(sources) - 1]
        s = random.choice(fits)
        numel = sources[s].numel()
        stride = random.randint(0, (numel - span) // max(rows - 1, 1)) if rows > 1 else 0
        last = (rows - 1) * stride + span if rows else span
        offset = random.randint(0, numel - last)
        runs.append(Run(s, offset, stride, 0, lo, width, rows, span, int(add)))

    for lo, hi in ranges:
        run_from_some_source(lo, hi, False)
    for _ in range(random.randint(0, 3) if adds else 0):
        lo = random.randint(0, width - 1)
        run_from_some_source(lo, random.randint(lo + 1, width), True)
    return sources, (rows, width), pack(runs)


def run_both(sources, shape, runs, copy):
    got = torch.full(shape, float("nan"), dtype=sources[0].dtype, device=sources[0].device)
    want = torch.full(shape, float("nan"), dtype=sources[0].dtype)
    copy(sources, [got], runs)
    copy_runs_ref([s.cpu() for s in sources], [want], runs)
    return got.cpu(), want


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_equals_reference(dtype):
    for _ in range(40):
        got, want = run_both(*random_case(dtype), copy_runs)
        assert torch.equal(got, want)
    # One large run, split over threads.
    source = torch.randn(300_000).to(dtype)
    target = torch.empty(1000, 290, dtype=dtype)
    copy_runs([source], [target], pack([Run(0, 7, 299, 0, 0, 290, 1000, 290)]))
    assert torch.equal(target, source[7:7 + 1000 * 299].view(1000, 299)[:, :290])


def test_several_targets_and_empty_runs():
    a, b = torch.randn(50), torch.randn(30)
    got = [torch.zeros(20), torch.zeros(4, 5)]
    want = [torch.zeros(20), torch.zeros(4, 5)]
    runs = pack([Run(0, 3, 0, 1, 0, 5, 4, 5), Run(1, 0, 0, 0, 2, 0, 1, 18),
                 Run(1, 0, 0, 0, 0, 0, 0, 7), Run(0, 0, 0, 1, 0, 5, 3, 0, 1)])
    copy_runs([a, b], got, runs)
    copy_runs_ref([a, b], want, runs)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    copy_runs([a], [torch.zeros(1)], [])  # no runs: nothing to check, nothing written


def bad_calls():
    s, t = torch.randn(10), torch.zeros(3, 4)
    return [
        ([s], [t], [0] * 8, ValueError, r"runs must hold 9 ints per run, got 8 ints"),
        ([s], [t], pack([Run(1, 0, 0, 0, 0, 4, 1, 2)]), ValueError,
         r"run 0 reads sources\[1\] of 1"),
        ([s], [t], pack([Run(0, 0, 0, 0, 0, 4, 1, 2), Run(0, 0, 0, 2, 0, 4, 1, 2)]),
         ValueError, r"run 1 writes targets\[2\] of 1"),
        ([s], [t], pack([Run(0, -1, 0, 0, 0, 4, 1, 2)]), ValueError,
         r"run 0 has a negative offset"),
        ([s], [t], pack([Run(0, 0, 0, 0, 0, 4, 1, 2, 2)]), ValueError,
         r"run 0's add must be 0 or 1, got 2"),
        ([s], [t], pack([Run(0, 0, 0, 0, 0, 1, 3, 2)]), ValueError,
         r"run 0 writes rows of 2 elements 1 apart: its rows overlap"),
        ([s], [t], pack([Run(0, 4, 3, 0, 0, 4, 3, 2)]), ValueError,
         r"run 0 reads up to element 12 of sources\[0\], which has 10"),
        ([s], [t], pack([Run(0, 0, 0, 0, 9, 4, 1, 4)]), ValueError,
         r"run 0 writes up to element 13 of targets\[0\], which has 12"),
        ([s.double()], [t], pack([Run(0, 0, 0, 0, 0, 4, 1, 2)]), TypeError,
         r"sources\[0\] must be Float like targets\[0\], got Double"),
        ([s], [t.t()], pack([Run(0, 0, 0, 0, 0, 4, 1, 2)]), ValueError,
         r"targets\[0\] must be contiguous"),
        ([s], [s[2:5]], pack([Run(0, 0, 0, 0, 0, 1, 1, 1)]), ValueError,
         r"targets\[0\] shares memory with sources\[0\]"),
        ([s.long()], [t.long()], pack([Run(0, 0, 0, 0, 0, 4, 1, 2)]), TypeError,
         r"the tensors must be float32, bfloat16 or float16, got Long"),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls())))
def test_errors_name_the_op_the_run_and_the_limit(case):
    sources, targets, runs, exc, match = bad_calls()[case]
    before = [t.clone() for t in targets]
    with pytest.raises(exc, match="recxla::copy_runs: " + match):
        copy_runs(sources, targets, runs)
    assert all(torch.equal(b, t) for b, t in zip(before, targets))  # nothing written
    # The Triton path's own checks (in Python) raise the same.
    python_match = match.replace("Float", "torch.float32").replace("Double", "torch.float64") \
        .replace("Long", "torch.int64")
    with pytest.raises(exc, match="recxla::copy_runs: " + python_match):
        check_runs(sources, targets, runs)


def test_pack_runs_gradient_equals_cat():
    """PackRuns as the owner's send message: blocks of a pooled tensor and of row tensors, one
    after another; its backward is torch.cat's."""
    pooled = torch.randn(6, 4, requires_grad=True)
    rows = torch.randn(5, 2, requires_grad=True)
    pieces = [pooled[0:2].reshape(-1), rows[1:4].reshape(-1), pooled[2:6].reshape(-1)]
    want = torch.cat(pieces)
    runs = [Run(0, 0, 0, 0, 0, 0, 1, 8), Run(1, 2, 0, 0, 8, 0, 1, 6), Run(0, 8, 0, 0, 14, 0, 1, 16)]
    got = PackRuns.apply(runs, want.numel(), pooled, rows)
    assert torch.equal(got, want)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [pooled, rows], grad)
    got_grads = torch.autograd.grad(got, [pooled, rows], grad)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    # A source without a gradient gets none, and the others theirs.
    frozen = rows.detach()
    got = PackRuns.apply(runs, want.numel(), pooled, frozen)
    (only,) = torch.autograd.grad(got, [pooled], grad)
    assert torch.equal(only, want_grads[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_join_columns_equals_cat_and_index_select_both_ways(seed, dtype):
    """JoinColumns against torch.cat + index_select over columns (the merge it replaces), bit
    for bit both ways: the parts' column blocks in a random order, the gradient contiguous or
    a column range of a wider tensor (read where it lies), a part without a gradient."""
    batch = random.randint(0, 7)
    widths = [random.randint(0, 12) for _ in range(random.randint(1, 3))]  # 0: no columns
    parts = [torch.randn(batch, w).to(dtype).requires_grad_() for w in widths]
    blocks = []
    for p, w in enumerate(widths):
        cuts = sorted(random.sample(range(1, w), random.randint(0, min(3, w - 1)))) if w > 1 \
            else []
        blocks += [(p, lo, hi - lo) for lo, hi in zip([0] + cuts, cuts + [w])]
    random.shuffle(blocks)
    ranges, column, index = [], 0, []
    offsets = [sum(widths[:p]) for p in range(len(widths))]
    for p, lo, count in blocks:
        ranges.append(ColumnRange(p, lo, column, count))
        index.extend(range(offsets[p] + lo, offsets[p] + lo + count))
        column += count
    want = torch.cat(parts, dim=1).index_select(1, torch.tensor(index, dtype=torch.int64))
    got = JoinColumns.apply(ranges, column, *parts)
    assert torch.equal(got, want) and got.is_contiguous()
    wide = torch.randn(batch, column + random.randint(1, 5)).to(dtype)
    left = random.randint(0, wide.shape[1] - column)
    for grad in (torch.randn(batch, column).to(dtype), wide[:, left:left + column]):
        want_grads = torch.autograd.grad(want, parts, grad, retain_graph=True)
        got_grads = torch.autograd.grad(got, parts, grad, retain_graph=True)
        assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    frozen = [parts[0].detach()] + parts[1:]
    got = JoinColumns.apply(ranges, column, *frozen)
    if len(parts) > 1:
        grad = torch.randn(batch, column).to(dtype)
        assert all(torch.equal(g, w) for g, w in zip(
            torch.autograd.grad(got, parts[1:], grad),
            torch.autograd.grad(want, parts[1:], grad)))


def test_rows_in_place_copies_only_what_row_span_cannot_read(seed):
    rows, width = random.randint(2, 6), random.randint(1, 8)
    wide = torch.randn(rows, width + random.randint(1, 4))
    block = wide[:, :width]
    assert rows_in_place(block) is block
    span, stride = row_span(block)
    assert stride == wide.shape[1] and span.data_ptr() == block.data_ptr()
    assert torch.equal(span.as_strided((rows, width), (stride, 1)), block)
    for apart in (torch.randn(width, rows).t(), torch.randn(1, width).expand(rows, width)):
        copied = rows_in_place(apart)
        assert copied.is_contiguous() and torch.equal(copied, apart)
    # Rows of nothing (a part with no columns) and no rows: nothing to read.
    for empty in (torch.empty(rows, 0), torch.empty(0, width)):
        span, _ = row_span(rows_in_place(empty))
        assert span.numel() == 0


def test_opcheck():
    sources, shape, runs = random_case(torch.float32)
    target = torch.zeros(shape)
    torch.library.opcheck(torch.ops.recxla.copy_runs.default, (sources, [target], runs))


@pytest.fixture
def interpreted_triton():
    """recxla.triton_kernels.copy_runs with its kernels built for the Triton interpreter."""
    pytest.importorskip("triton")
    from recxla.triton_kernels import interpreted

    return interpreted("copy_runs")


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_interpreted_equals_reference(interpreted_triton, dtype):
    for _ in range(8):
        got, want = run_both(*random_case(dtype), lambda s, t, runs: interpreted_triton
                             .copy_runs_triton(s, t, check_runs(s, t, runs)))
        assert torch.equal(got, want)


def test_triton_path_dispatch(interpreted_triton, monkeypatch):
    """The op's Triton path checks the runs first, then runs the kernels."""
    import sys

    monkeypatch.setattr(_extension, "backend_for", lambda t, op: "triton")
    monkeypatch.setitem(sys.modules, "recxla.triton_kernels.copy_runs", interpreted_triton)
    got, want = run_both(*random_case(torch.float32), copy_runs)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"recxla::copy_runs: run 0 reads sources\[1\] of 1"):
        copy_runs([torch.zeros(3)], [torch.zeros(3)], pack([Run(1, 0, 0, 0, 0, 0, 1, 1)]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_equals_reference(monkeypatch, backend, dtype):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    for _ in range(30):
        got, want = run_both(*random_case(dtype, "cuda"), copy_runs)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"recxla::copy_runs: run 0 reads up to element 12"):
        copy_runs([torch.zeros(10, device="cuda")], [torch.zeros(12, device="cuda")],
                  pack([Run(0, 4, 3, 0, 0, 4, 3, 2)]))
