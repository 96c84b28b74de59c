"""Setup shared by the benchmarks in bench/.

- The repository root goes on sys.path, so `bench.common` imports however pytest is started.
- Freed memory stays in the process (glibc's malloc never maps a block of its own and never
  gives memory back), as a caching allocator would keep it; RECXLA_BENCH_MALLOC=default turns
  this off. By default every call that returns a fresh tensor of 32 MiB or more (and, after the
  heap was trimmed, smaller ones) gets new pages from the kernel, and on these VMs a first touch
  costs about 3 us per 4 KiB page: 25 ms for 32 MiB, ten times the work of the kernels measured.
  The setting applies to every provider alike (references, FBGEMM, memcpy+alloc).
- The `gpu` marker skips its benchmarks when no CUDA device is visible (`make gpu-campaign` runs
  them on a GPU machine).
"""

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)


def _keep_freed_memory() -> bool:
    """glibc: no mmap'ed blocks, no trimming. False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError, TypeError, ctypes.ArgumentError):
        return False


KEEPS_FREED_MEMORY = os.environ.get("RECXLA_BENCH_MALLOC") != "default" and _keep_freed_memory()

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402


def pytest_report_header(config):
    mode = "kept in the process" if KEEPS_FREED_MEMORY else "malloc's default"
    return f"recxla bench: freed memory {mode} (RECXLA_BENCH_MALLOC)"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run `make gpu-campaign` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
