"""Setup shared by the benchmarks in bench/.

- The repository root goes on sys.path, so `bench.common` imports however pytest is started.
- Large CPU tensors are allocated on 2 MB pages (torch's THP_MEM_ALLOC_ENABLE=1), unless the
  environment already sets the variable. Without it every call that returns a fresh tensor of
  more than 32 MiB gets new 4 KiB pages from the kernel, and on these VMs a first touch costs
  about 3 us a page: 25 ms for 32 MiB, ten times the work of the kernels being measured. The
  setting applies to every provider alike; run with THP_MEM_ALLOC_ENABLE=0 to see the default.
  torch reads it at its first allocation, so it is set here, before the benchmarks import torch.
- The `gpu` marker skips its benchmarks when no CUDA device is visible (`make gpu-check` runs
  them on a GPU machine).
"""

import os
import sys

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run `make gpu-check` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
