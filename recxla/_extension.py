"""Loads the compiled extension `recxla._C`, which registers the `torch.ops.recxla.*` operators.

Every public op also has a plain-PyTorch reference (`recxla.reference`). When the extension is
missing (a source checkout that was never built) the ops fall back to it, with one warning, so
that a wrong install is slow and loud rather than broken.
"""

import os
import warnings

import torch

try:
    from recxla import _C  # noqa: F401  (loading it runs the operator registrations)

    HAVE_EXTENSION = True
    _LOAD_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    HAVE_EXTENSION = False
    _LOAD_ERROR = e

_warned = False

BACKENDS = ("auto", "cuda", "triton")


def extension_available() -> bool:
    """True when the compiled kernels are loaded; warns once when they are not."""
    global _warned
    if not HAVE_EXTENSION and not _warned:
        warnings.warn(
            f"recxla: compiled kernels not available ({_LOAD_ERROR}); using the PyTorch "
            "reference implementations. Reinstall with `pip install --no-build-isolation .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned = True
    return HAVE_EXTENSION


def register_fake(qualname: str):
    """`torch.library.register_fake(qualname)` when the extension is loaded (it defines the op);
    without it the decorated function is returned unregistered, so that `import recxla` still
    works and the ops run their references."""
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


def backend_for(t: torch.Tensor) -> str:
    """Which implementation runs an op on `t`: "cuda" or "triton" for CUDA tensors (see
    `gpu_backend`), "cpu" for the C++ kernels, "reference" when the extension is missing."""
    if t.is_cuda:
        return gpu_backend()
    return "cpu" if extension_available() else "reference"
