"""The input dist's id routing: a batch's ids checked against their tables, routed to the
owners of their row blocks, and ordered by the slot they are sent in.

A sharded module routes every batch's ids through this op (recxla.torchrec.id_encoder), on the
host: the ids come from the loader there, whatever device holds the tables, so the op has a C++
CPU kernel (two passes over the ids: csrc/cpu/route_ids.cpp) and no GPU kernel; ids on a GPU
run the plain-PyTorch reference (recxla.reference.route_ids), whose torch ops run there.
"""

from typing import Optional

import torch

from recxla import _extension
from recxla.reference.route_ids import RoutedIds, route_ids_ref

OP = "recxla.route_ids"


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
    if values.is_cuda or not _extension.extension_available():
        return route_ids_ref(values, lengths, weights, batch, slot_rows, slot_first_block,
                             block_starts, block_first_route, route_send_slot, route_row_group,
                             route_row_offset, num_send_slots)
    out = torch.ops.recxla.route_ids(values, lengths, weights, batch, slot_rows,
                                     slot_first_block, block_starts, block_first_route,
                                     route_send_slot, route_row_group, route_row_offset,
                                     num_send_slots)
    has_weights = weights is not None
    return RoutedIds(out[0], out[1] if has_weights else None, out[2], out[3], out[4], out[5],
                     out[6], out[7], out[8] if has_weights else None, int(out[9]))
