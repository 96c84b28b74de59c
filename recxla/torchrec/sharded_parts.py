"""The parts of a recxla sharded embedding module, as one explicit object.

`build_sharded_parts` (sharded_builder.py) makes them once per module, for the pooled module
(sharded_embedding_bag.py) and the sequence module (sharded_embedding.py) alike; the steps
(`ShardedSteps`, sharded_steps.py) and the state_dict side (`TableStateDict`,
sharded_state_dict.py) are objects over them and read nothing else, so what each depends on is
written down here rather than spread over private attributes set in another file.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.types import ShardingEnv

from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.fp16_tables import Float16Copies, RoundUpdatedRows
from recxla.torchrec.fused_optimizer import ShardedFusedOptimizer
from recxla.torchrec.input_dist import IdRouter
from recxla.torchrec.output_dist import OutputDist
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.shard_layout import ShardLayout
from recxla.torchrec.types import PooledTables


@dataclass
class LocalTables:
    """This rank's shards of the tables recxla shards (data-parallel tables are not here).

    names: every such table's name (table index t); weights: per local shard lt (the layout's
    local_tables order: pooled shards first, then row-exchange ones) its float32 Parameter;
    of_table: table t -> its local shards lt; num_pooled: how many of the local shards are
    pooled; pooled: those as a lookup reads them; sharded_weights: per table t, the
    ShardedTensor over its weight (TorchRec's state_dict layout, same memory); parameters: per
    table t the Parameters the module registers (`weight`, `weight_1`, ...: its local shards in
    order, or one empty placeholder where it holds none); has_fused_update: some local shard
    has a fused optimizer.
    """

    names: List[str]
    weights: List[nn.Parameter]
    of_table: Dict[int, List[int]]
    num_pooled: int
    pooled: Optional[PooledTables] = None
    sharded_weights: List[ShardedTensor] = field(default_factory=list)
    parameters: List[List[nn.Parameter]] = field(default_factory=list)
    has_fused_update: bool = False

    @property
    def row_weights(self) -> List[nn.Parameter]:
        """The row-exchange shards' weights, in the layout's row-group order."""
        return self.weights[self.num_pooled:]


@dataclass
class Fp16Parts:
    """FP16 tables (fp16_tables.py): the table indices, the live float16 copies of their local
    shards (None without FP16 tables), their ShardedTensors for state_dict (table -> tensor) and
    the hook that rounds the rows an update changed."""

    tables: List[int] = field(default_factory=list)
    copies: Optional[Float16Copies] = None
    weights: Dict[int, ShardedTensor] = field(default_factory=dict)
    round_rows: Optional[RoundUpdatedRows] = None


@dataclass
class ShardedParts:
    """Everything a sharded module's steps and state_dict side read.

    configs: the table configs recxla shards (table index t; data-parallel tables are not
    here); layout: where every shard, slot and output column lives (this rank: layout.rank);
    env: the sharding env (its process group carries the all-to-alls); device: where the
    shards live; on_meta: shapes only, no values; tables, fp16: the local shards; optim: the
    fused optimizer of every local shard; router: the input dist; output: the output dist (its
    `assembly` makes the module's output: pooled or expanded); replicas: 2D training's
    ReplicaSync, else None; stats: the bytes the dists move; staged_outputs: what the next
    forwards return (stage_output); staging: a pipeline's forward with a staged output runs.
    """

    configs: List[Any]
    layout: ShardLayout
    env: ShardingEnv
    device: torch.device
    on_meta: bool
    tables: LocalTables
    fp16: Fp16Parts
    optim: ShardedFusedOptimizer
    router: IdRouter
    output: OutputDist
    replicas: Optional[ReplicaSync]
    stats: CommStats
    staged_outputs: Deque[Union[Any, Callable[[], Any]]] = field(default_factory=deque)
    # A pipeline's forward is running, for which one output was staged (stage_output): a
    # second call of the module in it is an error, not a forward of its own.
    staging: bool = False

    def describe(self) -> str:
        """The module's extra_repr: its tables, wire formats and this rank's shards."""
        local = self.layout.local_tables[self.layout.rank]
        return (f"tables={self.tables.names}, fwd_comm={self.output.fwd_comm!r}, "
                f"bwd_comm={self.output.bwd_comm!r}, local tables="
                f"{[self.tables.names[lt.table] for lt in local]}")
