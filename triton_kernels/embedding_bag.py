"""Pooled embedding lookup over deduplicated ids and its fused optimizer update, in Triton (the
GPU path when RECXLA_BACKEND=triton; argument layout in csrc/embedding_bag.cpp). The launchers
take the ops' `lookup`, a recxla.ops.embedding_bag_lookup.BagLookup, and read its fields without
importing the type (the kernels import nothing of recxla.ops).

- Forward: one program per bag (one launch per feature): it walks the bag's ids, loads each id's
  unique row from the table and accumulates the row in registers (BLOCK_D >= dim columns).
- Backward: the ids are grouped by unique row with torch ops (a stable argsort of `inverse` and
  a bincount: a grid-wide sort has no place inside one Triton kernel), then one program per
  unique row (one launch per table) sums its ids' output gradients and applies the optimizer to
  the row. A row belongs to one program, so no atomics are needed.

The per-row formulas are those of csrc/include/recxla/embedding_bag.h. The kernels take plain
pointers and run under TRITON_INTERPRET=1 on CPU tensors, which is how they are tested without
a GPU. They trust their arguments: the launchers here are internal, and every public entry
(recxla.ops.embedding_bag's functions, FusedPooledLookup) checks the layout and the data on the
device first (recxla.ops.embedding_bag_checks: rows in range and strictly increasing, ids
inside their table's segment, offsets monotone).
"""

from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD = 0, 1, 2, 3
MEAN = 1


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _pool_kernel(weight_ptr, rows_ptr, inverse_ptr, offsets_ptr, psw_ptr, out_ptr, bag_base, dim,
                 out_stride, column, HAS_PSW: tl.constexpr, IS_MEAN: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    first = tl.load(offsets_ptr + bag_base + b)
    last = tl.load(offsets_ptr + bag_base + b + 1)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < dim
    acc = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    for i in range(first, last):
        row = tl.load(rows_ptr + tl.load(inverse_ptr + i)).to(tl.int64)
        w = tl.load(weight_ptr + row * dim + d, mask=dmask, other=0.0)
        if HAS_PSW:
            acc += tl.load(psw_ptr + i) * w
        else:
            acc += w
    if IS_MEAN:
        count = (last - first).to(tl.float32)
        acc = acc * tl.where(count > 0, 1.0 / tl.maximum(count, 1.0), 1.0)
    tl.store(out_ptr + b * out_stride + column + d, acc, mask=dmask)


@triton.jit
def _update_kernel(weight_ptr, state_ptr, rows_ptr, start_ptr, grad_offset_ptr, scale_ptr,
                   grad_ptr, out_ptr, first_unique, dim, lr, eps, weight_decay,
                   OPTIM: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    u = first_unique + j
    e0 = tl.load(start_ptr + u)
    e1 = tl.load(start_ptr + u + 1)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < dim
    g = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    for e in range(e0, e1):
        src = tl.load(grad_offset_ptr + e)
        g += tl.load(scale_ptr + e) * tl.load(grad_ptr + src + d, mask=dmask, other=0.0)
    if OPTIM == 0:
        tl.store(out_ptr + j * dim + d, g, mask=dmask)
    else:
        row = tl.load(rows_ptr + u).to(tl.int64)
        w = tl.load(weight_ptr + row * dim + d, mask=dmask, other=0.0)
        gd = tl.where(weight_decay != 0.0, g + weight_decay * w, g)
        if OPTIM == 1:
            w = w + (-lr) * gd
        elif OPTIM == 2:
            m = tl.load(state_ptr + row * dim + d, mask=dmask, other=0.0) + gd * gd
            tl.store(state_ptr + row * dim + d, m, mask=dmask)
            w = w + ((-lr) * gd) / (tl.sqrt_rn(m) + eps)
        else:
            # tl.reduce with a local combine rather than tl.sum (and tl.full, not tl.zeros): the
            # jit functions of triton's own library run under the interpreter only when
            # TRITON_INTERPRET was set before triton was imported, which a test process cannot
            # promise; builtins and this module's functions always do.
            squares = tl.reduce(tl.where(dmask, gd * gd, 0.0), 0, _add)
            m = tl.load(state_ptr + row) + squares / dim
            tl.store(state_ptr + row, m)
            multiplier = lr / (tl.sqrt_rn(m) + eps)
            correction = tl.where(weight_decay != 0.0, 1.0 - multiplier * weight_decay, 1.0)
            w = correction * w - g * multiplier
        tl.store(weight_ptr + row * dim + d, w, mask=dmask)


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(max(dim, 1)))


def _columns(weights, feature_table) -> List[int]:
    columns, c = [], 0
    for t in feature_table:
        columns.append(c)
        c += weights[t].shape[1]
    return columns + [c]


def embedding_bag_forward_triton(lookup, out=None, feature_columns=None) -> torch.Tensor:
    """-> float32 [B, total_dim] (written into `out` when given, each feature at its
    feature_columns entry when given); arguments as recxla.ops.embedding_bag.pooled_forward."""
    weights, unique_values, _, inverse, offsets, psw, feature_table, pooling, batch_size = lookup
    columns = _columns(weights, feature_table) if feature_columns is None else \
        list(feature_columns)
    if out is None:
        out = torch.empty(batch_size, columns[-1], dtype=torch.float32,
                          device=unique_values.device)
    if out.numel() == 0:
        return out
    for f, t in enumerate(feature_table):
        dim = weights[t].shape[1]
        if dim == 0:
            continue
        _pool_kernel[(batch_size,)](
            weights[t], unique_values, inverse, offsets, psw if psw is not None else offsets,
            out, f * batch_size, dim, out.stride(0), columns[f], HAS_PSW=psw is not None,
            IS_MEAN=pooling[t] == MEAN, BLOCK_D=_block(dim),
        )
    return out


def group_ids_by_row(lookup, signs: Optional[Sequence[float]] = None, feature_columns=None,
                     row_stride: Optional[int] = None, grad_offsets=None):
    """The ids of each unique row, as a CSR in torch ops: -> (start int64 [U + 1], grad_offset
    int64 [N] into grad_output (its rows row_stride apart, each feature's columns at
    feature_columns; by default [B, total_dim] contiguous; with grad_offsets, int64 [F * B],
    each bag's row where that says), scale float32 [N] = per-sample weight x (1 / bag length
    for mean) x sign), entries of a row in id order."""
    weights, unique_values, _, inverse, offsets, psw, feature_table, pooling, batch_size = lookup
    num_unique = unique_values.numel()
    device = inverse.device
    side_by_side = _columns(weights, feature_table)
    columns = torch.tensor(side_by_side[:-1] if feature_columns is None else list(feature_columns),
                           dtype=torch.int64, device=device)
    table = torch.tensor(list(feature_table), dtype=torch.int64, device=device)
    stride = side_by_side[-1] if row_stride is None else row_stride  # between samples' rows
    lengths = offsets.diff()
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths,
                                  output_size=inverse.numel())
    feature = bag // max(batch_size, 1)
    grad_offset = grad_offsets[bag] if grad_offsets is not None else \
        (bag % max(batch_size, 1)) * stride + columns[feature]
    mean = torch.tensor([p == MEAN for p in pooling] + [False], device=device)[table][feature]
    sign = torch.tensor(list(signs) if signs is not None else [1.0] * len(weights) + [1.0],
                        dtype=torch.float32, device=device)
    bag_scale = torch.where(mean, sign[table[feature]] * (1.0 / lengths[bag].float()),
                            sign[table[feature]])
    scale = psw.float() * bag_scale if psw is not None else bag_scale
    order = torch.argsort(inverse, stable=True)
    start = torch.zeros(num_unique + 1, dtype=torch.int64, device=device)
    torch.cumsum(torch.bincount(inverse, minlength=num_unique), 0, out=start[1:])
    return start, grad_offset[order].contiguous(), scale[order].contiguous()


