"""Runs with Triton (recxla.ops.copy_runs's GPU path when RECXLA_BACKEND=triton).

One launch per wave and (source, target) pair: a program walks BLOCK elements of one run (the
second grid axis picks the run), so a launch moves every run of its pair in that wave. Waves
keep the runs' order where it matters, as the CUDA kernel's do: copies (disjoint) first, then
each target's k-th add run in wave k. Its runs are checked as the C++ kernels check them
(recxla.ops.copy_runs.check_runs, before the call).
"""

from typing import Dict, List, Tuple

import torch
import triton
import triton.language as tl

from recxla.copy_runs_layout import RUN_FIELDS, Run

BLOCK = 1024
MAX_BLOCKS_PER_RUN = 1024
MAX_RUNS_PER_LAUNCH = 65535  # the grid's second axis


@triton.jit
def _copy_runs_kernel(source_ptr, target_ptr, runs_ptr, FIELDS: tl.constexpr,
                      IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    fields = runs_ptr + tl.program_id(1) * FIELDS
    source_offset = tl.load(fields + 1)
    source_stride = tl.load(fields + 2)
    target_offset = tl.load(fields + 4)
    target_stride = tl.load(fields + 5)
    rows = tl.load(fields + 6)
    width = tl.load(fields + 7)
    add = tl.load(fields + 8)
    total = rows * width
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for first in range(start, total, step):
        e = first + tl.arange(0, BLOCK).to(tl.int64)
        inside = e < total
        row = e // tl.maximum(width, 1)
        col = e - row * width
        value = tl.load(source_ptr + source_offset + row * source_stride + col, mask=inside)
        at = target_ptr + target_offset + row * target_stride + col
        if add != 0:
            old = tl.load(at, mask=inside)
            total_f32 = old.to(tl.float32) + value.to(tl.float32)
            if IS_BF16:
                value = _round_to_bf16(total_f32)
            else:
                value = total_f32.to(old.dtype)
        tl.store(at, value, mask=inside)


@triton.jit
def _round_to_bf16(x):
    """float32 -> bfloat16 rounded to nearest even with integer operations, NaN -> 0x7FC0, as
    c10 rounds (the interpreter's cast truncates; fp8_rows.py does the same)."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    h = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded).to(tl.uint16)
    return h.to(tl.bfloat16, bitcast=True)


def copy_runs_triton(sources: List[torch.Tensor], targets: List[torch.Tensor],
                     read: List[Run]) -> None:
    """recxla.ops.copy_runs.copy_runs with Triton kernels; `read`: the checked runs
    (recxla.ops.copy_runs.check_runs)."""
    adds_into = [0] * len(targets)
    launches: Dict[Tuple[int, int, int], List[Run]] = {}
    for run in read:
        wave = 0
        if run.add:
            adds_into[run.target] += 1
            wave = adds_into[run.target]
        if run.rows * run.width:
            launches.setdefault((wave, run.source, run.target), []).append(run)
    device = targets[0].device
    for (_, source, target), group in sorted(launches.items(), key=lambda item: item[0][0]):
        for first in range(0, len(group), MAX_RUNS_PER_LAUNCH):
            part = group[first:first + MAX_RUNS_PER_LAUNCH]
            table = torch.tensor([f for run in part for f in run], dtype=torch.int64).to(device)
            most = max(run.rows * run.width for run in part)
            grid = (min(triton.cdiv(most, BLOCK), MAX_BLOCKS_PER_RUN), len(part))
            _copy_runs_kernel[grid](sources[source], targets[target], table, FIELDS=RUN_FIELDS,
                                    IS_BF16=targets[0].dtype == torch.bfloat16, BLOCK=BLOCK)
