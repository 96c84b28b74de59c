"""Data-parallel tables of recxla's sharded modules: the pooled module's delegated to TorchRec,
the sequence module's replicated by recxla (`SequenceDataParallelTables`).

TorchRec's planner may plan a small table `data_parallel`: every rank holds the whole table,
looks its own batch up locally (no all-to-all), and the table's gradient is averaged over the
ranks by DistributedDataParallel; the user's dense optimizer updates it (no fused optimizer).
recxla does not reimplement that: `DataParallelTables` shards a sub-collection of those tables
with TorchRec's own sharder, so they train exactly as under TorchRec, and joins their pooled
embeddings with the model-parallel ones that recxla's input and output dists bring.

What the sharded module sees:
- `weights`: per table its replicated weight, a view into TorchRec's dense table-batched
  weights; the sharded module registers it as `embedding_bags.<table>.weight`, so
  state_dict holds a plain [rows, dim] tensor per table (TorchRec's layout) and loading one
  writes the table;
- `lookup(features)`: the tables' pooled embeddings for a batch (any key order, extra keys
  ignored) -> KeyedTensor of TorchRec's sub-collection;
- `OutputMerge`: the module's output in the unsharded module's key order, from the
  model-parallel values and the data-parallel KeyedTensor.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recxla.ops.copy_runs import ColumnRange, JoinColumns
from recxla.torchrec.keyed_output import KeyedOutput
from recxla.torchrec.shard_layout import OWNER

DATA_PARALLEL = ShardingType.DATA_PARALLEL.value


def is_data_parallel(sharding: ParameterSharding) -> bool:
    return sharding.sharding_type == DATA_PARALLEL


def broadcast_from_first(weights, env: ShardingEnv) -> None:
    """Every replica of `weights` set to the group's first rank's, so that all start equal
    (each rank built its own from the unsharded module or the tables' init_fn)."""
    if env.world_size <= 1:
        return
    group = env.process_group
    src = 0 if group is None or group is dist.group.WORLD else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for weight in weights:
            dist.broadcast(weight.data, src=src, group=group)


class DataParallelTables:
    """The data-parallel tables of one sharded module, as TorchRec shards them.

    Args:
        module: the unsharded EmbeddingBagCollection (its weights are copied when it is not on
            the meta device; rank 0's copy wins, so every replica starts equal).
        names: the data-parallel tables, in the module's table order.
        plan: the module's plan (ParameterSharding per table).
        env: the ShardingEnv of the sharded module.
        device: where the replicas live.
        fused_params: the sharder's fused_params (TorchRec's sharder reads its options; the
            tables get TorchRec's dense kernel and ordinary gradients either way).
    Not an nn.Module child of the sharded module: its parameters appear once, under the
    sharded module's `embedding_bags.<table>.weight`.
    """

    def __init__(self, module: EmbeddingBagCollection, names: Sequence[str],
                 plan: Dict[str, ParameterSharding], env: ShardingEnv,
                 device: torch.device, fused_params: Optional[dict] = None) -> None:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        configs = [c for c in module.embedding_bag_configs() if c.name in names]
        self.configs: List[EmbeddingBagConfig] = configs
        self.table_names = [c.name for c in configs]
        on_meta = any(module.embedding_bags[n].weight.device.type == "meta" for n in names)
        sub = EmbeddingBagCollection(configs, is_weighted=module.is_weighted(),
                                     device=torch.device("meta"))
        self.sharded = EmbeddingBagCollectionSharder(fused_params=fused_params).shard(
            sub, {n: plan[n] for n in names}, env, device)
        self.weights: Dict[str, torch.nn.Parameter] = {
            n: self.sharded.embedding_bags[n].weight for n in names}
        if device.type != "meta" and not on_meta:
            with torch.no_grad():
                for n in names:
                    self.weights[n].copy_(module.embedding_bags[n].weight)
        if device.type != "meta":
            broadcast_from_first(self.weights.values(), env)
        # The sub-collection's features, in the order its input dist expects them.
        self.feature_names = list(dict.fromkeys(f for c in configs for f in c.feature_names))
        self._selection: Dict[Tuple[str, ...], List[int]] = {}

    def select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch's features that these tables read, in their order."""
        keys = tuple(features.keys())
        order = self._selection.get(keys)
        if order is None:
            position = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self.feature_names if f not in position]
            if missing:
                raise ValueError(f"{OWNER}: feature '{missing[0]}' is missing from the input "
                                 f"(keys: {list(keys)}; the data-parallel tables read "
                                 f"{self.feature_names})")
            order = [position[f] for f in self.feature_names]
            self._selection[keys] = order
        if order == list(range(len(keys))):
            return features
        return features.permute(order)

    def lookup(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of the selected features (see `select`) on this rank's batch:
        TorchRec's data-parallel lookup, float32 [B, sum of dims], its gradient averaged
        over the ranks in backward."""
        return self.sharded(features).wait()


class OutputMerge:
    """Joins the model-parallel pooled values and the data-parallel KeyedTensor into the
    unsharded module's output: its keys, in its order.

    Args:
        configs: all tables of the unsharded module, in order.
        parallel: the model-parallel tables' names (recxla's layout), in order.
    """

    def __init__(self, configs: Sequence[EmbeddingBagConfig], parallel: Sequence[str]) -> None:
        names = get_embedding_names_by_table(list(configs))
        self.keys = [n for table in names for n in table]
        self.dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        mp = [c for c in configs if c.name in parallel]
        dp = [c for c in configs if c.name not in parallel]
        # (table, feature) -> the name each part calls it (a feature shared by several
        # tables of one part is `feature@table` there).
        self._part_names = [
            {(c.name, f): n for c, table in zip(part, get_embedding_names_by_table(part))
             for f, n in zip(c.feature_names, table)} if part else {}
            for part in (mp, dp)
        ]
        self._slots = [(c.name, f) for c in configs for f in c.feature_names]
        self._in_mp = [c.name in parallel for c in configs for _ in c.feature_names]
        self._ranges: Dict[Tuple, List[ColumnRange]] = {}

    def merge(self, mp_values: torch.Tensor, mp_keys: Sequence[str], mp_dims: Sequence[int],
              dp: KeyedTensor) -> KeyedTensor:
        """mp_values float32 [B, sum(mp_dims)] (columns per mp_keys), dp: the data-parallel
        KeyedTensor -> KeyedTensor with `keys`, float32 [B, sum(dims)]: each feature's columns
        moved from its part by one copy_runs (JoinColumns), its gradient back the same way."""
        signature = (tuple(mp_keys), tuple(mp_dims), tuple(dp.keys()), tuple(dp.length_per_key()))
        ranges = self._ranges.get(signature)
        if ranges is None:
            ranges = self._build_ranges(mp_keys, mp_dims, dp.keys(), dp.length_per_key())
            self._ranges[signature] = ranges
        dp_values = dp.values()
        if dp_values.dtype != mp_values.dtype:
            dp_values = dp_values.to(mp_values.dtype)
        values = JoinColumns.apply(ranges, sum(self.dims), mp_values.contiguous(),
                                   dp_values.contiguous())
        return KeyedOutput(keys=self.keys, length_per_key=self.dims, values=values)

    def _build_ranges(self, mp_keys, mp_dims, dp_keys, dp_dims) -> List[ColumnRange]:
        """Where each output feature's columns come from: part 0 (model-parallel) or 1
        (data-parallel), by the name each part gives the feature."""
        starts = []
        for keys, dims in ((mp_keys, mp_dims), (dp_keys, dp_dims)):
            at, start = {}, 0
            for key, dim in zip(keys, dims):
                at[key] = start
                start += dim
            starts.append(at)
        ranges, column = [], 0
        for slot, in_mp, dim in zip(self._slots, self._in_mp, self.dims):
            part = 0 if in_mp else 1
            ranges.append(ColumnRange(part, starts[part][self._part_names[part][slot]], column,
                                      dim))
            column += dim
        return ranges


class _SequenceLookup(nn.Module):
    """The data-parallel sequence tables' lookup: per (table, feature) the rows of its ids."""

    def __init__(self, weights: Dict[str, nn.Parameter], slots: Sequence[Tuple[str, str, str]]):
        super().__init__()
        self.weights = nn.ParameterDict(weights)
        self.slots = list(slots)  # (output key, table, feature)

    def forward(self, values: List[torch.Tensor]) -> List[torch.Tensor]:
        return [nn.functional.embedding(ids, self.weights[table])
                for ids, (_, table, _) in zip(values, self.slots)]


