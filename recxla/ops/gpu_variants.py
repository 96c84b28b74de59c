"""GPU kernel variants: which of an op family's interchangeable kernels runs on a GPU.

Each family (`families()`: `fp8_quantize`, `fp8_dequantize`, `dedup`, `cluster`) has several
GPU kernels that give the same result bit for bit; which is fastest depends on the
architecture. The default per architecture is the winner the GPU campaign measured there
(`make gpu-campaign`, bench/results/gpu.md), kept in one table in csrc/gpu_variants.cpp.
`use_variant` overrides it for a block of code (the campaign checks and times every variant
that way).
"""

import contextlib
from typing import Iterator, List, Optional

import torch

from recxla import _extension


def _require_extension(op: str) -> None:
    if not _extension.HAVE_EXTENSION:
        raise RuntimeError(f"{op}: the compiled extension recxla._C is not loaded")


def families() -> List[str]:
    """The op families that have GPU kernel variants."""
    _require_extension("recxla.ops.gpu_variants.families")
    return list(torch.ops.recxla.gpu_kernel_families())


def variants(family: str) -> List[str]:
    """The variants of `family`, the fallback of an unmeasured architecture first."""
    _require_extension("recxla.ops.gpu_variants.variants")
    return list(torch.ops.recxla.gpu_kernel_variants(family))


def capability(device: Optional[torch.device] = None) -> int:
    """Compute capability of a CUDA device as major * 10 + minor (90 for an H100)."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def chosen(family: str, device_capability: int) -> str:
    """The variant of `family` a device of this capability runs now (override included)."""
    _require_extension("recxla.ops.gpu_variants.chosen")
    return str(torch.ops.recxla.gpu_kernel_variant(family, int(device_capability)))


def set_variant(family: str, variant: str) -> None:
    """Every device runs `variant` of `family` in this process; "" restores the default."""
    _require_extension("recxla.ops.gpu_variants.set_variant")
    torch.ops.recxla.set_gpu_kernel_variant(family, variant)


@contextlib.contextmanager
def use_variant(family: str, variant: str) -> Iterator[None]:
    """Runs the block with `variant` of `family` on every device, then restores the default
    (an override made before the block is not restored: overrides do not nest)."""
    set_variant(family, variant)
    try:
        yield
    finally:
        set_variant(family, "")
