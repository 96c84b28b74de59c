"""Data checks of the pooled embedding ops for the kernels that trust their arguments (CUDA,
Triton); the CPU kernels check the same in C++ (csrc/include/recxla/embedding_bag_checks.h,
csrc/cpu/embedding_bag_cpu.h).

`check_lookup_data` runs every check that needs the data as torch ops on the inputs' device,
with no host sync, into one small flag tensor; `raise_for_lookup_flags` reads it (one sync) and
raises what the CPU kernel raises for the same data. recxla.ops.embedding_bag calls `check_lookup`
before any CUDA or Triton kernel launches.
"""

import math
from typing import Sequence

import torch

from recxla.host_copy import int64_on
from recxla.ops.embedding_bag_enums import (
    ADAGRAD, MEAN, NONE, NUM_HPARAMS, ROWWISE_ADAGRAD, SGD, SUM,
)
from recxla.ops.embedding_bag_lookup import BagLookup

_NO_ERROR = 2**62  # "no bad index" in the flag tensor (above any index)


def _check_layout(op: str, lookup: BagLookup) -> None:
    """Shapes, dtypes and devices (host only), as csrc/include/recxla/embedding_bag_checks.h."""
    (weights, unique_values, unique_offsets, inverse, offsets, psw, feature_table, pooling,
     batch_size) = lookup
    device = unique_values.device
    if batch_size < 0:
        raise ValueError(f"{op}: batch_size must be >= 0, got {batch_size}")
    if len(pooling) != len(weights):
        raise ValueError(f"{op}: pooling must have one entry per table ({len(weights)}), got "
                         f"{len(pooling)}")
    for t, w in enumerate(weights):
        if w.dim() != 2 or w.dtype != torch.float32 or not w.is_contiguous():
            raise TypeError(f"{op}: weights[{t}] must be a contiguous 2-D float32 tensor, got "
                            f"{w.dtype} {tuple(w.shape)}")
        if w.device != device:
            raise ValueError(f"{op}: weights[{t}] is on {w.device} but unique_values is on "
                             f"{device}")
        if pooling[t] not in (SUM, MEAN):
            raise ValueError(f"{op}: pooling[{t}] must be 0 (sum) or 1 (mean), got {pooling[t]}")
    for f, t in enumerate(feature_table):
        if not 0 <= t < len(weights):
            raise ValueError(f"{op}: feature_table[{f}] = {t} is not a table index in "
                             f"[0, {len(weights)})")
    num_features, num_tables = len(feature_table), len(weights)
    wanted = [("unique_values", unique_values, (torch.int32, torch.int64), None, ""),
              ("unique_offsets", unique_offsets, (torch.int64,), num_tables + 1,
               f"num_tables + 1 = {num_tables + 1} entries"),
              ("inverse", inverse, (torch.int64,), None, ""),
              ("offsets", offsets, (torch.int64,), num_features * batch_size + 1,
               f"num_features * batch_size + 1 = {num_features * batch_size + 1} entries")]
    if psw is not None:
        wanted.append(("per_sample_weights", psw, (torch.float32,), inverse.numel(),
                       f"one weight per id ({inverse.numel()})"))
    for name, x, dtypes, numel, what in wanted:
        if x.dtype not in dtypes:
            names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{op}: {name} must be {names}, got {x.dtype}")
        if x.dim() != 1 or (numel is not None and x.numel() != numel):
            raise ValueError(f"{op}: {name} must be 1-D" + (f" with {what}" if what else "")
                             + f", got shape {list(x.shape)}")
        if x.device != device:
            raise ValueError(f"{op}: all tensors must be on {device}, got {name} on {x.device}")


def check_feature_columns(op: str, lookup: BagLookup, tensor: torch.Tensor, name: str,
                          feature_columns: Sequence[int]) -> None:
    """`tensor` (an op's out or grad_output) laid out as feature_columns says, as
    csrc/include/recxla/embedding_bag_checks.h's place_features checks it: [B, C], adjacent
    columns, rows at least C apart, each feature's columns inside [0, C) and disjoint."""
    weights, feature_table, batch_size = lookup.weights, lookup.feature_table, lookup.batch_size
    if len(feature_columns) != len(feature_table):
        raise ValueError(f"{op}: feature_columns must have one entry per feature "
                         f"({len(feature_table)}), got {len(feature_columns)}")
    if tensor.dim() != 2 or tensor.shape[0] != batch_size:
        raise ValueError(f"{op}: {name} must be [batch_size, columns] = [{batch_size}, C], got "
                         f"{list(tensor.shape)}")
    width = tensor.shape[1]
    if tensor.stride(1) != 1 and width > 1:
        raise ValueError(f"{op}: {name}'s columns must be adjacent (column stride 1), got "
                         f"stride {tensor.stride(1)}")
    if tensor.shape[0] > 1 and tensor.stride(0) < width:
        raise ValueError(f"{op}: {name}'s rows must not overlap (row stride >= {width}), got "
                         f"{tensor.stride(0)}")
    ranges = []
    for f, (first, t) in enumerate(zip(feature_columns, feature_table)):
        dim = weights[t].shape[1]
        if first < 0 or first + dim > width:
            raise ValueError(f"{op}: feature_columns[{f}] = {first} puts feature {f}'s {dim} "
                             f"columns outside [0, {width}) of {name}")
        if dim:
            ranges.append((first, first + dim, f))
    ranges.sort()
    for (_, end, a), (first, _, b) in zip(ranges, ranges[1:]):
        if first < end:
            raise ValueError(f"{op}: features {a} and {b} overlap in {name} (feature_columns)")