def _run_update(grad_output, lookup, states, optim, hparams, outs, feature_columns=None,
                grad_offsets=None):
    weights, unique_values, unique_offsets = lookup[:3]
    signs = [hparams[4 * t + 3] for t in range(len(weights))] if hparams else None
    if grad_offsets is not None:  # read where it lies (contiguous: checked by the caller)
        grad = grad_output
        start, grad_offset, scale = group_ids_by_row(lookup, signs, grad_offsets=grad_offsets)
    elif feature_columns is None:
        grad = grad_output.contiguous().float()
        start, grad_offset, scale = group_ids_by_row(lookup, signs)
    else:  # read where it lies: the kernel takes its offsets from the first element
        grad = grad_output
        row_stride = grad.stride(0) if grad.shape[0] > 1 else grad.shape[1]
        start, grad_offset, scale = group_ids_by_row(lookup, signs, feature_columns, row_stride)
    bounds = unique_offsets.tolist()
    for t, w in enumerate(weights):
        n, dim = bounds[t + 1] - bounds[t], w.shape[1]
        if n == 0 or dim == 0 or (optim[t] == NONE and outs[t] is None):
            continue
        lr, eps, wd = (hparams[4 * t : 4 * t + 3]) if hparams else (0.0, 0.0, 0.0)
        has_state = states is not None and states[t] is not None and states[t].numel()
        state = states[t] if has_state else w
        _update_kernel[(n,)](
            w, state, unique_values, start, grad_offset, scale, grad,
            outs[t] if outs[t] is not None else w, bounds[t], dim, float(lr), float(eps),
            float(wd), OPTIM=int(optim[t]), BLOCK_D=_block(dim),
        )


def embedding_bag_unique_grad_triton(grad_output, lookup,
                                     feature_columns=None) -> List[torch.Tensor]:
    """-> T float32 [U_t, D_t]; arguments as recxla.ops.embedding_bag.unique_grad."""
    bounds = lookup.unique_offsets.tolist()
    outs = [torch.zeros(bounds[t + 1] - bounds[t], w.shape[1], dtype=torch.float32,
                        device=w.device) for t, w in enumerate(lookup.weights)]
    _run_update(grad_output, lookup, None, [NONE] * len(lookup.weights), None, outs,
                feature_columns)
    return outs


def embedding_bag_backward_update_triton(grad_output, lookup, states, optim, hparams,
                                         grad_offsets=None) -> None:
    """In place; arguments as recxla.ops.embedding_bag.backward_update."""
    _run_update(grad_output, lookup, states, optim, hparams, [None] * len(lookup.weights),
                grad_offsets=grad_offsets)
