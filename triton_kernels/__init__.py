"""recxla's Triton kernels, installed as `recxla.triton_kernels` (one module per op family).

They are the GPU path when `RECXLA_BACKEND=triton` and run on CUDA tensors. Machines without a GPU
test them in Triton's interpreter on CPU tensors: `interpreted("fp8_rows")` returns a separate copy
of a kernel module whose kernels were built for the interpreter. Triton chooses compiled or
interpreted kernels once, when `@triton.jit` runs at import, so the copy leaves the regular module
(and any other user of it in the same process) as it was.

This file also makes the folder a regular package: as a namespace package, an editable install
cannot import `recxla.triton_kernels` once `recxla` itself was found through the source tree.
"""

import importlib
import importlib.util
import sys
from types import ModuleType

_INTERPRETED_PREFIX = __name__ + "._interpreted."


def interpreted(name: str) -> ModuleType:
    """The kernel module `recxla.triton_kernels.<name>`, imported anew with its kernels built for
    Triton's interpreter (`TRITON_INTERPRET=1` semantics): they take CPU tensors, run anywhere and
    are slow, so keep shapes small. The copy is cached per name."""
    qualified = _INTERPRETED_PREFIX + name
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    if spec is None or spec.origin is None:
        raise ValueError(f"recxla.triton_kernels.interpreted: no kernel module named {name!r}")
    import triton

    copy_spec = importlib.util.spec_from_file_location(qualified, spec.origin)
    module = importlib.util.module_from_spec(copy_spec)
    # scope() restores the knob (and the TRITON_INTERPRET variable) afterwards.
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        copy_spec.loader.exec_module(module)
    sys.modules[qualified] = module
    return module
