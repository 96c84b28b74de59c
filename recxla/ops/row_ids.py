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

from itertools import accumulate
from typing import List, NamedTuple, Optional, Sequence

import torch

from recxla import _extension
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
    on_device = lambda values: torch.tensor(list(values), dtype=torch.int64,  # noqa: E731
                                            device=device)
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