def check_lookup_data(lookup: BagLookup, increasing: bool) -> torch.Tensor:
    """The CPU kernels' data checks as torch ops on the inputs' device, with no host sync.

    lookup: its layout already checked; increasing: also require each table's unique_values to
    be strictly increasing (what the fused update needs: a row listed twice would be updated
    twice, by racing threads on GPU). Returns int64 [7]: offsets[0], offsets[-1], then the first
    bad index of each check or 2**62: unique_offsets (0 when bad), offsets decreasing (bag), rows
    out of range (table), rows not increasing (table), ids outside their table's segment
    (feature). Every index used is clamped, so bad data reads nothing out of bounds.
    """
    (weights, unique_values, unique_offsets, inverse, offsets, _, feature_table, _,
     batch_size) = lookup
    device, n, u = unique_values.device, inverse.numel(), unique_values.numel()
    num_tables, num_features = len(weights), len(feature_table)
    big = torch.full((), _NO_ERROR, dtype=torch.int64, device=device)
    first = lambda bad, index: torch.where(bad, index, big).min() if bad.numel() else big  # noqa
    uo = unique_offsets
    uo_bad = (uo[0] != 0) | (uo[-1] != u) | (uo[1:] < uo[:-1]).any()
    decreasing = first(offsets[1:] < offsets[:-1], torch.arange(offsets.numel() - 1, device=device))
    rows = int64_on([w.shape[0] for w in weights] + [0], device)
    positions = torch.arange(u, device=device)
    table = (torch.searchsorted(uo, positions, right=True) - 1).clamp(0, max(num_tables - 1, 0))
    values = unique_values.long()
    out_of_range = first((values < 0) | (values >= rows[table]), table)
    unsorted = big
    if increasing and u > 1:
        repeat = (table[1:] == table[:-1]) & (values[1:] <= values[:-1])
        unsorted = first(repeat, table[1:])
    outside = big
    if n and num_features:
        bounds = offsets[(torch.arange(num_features + 1, device=device) * batch_size)
                         .clamp(max=offsets.numel() - 1)]
        feature = (torch.searchsorted(bounds, torch.arange(n, device=device), right=True) - 1) \
            .clamp(0, num_features - 1)
        t = int64_on(feature_table, device)[feature]
        ends = uo.clamp(0, u)
        outside = first((inverse < ends[t]) | (inverse >= ends[t + 1]), feature)
    return torch.stack([offsets[0], offsets[-1], torch.where(uo_bad, 0, big), decreasing,
                        out_of_range, unsorted, outside])


def raise_for_lookup_flags(op: str, flags: torch.Tensor, weights, num_ids: int) -> None:
    """Reads the flags of `check_lookup_data` (one host sync) and raises what the CPU kernel
    raises for the same data: ValueError for offsets and order, IndexError for ranges."""
    start, end, uo_bad, decreasing, out_of_range, unsorted, outside = flags.tolist()
    if uo_bad < _NO_ERROR:
        raise ValueError(f"{op}: unique_offsets must start at 0, be non-decreasing and end at "
                         "len(unique_values)")
    if start != 0 or end != num_ids:
        raise ValueError(f"{op}: offsets must start at 0 and end at the number of ids "
                         f"({num_ids}), got {start} and {end}")
    if decreasing < _NO_ERROR:
        raise ValueError(f"{op}: offsets must be non-decreasing (bag lengths >= 0)")
    if min(out_of_range, unsorted) < _NO_ERROR:
        if out_of_range <= unsorted:
            raise IndexError(f"{op}: unique_values of table {out_of_range} must lie in "
                             f"[0, {weights[out_of_range].shape[0]})")
        raise ValueError(f"{op}: unique_values must be strictly increasing within each table's "
                         f"segment, but table {unsorted}'s are not")
    if outside < _NO_ERROR:
        raise IndexError(f"{op}: inverse holds an index outside the unique_values segment of its "
                         f"table (feature {outside})")


def check_lookup(op: str, lookup: BagLookup, increasing: bool, data: bool = True) -> None:
    """Layout and (with `data`: one host sync) data checks of `lookup` for a backend whose
    kernels trust them."""
    _check_layout(op, lookup)
    if not data:
        return
    flags = check_lookup_data(lookup, increasing)
    raise_for_lookup_flags(op, flags, lookup.weights, lookup.inverse.numel())


