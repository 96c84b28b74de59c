"""The sender's half of the row exchange: `recxla::encode_row_ids`.

A rank's ids of row-exchange tables (recxla.torchrec.row_exchange), as route_ids routed them
(per id its global row group, input slot, sample and row local to the owner), become in one
op:
- the ids in (group, micro-batch, feature position, sample) order (stable: a bag keeps its
  order), each (group, micro-batch) run deduplicated: the distinct ids, ascending, travel to
  the owner, and each id keeps its index into them;
- the plan of the receiver's side: per micro-batch, the bags it pools the received rows with,
  as one multi-table lookup whose tables are the row groups' rows in the message (the
  arguments of `recxla.ops.embedding_bag.pooled_forward`), all in one int64 tensor that a
  device gets in one copy (`plan_sections` says where each part lies).

Done with torch ops it was a sort, two bincounts, a segmented unique and about twenty calls per
micro-batch on the step's path. A host op by design, like recxla.ops.route_ids: ids are routed
and encoded on the CPU whatever device holds the tables; ids on a GPU take the same op in torch
ops (`encode_row_ids_torch`). The oracle: recxla/reference/row_ids.py.
"""

import functools
from itertools import accumulate
from typing import List, NamedTuple, Optional, Sequence

import torch

from recxla import _extension
from recxla.host_copy import int64_on
from recxla.ops.dedup import segmented_unique

OP = "recxla.encode_row_ids"


class EncodedRows(NamedTuple):
    """encode_row_ids' result (P ids, G row groups, M micro-batches)."""

    order: torch.Tensor      # int64 [P]: the input index of each id in run order
    unique: torch.Tensor     # int64 [U]: each (group, micro-batch) run's distinct ids, ascending
    counts: torch.Tensor     # int64 [G, M]: distinct ids per run
    bounds: torch.Tensor     # int64 [G * M + 1]: the runs' bounds in run order
    inverse: torch.Tensor    # int64 [P]: each id's (run order) index into its run's distinct ids
    plan: torch.Tensor       # int64: every micro-batch's message bags (plan_sections)
    message_weights: Optional[torch.Tensor]  # float32 [P] in the plan's inverse order, or None


class PlanSection(NamedTuple):
    """Where micro-batch k's message bags lie in the plan: [start, end) of each part."""

    unique_values: slice   # int64 [U_k]: 0 .. U_gk - 1, group after group
    unique_offsets: slice  # int64 [G + 1]: each group's first row in the message's rows
    inverse: slice         # int64 [P_k]: each id's row, ids (group, feature, sample) in order
    offsets: slice         # int64 [F * B_k + 1]: the bags' bounds, bags (group, feature, sample)
    weights: slice         # micro-batch k's ids in message_weights (the inverse's order)


def plan_sections(counts: Sequence[int], bounds: Sequence[int], micro: Sequence[int],
                  group_features: Sequence[int]) -> List[PlanSection]:
    """The plan's layout per micro-batch, from the host copies of counts and bounds (G * M and
    G * M + 1 ints, run order), the micro-batch sizes and each group's feature count."""
    groups, num_micro = len(group_features), len(micro)
    features = sum(group_features)
    sections, at, first_id = [], 0, 0
    for k, size in enumerate(micro):
        runs = [g * num_micro + k for g in range(groups)]
        unique = sum(counts[r] for r in runs)
        ids = sum(bounds[r + 1] - bounds[r] for r in runs)
        ends = list(accumulate((unique, groups + 1, ids, features * size + 1), initial=at))
        sections.append(PlanSection(*(slice(a, b) for a, b in zip(ends, ends[1:])),
                                    slice(first_id, first_id + ids)))
        at, first_id = ends[-1], first_id + ids
    return sections


@_extension.register_fake("recxla::encode_row_ids")
def _encode_row_ids_fake(group, slot, sample, ids, weights, slot_position, group_features,
                         micro):
    ctx = torch.library.get_ctx()
    n, groups, num_micro = group.shape[0], len(group_features), len(micro)
    unique = ctx.new_dynamic_size()
    long = dict(dtype=torch.int64)
    plan = unique + num_micro * (groups + 2) + n + sum(group_features) * sum(micro)
    return (group.new_empty(n, **long), group.new_empty(unique, **long),
            group.new_empty((groups, num_micro), **long),
            group.new_empty(groups * num_micro + 1, **long), group.new_empty(n, **long),
            group.new_empty(plan, **long),
            group.new_empty(n if weights is not None else 0, dtype=torch.float32))


