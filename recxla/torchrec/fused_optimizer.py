"""The fused sparse optimizer of recxla's sharded EmbeddingBagCollection.

Which optimizer a table gets follows TorchRec: the sharder's `fused_params`
({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05, ...}) with the kwargs of an
optimizer attached to the unsharded weight (`torchrec.optim.apply_optimizer_in_backward`, or
recxla.nn.EmbeddingBagCollection's) merged over them, FBGEMM's defaults for the rest and
FBGEMM's weight decay (`table_update`; docs/drop-in.md). Supported: SGD, Adagrad and row-wise
Adagrad, with the exact sparse semantics of recxla's lookup (csrc/include/recxla/embedding_bag.h).
As with TorchRec's sharder, fused_params that name no optimizer (None included) give FBGEMM's
default, EXACT_SGD at learning rate 0.01 (TorchRec's fused kernel builds FBGEMM's
SplitTableBatchedEmbeddingBagsCodegen with them), and a table the plan puts on the "dense"
compute kernel gets an ordinary gradient instead (TorchRec's BatchedDenseEmbeddingBag).

The update runs inside the lookup's backward (`step_arguments` is its callback), once per
step, on the rows the step touched. `ShardedFusedOptimizer` exposes the state and the
hyperparameters as TorchRec's EmbeddingFusedOptimizer does, so that checkpoints interchange
with TorchRec's sharder (torch.distributed.checkpoint, both ways): per table this rank holds
a shard of, params keyed `embedding_bags.<table>.weight` (the weight's ShardedTensor) and state
`{"<table>.momentum1": ShardedTensor}` for Adagrad (the weight's layout) and row-wise Adagrad
(1-D, see `rowwise_state_layout`), `{}` for SGD. `param_groups` hold the live hyperparameters
(a learning rate scheduler that changes "lr" takes effect at the next step).

The step count (torch's Adagrad lr_decay, the replicas' sync_every) is kept as FBGEMM keeps its
`iter`: outside the state, settable with `set_optimizer_step` (TorchRec's name). Only where the
update depends on it (lr_decay != 0, which FBGEMM's Adagrad does not have) does the state also
hold `<table>.step`, so that a checkpoint restores it.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torchrec import optim as torchrec_optim
from torchrec.optim.keyed import KeyedOptimizer

from recxla.nn.optimizers import check_hyperparameters
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
                        "weights_precision", "enforce_hbm", "cache_algorithm"}
# FBGEMM's defaults for what fused_params leaves out (SplitTableBatchedEmbeddingBagsCodegen).
_FBGEMM_DEFAULT_OPTIMIZER = "exact_sgd"
_FBGEMM_DEFAULTS = {"lr": 0.01, "eps": 1.0e-8, "weight_decay": 0.0, "lr_decay": 0.0,
                    "initial_accumulator_value": 0.0, "maximize": False}


@dataclass
class TableUpdate:
    """One table's update: kind (recxla.ops.embedding_bag NONE/SGD/ADAGRAD/ROWWISE_ADAGRAD)
    and hyperparameters in torch's names (lr, eps, weight_decay, lr_decay,
    initial_accumulator_value, maximize)."""

    kind: int
    hyperparameters: Dict[str, Any]


# The plan's compute kernel that TorchRec runs without a fused optimizer.
DENSE_KERNEL = "dense"


def table_update(table: str, weight: torch.Tensor, fused_params: Optional[Dict[str, Any]],
                 compute_kernel: str = "fused", owner: str = OWNER) -> TableUpdate:
    """The update of one table as TorchRec's sharder builds FBGEMM's: the sharder's
    fused_params, with an optimizer attached to the unsharded weight
    (apply_optimizer_in_backward) merged over them (its class names the optimizer, its kwargs
    win: TorchRec's merge_fused_params); none on the plan's "dense" compute kernel (the shard
    then gets an ordinary gradient); FBGEMM's defaults (EXACT_SGD, learning rate 0.01, eps 1e-8,
    no weight decay) for what they leave out. owner: the module's name in error messages."""
    where = f"{owner}: table '{table}'"
    classes = getattr(weight, "_optimizer_classes", None)
    params = dict(fused_params or {})
    if classes:
        if len(classes) != 1:
            raise ValueError(f"{where} has {len(classes)} optimizers attached; the fused update "
                             "applies exactly one")
        kind = _ATTACHED_KINDS.get(classes[0])
        if kind is None:
            raise ValueError(f"{where}: the attached optimizer {classes[0].__name__} is not "
                             "supported by recxla's fused update (supported: "
                             f"{sorted(c.__module__ + '.' + c.__name__ for c in _ATTACHED_KINDS)})")
        kwargs = dict(getattr(weight, "_optimizer_kwargs", [{}])[0])
        # TorchRec's sharder rewrites these kwargs in place (lr -> learning_rate, and the
        # class's EmbOptimType as "optimizer"), so a module it planned carries either spelling.
        if "lr" in kwargs:
            kwargs["learning_rate"] = kwargs.pop("lr")
        named = kwargs.pop("optimizer", None)
        if named is not None and _emb_optim_kind(named, where) != kind:
            raise ValueError(f"{where}: the attached {classes[0].__name__} disagrees with its "
                             f"kwargs' optimizer {named!r}")
        for key in _TORCH_ONLY:
            if key in kwargs:  # torch's names with no FBGEMM argument behind them
                params[key] = kwargs.pop(key)
        params.update(kwargs)
    elif str(getattr(compute_kernel, "value", compute_kernel)) == DENSE_KERNEL:
        return TableUpdate(NONE, {})
    else:
        optimizer = params.get("optimizer")
        kind = _emb_optim_kind(_FBGEMM_DEFAULT_OPTIMIZER if optimizer is None else optimizer,
                               where)
    params.pop("optimizer", None)
    return TableUpdate(kind, _hyperparameters(kind, params, where))


