"""The parts of recxla's sharded EmbeddingBagCollection, as one explicit object.

The module's constructor (sharded_embedding_bag.py) builds them once; its public steps
(sharded_steps.py) and its state_dict side (sharded_state_dict.py) read them from
`module.parts` and from nowhere else, so what each of them depends on is written down here
rather than spread over private attributes set in another file.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedTensor

from recxla.torchrec.fp16_tables import Float16Copies, RoundUpdatedRows
from recxla.torchrec.fused_optimizer import ShardedFusedOptimizer
from recxla.torchrec.input_dist import IdRouter
from recxla.torchrec.output_dist import OutputDist
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.shard_layout import ShardLayout


@dataclass(frozen=True)
class PooledTables:
    """What a lookup of this rank's pooled tables reads.

    weights: per local pooled table t, its shard: the live float32 [rows_t, cols_t] Parameter
        (the fused optimizer updates it in place);
    slot_table: per owner slot j (LookupInput's slot order: bag (j, b) is
        offsets[j * B + b] .. offsets[j * B + b + 1]), its local table t;
    pooling: per local pooled table, recxla.ops.embedding_bag.SUM or MEAN (row-sharded
        tables: SUM; their MEAN is divided at the receiver).
    """

    weights: Tuple[nn.Parameter, ...]
    slot_table: Tuple[int, ...]
    pooling: Tuple[int, ...]


@dataclass
class LocalTables:
    """This rank's shards of the tables recxla shards (data-parallel tables are not here).

    names: every such table's name (table index t); weights: per local shard lt (the layout's
    local_tables order: pooled shards first, then row-exchange ones) its float32 Parameter;
    of_table: table t -> its local shards lt; num_pooled: how many of the local shards are
    pooled; pooled: those as a lookup reads them; sharded_weights: per table t, the
    ShardedTensor over its weight (TorchRec's state_dict layout, same memory); has_fused_update:
    some local shard has a fused optimizer.
    """

    names: List[str]
    weights: List[nn.Parameter]
    of_table: Dict[int, List[int]]
    num_pooled: int
    pooled: Optional[PooledTables] = None
    sharded_weights: List[ShardedTensor] = field(default_factory=list)
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
    """Everything the sharded module's steps and state_dict side read.

    layout: where every shard, slot and output column lives (this rank: layout.rank);
    env: the sharding env (its process group carries the all-to-alls); device: where the
    shards live; on_meta: shapes only, no values; tables, fp16: the local shards; optim: the
    fused optimizer of every local shard; router: the input dist; output: the output dist;
    replicas: 2D training's ReplicaSync, else None; embedding_names / embedding_dims: the
    output KeyedTensor's keys and widths (model-parallel features); staged_outputs: what the
    next forwards return (stage_output).
    """

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
    embedding_names: List[str]
    embedding_dims: List[int]
    staged_outputs: Deque[Union[KeyedTensor, Callable[[], KeyedTensor]]] = field(
        default_factory=deque)
