"""recxla's sharded EmbeddingBagCollection: TorchRec's model parallelism on recxla's kernels.

A subclass of TorchRec's `ShardedEmbeddingBagCollection`, so DistributedModelParallel, the
planner, `TrainPipelineSparseDist`, state_dict and torch.distributed.checkpoint treat it as
theirs, built on recxla's pieces instead of FBGEMM's:

    input_dist   ids to their owners, deduplicated per (destination, table)   (input_dist.py)
    compute      the owner's pooled lookup over unique rows, fused optimizer   (ops.embedding_bag)
    output_dist  pooled rows back through recxla.quantized_all_to_all          (output_dist.py)

Every sharding type is placed from the plan's shard metadata (shard_layout.py): table-wise,
column-wise, table-column-wise, row-wise and table-row-wise, on CPU (gloo) as on GPU; row-wise
pooled sums come back through the same all-to-all and are added by the receiver, so no
reduce-scatter is needed (gloo has none). Data-parallel tables are sharded by TorchRec
itself (data_parallel.py). The output is the unsharded module's: the same KeyedTensor keys,
order and columns. Batches with a variable batch per feature are expanded to the regular
batch they stand for (variable_batch.py).

The module is a thin TorchRec face over its parts (sharded_builder.py makes them) and its steps
(`self.steps`, sharded_steps.py: recxla.pipeline calls them one by one, docs/architecture.md);
recxla's sequence module (sharded_embedding.py) is the same parts and steps with another
receiver. What the constructor accepts is checked in sharded_config.py.

Weights: each rank holds, per table, one float32 Parameter per local shard under
`embedding_bags.<table>` (an empty one where it holds none; sharded_builder.py); state_dict
gives one ShardedTensor `embedding_bags.<table>.weight` per table (TorchRec's layout and
dtype), and load_state_dict takes ShardedTensors or full unsharded tensors
(sharded_state_dict.py).
"""

from typing import Any, Dict, Optional, Sequence, Union

import torch
from torchrec.distributed.embedding_types import ShardedEmbeddingModule
from torchrec.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection as TorchRecShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, get_format
from recxla.ops.embedding_bag import MEAN, SUM
from recxla.torchrec.data_parallel import DataParallelTables, OutputMerge, is_data_parallel
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.shard_layout import OWNER, TableInfo
from recxla.torchrec.sharded_builder import build_sharded_parts, table_holders
from recxla.nn.table_config import check_sharded_table_options, check_table_config
from recxla.torchrec.sharded_config import (  # noqa: F401  (SUPPORTED_SHARDING_TYPES: public here)
    SUPPORTED_SHARDING_TYPES,
    row_exchange_tables,
)
from recxla.torchrec.sharded_state_dict import TableStateDict
from recxla.torchrec.sharded_steps import ShardedSteps
from recxla.torchrec.torchrec_interface import SHARDING_NAME, TorchRecFace, TorchRecMethods

