"""Loads the compiled extension `recxla._C`, which registers the `torch.ops.recxla.*` operators.

recxla's ops run only on its kernels: C++ on CPU, CUDA or Triton on GPU. When the extension is
missing (a source checkout that was never built) `import recxla` still works, so that the
pure-Python parts (recxla.data, the planner) stay usable, but calling an op raises a
RuntimeError that names the op and says how to reinstall (`backend_for`). recxla.reference,
the tests' oracle, is not a fallback: recxla itself never runs it.
"""

import os

import torch

try:
    from recxla import _C  # noqa: F401  (loading it runs the operator registrations)

    HAVE_EXTENSION = True
    _LOAD_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    HAVE_EXTENSION = False
    _LOAD_ERROR = e

BACKENDS = ("auto", "cuda", "triton")


def register_fake(qualname: str):
    """`torch.library.register_fake(qualname)` when the extension is loaded (it defines the op);
    without it the decorated function is returned unregistered, so that `import recxla` still
    works (the ops then raise when called, see `backend_for`)."""
    if HAVE_EXTENSION:
        return torch.library.register_fake(qualname)
    return lambda fn: fn


def built_with_cuda() -> bool:
    """True when this build compiled the CUDA kernels (a GPU need not be present)."""
    return HAVE_EXTENSION and bool(torch.ops.recxla.built_with_cuda())


def gpu_backend() -> str:
    """The GPU backend to use for CUDA tensors: `RECXLA_BACKEND` = auto | cuda | triton.

    auto picks the CUDA kernels when this build has them, else the Triton kernels.
    """
    choice = os.environ.get("RECXLA_BACKEND", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"RECXLA_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "cuda" if built_with_cuda() else "triton"
    if choice == "cuda" and not built_with_cuda():
        raise RuntimeError("RECXLA_BACKEND=cuda, but this build of recxla has no CUDA kernels")
    return choice


def backend_for(t: torch.Tensor, op: str) -> str:
    """Which implementation runs the public op `op` (e.g. "recxla.quantize_rows") on `t`:
    "cuda" or "triton" for CUDA tensors (see `gpu_backend`), "cpu" for the C++ kernels.

    Raises RuntimeError naming `op` when a CPU tensor meets a build without the compiled
    extension: recxla has no plain-PyTorch fallback."""
    if t.is_cuda:
        return gpu_backend()
    if not HAVE_EXTENSION:
        raise RuntimeError(
            f"{op}: the compiled kernels are not available ({_LOAD_ERROR}); reinstall recxla "
            "with `pip install --no-build-isolation .` (README, \"Using recxla in your own "
            "environment\")"
        )
    return "cpu"
