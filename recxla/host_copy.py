"""Host tensors to a device: the one way recxla moves what the host built (plans, offsets,
decoded ids, bag lengths) to where the tables are.

To a GPU a host tensor is copied from pinned memory, without blocking: a copy from pageable
memory goes through a driver's staging buffer and can wait for the stream (a host sync), and no
other stream overlaps it. To any other device the copy is `Tensor.to`'s.
"""

from typing import Iterable, Optional

import torch


def to_device(tensor: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """`tensor` on `device` (itself when it is there; None stays None): a non-blocking copy,
    from pinned memory when a host tensor goes to a GPU."""
    if tensor is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def int64_on(values: Iterable[int], device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device` (to_device of a fresh host tensor)."""
    return to_device(torch.tensor(list(values), dtype=torch.int64), device)
