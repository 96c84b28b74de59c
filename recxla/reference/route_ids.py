"""Reference id routing of the input dist in plain PyTorch (see recxla.ops.route_ids for the
contract): vectorized over all ids, one torch op per step, so it also runs where the ids are on
a GPU."""

from typing import NamedTuple, Optional

import torch


class RoutedIds(NamedTuple):
    """One batch's ids, routed (recxla.ops.route_ids)."""

    send_ids: torch.Tensor      # int64 [M]: ids local to their owner, send slot by send slot
    send_weights: Optional[torch.Tensor]  # float32 [M], or None without weights
    slot_lengths: torch.Tensor  # int32 [num_send_slots * B]: each send slot's bag lengths
    slot_counts: torch.Tensor   # int64 [num_send_slots]
    row_group: torch.Tensor     # int64 [P]: ids to row groups, in input order: the group,
    row_slot: torch.Tensor      #   the input slot,
    row_sample: torch.Tensor    #   the sample,
    row_ids: torch.Tensor       #   the row local to the owner,
    row_weights: Optional[torch.Tensor]  # and the weight (None without weights)
    first_bad: int              # index of the first id outside its table, or -1


def route_ids_ref(values, lengths, weights, batch, slot_rows, slot_first_block, block_starts,
                  block_first_route, route_send_slot, route_row_group, route_row_offset,
                  num_send_slots) -> RoutedIds:
    device = values.device
    num_slots = slot_rows.numel()
    n = values.numel()
    long = dict(dtype=torch.int64, device=device)
    slot = torch.repeat_interleave(torch.arange(num_slots, device=device),
                                   lengths.view(num_slots, batch).sum(1), output_size=n)
    ids = values.to(torch.int64)
    bad = (ids < 0) | (ids >= slot_rows[slot])
    if bool(bad.any()):
        empty = torch.empty(0, **long)
        return RoutedIds(empty, None, torch.zeros(num_send_slots * batch, dtype=torch.int32,
                                                  device=device),
                         torch.zeros(num_send_slots, **long), empty, empty, empty, empty, None,
                         int(torch.nonzero(bad)[0]))
    sample = torch.repeat_interleave(torch.arange(num_slots * batch, device=device), lengths,
                                     output_size=n) - slot * batch
    # Each slot's blocks in a band of their own, so one searchsorted finds every id's block.
    band = int(slot_rows.max()) + 1 if num_slots else 1
    block_slot = torch.repeat_interleave(torch.arange(num_slots, device=device),
                                         slot_first_block.diff())
    block = torch.searchsorted(block_slot * band + block_starts, slot * band + ids,
                               right=True) - 1
    per_id = block_first_route[block + 1] - block_first_route[block]
    source = torch.repeat_interleave(torch.arange(n, device=device), per_id)
    first = torch.cumsum(per_id, 0) - per_id
    position = torch.arange(source.numel(), device=device) - \
        torch.repeat_interleave(first, per_id, output_size=source.numel())
    route = block_first_route[block[source]] + position
    local = ids[source] - route_row_offset[route]
    slot, sample = slot[source], sample[source]
    weights = weights[source] if weights is not None else None
    group = route_row_group[route]
    to_rows = group >= 0
    keep = ~to_rows
    send_slot = route_send_slot[route[keep]]
    order = torch.sort(send_slot, stable=True).indices
    return RoutedIds(
        local[keep][order], weights[keep][order] if weights is not None else None,
        torch.bincount(send_slot * batch + sample[keep],
                       minlength=num_send_slots * batch).to(torch.int32),
        torch.bincount(send_slot, minlength=num_send_slots),
        group[to_rows], slot[to_rows], sample[to_rows], local[to_rows],
        weights[to_rows] if weights is not None else None, -1)
