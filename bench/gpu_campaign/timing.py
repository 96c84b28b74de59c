"""Timing and result rows for the GPU campaign's kernel stages.

A GPU kernel is timed with CUDA events around each call (device time, not host time), after
warm-up calls that are left out (module load, Triton compilation, allocator growth), as the
median of many calls. Calls rotate over several input sets whose total exceeds the L2 cache, so
a kernel that reads its input does not find it in the cache from the previous call. The event
pair around one call also spans the host's launch of it: where a call lasts about as long as
its launch (the trainer's 1-2 MB messages), the same calls are also timed back to back, the
host enqueueing them all between one pair of events, so that the device runs them one after
another and their mean is the kernel's own time. On CPU (the campaign's dry run) the same
functions time with the host clock, so the code path is the one that runs on the GPU.

Every timing becomes one row (`row`): group, provider, median and minimum in microseconds, the
back-to-back mean, bytes moved, GB/s and the ratio to a device copy of the same bytes, and the
outcome of the check against the reference that preceded it.
"""

import contextlib
import os
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

# The provider name of every group's baseline row: a device copy of the bytes the group's
# providers read and write.
DEVICE_COPY = "device copy"

# Inputs rotate until they span this many bytes: above the H100's 50 MB and the H200's 60 MB of L2.
ROTATE_BYTES = 256 << 20


def rotation_count(bytes_per_set: int, limit: int = 16) -> int:
    """How many input sets to rotate over so that they span ROTATE_BYTES (1 to `limit`)."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(limit, -(-ROTATE_BYTES // bytes_per_set)))


def time_calls(fn: Callable, arg_sets: Sequence[tuple], warmup: int = 3, iters: int = 40,
               device: str = "cuda") -> Dict[str, float]:
    """Times fn(*arg_sets[i % len(arg_sets)]) for `iters` calls after `warmup` untimed ones,
    each between its own pair of events, then `iters` calls back to back between one pair.

    Returns {"median_us", "min_us", "back_to_back_us", "iters"}: device time per call from CUDA
    events on a CUDA device, host time on CPU; back_to_back_us is the back-to-back run's time
    over its calls (a function that waits for the device inside runs no faster that way).
    """
    n = len(arg_sets)
    for i in range(warmup):
        fn(*arg_sets[i % n])
    samples: List[float] = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(*arg_sets[i % n])
            end.record()
        torch.cuda.synchronize()
        samples = [1e3 * start.elapsed_time(end) for start, end in events]
        start, end = events[0]
        start.record()
        for i in range(iters):
            fn(*arg_sets[i % n])
        end.record()
        torch.cuda.synchronize()
        back_to_back = 1e3 * start.elapsed_time(end) / iters
    else:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(*arg_sets[i % n])
            samples.append(1e6 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for i in range(iters):
            fn(*arg_sets[i % n])
        back_to_back = 1e6 * (time.perf_counter() - t0) / iters
    return {"median_us": statistics.median(samples), "min_us": min(samples),
            "back_to_back_us": back_to_back, "iters": iters}


def copy_fn(nbytes: int, device: str, sets: int = 1):
    """(function, arg sets) of a device copy of `nbytes` (it moves 2 * nbytes: read + write),
    rotated over `sets` source/destination pairs like the kernels' inputs."""
    pairs = []
    for _ in range(sets):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        pairs.append((torch.empty_like(src), src))
    return (lambda dst, src: dst.copy_(src)), pairs


def row(group: str, provider: str, timing: Dict[str, float], nbytes: Optional[int] = None,
        copy_us: Optional[float] = None, check: str = "exact", **extra) -> dict:
    """One result row. nbytes: bytes read + written by one call; copy_us: the device copy of
    the same bytes (read + written) timed in the same process, for `of_copy`. check: how the
    provider's output compared with the reference before it was timed ("exact" bit for bit,
    "close" within the stated tolerance, "FAILED: ..." otherwise). The back-to-back time is kept as it is; the report sets it
    against the group's device copy's."""
    out = {"group": group, "provider": provider, "median_us": round(timing["median_us"], 2),
           "min_us": round(timing["min_us"], 2), "check": check}
    if timing.get("back_to_back_us") is not None:
        out["back_to_back_us"] = round(timing["back_to_back_us"], 2)
    if nbytes is not None:
        out["bytes"] = nbytes
        out["gbps"] = round(nbytes / timing["median_us"] / 1e3, 1)
        if copy_us:
            out["of_copy"] = round(copy_us / timing["median_us"], 3)
    out.update(extra)
    return out


