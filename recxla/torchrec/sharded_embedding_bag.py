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

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList, ShardedEmbeddingModule
from torchrec.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection as TorchRecShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import (
    LazyAwaitable,
    Multistreamable,
    ParameterSharding,
    ShardingEnv,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, get_format
from recxla.ops.embedding_bag import MEAN, SUM
from recxla.torchrec.data_parallel import DataParallelTables, OutputMerge, is_data_parallel
from recxla.torchrec.fused_optimizer import ShardedFusedOptimizer
from recxla.torchrec.input_dist import LookupInput
from recxla.torchrec.output_dist import Message
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.row_exchange import RowBags, RowInput
from recxla.torchrec.shard_layout import OWNER, ShardLayout, TableInfo
from recxla.torchrec.sharded_builder import build_sharded_parts
from recxla.torchrec.sharded_config import (  # noqa: F401  (SUPPORTED_SHARDING_TYPES: public here)
    SUPPORTED_SHARDING_TYPES,
    check_table_config,
    row_exchange_tables,
)
from recxla.torchrec.sharded_state_dict import TableStateDict, reset_local_shards, weight_name
from recxla.torchrec.sharded_steps import ShardedSteps

_SHARDING_NAME = "recxla"


@dataclass
class ShardedEmbeddingBagContext(Multistreamable):
    """Per-batch state between input_dist and the output: this rank's batch size, the
    sources' batch sizes at the owner, and the bag lengths of row-sharded MEAN features."""

    batch_size: int = 0
    source_batches: List[int] = field(default_factory=list)
    bag_lengths: Optional[torch.Tensor] = None
    row_bags: Optional[RowBags] = None  # this rank's bags of row tables (row_exchange.py)
    rows: Optional[RowInput] = None  # the owner's requested rows
    # The data-parallel tables' features (data_parallel.py), looked up with the output.
    data_parallel_features: Optional[KeyedJaggedTensor] = None
    # TorchRec's input-dist awaitables look for per-sharding contexts; recxla keeps none.
    sharding_contexts: List[Any] = field(default_factory=list)

    def record_stream(self, stream) -> None:
        if self.bag_lengths is not None and self.bag_lengths.is_cuda:
            self.bag_lengths.record_stream(stream)


class ShardedEmbeddingBagCollection(TorchRecShardedEmbeddingBagCollection):
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
        self._module_fqn = module_fqn
        device = torch.device(device) if device is not None else torch.device("cpu")
        # On the meta device (DistributedModelParallel(device="meta"), as with TorchRec's
        # sharder) the shards have shapes and no values: enough for state_dict layouts and
        # checkpoint planning; running it needs a module sharded onto a real device.
        self._fwd_comm, self._bwd_comm = fwd_comm, bwd_comm
        plan = table_name_to_parameter_sharding
        configs = module.embedding_bag_configs()
        self._embedding_bag_configs = configs
        self._is_weighted = module.is_weighted()
        self._sharding_types = [_SHARDING_NAME]
        for config in configs:
            check_table_config(config, self._is_weighted)
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
        self.comm_stats = self.parts.stats
        # Per table one Parameter per local shard: `weight`, then `weight_1`, ... (state_dict
        # shows them as the one ShardedTensor `weight`).
        self.embedding_bags = nn.ModuleDict()
        for config, params in zip(configs, self.parts.tables.parameters):
            holder = nn.Module()
            for k, param in enumerate(params):
                holder.register_parameter(weight_name(k), param)
            self.embedding_bags[config.name] = holder
        if self._data_parallel is not None:
            # TorchRec's replicated weights, under their usual names, in the module's order.
            for name, weight in self._data_parallel.weights.items():
                self.module_sharding_plan[name] = plan[name]
                holder = nn.Module()
                holder.register_parameter("weight", weight)
                self.embedding_bags[name] = holder
            self.embedding_bags = nn.ModuleDict(
                {c.name: self.embedding_bags[c.name] for c in self._embedding_bag_configs})
            # Checked on every rank before any id moves, like the router's own features.
            router = self.parts.router
            router.required_features = list(dict.fromkeys(
                router.required_features + self._data_parallel.feature_names))
        TableStateDict(self.parts, "embedding_bags").install(self)

    # ------------------------------------------------------------------ TorchRec interface

    def create_context(self) -> ShardedEmbeddingBagContext:
        return ShardedEmbeddingBagContext()

    def input_dist(self, ctx: ShardedEmbeddingBagContext, features: KeyedJaggedTensor):
        """Checks the batch and starts the id all-to-alls. -> Awaitable[Awaitable[KJTList]]
        whose KJTList holds one LookupInput (TorchRec's pipelines wait on it in two steps)."""
        if self.parts.on_meta:
            raise ValueError(f"{OWNER}: this module was sharded on the meta device: its shards "
                             "have no values; shard the model onto a real device (e.g. "
                             "DistributedModelParallel(..., device=torch.device('cpu'))) to run it")
        awaitable = self.steps.start_input_dist(features)
        if self._data_parallel is not None and awaitable.input_lengths is not None:
            # The router checked the batch (the data-parallel features included) and
            # expanded a variable batch per feature (variable_batch.py).
            ctx.data_parallel_features = self._data_parallel.select(awaitable.features)
        lengths = awaitable.input_lengths
        if lengths is not None:
            ctx.batch_size = lengths.shape[1]
            ctx.bag_lengths = self.steps.receive_lengths(lengths)
            ctx.row_bags = awaitable.row_bags
        return KJTListSplitsAwaitable([awaitable], ctx, self._module_fqn, self._sharding_types)


    def forward(self, *input, **kwargs):
        """TorchRec's forward (input dist, lookup, output dist), unless a pipeline staged this
        step's output (`stage_output`): then that output, for the same batch size."""
        if self.parts.staged_outputs:
            output = self.parts.staged_outputs.popleft()
            if callable(output):
                output = output()
            features = input[0] if input else kwargs.get("features")
            if isinstance(features, KeyedJaggedTensor) and \
                    features.stride() != output.values().shape[0]:
                self.parts.staged_outputs.clear()
                raise ValueError(f"{OWNER}: the pipeline staged embeddings of "
                                 f"{output.values().shape[0]} samples, but the model passed "
                                 f"{features.stride()}; the model must give this module the "
                                 "micro-batch's sparse features")
            if self._data_parallel is not None:
                # The staged output holds the model-parallel tables; the data-parallel ones
                # are looked up here, on this micro-batch's features.
                output = self._merge_data_parallel(output.values(),
                                                   self._data_parallel.select(features))
            return output
        return super().forward(*input, **kwargs)


    def compute(self, ctx: ShardedEmbeddingBagContext, dist_input: KJTList):
        """The owner's lookup. -> (pooled float32 [sum of the sources' batches, D_owner],
        per row group its gathered rows [R_g, cols_g])."""
        lookup_input: LookupInput = self.steps.to_device(dist_input[0])
        ctx.source_batches = lookup_input.batch_sizes
        ctx.rows = lookup_input.rows
        if ctx.row_bags is not None:
            ctx.row_bags = ctx.row_bags.to(self.parts.device)
        return self.steps.lookup(lookup_input)


    def output_dist(self, ctx: ShardedEmbeddingBagContext, output) -> LazyAwaitable[KeyedTensor]:
        """Starts the embeddings' all-to-all. -> LazyAwaitable[KeyedTensor]."""
        pooled, row_outputs = output
        message = self.steps.output_message(ctx.batch_size, ctx.row_bags)
        handle, send, _ = self.steps.start_output(pooled, ctx.source_batches, message,
                                                  row_outputs, ctx.rows)
        return _PooledEmbeddingsAwaitable(self, handle, send, message, ctx)

    def finish_output(self, handle, sent: List[int], message: Message,
                      bag_lengths: Optional[torch.Tensor],
                      data_parallel_features: Optional[KeyedJaggedTensor]) -> KeyedTensor:
        """output_dist's end (autograd path): waits for the rows, assembles this rank's
        KeyedTensor (the data-parallel tables' lookup merged in) whose backward sends the
        gradient back and counts a fused optimizer step."""
        values = self.parts.output.finish(handle, sent, message, bag_lengths,
                                          self.steps.count_step)
        if self._data_parallel is not None:
            return self._merge_data_parallel(values, data_parallel_features)
        return self.steps.form_output(values, bag_lengths)

    def _merge_data_parallel(self, values: torch.Tensor,
                             features: KeyedJaggedTensor) -> KeyedTensor:
        """The model-parallel values joined with the data-parallel tables' lookup of
        `features`, in the unsharded module's key order."""
        layout = self.parts.layout
        return self._output_merge.merge(values, layout.embedding_names, layout.embedding_dims,
                                        self._data_parallel.lookup(features))

    def compute_and_output_dist(self, ctx: ShardedEmbeddingBagContext,
                                input: KJTList) -> LazyAwaitable[KeyedTensor]:
        return self.output_dist(ctx, self.compute(ctx, input))

    @property
    def fused_optimizer(self) -> ShardedFusedOptimizer:
        return self.parts.optim

    @property
    def layout(self) -> ShardLayout:
        return self.parts.layout

    @property
    def replicas(self) -> Optional[ReplicaSync]:
        """The module's ReplicaSync in 2D training (recxla.torchrec.replicas), else None."""
        return self.parts.replicas

    def average_replicas(self) -> None:
        """2D training with sync="weights": the replicas averaged now (ShardedSteps)."""
        self.steps.average_replicas()

    def reset_parameters(self) -> None:
        """Re-initializes every local shard with its table's init_fn."""
        reset_local_shards(self.parts)

    def update_shards(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{OWNER}: resharding a live module is not supported; "
                                  "save a checkpoint and load it into a module sharded the new way")

    def extra_repr(self) -> str:
        return (f"tables={self.parts.tables.names}, fwd_comm={self._fwd_comm!r}, "
                f"bwd_comm={self._bwd_comm!r}, local tables="
                f"{[self.parts.tables.names[lt.table] for lt in self.parts.layout.local_tables[self.parts.layout.rank]]}")



class _PooledEmbeddingsAwaitable(LazyAwaitable[KeyedTensor]):
    def __init__(self, module: ShardedEmbeddingBagCollection, handle, send, message,
                 ctx: ShardedEmbeddingBagContext):
        super().__init__()
        self._module, self._handle, self._send, self._message, self._ctx = \
            module, handle, send, message, ctx

    def _wait_impl(self) -> KeyedTensor:
        handle, self._handle = self._handle, None
        return self._module.finish_output(handle, self._send, self._message,
                                          self._ctx.bag_lengths,
                                          self._ctx.data_parallel_features)