def encode_row_ids(group: torch.Tensor, slot: torch.Tensor, sample: torch.Tensor,
                   ids: torch.Tensor, weights: Optional[torch.Tensor],
                   slot_position: Sequence[int], group_features: Sequence[int],
                   micro: Sequence[int]) -> EncodedRows:
    """The sender's row-exchange ids encoded (module docstring).

    group, slot, sample, ids: int64 [P], per routed id in input order: its global row group
    (0 .. G-1), input slot, sample (0 .. sum(micro) - 1, micro-batch order) and row local to
    the owner; weights: float32 [P] or None. slot_position: per input slot, its feature's
    position among its table's features; group_features: per row group (G), its table's
    feature count; micro: the M micro-batch sizes. Bad input raises a ValueError or TypeError
    naming the op, the argument and the limit.
    """
    for name, t in (("group", group), ("slot", slot), ("sample", sample), ("ids", ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    args = (group, slot, sample, ids, weights, list(slot_position), list(group_features),
            list(micro))
    if group.is_cuda:
        return encode_row_ids_torch(*args)
    _extension.backend_for(group, OP)  # "cpu", or the error of a build without the extension
    out = torch.ops.recxla.encode_row_ids(*args)
    return EncodedRows(*out[:6], out[6] if weights is not None else None)


def encode_row_ids_torch(group, slot, sample, ids, weights, slot_position, group_features,
                         micro) -> EncodedRows:
    """`encode_row_ids` in torch ops (the path of ids on a GPU; no checks beyond torch's).
    Arguments and result as encode_row_ids'."""
    device = ids.device
    groups, num_micro, batch = len(group_features), len(micro), sum(micro)
    max_features = max(group_features, default=1)
    on_device = functools.partial(int64_on, device=device)
    micro_of_sample = torch.repeat_interleave(torch.arange(num_micro, device=device),
                                              on_device(micro), output_size=batch)
    k = micro_of_sample.index_select(0, sample)
    position = on_device(slot_position).index_select(0, slot)
    run = group * num_micro + k
    order = torch.sort((run * max_features + position) * max(batch, 1) + sample,
                       stable=True).indices
    run_sizes = torch.bincount(run, minlength=groups * num_micro)
    bounds = torch.zeros(groups * num_micro + 1, dtype=torch.int64, device=device)
    torch.cumsum(run_sizes, 0, out=bounds[1:])
    unique, unique_offsets, inverse = segmented_unique(ids.index_select(0, order), bounds)
    inverse = inverse - torch.repeat_interleave(unique_offsets[:-1], run_sizes,
                                                output_size=order.numel())
    lengths = torch.bincount((group * max_features + position) * max(batch, 1) + sample,
                             minlength=groups * max_features * batch)
    lengths = lengths.view(groups * max_features, batch)
    counts = unique_offsets.diff().view(groups, num_micro)
    counts_host, bounds_host = counts.tolist(), bounds.tolist()
    valid = on_device(g * max_features + f for g in range(groups)
                      for f in range(group_features[g]))
    ordered_weights = None if weights is None else weights.index_select(0, order)
    plan, message_weights, first_sample = [], [], 0
    for k, size in enumerate(micro):
        per_group = [counts_host[g][k] for g in range(groups)]
        unique_k = sum(per_group)
        starts = on_device(accumulate(per_group, initial=0))
        plan += [torch.arange(unique_k, device=device) - torch.repeat_interleave(
            starts[:-1], on_device(per_group), output_size=unique_k), starts]
        runs = [(bounds_host[g * num_micro + k], bounds_host[g * num_micro + k + 1])
                for g in range(groups)]
        take = torch.cat([torch.arange(a, b, device=device) for a, b in runs]) if runs else \
            bounds[:0]
        plan.append(inverse.index_select(0, take) + torch.repeat_interleave(
            starts[:-1], on_device(b - a for a, b in runs), output_size=take.numel()))
        if ordered_weights is not None:
            message_weights.append(ordered_weights.index_select(0, take))
        bag_lengths = lengths.index_select(0, valid)[:, first_sample: first_sample + size]
        offsets = torch.zeros(bag_lengths.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(bag_lengths.reshape(-1), 0, out=offsets[1:])
        plan.append(offsets)
        first_sample += size
    return EncodedRows(order, unique, counts, bounds, inverse, torch.cat(plan),
                       None if weights is None else torch.cat(message_weights))


# -------------------------------------------------------------- the expanded rows' plan

EXPAND_OP = "recxla.expand_row_plan"


class ExpandSection(NamedTuple):
    """Where micro-batch k's expansion lies in expand_row_plan's result: [start, end) of each
    part of the lookup that fills its output's chunks from its message's wire rows."""

    unique_values: slice   # int64 [W_k]: 0 .. W_k - 1 (the message's wire rows)
    unique_offsets: slice  # int64 [2]: 0, W_k
    index: slice           # int64 [C_k]: each output chunk's wire row
    offsets: slice         # int64 [C_k + 1]: 0 .. C_k (one wire row a bag)


def expand_sections(counts: Sequence[int], bounds: Sequence[int], micro: Sequence[int],
                    group_chunks: Sequence[int]) -> List[ExpandSection]:
    """expand_row_plan's layout per micro-batch, from encode_row_ids' counts and bounds as
    host ints (G * M and G * M + 1, run order), the micro-batch sizes and each row group's
    wire rows per row. W_k: the wire rows of micro-batch k's message; C_k: its output's chunks
    (each route fills its group's chunks of its id's row)."""
    num_micro = len(micro)
    sections, at = [], 0
    for k in range(num_micro):
        runs = [(g * num_micro + k, chunks) for g, chunks in enumerate(group_chunks)]
        wire_rows = sum(counts[r] * chunks for r, chunks in runs)
        output_chunks = sum((bounds[r + 1] - bounds[r]) * chunks for r, chunks in runs)
        ends = list(accumulate((wire_rows, 2, output_chunks, output_chunks + 1), initial=at))
        sections.append(ExpandSection(*(slice(a, b) for a, b in zip(ends, ends[1:]))))
        at = ends[-1]
    return sections


@_extension.register_fake("recxla::expand_row_plan")
def _expand_row_plan_fake(order, inverse, counts, bounds, slot, sample, input_lengths,
                          routes_per_slot, micro, group_chunks, group_first_chunk,
                          chunks_per_row):
    return order.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)


def expand_row_plan(order: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor,
                    bounds: torch.Tensor, slot: torch.Tensor, sample: torch.Tensor,
                    input_lengths: torch.Tensor, routes_per_slot: Sequence[int],
                    micro: Sequence[int], group_chunks: Sequence[int],
                    group_first_chunk: Sequence[int], chunks_per_row: int) -> torch.Tensor:
    """The receiver's plan for expanded rows (the sequence module), made with the encoding:
    per micro-batch k, the lookup (`recxla.ops.embedding_bag.pooled_forward`, one bag of one
    wire row per output chunk) that fills its output (input slot by slot, sample by sample, in
    bag order; chunks_per_row chunks an id) from the wire rows its message brings (row group
    after row group, each group's distinct ids in order, group_chunks[g] wire rows each).

    order, inverse, counts, bounds: encode_row_ids' results for the routed ids slot, sample
    (int64 [P], input order: slot by slot, id by id, each id's routes_per_slot[slot] routes one
    after another); input_lengths: int32/int64 [slots, batch], the batch's bag lengths; micro:
    the micro-batch sizes; group_chunks, group_first_chunk: per row group the wire rows of one
    of its rows and the first chunk of the output row they fill. -> int64, laid out as
    `expand_sections` says. Bad input (a chunk no route fills or two routes fill, lengths that
    disagree with the ids) raises a ValueError or TypeError naming the op, the argument and
    the limit.
    """
    for name, t in (("order", order), ("inverse", inverse), ("counts", counts),
                    ("bounds", bounds), ("slot", slot), ("sample", sample),
                    ("input_lengths", input_lengths)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{EXPAND_OP}: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    args = (order, inverse, counts, bounds, slot, sample, input_lengths, list(routes_per_slot),
            list(micro), list(group_chunks), list(group_first_chunk), int(chunks_per_row))
    if order.is_cuda:
        return expand_row_plan_torch(*args)
    _extension.backend_for(order, EXPAND_OP)
    return torch.ops.recxla.expand_row_plan(*args)


def expand_row_plan_torch(order, inverse, counts, bounds, slot, sample, input_lengths,
                          routes_per_slot, micro, group_chunks, group_first_chunk,
                          chunks_per_row) -> torch.Tensor:
    """`expand_row_plan` in torch ops (the path of ids on a GPU; no checks beyond torch's).
    Arguments and result as expand_row_plan's."""
    device = order.device
    num_micro = len(micro)
    on_device = functools.partial(int64_on, device=device)
    lengths = input_lengths.to(torch.int64)
    # Each route's id index in its slot, and its position in its micro-batch's output.
    per_slot = on_device(routes_per_slot)
    slot_ids = lengths.sum(1)
    slot_routes = slot_ids * per_slot
    slot_first_route = torch.cumsum(slot_routes, 0) - slot_routes
    route = torch.arange(slot.numel(), device=device)
    in_slot = torch.div(route - slot_first_route.index_select(0, slot),
                        per_slot.index_select(0, slot), rounding_mode="floor")
    edges = on_device(accumulate(micro, initial=0))
    running = torch.nn.functional.pad(torch.cumsum(lengths, 1), (1, 0))
    per_micro = running.index_select(1, edges).diff(dim=1)  # ids per (slot, micro-batch)
    earlier_micro = torch.cumsum(per_micro, 1) - per_micro
    earlier_slots = torch.cumsum(per_micro, 0) - per_micro
    shift = (earlier_slots - earlier_micro).flatten()
    micro_of_sample = torch.repeat_interleave(torch.arange(num_micro, device=device),
                                              on_device(micro), output_size=sum(micro))
    k_of = micro_of_sample.index_select(0, sample)
    position = (in_slot + shift.index_select(0, slot * num_micro + k_of)).index_select(0, order)
    counts_host, bounds_host = counts.flatten().tolist(), bounds.tolist()
    parts = []
    for k in range(num_micro):
        runs = [g * num_micro + k for g in range(len(group_chunks))]
        ids = [bounds_host[r + 1] - bounds_host[r] for r in runs]
        sizes = [counts_host[r] * c for r, c in zip(runs, group_chunks)]
        wire_rows = sum(sizes)
        take = torch.cat([torch.arange(bounds_host[r], bounds_host[r + 1], device=device)
                          for r in runs]) if runs else on_device([])
        group = torch.repeat_interleave(torch.arange(len(runs), device=device), on_device(ids),
                                        output_size=sum(ids))
        chunks = on_device(group_chunks).index_select(0, group)
        source = on_device(accumulate(sizes[:-1], initial=0)).index_select(0, group) + \
            inverse.index_select(0, take) * chunks
        target = position.index_select(0, take) * chunks_per_row + \
            on_device(group_first_chunk).index_select(0, group)
        # A column-sharded row is several wire rows: one entry per chunk it fills.
        expanded = int(sum(c * n for c, n in zip(group_chunks, ids)))
        entry = torch.repeat_interleave(torch.arange(take.numel(), device=device), chunks,
                                        output_size=expanded)
        step = torch.arange(expanded, device=device) - \
            (torch.cumsum(chunks, 0) - chunks).index_select(0, entry)
        index = torch.empty(expanded, dtype=torch.int64, device=device)
        index.index_copy_(0, target.index_select(0, entry) + step,
                          source.index_select(0, entry) + step)
        parts += [torch.arange(wire_rows, device=device), on_device([0, wire_rows]), index,
                  torch.arange(expanded + 1, device=device)]
    return torch.cat(parts)
