"""Runs: batched strided copies between flat buffers, one op for a whole layout move.

A sharded module's messages are laid out piece by piece: the owner's send message is its pooled
rows for each source rank followed by each row group's rows for it; the gradient message comes
back in the same layout and is unpacked into the per-table gradient buffers; the receiver moves
the pooled blocks' column ranges into TorchRec's output columns (adding the parts of row-sharded
tables) and, backward, the output gradient's columns back into the blocks. Done with torch ops,
each piece is a slice, a view and a copy or a cat (about 250 ATen calls a step on the trainer's
defaults, and on a GPU each copy is a kernel launch). As runs each move is one call:
`recxla::copy_runs` (C++ on CPU, one CUDA launch per wave, Triton with RECXLA_BACKEND=triton).
Two differentiable layouts are built on it here: `PackRuns` (pieces into one flat message) and
`JoinColumns` (column ranges of [B, C] tensors into one, as the data-parallel tables' merge
joins them; its backward reads the gradient where it lies, `row_span`).

A `Run` moves `rows` rows of `width` elements from sources[source] (row i at
source_offset + i * source_stride) to targets[target] (row i at target_offset + i *
target_stride), or adds them there with `add`; offsets and strides count elements of the flat,
contiguous tensors. Runs apply in order: an add run adds to what the runs before it wrote. Copy
runs must write disjoint elements (the GPU kernels run them side by side), and no target may
share memory with a source. Every run is checked against its tensors before anything is
written: a bad one raises a ValueError naming the run and the limit.

The plain-PyTorch reference, the tests' oracle: recxla/reference/copy_runs.py.
"""

from typing import List, NamedTuple, Sequence, Tuple

import torch

from recxla import _extension
from recxla.copy_runs_layout import RUN_FIELDS, Run, pack  # noqa: F401  (the op's contract)

OP = "recxla.copy_runs"


def check_runs(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
               runs: Sequence[int]) -> List[Run]:
    """The C++ kernels' checks (csrc/include/recxla/copy_runs_checks.h), for the Triton path:
    -> the runs, read. Raises what the C++ kernels raise."""
    op = "recxla::copy_runs"
    if len(runs) % RUN_FIELDS:
        raise ValueError(f"{op}: runs must hold {RUN_FIELDS} ints per run, got {len(runs)} ints")
    read = [Run(*runs[i:i + RUN_FIELDS]) for i in range(0, len(runs), RUN_FIELDS)]
    if not read:
        return read
    if not targets:
        raise ValueError(f"{op}: runs need at least one target")
    first = targets[0]
    if first.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: the tensors must be float32, bfloat16 or float16, got "
                        f"{first.dtype}")
    for name, tensors in (("sources", sources), ("targets", targets)):
        for i, t in enumerate(tensors):
            if t.dtype != first.dtype:
                raise TypeError(f"{op}: {name}[{i}] must be {first.dtype} like targets[0], got "
                                f"{t.dtype}")
            if t.device != first.device:
                raise ValueError(f"{op}: {name}[{i}] must be on {first.device} like "
                                 f"targets[0], got {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] must be contiguous")
    for i, t in enumerate(targets):
        for s, source in enumerate(sources):
            if _spans_overlap(t, source):
                raise ValueError(f"{op}: targets[{i}] shares memory with sources[{s}]")
    for r, run in enumerate(read):
        if not (0 <= run.source < len(sources)):
            raise ValueError(f"{op}: run {r} reads sources[{run.source}] of {len(sources)}")
        if not (0 <= run.target < len(targets)):
            raise ValueError(f"{op}: run {r} writes targets[{run.target}] of {len(targets)}")
        if min(run.rows, run.width, run.source_offset, run.source_stride, run.target_offset,
               run.target_stride) < 0:
            raise ValueError(f"{op}: run {r} has a negative offset, stride, row count or width")
        if run.add not in (0, 1):
            raise ValueError(f"{op}: run {r}'s add must be 0 or 1, got {run.add}")
        if run.rows > 1 and run.target_stride < run.width:
            raise ValueError(f"{op}: run {r} writes rows of {run.width} elements "
                             f"{run.target_stride} apart: its rows overlap")
        empty = run.rows * run.width == 0
        source_end = 0 if empty else \
            run.source_offset + (run.rows - 1) * run.source_stride + run.width
        target_end = 0 if empty else \
            run.target_offset + (run.rows - 1) * run.target_stride + run.width
        if source_end > sources[run.source].numel():
            raise ValueError(f"{op}: run {r} reads up to element {source_end} of "
                             f"sources[{run.source}], which has {sources[run.source].numel()}")
        if target_end > targets[run.target].numel():
            raise ValueError(f"{op}: run {r} writes up to element {target_end} of "
                             f"targets[{run.target}], which has {targets[run.target].numel()}")
    return read


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The byte ranges of two contiguous tensors intersect (recxla/checks.h spans_overlap)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


