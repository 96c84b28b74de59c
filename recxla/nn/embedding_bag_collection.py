"""recxla.nn.EmbeddingBagCollection: TorchRec's EmbeddingBagCollection with deduplicated lookups
and a fused sparse optimizer.

It is a subclass of torchrec.modules.embedding_modules.EmbeddingBagCollection that keeps its
parameters, initialisation and output layout (same constructor tables, same KeyedTensor keys,
order and columns, same state_dict keys `embedding_bags.<table>.weight`, so checkpoints move
between the two), and replaces the forward:

1. the ids of each table's features are deduplicated once (recxla.ops.dedup.segmented_unique,
   one segment per table, so features sharing a table share its unique rows);
2. one kernel pools every bag of every feature from those unique rows (sum or mean, optional
   per-sample weights) straight into the [B, sum of dims] output;
3. the backward reduces the output gradient per unique row and, for tables with an optimizer,
   updates those rows and their optimizer state in place (weight.grad stays None, as with FBGEMM's
   fused TBE); tables without one get an ordinary dense gradient.

The large tensors of a step (bag offsets, the dedup outputs, the pooled output) come from a
recxla.nn.workspace.Workspace, so that a steady-state training step on CPU allocates no new
large blocks (the buffers of a step are reused once nothing refers to them any more).

Sharding: TorchRec's DistributedModelParallel picks a sharder by the module's exact class, so
its default sharders leave this subclass unsharded (DDP then replicates the tables and trips over
their fused optimizers). Pass recxla's: `DistributedModelParallel(model, sharders=
recxla.torchrec.sharders())`, which shards TorchRec's class and this one alike.
"""

import types
from typing import Dict, List, Optional

import torch
import torch.fx
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection as TorchRecEmbeddingBagCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recxla.nn import optimizers
from recxla.nn.table_config import check_table_config
from recxla.nn.workspace import Workspace
from recxla.ops.dedup import segmented_unique
from recxla.ops.embedding_bag import MEAN, SUM, FusedPooledLookup, LookupPlan

OWNER = optimizers.OWNER


