"""Reference runs (see recxla.ops.copy_runs for the contract): each run in order, a row at a
time, with torch slicing of the flat tensors. The oracle of tests/test_copy_runs.py."""

from typing import Sequence

import torch

from recxla.ops.copy_runs import RUN_FIELDS, Run


def copy_runs_ref(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                  runs: Sequence[int]) -> None:
    """Same arguments and effect as `recxla.ops.copy_runs.copy_runs` (valid runs only)."""
    flat_targets = [t.view(-1) for t in targets]
    flat_sources = [s.reshape(-1) for s in sources]
    for r in range(len(runs) // RUN_FIELDS):
        run = Run(*runs[r * RUN_FIELDS:(r + 1) * RUN_FIELDS])
        for i in range(run.rows):
            first = run.source_offset + i * run.source_stride
            values = flat_sources[run.source][first:first + run.width]
            at = run.target_offset + i * run.target_stride
            window = flat_targets[run.target][at:at + run.width]
            if run.add:
                # Summed in float32 and rounded once, as the kernels do.
                window.copy_((window.float() + values.float()).to(window.dtype))
            else:
                window.copy_(values)
