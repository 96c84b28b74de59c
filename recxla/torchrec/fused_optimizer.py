"""The fused sparse optimizer of recxla's sharded EmbeddingBagCollection.

Which optimizer a table gets follows TorchRec: the sharder's `fused_params`
({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05, ...}), overridden per table by an
optimizer attached to the unsharded weight with `torchrec.optim.apply_optimizer_in_backward`
(or given to `recxla.nn.EmbeddingBagCollection`). Supported: SGD, Adagrad and row-wise Adagrad,
with the exact sparse semantics of recxla's lookup (csrc/include/recxla/embedding_bag.h).

The update runs inside the lookup's backward (`step_arguments` is its callback), once per
step, on the rows the step touched. `ShardedFusedOptimizer` exposes the state and the
hyperparameters as TorchRec's KeyedOptimizer does: params and state as ShardedTensors keyed
`embedding_bags.<table>.weight`, so DMP's `fused_optimizer`, its state_dict and
torch.distributed.checkpoint see them; `param_groups` hold the live hyperparameters (a learning
rate scheduler that changes "lr" takes effect at the next step).
"""

import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.optim.keyed import KeyedOptimizer

from recxla.nn.optimizers import check_hyperparameters, resolve_optimizer
from recxla.ops.embedding_bag import ADAGRAD, NONE, ROWWISE_ADAGRAD, SGD
from recxla.torchrec.shard_layout import OWNER

# TorchRec/FBGEMM optimizer names -> recxla's fused update.
_EMB_OPTIM_KINDS = {
    "sgd": SGD, "exact_sgd": SGD,
    "adagrad": ADAGRAD, "exact_adagrad": ADAGRAD,
    "row_wise_adagrad": ROWWISE_ADAGRAD, "exact_row_wise_adagrad": ROWWISE_ADAGRAD,
}
# fused_params keys of TorchRec's sharder that name a hyperparameter, in torch's spelling.
_FUSED_PARAM_NAMES = {"learning_rate": "lr", "eps": "eps", "weight_decay": "weight_decay",
                      "lr_decay": "lr_decay",
                      "initial_accumulator_value": "initial_accumulator_value"}
# fused_params keys that tune FBGEMM's kernels or storage and do not change the update.
_FUSED_PARAM_IGNORED = {"cache_load_factor", "cache_precision", "prefetch_pipeline",
                        "output_dtype", "stochastic_rounding", "bounds_check_mode",
                        "gradient_clipping", "max_gradient", "weights_precision",
                        "enforce_hbm", "cache_algorithm"}
# FBGEMM's defaults for what fused_params leaves out.
_FBGEMM_DEFAULTS = {"lr": 0.01, "eps": 1.0e-8, "weight_decay": 0.0, "lr_decay": 0.0,
                    "initial_accumulator_value": 0.0, "maximize": False}


@dataclass
class TableUpdate:
    """One table's update: kind (recxla.ops.embedding_bag NONE/SGD/ADAGRAD/ROWWISE_ADAGRAD)
    and hyperparameters in torch's names (lr, eps, weight_decay, lr_decay,
    initial_accumulator_value, maximize)."""

    kind: int
    hyperparameters: Dict[str, Any]


def table_update(table: str, weight: torch.Tensor,
                 fused_params: Optional[Dict[str, Any]]) -> TableUpdate:
    """The update of one table: the optimizer attached to its unsharded weight, else the
    sharder's fused_params, else none (the shard then gets an ordinary gradient)."""
    where = f"{OWNER}: table '{table}'"
    classes = getattr(weight, "_optimizer_classes", None)
    if classes:
        if len(classes) != 1:
            raise ValueError(f"{where} has {len(classes)} optimizers attached; the fused update "
                             "applies exactly one")
        kind, cls = resolve_optimizer(classes[0])
        kwargs = dict(getattr(weight, "_optimizer_kwargs", [{}])[0])
        check_hyperparameters(kind, kwargs, where)
        defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        hyper = {name: kwargs.get(name, defaults.get(name, _FBGEMM_DEFAULTS[name]))
                 for name in _FBGEMM_DEFAULTS}
        return TableUpdate(kind, hyper)
    if not fused_params or fused_params.get("optimizer") is None:
        return TableUpdate(NONE, {})
    name = str(getattr(fused_params["optimizer"], "value", fused_params["optimizer"])).lower()
    if name not in _EMB_OPTIM_KINDS:
        raise ValueError(f"{where}: fused_params optimizer {fused_params['optimizer']!r} is not "
                         f"supported (supported: {sorted(_EMB_OPTIM_KINDS)})")
    kind = _EMB_OPTIM_KINDS[name]
    given = {}
    for key, value in fused_params.items():
        if key == "optimizer" or key in _FUSED_PARAM_IGNORED:
            continue
        if key not in _FUSED_PARAM_NAMES:
            raise ValueError(f"{where}: fused_params key {key!r} is not supported by the fused "
                             f"update (supported: {sorted(_FUSED_PARAM_NAMES)})")
        given[_FUSED_PARAM_NAMES[key]] = value
    check_hyperparameters(kind, given, where)
    return TableUpdate(kind, {**_FBGEMM_DEFAULTS, **given})