class SequenceDataParallelTables:
    """The data-parallel tables of a sharded EmbeddingCollection, as TorchRec trains them:
    every rank holds the whole table and looks its own batch up (no all-to-all), and
    DistributedDataParallel averages the tables' gradients over the group in backward, for the
    user's dense optimizer (TorchRec's dense kernel; no fused optimizer). recxla does this
    itself: TorchRec 1.9.2's data-parallel sequence sharding raises on CPU.

    Args:
        module: the unsharded EmbeddingCollection (its weights are copied when it is not on
            the meta device, else each table's init_fn runs; rank 0's copy wins).
        names: the data-parallel tables, in the module's table order.
        env: the ShardingEnv of the sharded module (DDP's process group).
        device: where the replicas live.
        output_keys: the module's output keys, table by table (the unsharded module's names).
        owner: the sharded module's name in error messages.
    Not an nn.Module child of the sharded module: its parameters appear once, under the
    sharded module's `embeddings.<table>.weight`.
    """

    def __init__(self, module, names: Sequence[str], env: ShardingEnv, device: torch.device,
                 output_keys: Sequence[str], owner: str) -> None:
        configs = module.embedding_configs()
        keys = iter(output_keys)
        slots = []
        for c in configs:
            for f in c.feature_names:
                key = next(keys)
                if c.name in names:
                    slots.append((key, c.name, f))
        self.owner = owner
        self.weights: Dict[str, nn.Parameter] = {}
        for c in configs:
            if c.name not in names:
                continue
            source = module.embeddings[c.name].weight
            weight = torch.empty(source.shape, dtype=torch.float32, device=device)
            if device.type != "meta":
                with torch.no_grad():
                    if source.device.type != "meta":
                        weight.copy_(source)
                    else:
                        c.init_fn(weight)
            self.weights[c.name] = nn.Parameter(weight)
        if device.type != "meta":
            broadcast_from_first(self.weights.values(), env)
        self.feature_names = list(dict.fromkeys(f for _, _, f in slots))
        self._slots = slots
        lookup = _SequenceLookup(self.weights, slots)
        self._lookup = lookup
        if device.type != "meta" and env.world_size > 1:
            # As TorchRec's data-parallel sharding: the gradients averaged over the group.
            self._lookup = DistributedDataParallel(
                lookup, process_group=env.process_group, gradient_as_bucket_view=True,
                broadcast_buffers=False, static_graph=True)

    def lookup(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """The tables' rows for this rank's batch: per output key its JaggedTensor (values
        float32 [ids, dim], the feature's lengths)."""
        by_key = features.to_dict()
        missing = [f for f in self.feature_names if f not in by_key]
        if missing:
            raise ValueError(f"{self.owner}: feature '{missing[0]}' is missing from the input "
                             f"(keys: {features.keys()}; the data-parallel tables read "
                             f"{self.feature_names})")
        jagged = [by_key[f] for _, _, f in self._slots]
        rows = self._lookup([j.values() for j in jagged])
        return {key: JaggedTensor(values=r, lengths=j.lengths())
                for (key, _, _), r, j in zip(self._slots, rows, jagged)}