# Optimizer classes TorchRec's sharder accepts from apply_optimizer_in_backward, by kind
# (torchrec.distributed.utils._OPTIMIZER_CLASS_TO_EMB_OPT_TYPE, those recxla's update runs).
_ATTACHED_KINDS = {torch.optim.SGD: SGD, torch.optim.Adagrad: ADAGRAD,
                   torchrec_optim.SGD: SGD, torchrec_optim.Adagrad: ADAGRAD,
                   torchrec_optim.RowWiseAdagrad: ROWWISE_ADAGRAD}
# torch's Adagrad hyperparameters that FBGEMM's update has no argument for: recxla honours
# them (a torch user's lr_decay and accumulator start), so they pass to the update as given.
_TORCH_ONLY = ("lr_decay", "initial_accumulator_value", "maximize")
# FBGEMM's WeightDecayMode (fbgemm_gpu.split_embedding_configs): how row-wise Adagrad applies
# weight_decay. NONE (FBGEMM's default) ignores it; L2 adds it to the gradient; DECOUPLE (and
# its global variant) shrink the weight by lr x weight_decay, which recxla's update has no
# form for yet. SGD and Adagrad have no weight decay in FBGEMM at all.
_WEIGHT_DECAY_MODES = {"none": 0, "l2": 1, "decouple": 2, "counter": 3, "cowclip": 4,
                       "decouple_global": 5}


def _emb_optim_kind(optimizer, where: str) -> int:
    name = str(getattr(optimizer, "value", optimizer)).lower()
    if name not in _EMB_OPTIM_KINDS:
        raise ValueError(f"{where}: fused_params optimizer {optimizer!r} is not "
                         f"supported (supported: {sorted(_EMB_OPTIM_KINDS)})")
    return _EMB_OPTIM_KINDS[name]


