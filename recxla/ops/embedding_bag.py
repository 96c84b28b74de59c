"""Pooled embedding lookup over deduplicated ids with a fused sparse optimizer.

The three ops of csrc/embedding_bag.cpp (argument layout documented there and in
recxla.reference.embedding_bag) get their fake kernels here, a dispatcher per op (C++ on CPU, CUDA
or Triton on GPU following RECXLA_BACKEND, the reference when the extension is missing), and the
autograd Function `FusedPooledLookup` that joins them: its forward pools the rows, its backward
either updates the rows in place (the weights get no .grad, as in FBGEMM's TBE) or, for tables
without an optimizer, returns an ordinary dense gradient.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from recxla import _extension
from recxla.reference import embedding_bag as reference

SUM, MEAN = reference.SUM, reference.MEAN
NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD = (
    reference.NONE, reference.SGD, reference.ADAGRAD, reference.ROWWISE_ADAGRAD,
)
NUM_HPARAMS = reference.NUM_HPARAMS


@torch.library.register_fake("recxla::embedding_bag_forward")
def _forward_fake(weights, unique_values, unique_offsets, inverse, offsets, psw, feature_table,
                  pooling, batch_size):
    total_dim = sum(weights[t].shape[1] for t in feature_table)
    return unique_values.new_empty((batch_size, total_dim), dtype=torch.float32)


@torch.library.register_fake("recxla::embedding_bag_unique_grad")
def _unique_grad_fake(grad_output, weights, unique_values, unique_offsets, inverse, offsets, psw,
                      feature_table, pooling, batch_size):
    ctx = torch.library.get_ctx()
    return [grad_output.new_empty((ctx.new_dynamic_size(), w.shape[1])) for w in weights]


@torch.library.register_fake("recxla::embedding_bag_backward_update")
def _backward_update_fake(grad_output, weights, states, unique_values, unique_offsets, inverse,
                          offsets, psw, feature_table, pooling, batch_size, optim, hparams):
    return None


def pooled_forward(
    weights: Sequence[torch.Tensor],
    unique_values: torch.Tensor,
    unique_offsets: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_table: Sequence[int],
    pooling: Sequence[int],
    batch_size: int,
) -> torch.Tensor:
    """Pool the rows of every bag. -> float32 [B, sum_f D_{feature_table[f]}].

    weights: T float32 [E_t, D_t]; unique_values: int32/int64 [U] (table by table, segment bounds
    unique_offsets int64 [T + 1]); inverse: int64 [N] into unique_values; offsets: int64
    [F * B + 1] bag bounds; per_sample_weights: float32 [N] or None; feature_table: F table
    indices; pooling: T ints (0 sum, 1 mean).
    """
    args = (list(weights), unique_values, unique_offsets, inverse, offsets, per_sample_weights,
            list(feature_table), list(pooling), batch_size)
    backend = _extension.backend_for(unique_values)
    if backend == "triton":
        from recxla.triton_kernels.embedding_bag import embedding_bag_forward_triton

        return embedding_bag_forward_triton(*args)
    if backend == "reference":
        return reference.embedding_bag_forward_ref(*args)
    return torch.ops.recxla.embedding_bag_forward(*args)


def unique_grad(
    grad_output: torch.Tensor,
    weights: Sequence[torch.Tensor],
    unique_values: torch.Tensor,
    unique_offsets: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_table: Sequence[int],
    pooling: Sequence[int],
    batch_size: int,
) -> List[torch.Tensor]:
    """grad_output float32 [B, total_dim] -> T float32 [U_t, D_t]: the weight gradient of each
    table at its unique rows (a dense gradient is zero elsewhere)."""
    args = (grad_output, list(weights), unique_values, unique_offsets, inverse, offsets,
            per_sample_weights, list(feature_table), list(pooling), batch_size)
    backend = _extension.backend_for(unique_values)
    if backend == "triton":
        from recxla.triton_kernels.embedding_bag import embedding_bag_unique_grad_triton

        return embedding_bag_unique_grad_triton(*args)
    if backend == "reference":
        return reference.embedding_bag_unique_grad_ref(*args)
    return list(torch.ops.recxla.embedding_bag_unique_grad(*args))


def backward_update(
    grad_output: torch.Tensor,
    weights: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    unique_values: torch.Tensor,
    unique_offsets: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_table: Sequence[int],
    pooling: Sequence[int],
    batch_size: int,
    optim: Sequence[int],
    hparams: Sequence[float],
) -> None:
    """Reduce grad_output per unique row and apply each table's optimizer to those rows in place.

    optim: T ints (NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD); states: T float32 tensors (Adagrad
    [E_t, D_t], row-wise Adagrad E_t values, else unused); hparams: 4 * T floats, per table
    (lr, eps, weight_decay, grad_sign). unique_values must be strictly increasing per table.
    """
    args = (grad_output, list(weights), list(states), unique_values, unique_offsets, inverse,
            offsets, per_sample_weights, list(feature_table), list(pooling), batch_size,
            list(optim), [float(h) for h in hparams])
    backend = _extension.backend_for(unique_values)
    if backend == "triton":
        from recxla.triton_kernels.embedding_bag import embedding_bag_backward_update_triton

        return embedding_bag_backward_update_triton(*args)
    if backend == "reference":
        return reference.embedding_bag_backward_update_ref(*args)
    torch.ops.recxla.embedding_bag_backward_update(*args)


# What the backward asks for, once per step: per table its optimizer kind, state tensor and
# (lr, eps, weight_decay, grad_sign); tables of kind NONE get a dense gradient instead.
OptimizerStep = Callable[[], Tuple[List[int], List[torch.Tensor], List[float]]]


@dataclass
class LookupPlan:
    """The static part of one lookup: feature_table (F ints), pooling (T ints), batch_size, and
    the optimizer callback (None: every table gets a dense gradient)."""

    feature_table: List[int]
    pooling: List[int]
    batch_size: int
    optimizer_step: Optional[OptimizerStep] = None


class FusedPooledLookup(torch.autograd.Function):
    """out = pooled_forward(...); backward updates the rows of tables with an optimizer in place.

    Inputs: plan, unique_values, unique_offsets, inverse, offsets, per_sample_weights, *weights.
    Per-sample weights get a gradient when they require one (computed before any row moves).
    """

    @staticmethod
    def forward(ctx, plan, unique_values, unique_offsets, inverse, offsets, psw, *weights):
        out = pooled_forward(weights, unique_values, unique_offsets, inverse, offsets, psw,
                             plan.feature_table, plan.pooling, plan.batch_size)
        ctx.plan = plan
        # The weights are kept as objects, not saved tensors: the fused update changes them in
        # place, and an earlier lookup's backward in the same step may already have done so.
        ctx.weights = weights
        ctx.save_for_backward(unique_values, unique_offsets, inverse, offsets, psw)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        plan = ctx.plan
        unique_values, unique_offsets, inverse, offsets, psw = ctx.saved_tensors
        weights = [w.detach() for w in ctx.weights]
        grad_output = grad_output.contiguous().float()
        common = (unique_values, unique_offsets, inverse, offsets, psw, plan.feature_table,
                  plan.pooling, plan.batch_size)
        grad_psw = None
        if psw is not None and ctx.needs_input_grad[5]:
            grad_psw = _per_sample_weight_grad(grad_output, weights, *common)
        num_tables = len(weights)
        optim, states, hparams = (
            plan.optimizer_step() if plan.optimizer_step is not None
            else ([NONE] * num_tables, [None] * num_tables, [0.0] * (NUM_HPARAMS * num_tables))
        )
        if any(k != NONE for k in optim):
            states = [s if s is not None else w.new_empty(0) for s, w in zip(states, weights)]
            with torch.no_grad():
                backward_update(grad_output, weights, states, *common, optim, hparams)
        grads = [None] * num_tables
        need = [t for t, k in enumerate(optim) if k == NONE and ctx.needs_input_grad[6 + t]]
        if need:
            rows = unique_grad(grad_output, weights, *common)
            uoff = unique_offsets.tolist()
            for t in need:
                grads[t] = torch.zeros_like(weights[t]).index_add_(
                    0, unique_values[uoff[t] : uoff[t + 1]].long(), rows[t]
                )
        return (None, None, None, None, None, grad_psw, *grads)


def _per_sample_weight_grad(grad_output, weights, unique_values, unique_offsets, inverse, offsets,
                            psw, feature_table, pooling, batch_size):
    """d out / d psw[i] = <row of id i, output gradient of its bag> (/ bag length for mean)."""
    ids = unique_values[inverse].long()
    lengths = offsets.diff()
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
    grad = torch.empty_like(psw)
    column = 0
    for f, t in enumerate(feature_table):
        dim = weights[t].shape[1]
        first, last = offsets[f * batch_size].item(), offsets[(f + 1) * batch_size].item()
        g = grad_output[bag[first:last] % batch_size, column : column + dim]
        dot = (weights[t][ids[first:last]] * g).sum(dim=1)
        if pooling[t] == MEAN:
            dot = dot * (1.0 / lengths[bag[first:last]].float())
        grad[first:last] = dot
        column += dim
    return grad