def check_optimizer(op, weights, states, optim, hparams) -> None:
    """The optimizer arguments of embedding_bag_backward_update (host only), as the C++
    `check_optimizer` raises them: one kind, state and NUM_HPARAMS (lr, eps, weight_decay,
    grad_sign) per table."""
    num_tables = len(weights)
    if len(optim) != num_tables:
        raise ValueError(f"{op}: optim must have one entry per table ({num_tables}), got "
                         f"{len(optim)}")
    if len(states) != num_tables:
        raise ValueError(f"{op}: states must have one tensor per table ({num_tables}), got "
                         f"{len(states)}")
    if len(hparams) != NUM_HPARAMS * num_tables:
        raise ValueError(f"{op}: hparams must hold {NUM_HPARAMS} values per table "
                         f"({NUM_HPARAMS * num_tables}), got {len(hparams)}")
    for t, (w, kind) in enumerate(zip(weights, optim)):
        if kind not in (NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD):
            raise ValueError(f"{op}: optim[{t}] must be 0 (none), 1 (SGD), 2 (Adagrad) or 3 "
                             f"(row-wise Adagrad), got {kind}")
        if kind in (ADAGRAD, ROWWISE_ADAGRAD):
            s = states[t]
            want = w.numel() if kind == ADAGRAD else w.shape[0]
            if s.dtype != torch.float32:
                raise TypeError(f"{op}: states[{t}] must be float32, got {s.dtype}")
            if not s.is_contiguous() or s.numel() != want:
                what = "one per weight" if kind == ADAGRAD else "one per row"
                raise ValueError(f"{op}: states[{t}] must be a contiguous tensor of {want} "
                                 f"values ({what}), got shape {list(s.shape)}")
            if s.device != w.device:
                raise ValueError(f"{op}: states[{t}] is on {s.device} but the weights are on "
                                 f"{w.device}")
        first = NUM_HPARAMS * t
        lr, eps, weight_decay, sign = (float(h) for h in hparams[first:first + NUM_HPARAMS])
        for k, (name, value) in enumerate((("lr", lr), ("eps", eps),
                                           ("weight_decay", weight_decay))):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{op}: hparams[{first + k}] ({name} of table {t}) must be "
                                 f"finite and >= 0, got {value}")
        if sign not in (1.0, -1.0):
            raise ValueError(f"{op}: hparams[{first + 3}] (grad_sign of table {t}) must be 1 or "
                             f"-1, got {sign}")


def check_grad_offsets(op: str, lookup: BagLookup, grad_output: torch.Tensor,
                       grad_offsets: torch.Tensor, data: bool = True) -> None:
    """backward_update's grad_offsets for a backend whose kernels trust them, as the C++ checks
    raise them (csrc/include/recxla/embedding_bag_checks.h, csrc/cpu/embedding_bag_backward.cpp):
    grad_output contiguous float32, grad_offsets int64 [F * B], and (with `data`: one host
    sync) every non-empty bag's gradient row inside grad_output."""
    device = lookup.unique_values.device
    bags = len(lookup.feature_table) * lookup.batch_size
    if grad_output.dtype != torch.float32:
        raise TypeError(f"{op}: grad_output must be float32, got {grad_output.dtype}")
    if not grad_output.is_contiguous():
        raise ValueError(f"{op}: grad_output must be contiguous when grad_offsets places its "
                         "rows")
    if grad_output.device != device:
        raise ValueError(f"{op}: grad_output is on {grad_output.device} but unique_values is on "
                         f"{device}")
    if grad_offsets.dtype != torch.int64:
        raise TypeError(f"{op}: grad_offsets must be int64, got {grad_offsets.dtype}")
    if grad_offsets.dim() != 1 or grad_offsets.numel() != bags:
        raise ValueError(f"{op}: grad_offsets must be 1-D with num_features * batch_size = "
                         f"{bags} entries, got shape {list(grad_offsets.shape)}")
    if grad_offsets.device != device:
        raise ValueError(f"{op}: grad_offsets is on {grad_offsets.device} but unique_values is "
                         f"on {device}")
    if not bags or not data:
        return
    dims = int64_on([lookup.weights[t].shape[1] for t in lookup.feature_table], device)
    dim = dims.repeat_interleave(lookup.batch_size)
    used = lookup.offsets[1:] != lookup.offsets[:-1]
    bad = used & ((grad_offsets < 0) | (grad_offsets > grad_output.numel() - dim))
    index = torch.where(bad, torch.arange(bags, device=device),
                        torch.full((), _NO_ERROR, device=device)).min()
    first = int(index)
    if first < _NO_ERROR:
        raise IndexError(f"{op}: grad_offsets[{first}] = {int(grad_offsets[first])} puts bag "
                         f"{first}'s {int(dim[first])}-wide gradient row outside grad_output's "
                         f"{grad_output.numel()} elements")
