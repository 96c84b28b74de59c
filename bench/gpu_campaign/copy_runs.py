"""Campaign stage: the layout moves of a sharded module's messages (`recxla::copy_runs`).

The group times the receiver's column move of the trainer's message at a GPU's batch: 26
column ranges of [8192, 128] float32 from 4 owner blocks into the [8192, 3328] output (bench/
bench_copy_runs.py's layout, scaled), rotated over input sets past the L2 cache. Providers:
recxla's CUDA kernel ("cuda"; one launch: copies are one wave), the Triton path ("triton"; a
launch per wave and tensor pair), the torch ops it replaced (slices and one torch.cat) and a
device copy of the output's bytes. The op has no kernel variants, so no choice.

Check (before any timing): each provider against recxla.reference.copy_runs on fresh random
runs: column ranges in a random order from several sources (strides 0 included), add runs on
top (the row-sharded sums: a second wave), an empty run, bfloat16 as well; bit for bit.

Predictions, written before any GPU run (H100 SXM; not measurements): the move reads 109 MB and
writes 109 MB at batch 8192, about 75-90 us at the copy's ~2.5-3 TB/s; the CUDA kernel's
256-thread blocks stride a run's rows of 128 values, so it should reach 0.8-0.9x the copy;
torch.cat of 26 strided slices is one kernel too (its batched cat), about the same; at the
trainer's 1-2 MB messages all of them are launch-bound (~5-10 us).
"""

import random
import time
from typing import Callable, List

import torch

from bench.bench_copy_runs import DIM, TABLES, layout, torch_cat
from bench.gpu_campaign.timing import (
    DEVICE_COPY, Guard, backend, copy_fn, failed_row, rotation_count, row, time_calls,
)
from recxla.ops.copy_runs import Run, check_runs, copy_runs, pack
from recxla.reference.copy_runs import copy_runs_ref

GROUP = "copy_runs column move"


def check_cases(dry_run: bool):
    """(name, sources, target shape, packed runs) on CPU, fresh random runs every call."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        rows, width = random.randint(1, 40), random.randint(20, 300)
        sources = [torch.randn(random.randint(width * rows + 1, 4 * width * rows + 10))
                   .to(dtype) for _ in range(2)]
        cuts = sorted(random.sample(range(1, width), 6))
        ranges = list(zip([0] + cuts, cuts + [width]))
        random.shuffle(ranges)
        runs = []
        for lo, hi in ranges:
            s = random.randrange(2)
            stride = random.choice([0, hi - lo, width])
            offset = random.randint(0, sources[s].numel() - (rows - 1) * stride - (hi - lo))
            runs.append(Run(s, offset, stride, 0, lo, width, rows, hi - lo))
        runs.append(Run(1, 0, 0, 0, 0, width, rows, 5, 1))  # an add over the first columns
        runs.append(Run(0, 0, 0, 0, 0, width, 0, 7))  # empty
        cases.append((f"random runs {dtype}", sources, (rows, width), pack(runs)))
    batch = 64 if dry_run else 1024
    offsets, widths, runs = layout(batch, DIM)
    flat = torch.randn(sum(batch * w for w in widths))
    cases.append((f"column move batch {batch}", [flat], (batch, TABLES * DIM), pack(runs)))
    return cases


def check(call: Callable, device: str) -> str:
    """"exact" when call(sources, targets, runs) equals the reference on every case."""
    for name, sources, shape, runs in check_cases(device == "cpu"):
        want = torch.zeros(shape, dtype=sources[0].dtype)
        copy_runs_ref(sources, [want], runs)
        got = torch.zeros(shape, dtype=sources[0].dtype, device=device)
        call([s.to(device) for s in sources], [got], runs)
        if not torch.equal(got.cpu(), want):
            where = int(torch.nonzero((got.cpu() != want).flatten())[0])
            return f"FAILED: {name}: element {where} differs from the reference"
    return "exact"


def _calls(device: str):
    """name -> (call(sources, targets, runs), context): recxla's CUDA path (in the dry run the
    C++ CPU op stands in) and its Triton path (interpreted on CPU in the dry run)."""
    if device == "cpu":
        from recxla.triton_kernels.copy_runs import copy_runs_triton

        def triton(sources, targets, runs):
            copy_runs_triton(sources, targets, check_runs(sources, targets, runs))

        return {"cuda": (copy_runs, lambda: backend(None)),
                "triton": (triton, lambda: backend(None))}
    return {"cuda": (copy_runs, lambda: backend("cuda")),
            "triton": (copy_runs, lambda: backend("triton"))}


def run(device: str, dry_run: bool) -> dict:
    began = time.monotonic()
    random.seed(int(torch.randint(1, 2**30, ())))
    timing = {"iters": 3, "warmup": 1} if dry_run else {"iters": 60, "warmup": 5}
    guard = Guard(device)
    batch = 64 if dry_run else 8192
    dim = DIM if dry_run else 2 * DIM
    offsets, widths, runs = layout(batch, dim)
    packed = pack(runs)
    out_bytes = batch * TABLES * dim * 4
    count = 2 if dry_run else rotation_count(2 * out_bytes)
    sets = [(torch.randn(sum(batch * w for w in widths), device=device),
             torch.empty(batch, TABLES * dim, device=device)) for _ in range(count)]
    group = f"{GROUP}, batch {batch} x {TABLES} tables x dim {dim}"
    rows: List[dict] = []
    copy, pairs = copy_fn(out_bytes, device, sets=count)
    copied, error = guard(DEVICE_COPY, lambda: time_calls(copy, pairs, timing["warmup"],
                                                          timing["iters"], device))
    copy_us = None if error else copied["median_us"]
    rows.append(failed_row(group, DEVICE_COPY, error) if error else
                row(group, DEVICE_COPY, copied, 2 * out_bytes, copy_us, check="baseline"))
    providers = {name: (lambda flat, out, call=call: call([flat], [out], packed), context,
                        lambda call=call: check(call, device))
                 for name, (call, context) in _calls(device).items()}

    def cat(flat, out):
        return torch_cat(flat, offsets, widths, runs, batch)

    def cat_check():
        flat, out = sets[0]
        copy_runs([flat], [out], packed)
        return "exact" if torch.equal(cat(flat, out), out) else \
            "FAILED: torch.cat's output differs from copy_runs'"

    providers["torch.cat"] = (cat, lambda: backend(None), cat_check)
    for name, (fn, context, checker) in providers.items():
        def checked(context=context, checker=checker):
            with context():
                return checker()

        verdict, error = guard(name, checked)
        verdict = error or verdict
        if verdict.startswith("FAILED"):
            rows.append(failed_row(group, name, verdict))
            continue

        def timed(fn=fn, context=context):
            with context():
                return time_calls(fn, sets, timing["warmup"], timing["iters"], device)

        result, error = guard(name, timed)
        rows.append(failed_row(group, name, error) if error else
                    row(group, name, result, 2 * out_bytes, copy_us, check=verdict,
                        runs=len(runs)))
    if device.startswith("cuda") and not guard.poisoned:
        torch.cuda.empty_cache()
    print(f"{GROUP}: {time.monotonic() - began:.1f} s")
    return {"rows": rows, "choices": []}
