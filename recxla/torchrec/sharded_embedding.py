"""recxla's sharded EmbeddingCollection: sequence embeddings (a row per id) on recxla's dists.

A subclass of TorchRec's `ShardedEmbeddingCollection`, so DistributedModelParallel, the
planner, `TrainPipelineSparseDist`, state_dict and torch.distributed.checkpoint treat it as
theirs. TorchRec's sequence all-to-all sends one row per id of the batch: sum(lengths) x dim
values. recxla's sends each row a rank's batch needs once:

    input_dist   every table's ids deduplicated per (owner, row group, micro-batch) and sent to
                 their owners (row_exchange.py, through input_dist.py)
    compute      the owner gathers the requested rows, one lookup for every table
                 (row_exchange.RowLookup)
    output_dist  each unique row once to each rank that asked, FP8 row-wise by default
                 (recxla.quantized_all_to_all); the rank expands them to the positions of its
                 ids (sequence_output.py)
    backward     the rank sums each row's gradients over its positions and sends one gradient
                 per unique row; the owner applies the fused optimizer once per row over every
                 rank's (row_exchange.update_requested_rows)

It is recxla's pooled module (sharded_embedding_bag.py) with every table exchanged as rows and
an expanding receiver: the same parts (sharded_builder.py), steps (sharded_steps.py, which
recxla.pipeline drives) and TorchRec interface (torchrec_interface.py).

Sharding types: table-wise, column-wise, table-column-wise, row-wise and table-row-wise from
the plan's shard metadata, on CPU (gloo) as on GPU; data-parallel tables are replicated and
looked up on every rank, their gradients averaged by DistributedDataParallel for the dense
optimizer, as TorchRec does (data_parallel.SequenceDataParallelTables). The output is the
unsharded module's: Dict[str, JaggedTensor], one per embedding name (a feature, or
`feature@table` where several tables read it), values float32 [ids of the feature, dim],
lengths [B]; with `need_indices` its weights are the ids. state_dict holds one ShardedTensor
`embeddings.<table>.weight` per table, TorchRec's layout, so a checkpoint moves both ways.
"""