def _finite_number(value, name: str, where: str) -> float:
    value = float(value)
    if not (value == value and abs(value) != float("inf")):
        raise ValueError(f"{where}: {name} must be finite, got {value}")
    return value


class ShardedFusedOptimizer(KeyedOptimizer):
    """Hyperparameters and state of the local tables of one sharded module.

    Args:
        names: per table of the module, its state_dict key (`embedding_bags.<table>.weight`).
        sharded_weights: per table, the ShardedTensor of its weight (this rank's shards).
        updates: per table, its TableUpdate.
        local_tables: per local table (this rank's lookup order), the module table index.
        states: per local table, its state tensor (Adagrad: float32 [rows, cols]; row-wise:
            float32 [rows]; SGD and none: None).
        sharded_states: per table, its state ShardedTensor (or None).
    """

    def __init__(self, names: List[str], sharded_weights: List[Any], updates: List[TableUpdate],
                 local_tables: List[int], states: List[Optional[torch.Tensor]],
                 sharded_states: List[Optional[Any]]):
        self._updates = updates
        self._local_tables = local_tables
        self._states = states
        self._steps = [torch.zeros((), dtype=torch.float32) for _ in names]
        params = {}
        state: Dict[Any, Dict[str, Any]] = {}
        groups = []
        for t, (name, weight, update) in enumerate(zip(names, sharded_weights, updates)):
            if update.kind == NONE:
                continue
            params[name] = weight
            table = name.split(".")[-2]
            entry: Dict[str, Any] = {f"{table}.step": self._steps[t]}
            if sharded_states[t] is not None:
                entry[f"{table}.momentum1"] = sharded_states[t]
            state[weight] = entry
            groups.append({"params": [weight], **update.hyperparameters})
        self._group_of_table = {}
        for t, update in enumerate(updates):
            if update.kind != NONE:
                self._group_of_table[t] = groups[len(self._group_of_table)]
        super().__init__(params, state, groups)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing to do: the update is applied in backward and leaves no gradient."""

    def step(self, closure: Any = None) -> None:
        """Nothing to do: the update is applied in backward."""

    def count_step(self) -> None:
        """Advances every table's step counter. The sharded module calls it once per backward
        on every rank (also on a rank that holds no shard of a table), so the counters, which
        a checkpoint saves once for all ranks, agree everywhere."""
        for step in self._steps:
            step += 1

    @property
    def step_count(self) -> int:
        """Steps counted so far (every table's counter advances together)."""
        return int(self._steps[0]) if self._steps else 0

    def step_arguments(self) -> Tuple[List[int], List[Optional[torch.Tensor]], List[float]]:
        """The lookup's optimizer callback: per local table, (kind, state tensor,
        [lr, eps, weight_decay, grad_sign]) for this step, with torch's lr_decay applied
        (lr / (1 + (step - 1) * lr_decay))."""
        kinds, states, hparams = [], [], []
        for local, t in enumerate(self._local_tables):
            update = self._updates[t]
            kinds.append(update.kind)
            states.append(self._states[local])
            if update.kind == NONE:
                hparams += [0.0, 0.0, 0.0, 1.0]
                continue
            group = self._group_of_table[t]
            where = f"{OWNER}: table {t}"
            lr = _finite_number(group["lr"], "lr", where)
            if update.kind != SGD:
                lr = lr / (1 + (float(self._steps[t]) - 1) * float(group.get("lr_decay", 0.0)))
            hparams += [lr, _finite_number(group.get("eps", 0.0), "eps", where),
                        _finite_number(group.get("weight_decay", 0.0), "weight_decay", where),
                        -1.0 if group.get("maximize", False) else 1.0]
        return kinds, states, hparams