def _renamed(fn, name: str):
    """A copy of function `fn` called `name` (same code, globals and annotations)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__annotations__ = name, dict(fn.__annotations__)
    return copy


def _traced_or_meta(features, weights: List[torch.Tensor]) -> bool:
    """Whether forward runs under FX tracing (`features` is a Proxy) or on the meta device."""
    if torch.fx._symbolic_trace.is_fx_tracing() or isinstance(features, torch.fx.Proxy):
        return True
    return any(w.is_meta for w in weights) or (
        isinstance(features, KeyedJaggedTensor) and features.values().is_meta)


class EmbeddingBagCollection(TorchRecEmbeddingBagCollection):
    """Pooled embedding tables with deduplicated lookups and a fused sparse optimizer.

    Args:
        tables: torchrec EmbeddingBagConfig list (FP32 tables; SUM or MEAN pooling).
        is_weighted: the input carries per-sample weights (kjt.weights(), float, one per id).
            Only with SUM pooling: TorchRec's module (torch.nn.EmbeddingBag) raises
            NotImplementedError for weights with MEAN, and so does this one, at construction.
        device: where the tables live.
        optimizer: None, "sgd", "adagrad", "rowwise_adagrad", torch.optim.SGD,
            torch.optim.Adagrad or torchrec.optim.RowWiseAdagrad: the update applied in backward
            to every table. Tables can also get one later with
            torchrec.optim.apply_optimizer_in_backward(cls, [weight], kwargs).
        **optimizer_kwargs: the optimizer's hyperparameters (lr, eps, weight_decay, lr_decay,
            initial_accumulator_value, maximize), as in the optimizer class.

    forward(features: KeyedJaggedTensor with B samples per key) -> KeyedTensor with values
    float32 [B, sum of the features' dims], keys and columns as TorchRec's module gives. On the
    meta device, under torchrec.fx.symbolic_trace and under torch.jit.script the module runs
    TorchRec's forward on its tables (shapes on meta; a traced or scripted copy pools with
    torch.nn.EmbeddingBag and leaves the gradient in weight.grad).
    Raises ValueError for a feature that no table lists or that is missing, lengths that do not
    match the values, and IndexError for ids outside [0, num_embeddings), before any row changes.
    On CPU the output's storage is reused by a later step once nothing refers to it any more.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        optimizer=None,
        **optimizer_kwargs,
    ) -> None:
        for config in tables:
            check_table_config(config, is_weighted, OWNER)
        if optimizer is None and optimizer_kwargs:
            raise TypeError(f"{OWNER}: optimizer keyword arguments {sorted(optimizer_kwargs)} "
                            "given without an optimizer")
        super().__init__(tables, is_weighted=is_weighted, device=device)
        self._flat_features: List[str] = [n for names in self._feature_names for n in names]
        self._feature_table: List[int] = [
            t for t, names in enumerate(self._feature_names) for _ in names
        ]
        self._pooling = [MEAN if c.pooling == PoolingType.MEAN else SUM for c in tables]
        self._table_of_feature: Dict[str, str] = {}
        for config in tables:
            for name in config.feature_names:
                self._table_of_feature.setdefault(name, config.name)
        if optimizer is not None:
            optimizers.attach_optimizer(self._weights(), optimizer, optimizer_kwargs)
        self._workspace = Workspace()

    def _weights(self) -> List[torch.nn.Parameter]:
        return [bag.weight for bag in self.embedding_bags.values()]

    # TorchRec's own forward (torch.nn.EmbeddingBag per feature) on this module's tables: what
    # TorchScript compiles, FX records and the meta device runs (shapes only), where recxla's
    # kernels cannot go. Same parameters, same output layout; no dedup, and the gradient lands
    # in weight.grad (no fused update) in a scripted or traced copy.
    # (A copy under its own name: TorchScript names a method after its function.)
    _torchrec_forward = _renamed(TorchRecEmbeddingBagCollection.forward, "_torchrec_forward")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: KeyedJaggedTensor (int32/int64 ids, B samples per key, float weights when
        is_weighted) -> KeyedTensor, values float32 [B, sum of dims], one key per feature of
        each table (`feature@table` for a feature read by several tables), in table order.
        Under torch.jit.script, torchrec.fx.symbolic_trace and on the meta device it is
        TorchRec's forward (see _torchrec_forward)."""
        if torch.jit.is_scripting():
            return self._torchrec_forward(features)
        else:
            if _traced_or_meta(features, self._weights()):
                return self._torchrec_forward(features)
            return self._fused_forward(features)

    @torch.jit.unused
    def _fused_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """recxla's forward. Every input check and the optimizer lookup run here, before the
        autograd graph exists, so a bad batch leaves the rows and optimizer states as they
        were."""
        values, offsets, psw, table_bounds = self._table_major_ids(features)
        n, ws = values.numel(), self._workspace
        dedup_out = (ws.empty("unique_values", (n,), values.dtype, values.device),
                     ws.empty("unique_offsets", (table_bounds.numel(),), torch.int64,
                              values.device),
                     ws.empty("inverse", (n,), torch.int64, values.device))
        try:
            unique_values, unique_offsets, inverse = segmented_unique(values, table_bounds,
                                                                      out=dedup_out)
        except ValueError:
            self._negative_length(features)  # a clearer message when that is the cause
            raise
        self._check_ids(unique_values, unique_offsets, values, offsets, features.stride())
        weights = self._weights()
        plan = LookupPlan(
            feature_table=self._feature_table,
            pooling=self._pooling,
            batch_size=features.stride(),
            optimizer_step=optimizers.optimizer_step_callback(
                [optimizers.table_optimizer(w, c.name)
                 for w, c in zip(weights, self._embedding_bag_configs)]
            ),
            workspace=ws,
        )
        try:
            out = FusedPooledLookup.apply(
                plan, unique_values, unique_offsets, inverse, offsets, psw, *weights
            )
        except ValueError:
            self._negative_length(features)  # a clearer message when that is the cause
            raise
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=out
        )

    def _table_major_ids(self, features: KeyedJaggedTensor):
        """The ids of the module's features, table by table (the order of the output columns).
        -> values [N], bag offsets int64 [F * B + 1], per-sample weights float32 [N] or None,
        table bounds int64 [T + 1] into values."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"{OWNER}: features must be a KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        keys = features.keys()
        unknown = [k for k in keys if k not in self._table_of_feature]
        if unknown:
            raise ValueError(f"{OWNER}: feature '{unknown[0]}' names no table (features of this "
                             f"module: {sorted(self._table_of_feature)})")
        position = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self._flat_features if f not in position]
        if missing:
            raise ValueError(f"{OWNER}: feature '{missing[0]}' of table "
                             f"'{self._table_of_feature[missing[0]]}' is missing from the input "
                             f"(keys: {keys})")
        if features.variable_stride_per_key() or features.inverse_indices_or_none() is not None:
            raise ValueError(f"{OWNER}: variable batch sizes per feature are not supported")
        batch = features.stride()
        values, lengths = features.values(), features.lengths()
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{OWNER}: ids must be int32 or int64, got {values.dtype}")
        if lengths.numel() != len(keys) * batch:
            raise ValueError(f"{OWNER}: lengths has {lengths.numel()} entries, but {len(keys)} "
                             f"features x batch size {batch} need {len(keys) * batch}")
        # The running sum of the lengths gives the bag offsets; feature totals and the check
        # against the number of ids then cost nothing more. A negative length inside a feature
        # shows as decreasing offsets, which the kernels reject before any row is touched
        # (`_negative_length` names the feature).
        offsets = self._offsets(lengths)
        bounds = offsets[:: max(batch, 1)].tolist() if batch else [0] * (len(keys) + 1)
        per_key = [bounds[i + 1] - bounds[i] for i in range(len(keys))]
        if bounds[-1] != values.numel():
            raise ValueError(f"{OWNER}: lengths sum to {bounds[-1]} but the input holds "
                             f"{values.numel()} ids (lengths per feature: "
                             f"{dict(zip(keys, per_key))})")
        psw = None
        if self._is_weighted:
            psw = features.weights_or_none()
            if psw is None:
                raise ValueError(f"{OWNER}: is_weighted=True but the input has no weights")
            psw = psw.to(torch.float32)
        if keys != self._flat_features:
            # Feature order of the tables (a feature read by two tables appears twice).
            order = [position[f] for f in self._flat_features]
            total, ws = sum(per_key[i] for i in order), self._workspace
            values = torch.cat([values[bounds[i] : bounds[i + 1]] for i in order],
                               out=ws.empty("values", (total,), values.dtype, values.device))
            if psw is not None:  # (cat's out= has no autograd: not for weights that need grad)
                psw = torch.cat([psw[bounds[i] : bounds[i + 1]] for i in order],
                                out=None if psw.requires_grad else
                                ws.empty("weights", (total,), psw.dtype, psw.device))
            reordered = torch.index_select(
                lengths.view(len(keys), batch), 0, torch.tensor(order, device=lengths.device),
                out=ws.empty("lengths", (len(order), batch), lengths.dtype, lengths.device))
            offsets = self._offsets(reordered.view(-1))
        first_feature = [0]
        for names in self._feature_names:
            first_feature.append(first_feature[-1] + len(names))
        table_bounds = offsets[torch.tensor(first_feature, device=values.device) * batch]
        return values, offsets, psw, table_bounds

    def _offsets(self, lengths: torch.Tensor) -> torch.Tensor:
        """lengths [K] -> int64 [K + 1], 0 then their running sum."""
        # empty + one zero rather than zeros: a fill of the whole buffer is a pass for nothing.
        offsets = self._workspace.empty("offsets", (lengths.numel() + 1,), torch.int64,
                                        lengths.device)
        offsets[:1] = 0
        torch.cumsum(lengths, 0, dtype=torch.int64, out=offsets[1:])
        return offsets

    def _negative_length(self, features: KeyedJaggedTensor) -> None:
        """ValueError naming the first feature with a negative bag length, if there is one."""
        lengths = features.lengths()
        bad = torch.nonzero(lengths < 0)
        if bad.numel():
            b = int(bad[0]) % features.stride()
            feature = features.keys()[int(bad[0]) // features.stride()]
            raise ValueError(f"{OWNER}: feature '{feature}' has a negative length "
                             f"({int(lengths[bad[0]])}) at sample {b}")

    def _check_ids(self, unique_values, unique_offsets, values, offsets, batch) -> None:
        """IndexError naming the feature when an id is negative or >= its table's rows. The
        uniques of a table are sorted, so its first and last unique id bound all of its ids."""
        num_tables = unique_offsets.numel() - 1
        if unique_values.numel() == 0 or num_tables == 0:
            return
        starts, ends = unique_offsets[:-1], unique_offsets[1:]
        nonempty = ends > starts
        last_index = unique_values.numel() - 1
        low = unique_values[starts.clamp(max=last_index)]
        high = unique_values[(ends - 1).clamp(min=0)]
        rows = torch.tensor([c.num_embeddings for c in self._embedding_bag_configs],
                            device=unique_values.device)
        bad = nonempty & ((low < 0) | (high >= rows))
        if not bool(bad.any()):
            return
        t = int(torch.nonzero(bad)[0])
        limit = self._embedding_bag_configs[t].num_embeddings
        for f, table in enumerate(self._feature_table):
            if table != t:
                continue
            ids = values[int(offsets[f * batch]) : int(offsets[(f + 1) * batch])]
            wrong = ids[(ids < 0) | (ids >= limit)]
            if wrong.numel():
                raise IndexError(
                    f"{OWNER}: feature '{self._flat_features[f]}' has id {int(wrong[0])} outside "
                    f"[0, {limit}) (table '{self._embedding_bag_configs[t].name}' has {limit} rows)"
                )