def pick_winner(rows: List[dict], providers: Sequence[str]) -> Optional[dict]:
    """The fastest of `providers` among rows whose check passed, or None."""
    ok = [r for r in rows if r["provider"] in providers and not r["check"].startswith("FAILED")]
    return min(ok, key=lambda r: r["median_us"]) if ok else None


def failed_row(group: str, provider: str, why: str) -> dict:
    """The row of a provider that failed its check or raised: never timed, never chosen."""
    return {"group": group, "provider": provider, "median_us": None, "min_us": None,
            "check": why if why.startswith("FAILED") else f"FAILED: {why}"}


# What a CUDA error that leaves the context unusable says (every later CUDA call fails too).
CUDA_ERRORS = ("CUDA error", "illegal memory access", "misaligned address", "illegal instruction",
               "unspecified launch failure", "device-side assert")


@contextlib.contextmanager
def backend(name: Optional[str]) -> Iterator[None]:
    """RECXLA_BACKEND=name for the block (None: left as it is), restored after."""
    saved = os.environ.get("RECXLA_BACKEND")
    if name is not None:
        os.environ["RECXLA_BACKEND"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RECXLA_BACKEND", None)
        else:
            os.environ["RECXLA_BACKEND"] = saved


class Guard:
    """Runs a provider's calls so that an exception becomes its row's check, and a CUDA error
    (the context is then poisoned) stops every later CUDA call."""

    def __init__(self, device: str):
        self.device = device
        self.poisoned: Optional[str] = None

    def __call__(self, name: str, fn: Callable, on_cuda: Optional[bool] = None):
        """(fn's result, None) or (None, "FAILED: ..."). on_cuda (default: the guard's device is
        a GPU): fn runs CUDA work, which is synchronized so that an asynchronous error surfaces
        in its own row."""
        on_cuda = self.device.startswith("cuda") if on_cuda is None else on_cuda
        if on_cuda and self.poisoned:
            return None, f"FAILED: not run: {self.poisoned}"
        try:
            out = fn()
            if on_cuda:
                torch.cuda.synchronize()
            return out, None
        except Exception as e:  # noqa: BLE001 - one provider's failure is a row, not the end
            text = f"{type(e).__name__}: {str(e)[:300]}"
            if on_cuda and any(s in str(e) for s in CUDA_ERRORS):
                self.poisoned = (f"CUDA context poisoned by {name} ({text[:120]}); "
                                 "no CUDA call after it")
            return None, f"FAILED: {text}"


def medians_by_group(rows: List[dict], provider: str) -> Dict[str, float]:
    """`provider`'s median (us) in each group of `rows` where it was timed."""
    return {r["group"]: r["median_us"] for r in rows
            if r["provider"] == provider and r.get("median_us") is not None}


def least_summed_median(rows: List[dict], variants: Sequence[str], groups: Sequence[str],
                        prefix: str = "cuda:") -> Optional[str]:
    """The variant (provider `prefix` + name) with the least sum of its medians over `groups`,
    among those timed in every one of them (a variant whose check failed has no median); the
    earlier variant on a tie; None when none was."""
    totals = {}
    for v in variants:
        got = medians_by_group(rows, prefix + v)
        if groups and all(g in got for g in groups):
            totals[v] = sum(got[g] for g in groups)
    return min(totals, key=totals.get) if totals else None


DRY_RUN_NOTE = "dry run on CPU (the CPU op stood in for every variant; not a measurement): "


def choice(family: str, winner: str, why: str, device: str, dry_run: bool,
           began: float) -> dict:
    """A family's variant choice: for the device's compute capability (0 on CPU), why says
    which figures decided it (a dry run says it is none), and how long the module ran."""
    capability = 0
    if device.startswith("cuda"):
        from recxla.ops.gpu_variants import capability as device_capability

        capability = device_capability()
    if dry_run:
        why = DRY_RUN_NOTE + why
    return {"family": family, "capability": capability, "winner": winner,
            "why": f"{why} (the module ran {time.monotonic() - began:.0f} s)"}