def _weight_decay_mode(value, where: str) -> int:
    """FBGEMM's WeightDecayMode (the enum, its name or value) -> its value."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.lower() in _WEIGHT_DECAY_MODES:
        return _WEIGHT_DECAY_MODES[name.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and \
            value in _WEIGHT_DECAY_MODES.values():
        return value
    raise ValueError(f"{where}: weight_decay_mode {value!r} is not one of FBGEMM's "
                     f"WeightDecayMode ({sorted(_WEIGHT_DECAY_MODES)})")


def _hyperparameters(kind: int, params: Dict[str, Any], where: str) -> Dict[str, Any]:
    """fused_params (FBGEMM's names; torch's lr_decay, initial_accumulator_value, maximize)
    -> the update's hyperparameters in torch's names, FBGEMM's defaults for the rest and its
    weight-decay semantics (_WEIGHT_DECAY_MODES)."""
    given = {}
    mode = _weight_decay_mode(params.get("weight_decay_mode", 0), where)
    if params.get("gradient_clipping", False):
        raise ValueError(f"{where}: gradient_clipping=True (FBGEMM clips each row's gradient to "
                         f"+-max_gradient={params.get('max_gradient', 1.0)}) is not supported by "
                         "recxla's fused update; leave it unset or False")
    for key, value in params.items():
        if key in _FUSED_PARAM_IGNORED or key in ("weight_decay_mode", "gradient_clipping",
                                                  "max_gradient") or \
                (kind == SGD and key == "eps"):  # FBGEMM takes eps with any optimizer
            continue
        if key not in _FUSED_PARAM_NAMES and key not in _TORCH_ONLY:
            raise ValueError(f"{where}: fused_params key {key!r} is not supported by the fused "
                             f"update (supported: {sorted(_FUSED_PARAM_NAMES)})")
        given[_FUSED_PARAM_NAMES.get(key, key)] = value
    decay = given.pop("weight_decay", 0.0)
    if kind == ROWWISE_ADAGRAD and mode == _WEIGHT_DECAY_MODES["l2"]:
        given["weight_decay"] = decay
    elif kind == ROWWISE_ADAGRAD and mode not in (0, _WEIGHT_DECAY_MODES["l2"]) and decay:
        raise ValueError(f"{where}: weight_decay_mode {params['weight_decay_mode']!r} is not "
                         "supported by recxla's fused row-wise Adagrad (NONE and L2 are)")
    # Otherwise FBGEMM applies no weight decay: SGD and Adagrad have none, row-wise Adagrad's
    # default mode (NONE) ignores it.
    check_hyperparameters(kind, given, where)
    return {**_FBGEMM_DEFAULTS, **given}


def rowwise_state_layout(shards: Sequence[Any], num_embeddings: int, embedding_dim: int,
                         where: str = OWNER) -> Tuple[int, List[Tuple[Any, int]]]:
    """TorchRec's layout of a row-wise optimizer state (row-wise Adagrad's momentum1: one value
    per row of each shard), as its EmbeddingFusedOptimizer builds it: a 1-D ShardedTensor.
    Rows split (table-/row-wise): [num_embeddings], each shard at its row offset. Columns
    split (column-wise, table-column-wise): each column block keeps its own value per row
    (its own FBGEMM table), so the state is [num_embeddings x blocks], the blocks in column
    order, block k at k x num_embeddings.

    shards: the table's shards (row_offset, rows, col_offset, cols attributes).
    -> (global size, [(shard, offset)] in TorchRec's shard order)."""
    column_split = any(s.cols != embedding_dim for s in shards)
    if column_split and any(s.rows != num_embeddings for s in shards):
        raise ValueError(f"{where}: a table split by both rows and columns (grid sharding) has "
                         "no TorchRec layout for row-wise optimizer state here")
    if not column_split:
        return num_embeddings, [(s, s.row_offset) for s in shards]
    ordered = sorted(shards, key=lambda s: s.col_offset)  # stable, as TorchRec's sort
    return num_embeddings * len(ordered), [(s, k * num_embeddings) for k, s in enumerate(ordered)]


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
        save_step: also save the step count where nothing else needs it (the replicas'
            sync_every > 1).
    """

    def __init__(self, names: List[str], sharded_weights: List[Any], updates: List[TableUpdate],
                 local_tables: List[int], states: List[Optional[torch.Tensor]],
                 sharded_states: List[Optional[Any]], save_step: bool = False):
        self._updates = updates
        self._local_tables = local_tables
        self._states = states
        # One count for every table: the module advances it once per backward on every rank.
        self._step = torch.zeros((), dtype=torch.float32)
        params = {}
        state: Dict[Any, Dict[str, Any]] = {}
        self._group_of_table: Dict[int, Dict[str, Any]] = {}
        groups = []
        held = set(local_tables)
        for t, (name, weight, update) in enumerate(zip(names, sharded_weights, updates)):
            if update.kind == NONE or t not in held:
                # As TorchRec's: only the tables this rank holds a shard of.
                continue
            params[name] = weight
            table = name.split(".")[-2]
            entry: Dict[str, Any] = {}
            if sharded_states[t] is not None:
                entry[f"{table}.momentum1"] = sharded_states[t]
            if save_step or (update.kind != SGD and
                             float(update.hyperparameters.get("lr_decay", 0.0)) != 0.0):
                entry[f"{table}.step"] = self._step
            state[weight] = entry
            self._group_of_table[t] = {"params": [weight], **update.hyperparameters}
            groups.append(self._group_of_table[t])
        super().__init__(params, state, groups)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing to do: the update is applied in backward and leaves no gradient."""

    def step(self, closure: Any = None) -> None:
        """Nothing to do: the update is applied in backward."""

    def count_step(self) -> None:
        """Advances the step count. The sharded module calls it once per backward on every
        rank (also on a rank that holds no shard), so the counts agree everywhere."""
        self._step += 1

    def set_optimizer_step(self, step: int) -> None:
        """Sets the step count (TorchRec's and FBGEMM's name), e.g. after loading a checkpoint
        that does not hold it; torchrec's CombinedOptimizer passes it on."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{OWNER}: set_optimizer_step: step must be an int >= 0, got "
                             f"{step!r}")
        self._step.fill_(step)

    @property
    def step_count(self) -> int:
        """Steps counted so far."""
        return int(self._step)

    def step_arguments(self, first: int = 0, last: Optional[int] = None
                       ) -> Tuple[List[int], List[Optional[torch.Tensor]], List[float]]:
        """The lookup's optimizer callback: per local table first .. last (None: every one),
        (kind, state tensor, [lr, eps, weight_decay, grad_sign]) for this step, with torch's
        lr_decay applied (lr / (1 + (step - 1) * lr_decay))."""
        kinds, states, hparams = [], [], []
        last = len(self._local_tables) if last is None else last
        step = float(self._step)  # one read of the (host) count for every table
        for local in range(first, last):
            t = self._local_tables[local]
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
                lr = lr / (1 + (step - 1) * float(group.get("lr_decay", 0.0)))
            hparams += [lr, _finite_number(group.get("eps", 0.0), "eps", where),
                        _finite_number(group.get("weight_decay", 0.0), "weight_decay", where),
                        -1.0 if group.get("maximize", False) else 1.0]
        return kinds, states, hparams
