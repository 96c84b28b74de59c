"""One small all_gather that lets every rank see the whole send/receive matrix of an all-to-all.

gloo and NCCL trust the split sizes they are given: when two ranks disagree on how many rows one
sends the other, the result is an aborted process, a hang or silently wrong rows (see
`quantized_all_to_all`'s docstring). Exchanging the sizes first costs one collective of a few
integers and turns all of those into the same ValueError on every rank, before any data moves.
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from recxla.distributed.gather import all_gather_flat

from recxla.formats import FORMATS

_FORMAT_IDS = {name: i for i, name in enumerate(sorted(FORMATS))}
_FORMAT_NAMES = {i: name for name, i in _FORMAT_IDS.items()}
# Stands for "output_split_sizes=None: learn it from the peers".
_UNKNOWN = -1
# Mismatches listed in the message; the rest are counted.
_MAX_LISTED = 4


def _gather_rows(local: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """[world, local.numel()]: row r is rank r's `local` (gloo wants a flat output)."""
    world = dist.get_world_size(group)
    out = local.new_empty((world * local.numel(),))
    all_gather_flat(out, local, group=group)
    return out.view(world, local.numel())


def exchange_splits(
    op: str,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    input_splits: Sequence[int],
    output_splits: Optional[Sequence[int]],
    dim: int,
    fwd: str,
    bwd: str,
) -> List[int]:
    """Gather every rank's splits, row width and formats; check them; return output splits.

    Args:
        op: the op's name, for the messages.
        group: the process group of the all-to-all (None: the default group).
        device: where the metadata tensor lives (the data's device, so NCCL groups work too).
        input_splits: W rows this rank sends to each rank.
        output_splits: W rows this rank expects from each rank, or None to derive them.
        dim, fwd, bwd: the row width and wire formats, which every rank must share.
    Returns:
        This rank's output splits: rank r's input_splits[me] for every r.
    Raises:
        ValueError on every rank, with the same message, when the ranks disagree.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    out = [_UNKNOWN] * world if output_splits is None else list(output_splits)
    local = torch.tensor(
        list(input_splits) + out + [dim, _FORMAT_IDS[fwd], _FORMAT_IDS[bwd]],
        dtype=torch.int64,
        device=device,
    )
    table = _gather_rows(local, group).cpu().tolist()
    sends = [row[:world] for row in table]
    expects = [row[world : 2 * world] for row in table]
    dims = [row[2 * world] for row in table]
    fwds = [_FORMAT_NAMES[row[2 * world + 1]] for row in table]
    bwds = [_FORMAT_NAMES[row[2 * world + 2]] for row in table]

    # Every rank runs the same checks on the same table, so every rank raises the same error.
    for name, values in (("x.shape[1] (D)", dims), ("fwd", fwds), ("bwd", bwds)):
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{op}: every rank must use the same {name}, got {per_rank}")
    mismatches = [
        f"rank {src} sends {sends[src][dst]} rows to rank {dst}, but rank {dst} expects "
        f"{expects[dst][src]} from rank {src}"
        for src in range(world)
        for dst in range(world)
        if expects[dst][src] != _UNKNOWN and expects[dst][src] != sends[src][dst]
    ]
    if mismatches:
        more = len(mismatches) - _MAX_LISTED
        listed = "; ".join(mismatches[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
        raise ValueError(
            f"{op}: input_split_sizes and output_split_sizes disagree across ranks "
            f"(found by validate_splits before any data moved): {listed}"
        )
    return [sends[src][me] for src in range(world)]
