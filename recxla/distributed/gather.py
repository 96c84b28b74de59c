"""A flat all-gather on every torch recxla runs on.

`torch.distributed.all_gather_single` (output [world * n], input [n]) is the collective's name
in the torch recxla pins; older releases (the torch of some GPU images, 2.11 among them) call the
same collective `all_gather_into_tensor` and lack the new name. Looked up at each call, so that
a wrapper installed on either name (recxla.train.comm_meter's meter) sees it.
"""

from typing import Optional

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, local: torch.Tensor,
                    group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """output [world * local.numel()] <- every rank's `local`, rank by rank (blocking, or with
    async_op its Work)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)
