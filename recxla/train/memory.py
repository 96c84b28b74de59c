"""Steady-state memory: freed blocks stay in the process, and page faults are counted per step.

PyTorch has no caching allocator on CPU: every step's activations, gradients and collective
buffers are fresh malloc() blocks. glibc serves blocks above its mmap threshold with fresh
mmap()s and hands freed memory above its trim threshold back to the kernel, so such a step
page-faults its large tensors in again, every step: about 3 us per 4 KiB page on these
machines, milliseconds per step (DESIGN.md). `keep_freed_memory` pins both thresholds high
(mallopt), so that after the first steps every large block is reused from the heap: the steady
state allocates no new memory from the kernel, for the recxla path and the TorchRec baseline
alike. `minor_faults` is the counter that checks it.

Blocks above glibc's largest mmap threshold (32 MiB on 64-bit) are still mmap()ed; a step
holding such tensors should keep them in persistent buffers.
"""

import ctypes
import ctypes.util
import resource
from typing import Optional

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: the largest accepted
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: up to 2 GiB free at the heap's top stays
TOP_PAD = 64 << 20


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018  (glibc only: musl and others lack it)
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process (see the module docstring). Returns False
    where the C library has no mallopt (the process keeps its allocator's defaults)."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    ok &= libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ok &= libc.mallopt(M_TOP_PAD, TOP_PAD)
    return bool(ok)


def minor_faults() -> int:
    """Minor page faults of this process so far (all threads): a fault is a page the kernel
    had to map in, the cost of touching fresh memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
