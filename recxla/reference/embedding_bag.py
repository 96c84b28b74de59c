"""Reference pooled embedding lookup over deduplicated ids, its gradient and the fused sparse
optimizers, in plain PyTorch (the oracle of tests/test_embedding_bag.py; the kernels are
csrc/cpu/embedding_bag.cpp, csrc/cuda/embedding_bag.cu and triton_kernels/embedding_bag.py).

Each function takes the ops' argument, a `BagLookup` (recxla.ops.embedding_bag_lookup: the
tables, ids and bags, with their shapes), as recxla.ops.embedding_bag's functions do.
"""

from typing import List, Optional, Sequence

import torch

from recxla.ops.embedding_bag_enums import (  # noqa: F401  (the op's codes, public here too)
    ADAGRAD, MEAN, NONE, NUM_HPARAMS, ROWWISE_ADAGRAD, SGD, SUM,
)
from recxla.ops.embedding_bag_lookup import BagLookup  # the ops' argument, public here too


def _bag_layout(offsets: torch.Tensor, num_features: int, batch_size: int):
    """Per id: its bag's sample index, and the bag length (for mean pooling)."""
    lengths = offsets.diff()
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device),
                                        lengths)
    return bag_of_id % max(batch_size, 1), lengths[bag_of_id]


def _id_scale(pool, lengths_of_id, per_sample_weights, f_slice):
    scale = torch.ones(lengths_of_id[f_slice].shape, dtype=torch.float32,
                       device=lengths_of_id.device)
    if per_sample_weights is not None:
        scale = per_sample_weights[f_slice].float()
    if pool == MEAN:
        scale = scale * (1.0 / lengths_of_id[f_slice].float())
    return scale


def embedding_bag_forward_ref(lookup: BagLookup) -> torch.Tensor:
    """-> float32 [B, sum_f D_{feature_table[f]}]; differentiable with respect to the weights
    and the per-sample weights."""
    (weights, unique_values, _, inverse, offsets, per_sample_weights, feature_table, pooling,
     batch_size) = lookup
    ids = unique_values[inverse].long()
    sample_of_id, _ = _bag_layout(offsets, len(feature_table), batch_size)
    outs = []
    for f, t in enumerate(feature_table):
        w = weights[t]
        first, last = offsets[f * batch_size].item(), offsets[(f + 1) * batch_size].item()
        rows = w[ids[first:last]]
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[first:last, None]
        out = torch.zeros(batch_size, w.shape[1], dtype=w.dtype, device=w.device)
        out = out.index_add(0, sample_of_id[first:last], rows)
        if pooling[t] == MEAN:
            lengths = offsets[f * batch_size : (f + 1) * batch_size + 1].diff()
            out = out * torch.where(lengths > 0, 1.0 / lengths.clamp(min=1).float(), 1.0)[:, None]
        outs.append(out)
    if not outs:
        return torch.zeros(batch_size, 0, dtype=torch.float32, device=offsets.device)
    return torch.cat(outs, dim=1)


def embedding_bag_unique_grad_ref(grad_output: torch.Tensor, lookup: BagLookup,
                                  feature_columns: Optional[Sequence[int]] = None
                                  ) -> List[torch.Tensor]:
    """grad_output: float32 [B, total_dim] -> T float32 [U_t, D_t], the weight gradient at each
    unique row (ids' output gradients, scaled by per-sample weight and 1 / bag length for mean).
    feature_columns: feature f's gradient is grad_output[:, feature_columns[f]:][:, :D]
    instead of the features side by side."""
    (weights, _, unique_offsets, inverse, offsets, per_sample_weights, feature_table, pooling,
     batch_size) = lookup
    uoff = unique_offsets.tolist()
    sample_of_id, lengths_of_id = _bag_layout(offsets, len(feature_table), batch_size)
    grads = [
        torch.zeros(uoff[t + 1] - uoff[t], w.shape[1], dtype=torch.float32, device=w.device)
        for t, w in enumerate(weights)
    ]
    column = 0
    for f, t in enumerate(feature_table):
        dim = weights[t].shape[1]
        first, last = offsets[f * batch_size].item(), offsets[(f + 1) * batch_size].item()
        scale = _id_scale(pooling[t], lengths_of_id, per_sample_weights, slice(first, last))
        at = column if feature_columns is None else feature_columns[f]
        g = grad_output[sample_of_id[first:last], at : at + dim] * scale[:, None]
        grads[t].index_add_(0, inverse[first:last] - uoff[t], g)
        column += dim
    return grads


def place_features_ref(pooled: torch.Tensor, lookup: BagLookup, out: torch.Tensor,
                       feature_columns: Sequence[int]) -> torch.Tensor:
    """What pooled_forward(lookup, out, feature_columns) makes of `out`: a copy of it with
    feature f's columns of `pooled` (embedding_bag_forward_ref's [B, total_dim]) at
    feature_columns[f]."""
    placed, column = out.clone(), 0
    for f, t in enumerate(lookup.feature_table):
        dim = lookup.weights[t].shape[1]
        placed[:, feature_columns[f]: feature_columns[f] + dim] = pooled[:, column: column + dim]
        column += dim
    return placed


def apply_optimizer_ref(
    weight: torch.Tensor,
    state: Optional[torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    optim: int,
    lr: float,
    eps: float,
    weight_decay: float,
    grad_sign: float = 1.0,
) -> None:
    """Update weight[rows] (float32 [E, D]) in place with the gradient rows grad [len(rows), D];
    state: Adagrad float32 [E, D], row-wise Adagrad float32 with E values (updated in place).
    The formulas are those of csrc/include/recxla/embedding_bag.h, in torch ops."""
    rows = rows.long()
    w = weight[rows]
    g = grad * grad_sign
    gd = g + weight_decay * w if weight_decay != 0 else g
    if optim == SGD:
        weight[rows] = w + (-lr) * gd
    elif optim == ADAGRAD:
        m = state[rows] + gd * gd
        state[rows] = m
        weight[rows] = w + ((-lr) * gd) / (m.sqrt() + eps)
    elif optim == ROWWISE_ADAGRAD:
        flat = state.view(-1)
        m = flat[rows] + (gd * gd).sum(dim=1) / w.shape[1]
        flat[rows] = m
        multiplier = lr / (m.sqrt() + eps)
        correction = 1.0 - multiplier * weight_decay if weight_decay != 0 else torch.ones_like(m)
        weight[rows] = correction[:, None] * w - g * multiplier[:, None]
    elif optim != NONE:
        raise ValueError(f"apply_optimizer_ref: unknown optim {optim}")


def embedding_bag_backward_update_ref(
    grad_output: torch.Tensor,
    lookup: BagLookup,
    states: Sequence[torch.Tensor],
    optim: Sequence[int],
    hparams: Sequence[float],
) -> None:
    """Reduce the gradient per unique row and update lookup.weights and states in place (see
    recxla.ops.embedding_bag.backward_update)."""
    grads = embedding_bag_unique_grad_ref(grad_output, lookup)
    uoff = lookup.unique_offsets.tolist()
    with torch.no_grad():
        for t, w in enumerate(lookup.weights):
            lr, eps, wd, sign = hparams[NUM_HPARAMS * t : NUM_HPARAMS * (t + 1)]
            rows = lookup.unique_values[uoff[t] : uoff[t + 1]]
            apply_optimizer_ref(w, states[t], rows, grads[t], optim[t], lr, eps, wd, sign)
