"""The input dist's id routing: a batch's ids checked against their tables, routed to the
owners of their row blocks, and ordered by the slot they are sent in.

A sharded module routes every batch's ids through this op (recxla.torchrec.id_encoder), on the
host: the ids come from the loader there, whatever device holds the tables, so the op has a C++
CPU kernel (two passes over the ids: csrc/cpu/route_ids.cpp) and no GPU kernel; ids on a GPU
run `route_ids_torch`, whose torch ops run there. Without the compiled extension, CPU ids raise
a RuntimeError saying to reinstall. The tests check both paths against their oracle,
recxla/reference/route_ids.py, a plain loop over the ids.
"""

from typing import NamedTuple, Optional

import torch

from recxla import _extension

OP = "recxla.route_ids"


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


@_extension.register_fake("recxla::route_ids")
def _route_ids_fake(values, lengths, weights, batch, slot_rows, slot_first_block, block_starts,
                    block_first_route, route_send_slot, route_row_group, route_row_offset,
                    num_send_slots):
    ctx = torch.library.get_ctx()
    sent, routed_to_rows = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    ids = values.new_empty(sent, dtype=torch.int64)
    rows = values.new_empty(routed_to_rows, dtype=torch.int64)
    floats = dict(dtype=torch.float32)
    return (ids, values.new_empty(sent if weights is not None else 0, **floats),
            values.new_empty(num_send_slots * batch, dtype=torch.int32),
            values.new_empty(num_send_slots, dtype=torch.int64), rows, rows.clone(),
            rows.clone(), rows.clone(),
            values.new_empty(routed_to_rows if weights is not None else 0, **floats),
            values.new_empty((), dtype=torch.int64))


def route_ids(values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor],
              batch: int, slot_rows: torch.Tensor, slot_first_block: torch.Tensor,
              block_starts: torch.Tensor, block_first_route: torch.Tensor,
              route_send_slot: torch.Tensor, route_row_group: torch.Tensor,
              route_row_offset: torch.Tensor, num_send_slots: int) -> RoutedIds:
    """Routes one batch's ids.

    Args:
        values: int32/int64 [N]: the ids, input slot by input slot, bag by bag.
        lengths: int32/int64 [S * batch]: bag lengths, [S, batch] row-major (sum: N).
        weights: float32 [N] or None.
        batch: samples per input slot.
        slot_rows: int64 [S]: rows of each input slot's table (an id must be in [0, rows)).
        slot_first_block: int64 [S + 1]: input slot s's row blocks are
            [slot_first_block[s], slot_first_block[s + 1]); each slot has at least one.
        block_starts: int64 [K]: each block's first row within its table, ascending within a
            slot from 0; an id belongs to the last block of its slot that starts at or below it.
        block_first_route: int64 [K + 1]: block k's routes are
            [block_first_route[k], block_first_route[k + 1]) (column-wise: one per owner).
        route_send_slot: int64 [R]: the send slot a route's ids go to (when not to a row group).
        route_row_group: int64 [R]: the global row group a route's ids go to, or -1.
        route_row_offset: int64 [R]: subtracted from an id to give its row at the owner.
        num_send_slots: the number of send slots (every route's send slot below it).
    Returns: RoutedIds: the ids of send routes, local to their owner, grouped by send slot in
        slot order (stable: in input order inside a slot), with their weights, each send slot's
        bag lengths and id count; the ids of row-group routes in input order with their group,
        input slot and sample; and first_bad, the index of the first id outside its table (-1:
        none; then nothing else is meaningful).
    """
    if not isinstance(values, torch.Tensor) or not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{OP}: values and lengths must be torch.Tensors")
    if values.is_cuda:
        return route_ids_torch(values, lengths, weights, batch, slot_rows, slot_first_block,
                               block_starts, block_first_route, route_send_slot, route_row_group,
                               route_row_offset, num_send_slots)
    _extension.backend_for(values, OP)  # "cpu", or the error of a build without the extension
    out = torch.ops.recxla.route_ids(values, lengths, weights, batch, slot_rows,
                                     slot_first_block, block_starts, block_first_route,
                                     route_send_slot, route_row_group, route_row_offset,
                                     num_send_slots)
    has_weights = weights is not None
    return RoutedIds(out[0], out[1] if has_weights else None, out[2], out[3], out[4], out[5],
                     out[6], out[7], out[8] if has_weights else None, int(out[9]))


def route_ids_torch(values, lengths, weights, batch, slot_rows, slot_first_block, block_starts,
                    block_first_route, route_send_slot, route_row_group, route_row_offset,
                    num_send_slots) -> RoutedIds:
    """`route_ids` in torch ops, vectorized over all ids (one op per step): the path of ids on a
    GPU. Arguments and result as `route_ids`."""
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
