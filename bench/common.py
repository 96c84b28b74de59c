"""Helpers shared by the microbenchmarks in bench/: bandwidth bookkeeping, the memcpy baseline and
one thread for the serial kernels.

Bandwidth here is always (bytes read + bytes written) / time, in GB/s (1e9 bytes per second), at
the median of pytest-benchmark's rounds. A memcpy of B bytes therefore moves 2 * B bytes. The
memcpy baseline is `dst.copy_(src)` into a tensor that already exists (the machine's streaming
speed); `clone()` adds what any op returning a fresh tensor pays for new memory.

Every benchmark records in `benchmark.extra_info`:
    bytes          bytes read + written by one call
    gbps           bytes / median time
    memcpy_gbps    a memcpy's GB/s at the same size, timed in the same process just before
    of_memcpy      gbps / memcpy_gbps
plus whatever the benchmark adds (wire bytes, shapes).
"""

import contextlib
import time
from typing import Callable, Dict, Tuple

import torch

_memcpy_cache: Dict[Tuple[int, int, str], float] = {}


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block, its count restored after: the host kernels timed
    with it are serial, and the cluster benchmark runs its ranks on one thread each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes per second, in GB/s (1e9)."""
    return nbytes / seconds / 1e9


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Total size in bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def memcpy_fn(nbytes: int, device: str = "cpu", alloc: bool = False) -> Callable[[], torch.Tensor]:
    """A function that copies `nbytes` random bytes: into a preallocated buffer (copy_) or into a
    new one (clone, alloc=True). It moves 2 * nbytes bytes."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    if alloc:
        return src.clone
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def synchronized(fn: Callable, device: str) -> Callable:
    """`fn` followed by a device synchronization, so a timer sees the whole GPU work."""
    if not str(device).startswith("cuda"):
        return fn

    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out

    return run


def memcpy_gbps(nbytes: int, device: str = "cpu", repeats: int = 30) -> float:
    """GB/s (2 * nbytes moved) of the fastest of `repeats` copy_ calls, after a warm-up; measured
    once per (size, thread count, device) and process."""
    key = (nbytes, torch.get_num_threads(), str(device))
    if key not in _memcpy_cache:
        copy = synchronized(memcpy_fn(nbytes, device), device)
        copy()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            copy()
            best = min(best, time.perf_counter() - start)
        _memcpy_cache[key] = gbps(2 * nbytes, best)
    return _memcpy_cache[key]


def run_and_record(benchmark, fn: Callable, *args, nbytes: int, memcpy_nbytes: int,
                   device: str = "cpu", **extra):
    """Times fn(*args) with pytest-benchmark and records bandwidth (see the module docstring).

    Args:
        nbytes: bytes read + written by one call of fn.
        memcpy_nbytes: the size of the memcpy to compare with (it moves twice that).
        extra: more extra_info entries.
    Returns:
        fn's result.
    """
    reference_gbps = memcpy_gbps(memcpy_nbytes, device)
    if device != "cpu":
        # The first call on a GPU compiles (Triton) or loads the kernels: left out of the timing
        # and of pytest-benchmark's calibration, which otherwise settles on a handful of rounds.
        synchronized(fn, device)(*args)
    result = benchmark(synchronized(fn, device), *args)
    benchmark.extra_info.update(extra)
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["memcpy_gbps"] = round(reference_gbps, 2)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        benchmark.extra_info["gbps"] = round(gbps(nbytes, median), 2)
        benchmark.extra_info["of_memcpy"] = round(gbps(nbytes, median) / reference_gbps, 3)
    return result
