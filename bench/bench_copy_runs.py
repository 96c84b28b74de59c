"""pytest-benchmark: the receiver's column move (recxla.ops.copy_runs) on the message a rank gets
in the trainer's default 4-rank job.

    .venv/bin/python -m pytest bench/bench_copy_runs.py --benchmark-only \\
        --benchmark-columns=min,median,mean,rounds

The move: rank 0 of 4, batch 1024, 26 one-feature tables of dim 64 dealt table-wise over the
ranks, with TorchRec's output order (table by table) and each owner's block (its tables in
turn): 26 column ranges of [1024, 64] from 4 blocks into the [1024, 1664] output, float32.
Providers, all writing the same output (checked once against the reference, not timed):
- recxla: one `recxla::copy_runs` (PooledAssembly's forward pass);
- torch: the column ranges sliced and joined by one torch.cat (how the output dist assembled
  before the op: a slice per range, then the cat);
- torch-compile: that function under torch.compile (Inductor);
- memcpy: a copy of the output's bytes into an existing tensor (each value read and written
  once, as the move must).
On one thread and on all of the machine's: the op's rows are split over threads when large.
"""

import pytest
import torch

from bench.common import run_and_record
from recxla.ops.copy_runs import Run, copy_runs, pack
from recxla.reference.copy_runs import copy_runs_ref

WORLD, BATCH, TABLES, DIM = 4, 1024, 26, 64


def layout(batch: int = BATCH, dim: int = DIM):
    """(block offsets, widths, column runs into the output [batch, TABLES * dim]): WORLD owner
    blocks, each its tables in turn, the tables dealt table-wise (rank 0's message)."""
    owned = [[t for t in range(TABLES) if t % WORLD == r] for r in range(WORLD)]
    widths = [len(tables) * dim for tables in owned]
    offsets = [sum(batch * w for w in widths[:r]) for r in range(WORLD)]
    runs = [Run(0, offsets[r] + j * dim, widths[r], 0, t * dim, TABLES * dim, batch, dim)
            for r, tables in enumerate(owned) for j, t in enumerate(tables)]
    return offsets, widths, runs


def torch_cat(flat, offsets, widths, runs, batch: int = BATCH):
    """The same move in torch ops: the blocks viewed [batch, width], a slice per range, one
    cat in the output's column order."""
    blocks = [flat[o: o + batch * w].view(batch, w) for o, w in zip(offsets, widths)]
    pieces = []
    for run in sorted(runs, key=lambda r: r.target_offset):
        r = max(b for b, o in enumerate(offsets) if o <= run.source_offset)
        column = run.source_offset - offsets[r]
        pieces.append(blocks[r][:, column: column + run.width])
    return torch.cat(pieces, dim=1)


PROVIDERS = ["recxla", "torch", "torch-compile", "memcpy"]


@pytest.mark.parametrize("threads", ["1", "all"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_column_move(benchmark, provider, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads == "1" else before)
    try:
        offsets, widths, runs = layout()
        flat = torch.randn(sum(BATCH * w for w in widths),
                           generator=torch.Generator().manual_seed(0))
        out = torch.empty(BATCH, TABLES * DIM)
        packed = pack(runs)
        want = torch.empty(BATCH, TABLES * DIM)
        copy_runs_ref([flat], [want], packed)
        if provider == "recxla":
            def fn():
                copy_runs([flat], [out], packed)
                return out
        elif provider == "memcpy":
            source = want.clone()
            fn = lambda: out.copy_(source)  # noqa: E731
        else:
            move = torch_cat if provider == "torch" else torch.compile(torch_cat, dynamic=False)
            fn = lambda: move(flat, offsets, widths, runs)  # noqa: E731
        assert torch.equal(fn(), want)
        benchmark.group = (f"column move, rank 0 of {WORLD}: {TABLES} tables x dim {DIM}, "
                           f"batch {BATCH}, {threads} thread(s)")
        nbytes = 2 * out.numel() * out.element_size()
        run_and_record(benchmark, fn, nbytes=nbytes, memcpy_nbytes=nbytes // 2,
                       provider=provider, runs=len(runs))
    finally:
        torch.set_num_threads(before)
