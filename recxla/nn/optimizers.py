"""Fused sparse optimizers of recxla.nn.EmbeddingBagCollection, set the TorchRec way.

A table's optimizer is the one that `torchrec.optim.apply_optimizer_in_backward` (or torch's
`_apply_optimizer_in_backward`) attached to its weight: the parameter then carries
`_in_backward_optimizers` (optimizer objects), `_optimizer_classes` and `_optimizer_kwargs`.
The module's constructor arguments do the same thing for every table. recxla does not let that
optimizer step: its backward updates the touched rows itself (the weight's .grad stays None), and
it keeps the optimizer state in the optimizer object's own state (`state[param]["sum"]`,
`["step"]`), so an optimizer state_dict taken from `_get_in_backward_optimizers(module)` saves and
restores it, and a learning-rate scheduler on that optimizer takes effect at the next step.

Supported, with FBGEMM's exact sparse semantics (rows that no id touched are left alone, weight
decay included; see csrc/include/recxla/embedding_bag.h):
    torch.optim.SGD (momentum 0), torch.optim.Adagrad, torchrec.optim.RowWiseAdagrad
    (FBGEMM EXACT_ROWWISE_ADAGRAD), also named "sgd", "adagrad", "rowwise_adagrad".
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch

from recxla.ops.embedding_bag import ADAGRAD, NONE, ROWWISE_ADAGRAD, SGD

OWNER = "recxla.nn.EmbeddingBagCollection"

# Hyperparameters a fused update honours, per kind; anything else must keep its default.
_HONOURED = {
    SGD: {"lr", "weight_decay", "maximize", "momentum", "dampening", "nesterov"},
    ADAGRAD: {"lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value", "maximize"},
    ROWWISE_ADAGRAD: {"lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value",
                      "maximize"},
}
# Options that pick torch's implementation of the same update; a fused update is its own.
_IMPLEMENTATION_FLAGS = {"foreach", "fused", "differentiable", "capturable"}


def _rowwise_adagrad_class() -> type:
    from torchrec.optim import RowWiseAdagrad

    return RowWiseAdagrad


def resolve_optimizer(optimizer: Union[str, Type[torch.optim.Optimizer]]) -> Tuple[int, type]:
    """A name ("sgd", "adagrad", "rowwise_adagrad") or a supported optimizer class ->
    (kind, optimizer class). Raises ValueError for anything else."""
    classes = {
        "sgd": (SGD, torch.optim.SGD),
        "adagrad": (ADAGRAD, torch.optim.Adagrad),
        "rowwise_adagrad": (ROWWISE_ADAGRAD, _rowwise_adagrad_class()),
    }
    if isinstance(optimizer, str):
        key = optimizer.lower().replace("-", "_").replace("row_wise", "rowwise")
        if key in classes:
            return classes[key]
    else:
        for kind, cls in classes.values():
            if optimizer is cls:  # not subclasses: they may change the update
                return kind, cls
    raise ValueError(
        f"{OWNER}: optimizer must be one of 'sgd', 'adagrad', 'rowwise_adagrad', torch.optim.SGD, "
        f"torch.optim.Adagrad or torchrec.optim.RowWiseAdagrad, got {optimizer!r}"
    )


def check_hyperparameters(kind: int, params: Dict[str, Any], where: str) -> None:
    """ValueError for a hyperparameter that the fused update of `kind` cannot honour, and for
    lr, eps, weight_decay, lr_decay, initial_accumulator_value that are not finite and >= 0."""
    if kind == SGD:
        if params.get("momentum", 0.0) != 0.0 or params.get("nesterov", False):
            raise ValueError(
                f"{where}: the fused SGD update supports momentum=0 and nesterov=False only, got "
                f"momentum={params.get('momentum')}, nesterov={params.get('nesterov')}"
            )
    for name, value in params.items():
        if name == "params" or name in _HONOURED[kind] or name in _IMPLEMENTATION_FLAGS:
            continue
        raise ValueError(f"{where}: hyperparameter {name}={value!r} is not supported by the "
                         f"fused update (supported: {sorted(_HONOURED[kind])})")
    # NaN passes a `< 0` test and Inf is a number: either would turn every touched row into NaN.
    for name in ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
        value = params.get(name, 0.0)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")


def attach_optimizer(params: Sequence[torch.nn.Parameter], optimizer, kwargs: Dict[str, Any]) -> None:
    """Mark `params` the way apply_optimizer_in_backward does (optimizer objects hold the state);
    no backward hook is registered, since the fused backward does the update."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    kind, cls = resolve_optimizer(optimizer)
    check_hyperparameters(kind, kwargs, f"{OWNER}({cls.__name__})")
    _apply_optimizer_in_backward(cls, params, dict(kwargs), register_hook=False)