class ShardedEmbeddingBagCollection(TorchRecMethods, TorchRecShardedEmbeddingBagCollection):
    """EmbeddingBagCollection sharded by recxla (see the module docstring).

    Args:
        module: torchrec EmbeddingBagCollection or recxla.nn.EmbeddingBagCollection (FP32
            or FP16 tables, SUM or MEAN pooling).
        table_name_to_parameter_sharding: the plan for this module (TorchRec's planner).
        env: ShardingEnv (its process group carries the all-to-alls).
        fused_params: TorchRec's fused_params ({"optimizer": EmbOptimType, "learning_rate",
            "eps", "weight_decay", ...}; no optimizer named: EXACT_SGD at 0.01, as TorchRec's);
            an optimizer attached to a table's weight wins; a table planned on the "dense"
            compute kernel gets an ordinary gradient.
        device: where the shards live.
        fwd_comm, bwd_comm: wire formats of pooled embeddings and of their gradients.
        dedup_ids: let the input dist send unique ids (it picks, per destination, whichever
            is smaller; False: always raw ids).
        module_fqn: the module's path in the model.
        replicas: in 2D training (env is one node's shard group), how the copies of this
            rank's shards on the other nodes stay in step (recxla.torchrec.replicas); None: 1D.
        row_exchange: which tables' owners send unique rows instead of pooled bags
            (row_exchange.py): "off" (none), "all", or a list of table names. Tables in it
            need a fused optimizer.
    forward(features: KeyedJaggedTensor) -> LazyAwaitable[KeyedTensor], values float32
    [B, sum of dims] as the unsharded module's. `comm_stats` counts the bytes.
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        fwd_comm: str = DEFAULT_FWD_COMM,
        bwd_comm: str = DEFAULT_BWD_COMM,
        dedup_ids: bool = True,
        module_fqn: Optional[str] = None,
        replicas: Optional[ReplicaSync] = None,
        row_exchange: Union[str, Sequence[str]] = "off",
    ) -> None:
        # TorchRec's constructor builds FBGEMM lookups and its own dists; recxla builds its own.
        ShardedEmbeddingModule.__init__(self, qcomm_codecs_registry=None)
        get_format(fwd_comm, OWNER, "fwd_comm")
        get_format(bwd_comm, OWNER, "bwd_comm")
        device = torch.device(device) if device is not None else torch.device("cpu")
        # On the meta device (DistributedModelParallel(device="meta"), as with TorchRec's
        # sharder) the shards have shapes and no values: enough for state_dict layouts and
        # checkpoint planning; running it needs a module sharded onto a real device.
        plan = table_name_to_parameter_sharding
        configs = module.embedding_bag_configs()
        self._embedding_bag_configs = configs
        self._is_weighted = module.is_weighted()
        self._sharding_types = [SHARDING_NAME]  # read by TorchRec's code
        for config in configs:
            check_table_config(config, self._is_weighted, OWNER,
                               (DataType.FP32, DataType.FP16))
            check_sharded_table_options(config, OWNER)
            if config.name not in plan:
                raise ValueError(f"{OWNER}: the plan has no entry for table '{config.name}'")
        # Data-parallel tables are TorchRec's (data_parallel.py); from here on `configs` are
        # the tables recxla shards, and table indices count those.
        data_parallel = [c.name for c in configs if is_data_parallel(plan[c.name])]
        self._data_parallel: Optional[DataParallelTables] = None
        self._output_merge: Optional[OutputMerge] = None
        if data_parallel:
            self._data_parallel = DataParallelTables(module, data_parallel, plan, env, device,
                                                     fused_params)
            self._output_merge = OutputMerge(
                configs, [c.name for c in configs if c.name not in data_parallel])
            configs = [c for c in configs if c.name not in data_parallel]
        self.module_sharding_plan = {c.name: plan[c.name] for c in configs}
        tables = [TableInfo(c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names),
                            MEAN if c.pooling == PoolingType.MEAN else SUM) for c in configs]
        self.parts = build_sharded_parts(
            tables, configs, {c.name: module.embedding_bags[c.name].weight for c in configs},
            self.module_sharding_plan, env, fused_params=fused_params, device=device,
            fwd_comm=fwd_comm, bwd_comm=bwd_comm, dedup_ids=dedup_ids,
            is_weighted=self._is_weighted, weight_prefix="embedding_bags",
            row_tables=row_exchange_tables(row_exchange, [c.name for c in configs]),
            replicas=replicas)
        self.steps = ShardedSteps(self.parts)
        self._face = TorchRecFace(self.steps, module_fqn, self._complete,
                                  lambda output: output.values().shape[0])
        self.comm_stats = self.parts.stats
        # TorchRec's replicated weights of the data-parallel tables under their usual names.
        replicated = {} if self._data_parallel is None else self._data_parallel.weights
        self.module_sharding_plan.update({name: plan[name] for name in replicated})
        self.embedding_bags = table_holders(
            self.parts, [c.name for c in self._embedding_bag_configs], replicated)
        if self._data_parallel is not None:
            self.parts.router.require(self._data_parallel.feature_names)
        TableStateDict(self.parts, "embedding_bags").install(self)

    # ------------------------------------------------------------------ TorchRec interface
    # (TorchRecMethods: input_dist, compute, output_dist, forward, ... delegated to the parts)

    def _complete(self, output: KeyedTensor,
                  features: Optional[KeyedJaggedTensor]) -> KeyedTensor:
        """The model-parallel output joined with the data-parallel tables' lookup of
        `features`, in the unsharded module's key order (no data-parallel tables: as it is)."""
        if self._data_parallel is None:
            return output
        layout = self.parts.layout
        return self._output_merge.merge(
            output.values(), layout.embedding_names, layout.embedding_dims,
            self._data_parallel.lookup(self._data_parallel.select(features)))
