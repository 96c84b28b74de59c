"""Reference id routing of the input dist (see recxla.ops.route_ids for the contract): a plain
Python loop over the input slots, their samples and each sample's ids, one route at a time.

The oracle of tests/test_route_ids.py for the C++ kernel (csrc/cpu/route_ids.cpp) and for the
op's vectorized torch path (recxla.ops.route_ids.route_ids_torch, which ids on a GPU run): a
different computation from both, written for clarity, not speed (bench/bench_route_ids.py).
"""

from typing import Dict, List

import torch

from recxla.ops.route_ids import RoutedIds


def _block_of(id_: int, first: int, last: int, block_starts: List[int]) -> int:
    """The last of the blocks [first, last) whose start is at or below id_ (the first one
    starts at row 0, so there is one)."""
    block = first
    for k in range(first, last):
        if block_starts[k] <= id_:
            block = k
    return block


def route_ids_ref(values, lengths, weights, batch, slot_rows, slot_first_block, block_starts,
                  block_first_route, route_send_slot, route_row_group, route_row_offset,
                  num_send_slots) -> RoutedIds:
    """Same arguments and result as `recxla.ops.route_ids.route_ids`, tensors on values'
    device. With an id outside its table, first_bad is its index and the rest is empty (no
    weights, zero counts)."""
    device = values.device
    ids = [int(v) for v in values.tolist()]
    bag_lengths = [int(n) for n in lengths.tolist()]
    ws = weights.tolist() if weights is not None else None
    rows, first_block = slot_rows.tolist(), slot_first_block.tolist()
    starts, first_route = block_starts.tolist(), block_first_route.tolist()
    send_slot_of, group_of = route_send_slot.tolist(), route_row_group.tolist()
    offset_of = route_row_offset.tolist()

    sent: Dict[int, list] = {slot: [] for slot in range(num_send_slots)}  # (id, weight)
    sent_per_bag = [0] * (num_send_slots * batch)
    to_rows = []  # (group, input slot, sample, id, weight), in input order
    i = 0
    for s in range(len(rows)):
        for b in range(batch):
            for _ in range(bag_lengths[s * batch + b]):
                id_ = ids[i]
                if not 0 <= id_ < rows[s]:
                    return _bad(i, num_send_slots, batch, device)
                w = ws[i] if ws is not None else None
                block = _block_of(id_, first_block[s], first_block[s + 1], starts)
                for r in range(first_route[block], first_route[block + 1]):
                    local = id_ - offset_of[r]
                    if group_of[r] >= 0:
                        to_rows.append((group_of[r], s, b, local, w))
                    else:
                        slot = send_slot_of[r]
                        sent[slot].append((local, w))
                        sent_per_bag[slot * batch + b] += 1
                i += 1

    in_slot_order = [entry for slot in range(num_send_slots) for entry in sent[slot]]

    def long(xs):
        return torch.tensor(xs, dtype=torch.int64, device=device)

    def floats(xs):
        return torch.tensor(xs, dtype=weights.dtype, device=device) if ws is not None else None

    return RoutedIds(
        send_ids=long([local for local, _ in in_slot_order]),
        send_weights=floats([w for _, w in in_slot_order]),
        slot_lengths=torch.tensor(sent_per_bag, dtype=torch.int32, device=device),
        slot_counts=long([len(sent[slot]) for slot in range(num_send_slots)]),
        row_group=long([g for g, _, _, _, _ in to_rows]),
        row_slot=long([s for _, s, _, _, _ in to_rows]),
        row_sample=long([b for _, _, b, _, _ in to_rows]),
        row_ids=long([local for _, _, _, local, _ in to_rows]),
        row_weights=floats([w for _, _, _, _, w in to_rows]),
        first_bad=-1,
    )


def _bad(index: int, num_send_slots: int, batch: int, device) -> RoutedIds:
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return RoutedIds(empty, None, torch.zeros(num_send_slots * batch, dtype=torch.int32,
                                              device=device),
                     torch.zeros(num_send_slots, dtype=torch.int64, device=device), empty, empty,
                     empty, empty, None, index)