class TableOptimizer:
    """The fused update of one table, read from the optimizer attached to its weight."""

    def __init__(self, kind: int, optimizer: torch.optim.Optimizer, param: torch.nn.Parameter):
        self.kind = kind
        self.optimizer = optimizer
        self.param = param

    def step_arguments(self) -> Tuple[int, Optional[torch.Tensor], List[float]]:
        """Advances the step counter -> (kind, state tensor, [lr, eps, weight_decay, grad_sign])
        for this step, with torch's lr_decay applied (lr / (1 + (step - 1) * lr_decay))."""
        group = self.optimizer.param_groups[0]
        state = self.optimizer.state[self.param]
        lr = float(group["lr"])
        if self.kind == SGD:
            return SGD, None, [lr, 0.0, float(group["weight_decay"]), _sign(group)]
        if isinstance(state["step"], torch.Tensor):
            state["step"] += 1
        else:
            state["step"] = state["step"] + 1
        step = float(state["step"])
        lr = lr / (1 + (step - 1) * float(group.get("lr_decay", 0.0)))
        return (self.kind, state["sum"],
                [lr, float(group["eps"]), float(group["weight_decay"]), _sign(group)])


def _sign(group: Dict[str, Any]) -> float:
    return -1.0 if group.get("maximize", False) else 1.0


def table_optimizer(param: torch.nn.Parameter, table: str) -> Optional[TableOptimizer]:
    """The fused update for a table's weight, or None when no optimizer is attached to it.
    ValueError when the attached optimizer cannot be fused."""
    optimizers = getattr(param, "_in_backward_optimizers", None)
    if not optimizers:
        return None
    where = f"{OWNER}: table '{table}'"
    if len(optimizers) != 1:
        raise ValueError(f"{where} has {len(optimizers)} optimizers attached to its weight; the "
                         "fused update applies exactly one")
    optimizer = optimizers[0]
    kind, _ = resolve_optimizer(type(optimizer))
    if len(optimizer.param_groups) != 1 or len(optimizer.param_groups[0]["params"]) != 1:
        raise ValueError(f"{where}: the attached optimizer must hold this weight alone")
    check_hyperparameters(kind, optimizer.param_groups[0], where)
    if kind != SGD:
        state = optimizer.state[param]
        want = param.shape[0] * (param.shape[1] if kind == ADAGRAD else 1)
        if state["sum"].dtype != torch.float32 or not state["sum"].is_contiguous() \
                or state["sum"].numel() != want:
            raise ValueError(f"{where}: optimizer state 'sum' must be a contiguous float32 "
                             f"tensor of {want} values, got {tuple(state['sum'].shape)} "
                             f"{state['sum'].dtype}")
    return TableOptimizer(kind, optimizer, param)


def optimizer_step_callback(table_optimizers: Sequence[Optional[TableOptimizer]]):
    """-> a callable for LookupPlan.optimizer_step, or None when no table has an optimizer."""
    if all(o is None for o in table_optimizers):
        return None

    def step():
        kinds, states, hparams = [], [], []
        for o in table_optimizers:
            if o is None:
                kinds.append(NONE)
                states.append(None)
                hparams += [0.0, 0.0, 0.0, 1.0]
            else:
                kind, state, h = o.step_arguments()
                kinds.append(kind)
                states.append(state)
                hparams += h
        return kinds, states, hparams

    return step