from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding import (
    ShardedEmbeddingCollection as TorchRecShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_types import ShardedEmbeddingModule
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingCollection, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, get_format
from recxla.nn.table_config import check_sharded_table_options
from recxla.ops.embedding_bag import SUM
from recxla.torchrec.data_parallel import SequenceDataParallelTables, is_data_parallel
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.shard_layout import TableInfo
from recxla.torchrec.sharded_builder import build_sharded_parts, table_holders
from recxla.torchrec.sharded_config import SUPPORTED_SHARDING_TYPES
from recxla.torchrec.sharded_state_dict import TableStateDict
from recxla.torchrec.sharded_steps import ShardedSteps
from recxla.torchrec.torchrec_interface import SHARDING_NAME, TorchRecFace, TorchRecMethods

OWNER = "recxla.torchrec.ShardedEmbeddingCollection"
# TorchRec's EmbeddingCollectionSharder offers data-parallel, table-, column- and row-wise;
# recxla's layout places the table-column-wise and table-row-wise plans the same way.
SEQUENCE_SHARDING_TYPES = list(SUPPORTED_SHARDING_TYPES)


def check_sequence_configs(configs, plan: Dict[str, ParameterSharding]) -> None:
    """The tables of an EmbeddingCollection recxla shards: every one planned, FP32, one dim
    for all (TorchRec's EmbeddingCollection refuses several), no option of
    UNSHARDABLE_TABLE_OPTIONS (ValueError/TypeError/NotImplementedError naming the table and
    the limit)."""
    dims = {c.embedding_dim for c in configs}
    for config in configs:
        check_sharded_table_options(config, OWNER)
        if config.name not in plan:
            raise ValueError(f"{OWNER}: the plan has no entry for table '{config.name}'")
        if config.data_type != DataType.FP32:
            raise TypeError(f"{OWNER}: table '{config.name}' must be FP32, got "
                            f"{config.data_type} (FP16 sequence tables are not supported)")
        if len(dims) > 1:
            raise ValueError(f"{OWNER}: all tables of an EmbeddingCollection must have one "
                             f"embedding_dim (as TorchRec's); table '{config.name}' has "
                             f"{config.embedding_dim}, the tables have {sorted(dims)}")


class ShardedEmbeddingCollection(TorchRecMethods, TorchRecShardedEmbeddingCollection):
    """EmbeddingCollection sharded by recxla (see the module docstring).

    Args:
        module: torchrec EmbeddingCollection (FP32 tables of one dim).
        table_name_to_parameter_sharding: the plan for this module (TorchRec's planner).
        env: ShardingEnv (its process group carries the all-to-alls).
        fused_params: TorchRec's fused_params ({"optimizer": EmbOptimType, "learning_rate",
            "eps", "weight_decay", ...}; no optimizer named: EXACT_SGD at 0.01, as TorchRec's);
            an optimizer attached to a table's weight wins. Every model-parallel table needs
            one (its rows are updated once per step where they are owned).
        device: where the shards live.
        fwd_comm, bwd_comm: wire formats of the rows and of their gradients.
        dedup_ids: kept for the sharders' common arguments; the rows' ids always travel
            deduplicated (each row is sent once).
        module_fqn: the module's path in the model.
        replicas: in 2D training (env is one node's shard group), how the copies of this
            rank's shards on the other nodes stay in step (recxla.torchrec.replicas); None: 1D.
        max_sequence_length: the longest sequence (bag) a batch may hold; longer ones raise a
            ValueError naming the feature and the sample, on every rank. None: no limit.
    forward(features: KeyedJaggedTensor) -> LazyAwaitable[Dict[str, JaggedTensor]] as the
    unsharded module's. `comm_stats` counts the bytes.
    """

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        fwd_comm: str = DEFAULT_FWD_COMM,
        bwd_comm: str = DEFAULT_BWD_COMM,
        dedup_ids: bool = True,
        module_fqn: Optional[str] = None,
        replicas: Optional[ReplicaSync] = None,
        max_sequence_length: Optional[int] = None,
    ) -> None:
        # TorchRec's constructor builds FBGEMM lookups and its own dists; recxla builds its own.
        ShardedEmbeddingModule.__init__(self, qcomm_codecs_registry=None)
        get_format(fwd_comm, OWNER, "fwd_comm")
        get_format(bwd_comm, OWNER, "bwd_comm")
        if max_sequence_length is not None and (
                not isinstance(max_sequence_length, int) or isinstance(max_sequence_length, bool)
                or max_sequence_length < 1):
            raise ValueError(f"{OWNER}: max_sequence_length must be None or an int >= 1, got "
                             f"{max_sequence_length!r}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        plan = table_name_to_parameter_sharding
        configs = module.embedding_configs()
        check_sequence_configs(configs, plan)
        self._embedding_configs = configs
        self._embedding_dim = module.embedding_dim()
        self._need_indices = module.need_indices()
        self._sharding_types = [SHARDING_NAME]  # read by TorchRec's code
        # Output keys: the unsharded module's names (a feature shared by several tables is
        # feature@table among all of them), in its order.
        names = get_embedding_names_by_table(configs)
        self._output_keys = [n for table in names for n in table]
        self._key_feature = {n: f for c, table in zip(configs, names)
                             for n, f in zip(table, c.feature_names)}
        data_parallel = [c.name for c in configs if is_data_parallel(plan[c.name])]
        self._data_parallel: Optional[SequenceDataParallelTables] = None
        if data_parallel:
            self._data_parallel = SequenceDataParallelTables(module, data_parallel, env, device,
                                                             self._output_keys, OWNER)
            if replicas is not None:
                raise ValueError(f"{OWNER}: data-parallel tables ({data_parallel}) with 2D "
                                 "replicas are not supported")
        model_parallel = [(c, table) for c, table in zip(configs, names)
                          if c.name not in data_parallel]
        configs = [c for c, _ in model_parallel]
        self.module_sharding_plan = {c.name: plan[c.name] for c in configs}
        tables = [TableInfo(c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names),
                            SUM) for c in configs]
        self.parts = build_sharded_parts(
            tables, configs, {c.name: module.embeddings[c.name].weight for c in configs},
            self.module_sharding_plan, env, fused_params=fused_params, device=device,
            fwd_comm=fwd_comm, bwd_comm=bwd_comm, dedup_ids=dedup_ids, is_weighted=False,
            weight_prefix="embeddings", replicas=replicas, sequence=True,
            max_sequence_length=max_sequence_length,
            sharding_types=SEQUENCE_SHARDING_TYPES, owner=OWNER)
        self.steps = ShardedSteps(self.parts)
        # The layout names the model-parallel tables' outputs among themselves: -> output keys.
        self._renamed = dict(zip(self.parts.layout.embedding_names,
                                 [n for _, table in model_parallel for n in table]))
        self._face = TorchRecFace(self.steps, module_fqn, self._complete, _samples)
        self.comm_stats = self.parts.stats
        # The data-parallel tables' replicas under their usual names.
        replicated = {} if self._data_parallel is None else self._data_parallel.weights
        self.module_sharding_plan.update({name: plan[name] for name in replicated})
        self.embeddings = table_holders(self.parts, [c.name for c in self._embedding_configs],
                                        replicated)
        if self._data_parallel is not None:
            self.parts.router.require(self._data_parallel.feature_names)
        TableStateDict(self.parts, "embeddings").install(self)

    # ------------------------------------------------------------------ TorchRec interface
    # (TorchRecMethods: input_dist, compute, output_dist, forward, ... delegated to the parts)

    def _complete(self, output: Dict[str, JaggedTensor],
                  features: Optional[KeyedJaggedTensor]) -> Dict[str, JaggedTensor]:
        """The model-parallel tables' jagged tensors under the module's output keys, with the
        data-parallel tables' lookup of `features` and, with need_indices, each feature's ids
        as weights, in the unsharded module's order."""
        out = {self._renamed[name]: jagged for name, jagged in output.items()}
        if self._data_parallel is not None:
            out.update(self._data_parallel.lookup(features))
        if self._need_indices:
            ids = features.to_dict()
            out = {n: JaggedTensor(values=j.values(), lengths=j.lengths(),
                                   weights=ids[self._key_feature[n]].values())
                   for n, j in out.items()}
        if len(out) > 1:
            out = {n: out[n] for n in self._output_keys}
        return out

    # ------------------------------------------------------------------ the rest

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names(self) -> List[str]:
        return list(self._output_keys)


def _samples(output: Dict[str, JaggedTensor]) -> Optional[int]:
    """The samples of a formed sequence output (its jagged tensors' batch; None without
    any)."""
    return next(iter(output.values())).lengths().numel() if output else None