@_extension.register_fake("recxla::copy_runs")
def _copy_runs_fake(sources, targets, runs):
    return None


def copy_runs(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
              runs: Sequence[int]) -> None:
    """Applies `runs` (pack's ints) from `sources` to `targets` in place (module docstring).
    The tensors: contiguous float32, bfloat16 or float16, one dtype and device."""
    if not runs:
        return
    if not targets:
        raise ValueError(f"{OP}: runs need at least one target")
    backend = _extension.backend_for(targets[0], OP)
    if backend == "triton":
        from recxla.triton_kernels.copy_runs import copy_runs_triton

        # The Triton kernels trust their runs: checked here as the C++ kernels check them.
        copy_runs_triton(list(sources), list(targets), check_runs(sources, targets, runs))
        return
    torch.ops.recxla.copy_runs(list(sources), list(targets), list(runs))


class PackRuns(torch.autograd.Function):
    """PackRuns.apply(runs, total, *sources): a new flat tensor of `total` elements that `runs`
    (Run tuples into target 0) write from `sources`, every element of it; differentiable
    w.r.t. the sources. The backward moves the gradient back along the transposed runs, which
    is each source's whole gradient when every source element is read by one run at most
    (elements no run reads get zero)."""

    @staticmethod
    def forward(ctx, runs: List[Run], total: int, *sources):
        out = sources[0].new_empty((total,))
        copy_runs(sources, [out], pack(runs))
        ctx.runs = runs
        ctx.shapes = [s.shape for s in sources]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [grad.new_zeros(shape) if needed else None
                 for shape, needed in zip(ctx.shapes, ctx.needs_input_grad[2:])]
        # Transposed, the runs read the gradient (source 0) and write the sources' gradients,
        # numbered as the sources were; sources without one get an empty placeholder.
        back = [r.transposed() for r in ctx.runs if grads[r.source] is not None]
        if back:
            targets = [g if g is not None else grad.new_empty((0,)) for g in grads]
            copy_runs([grad.contiguous()], targets, pack(back))
        return (None, None, *grads)


def row_span(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """t [B, C] with adjacent columns -> (the contiguous 1-D span of memory its rows lie in,
    starting at its first element, as copy_runs takes a source; the rows' stride in it)."""
    batch, width = t.shape
    stride = t.stride(0) if batch > 1 else width
    if t.numel() == 0:  # no rows, or rows of nothing: no memory to read (maybe none at all)
        return t.new_empty((0,)), stride
    return t.as_strided(((batch - 1) * stride + width,), (1,)), stride


def rows_in_place(t: torch.Tensor) -> torch.Tensor:
    """t [B, C] as row_span can read it: t itself when its columns are adjacent and its rows
    do not overlap (a column range of a wider tensor, say), else a contiguous copy."""
    if t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        return t.contiguous()
    return t


class ColumnRange(NamedTuple):
    """`count` columns of parts[part], from column `part_column` on, are the joined tensor's
    columns from `column` on (JoinColumns)."""

    part: int
    part_column: int
    column: int
    count: int


class JoinColumns(torch.autograd.Function):
    """JoinColumns.apply(ranges, width, *parts): parts [B, C_p] (contiguous, one dtype and
    device) -> [B, width] whose columns are the parts' column ranges as `ranges` place them
    (every column of the result and of each part in exactly one range): one copy_runs forward,
    and one backward that reads the gradient where it lies (any row stride, rows_in_place)
    into each part's gradient. Where a cat and a column index_select would each move the
    whole tensor, and the index_select's backward would zero it and scatter into it."""

    @staticmethod
    def forward(ctx, ranges: Sequence[ColumnRange], width: int, *parts):
        batch = parts[0].shape[0]
        out = parts[0].new_empty((batch, width))
        widths = [p.shape[1] for p in parts]
        copy_runs([p.reshape(-1) for p in parts], [out.view(-1)],
                  pack(Run(r.part, r.part_column, widths[r.part], 0, r.column, width, batch,
                           r.count) for r in ranges if r.count))
        ctx.ranges, ctx.widths = list(ranges), widths
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = rows_in_place(grad)
        span, stride = row_span(grad)
        batch = grad.shape[0]
        needed = ctx.needs_input_grad[2:]
        # Every column of every part is in one range: its gradient is written whole.
        grads = [grad.new_empty((batch, w)) if n else None for w, n in zip(ctx.widths, needed)]
        back = [Run(0, r.column, stride, r.part, r.part_column, ctx.widths[r.part], batch,
                    r.count) for r in ctx.ranges if r.count and grads[r.part] is not None]
        if back:
            copy_runs([span], [g.view(-1) if g is not None else grad.new_empty((0,))
                               for g in grads], pack(back))
        return (None, None, *grads)
