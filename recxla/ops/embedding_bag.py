"""Pooled embedding lookup over deduplicated ids with a fused sparse optimizer.

The ops of csrc/embedding_bag.cpp (argument layout documented there; the nine arguments they
share are one `BagLookup`, recxla.ops.embedding_bag_lookup; their codes in
recxla.ops.embedding_bag_enums) get their fake kernels here, a dispatcher per op (C++ on CPU,
CUDA or Triton on GPU following RECXLA_BACKEND; a RuntimeError saying to reinstall when the
compiled extension is missing), and the autograd Function `FusedPooledLookup` that joins
them: its forward pools the rows, its backward either updates the rows in place (the weights get
no .grad, as in FBGEMM's TBE) or, for tables without an optimizer, returns an ordinary dense
gradient.

Data checks. The CPU kernels check the data themselves (rows in range and, for the update,
strictly increasing per table; ids inside their table's segment; offsets monotone) before they
write anything. The CUDA and Triton kernels do not: on those paths
recxla.ops.embedding_bag_checks runs the same checks as torch ops on the device, without a host
sync, into one small flag tensor, reads it once before any kernel launches and raises what the
CPU kernel would. The functions below do that on every call; `FusedPooledLookup` once per step
(in its forward: the backward reuses the tensors autograd saved, which cannot change between).
"""

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from recxla import _extension
from recxla.ops.embedding_bag_checks import (check_feature_columns, check_grad_offsets,
                                              check_lookup, check_optimizer)
from recxla.ops.embedding_bag_enums import (  # noqa: F401  (the op's codes, public here)
    ADAGRAD, MEAN, NONE, NUM_HPARAMS, ROWWISE_ADAGRAD, SGD, SUM,
)
from recxla.ops.embedding_bag_lookup import BagLookup  # the ops' argument, public here too


@_extension.register_fake("recxla::embedding_bag_forward")
def _forward_fake(weights, unique_values, unique_offsets, inverse, offsets, psw, feature_table,
                  pooling, batch_size):
    total_dim = sum(weights[t].shape[1] for t in feature_table)
    return unique_values.new_empty((batch_size, total_dim), dtype=torch.float32)


@_extension.register_fake("recxla::embedding_bag_forward_out")
def _forward_out_fake(weights, unique_values, unique_offsets, inverse, offsets, psw,
                      feature_table, pooling, batch_size, out, feature_columns=None):
    return None


@_extension.register_fake("recxla::embedding_bag_unique_grad")
def _unique_grad_fake(grad_output, weights, unique_values, unique_offsets, inverse, offsets, psw,
                      feature_table, pooling, batch_size, feature_columns=None):
    ctx = torch.library.get_ctx()
    return [grad_output.new_empty((ctx.new_dynamic_size(), w.shape[1])) for w in weights]


@_extension.register_fake("recxla::embedding_bag_backward_update")
def _backward_update_fake(grad_output, weights, states, unique_values, unique_offsets, inverse,
                          offsets, psw, feature_table, pooling, batch_size, optim, hparams,
                          grad_offsets=None):
    return None


# ---------------------------------------------------------------------------------------------
# Dispatch (`lookup` already as its op_args)


def _forward(lookup: BagLookup, out: Optional[torch.Tensor], backend: str,
             feature_columns: Optional[Sequence[int]] = None) -> torch.Tensor:
    if backend == "triton":
        from recxla.triton_kernels.embedding_bag import embedding_bag_forward_triton

        return embedding_bag_forward_triton(lookup, out=out, feature_columns=feature_columns)
    if out is None:
        return torch.ops.recxla.embedding_bag_forward(*lookup)
    torch.ops.recxla.embedding_bag_forward_out(*lookup, out, feature_columns)
    return out


def _unique_grad(grad_output, lookup: BagLookup, backend: str,
                 feature_columns: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    if backend == "triton":
        from recxla.triton_kernels.embedding_bag import embedding_bag_unique_grad_triton

        return embedding_bag_unique_grad_triton(grad_output, lookup, feature_columns)
    return list(torch.ops.recxla.embedding_bag_unique_grad(grad_output, *lookup,
                                                           feature_columns))


def _backward_update(grad_output, lookup: BagLookup, states, optim, hparams,
                     backend: str, grad_offsets: Optional[torch.Tensor] = None) -> None:
    states, optim, hparams = list(states), list(optim), [float(h) for h in hparams]
    if backend == "triton":
        from recxla.triton_kernels.embedding_bag import embedding_bag_backward_update_triton

        return embedding_bag_backward_update_triton(grad_output, lookup, states, optim, hparams,
                                                    grad_offsets)
    weights, *rest = lookup
    torch.ops.recxla.embedding_bag_backward_update(grad_output, weights, states, *rest, optim,
                                                   hparams, grad_offsets)


def pooled_forward(lookup: BagLookup, out: Optional[torch.Tensor] = None,
                   feature_columns: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Pool the rows of every bag. -> float32 [B, sum_f D_{feature_table[f]}].

    lookup: the tables, ids and bags (`BagLookup`: shapes and dtypes there); out: optional
    float32 [B, total_dim] contiguous tensor to write into (returned), so that a loop can reuse
    one buffer. feature_columns (F ints, with `out`): pool straight into a caller's layout
    instead; out is then [B, C] with adjacent columns and rows at least C apart (a column range
    of a wider tensor, say), feature f's D columns are out[:, feature_columns[f]:][:, :D], the
    features' ranges disjoint and inside [0, C), and the other columns are left as they are.
    """
    if feature_columns is not None and out is None:
        raise ValueError("recxla.ops.embedding_bag.pooled_forward: feature_columns places the "
                         "features in `out`, and out is None")
    lookup = lookup.op_args()
    backend = _extension.backend_for(lookup.unique_values,
                                     "recxla.ops.embedding_bag.pooled_forward")
    if backend != "cpu":
        check_lookup("recxla::embedding_bag_forward", lookup, increasing=False)
    if backend == "triton" and feature_columns is not None:  # the C++ kernels check it
        check_feature_columns("recxla::embedding_bag_forward_out", lookup, out, "out",
                              feature_columns)
    return _forward(lookup, out, backend, feature_columns)


def unique_grad(grad_output: torch.Tensor, lookup: BagLookup,
                feature_columns: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """grad_output float32 [B, total_dim] -> T float32 [U_t, D_t]: the weight gradient of each
    table at its unique rows (a dense gradient is zero elsewhere). feature_columns (F ints):
    grad_output laid out as pooled_forward's `out` with them, each feature's gradient read
    where it lies (the other columns are not read)."""
    lookup = lookup.op_args()
    backend = _extension.backend_for(lookup.unique_values,
                                     "recxla.ops.embedding_bag.unique_grad")
    if backend != "cpu":
        check_lookup("recxla::embedding_bag_unique_grad", lookup, increasing=False)
    if backend == "triton" and feature_columns is not None:  # the C++ kernels check it
        check_feature_columns("recxla::embedding_bag_unique_grad", lookup, grad_output,
                              "grad_output", feature_columns)
    return _unique_grad(grad_output, lookup, backend, feature_columns)


def backward_update(
    grad_output: torch.Tensor,
    lookup: BagLookup,
    states: Sequence[torch.Tensor],
    optim: Sequence[int],
    hparams: Sequence[float],
    grad_offsets: Optional[torch.Tensor] = None,
    checked_upstream: bool = False,
) -> None:
    """Reduce grad_output (float32 [B, total_dim]) per unique row and apply each table's
    optimizer to those rows of lookup.weights in place.

    optim: T ints (NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD); states: T float32 tensors (Adagrad
    [E_t, D_t], row-wise Adagrad E_t values, else unused); hparams: 4 * T floats, per table
    (lr, eps, weight_decay, grad_sign). lookup.unique_values must be strictly increasing per
    table. grad_offsets (int64 [F * B]): read the gradient where it lies instead: grad_output is
    any contiguous float32 tensor, read flat, and bag f * B + b's gradient row is its D_f
    elements from grad_offsets[f * B + b] on (a received message, say); only non-empty bags'
    entries are read, and each must keep its row inside grad_output. checked_upstream: the
    data (ids, rows, offsets, grad_offsets) were made or checked by the caller (recxla's
    sharded module: LookupPlan.checked_upstream says how), so on GPU the device checks, a host
    sync each, are skipped; the layout checks still run, and the CPU kernel checks everything.
    """
    lookup = lookup.op_args()
    backend = _extension.backend_for(lookup.unique_values,
                                     "recxla.ops.embedding_bag.backward_update")
    op = "recxla::embedding_bag_backward_update"
    if backend != "cpu":
        check_lookup(op, lookup, increasing=True, data=not checked_upstream)
        if grad_offsets is not None:
            check_grad_offsets(op, lookup, grad_output, grad_offsets, data=not checked_upstream)
    if backend not in ("cpu", "cuda"):  # the C++ kernels check these themselves
        check_optimizer(op, lookup.weights, states, optim, hparams)
    _backward_update(grad_output, lookup, states, optim, hparams, backend, grad_offsets)


# A lookup's backward run on a received message: (message, grad_offsets or None) -> None.
MessageUpdate = Callable[[torch.Tensor, Optional[torch.Tensor]], Any]

# What the backward asks for, once per step: per table its optimizer kind, state tensor and
# (lr, eps, weight_decay, grad_sign); tables of kind NONE get a dense gradient instead.
OptimizerStep = Callable[[], Tuple[List[int], List[torch.Tensor], List[float]]]


@dataclass
class LookupPlan:
    """The static part of one lookup: feature_table (F ints), pooling (T ints), batch_size, the
    optimizer callback (None: every table gets a dense gradient), and an optional workspace
    (recxla.nn.workspace.Workspace, or anything with its `empty(name, shape, dtype, device)`)
    that provides the pooled output's buffer, reused across steps on CPU. after_update, if
    set, is called right after the fused update with (weights, unique_values, unique_offsets):
    e.g. to round the updated rows of a table stored at lower precision. checked_upstream: the
    ids were checked where they were made (recxla's sharded module: its input dist's sender
    checks every id's range, and dedup makes each table's rows unique and increasing), so on
    GPU the forward skips the data checks, whose flags cost a host sync every step; the
    layout checks (host only) still run."""

    feature_table: List[int]
    pooling: List[int]
    batch_size: int
    optimizer_step: Optional[OptimizerStep] = None
    workspace: Optional[Any] = None
    after_update: Optional[Callable[[List[torch.Tensor], torch.Tensor, torch.Tensor], None]] = None
    checked_upstream: bool = False


class FusedPooledLookup(torch.autograd.Function):
    """out = pooled_forward(lookup); backward updates the rows of tables with an optimizer in
    place.

    Inputs: plan, unique_values, unique_offsets, inverse, offsets, per_sample_weights, *weights:
    the fields of a `BagLookup` (with the plan's feature_table, pooling and batch_size) one by
    one, since autograd sees only the tensors passed as inputs.
    Per-sample weights get a gradient when they require one (computed before any row moves).
    On GPU the data are checked once, in the forward (strictly increasing rows too when the plan
    has an optimizer), before any kernel runs, unless the plan says they were checked upstream.
    """

    @staticmethod
    def forward(ctx, plan, unique_values, unique_offsets, inverse, offsets, psw, *weights):
        lookup = BagLookup(weights, unique_values, unique_offsets, inverse, offsets, psw,
                           plan.feature_table, plan.pooling, plan.batch_size).op_args()
        backend = _extension.backend_for(unique_values,
                                         "recxla.ops.embedding_bag.FusedPooledLookup")
        if backend != "cpu":
            check_lookup("recxla.ops.embedding_bag.FusedPooledLookup", lookup,
                         increasing=plan.optimizer_step is not None,
                         data=not plan.checked_upstream)
        out = None
        if plan.workspace is not None:
            total_dim = sum(weights[t].shape[1] for t in plan.feature_table)
            out = plan.workspace.empty("pooled", (plan.batch_size, total_dim), torch.float32,
                                       unique_values.device)
        out = _forward(lookup, out, backend)
        ctx.plan = plan
        ctx.backend = backend
        ctx.made_by = FusedPooledLookup  # what message_update looks for
        # The weights are kept as objects, not saved tensors: the fused update changes them in
        # place, and an earlier lookup's backward in the same step may already have done so.
        ctx.weights = weights
        ctx.save_for_backward(unique_values, unique_offsets, inverse, offsets, psw)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.contiguous().float()
        lookup = _saved_lookup(ctx)
        grad_psw = None
        if lookup.per_sample_weights is not None and ctx.needs_input_grad[5]:
            grad_psw = _per_sample_weight_grad(grad_output, lookup)
        weights, unique_values = lookup.weights, lookup.unique_values
        num_tables = len(weights)
        optim = _fused_update(ctx, lookup, _optimizer_arguments(ctx.plan, num_tables),
                              grad_output, None)
        grads = [None] * num_tables
        need = [t for t, k in enumerate(optim) if k == NONE and ctx.needs_input_grad[6 + t]]
        if need:
            rows = _unique_grad(grad_output, lookup, ctx.backend)
            uoff = lookup.unique_offsets.tolist()
            for t in need:
                grads[t] = torch.zeros_like(weights[t]).index_add_(
                    0, unique_values[uoff[t] : uoff[t + 1]].long(), rows[t]
                )
        return (None, None, None, None, None, grad_psw, *grads)

    @staticmethod
    def message_update(output: torch.Tensor) -> Optional[MessageUpdate]:
        """`output`'s backward as a call on a gradient that autograd could not hand over
        without a copy: update(message, grad_offsets) with bag f * B + b's gradient row in
        `message` at grad_offsets[f * B + b] (backward_update's grad_offsets; None: message is
        the [B, total_dim] gradient); the caller then drops `output` without its backward.
        None where that backward is more than the fused update (a table without an optimizer,
        per-sample weights that want a gradient) or `output` is not this Function's."""
        ctx = output.grad_fn
        if getattr(ctx, "made_by", None) is not FusedPooledLookup or ctx.needs_input_grad[5]:
            return None
        lookup = _saved_lookup(ctx)
        arguments = _optimizer_arguments(ctx.plan, len(lookup.weights))
        if NONE in arguments[0]:
            return None
        return functools.partial(_fused_update, ctx, lookup, arguments)


def _saved_lookup(ctx) -> BagLookup:
    """The lookup a FusedPooledLookup's forward ran, from its context (op arguments)."""
    plan = ctx.plan
    unique_values, unique_offsets, inverse, offsets, psw = ctx.saved_tensors
    return BagLookup([w.detach() for w in ctx.weights], unique_values, unique_offsets, inverse,
                     offsets, psw, plan.feature_table, plan.pooling, plan.batch_size).op_args()


def _optimizer_arguments(plan: LookupPlan, num_tables: int):
    """The plan's (kinds, states, hparams) for this step; without an optimizer, NONE for every
    table."""
    if plan.optimizer_step is not None:
        return plan.optimizer_step()
    return [NONE] * num_tables, [None] * num_tables, [0.0] * (NUM_HPARAMS * num_tables)


def _fused_update(ctx, lookup: BagLookup, arguments, grad_output: torch.Tensor,
                  grad_offsets: Optional[torch.Tensor]) -> List[int]:
    """A FusedPooledLookup's fused update of its tables with an optimizer (backward_update's
    grad_output and grad_offsets), then the plan's after_update. -> the kinds."""
    optim, states, hparams = arguments
    if any(k != NONE for k in optim):
        states = [s if s is not None else w.new_empty(0)
                  for s, w in zip(states, lookup.weights)]
        with torch.no_grad():
            _backward_update(grad_output, lookup, states, optim, hparams, ctx.backend,
                             grad_offsets)
            if ctx.plan.after_update is not None:
                ctx.plan.after_update(lookup.weights, lookup.unique_values,
                                      lookup.unique_offsets)
    return optim


def _per_sample_weight_grad(grad_output: torch.Tensor, lookup: BagLookup) -> torch.Tensor:
    """d out / d psw[i] = <row of id i, output gradient of its bag> (/ bag length for mean).
    -> float32 [N]."""
    weights, unique_values, _, inverse, offsets, psw, feature_table, pooling, batch_size = lookup
    ids = unique_values.index_select(0, inverse).long()
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
