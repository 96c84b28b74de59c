"""The builder of a sharded module's parts: from TorchRec's plan to `ShardedParts`.

One function for both of recxla's sharded modules (types.py): the pooled
`ShardedEmbeddingBagCollection` and the sequence `ShardedEmbeddingCollection` give it their
tables (TableInfo, the configs, the unsharded weights), the plan and their options, and get
back the layout, the local shards and their optimizer state, the fused optimizer, the input
and output dists. What differs between the two is passed in: which tables are exchanged as
rows (the sequence module: all) and the receiver's assembly (pooling or expanding). The
modules register the local shards as their Parameters under their own attribute
(`embedding_bags` or `embeddings`, `weight_prefix`; `table_holders`).

Weights: each rank holds, per table, one float32 Parameter per local shard (an empty one where
it holds none). They start as copies of the unsharded module's weights when those have values
(a module built on CPU), else from each table's init_fn; on the meta device they are shapes
only. FP16 tables hold float16 values in their float32 shards
(fp16_tables.py).
"""

import functools
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import DataType

from recxla.ops.embedding_bag import ADAGRAD, NONE, ROWWISE_ADAGRAD
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.fp16_tables import (Float16Copies, RoundUpdatedRows, as_fp16,
                                          check_fp16_table)
from recxla.torchrec.fused_optimizer import ShardedFusedOptimizer, table_update
from recxla.torchrec.input_dist import IdRouter
from recxla.torchrec.output_dist import OutputDist, PooledAssembly
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.shard_layout import OWNER, ShardLayout, TableInfo
from recxla.torchrec.sequence_output import ExpandedAssembly
from recxla.torchrec.sharded_config import SUPPORTED_SHARDING_TYPES, plan_shards
from recxla.torchrec.sharded_parts import Fp16Parts, LocalTables, ShardedParts
from recxla.torchrec.sharded_state_dict import (global_rank, initial_weight, sharded_tensor,
                                                 weight_name)
from recxla.torchrec.types import PooledTables


def build_sharded_parts(
    tables: Sequence[TableInfo],
    configs: Sequence[Any],
    unsharded: Dict[str, torch.Tensor],
    plan: Dict[str, ParameterSharding],
    env: ShardingEnv,
    *,
    fused_params: Optional[Dict[str, Any]],
    device: torch.device,
    fwd_comm: str,
    bwd_comm: str,
    dedup_ids: bool,
    is_weighted: bool,
    weight_prefix: str,
    row_tables: Sequence[int] = (),
    replicas: Optional[ReplicaSync] = None,
    sequence: bool = False,
    max_sequence_length: Optional[int] = None,
    sharding_types: Sequence[str] = SUPPORTED_SHARDING_TYPES,
    owner: str = OWNER,
) -> ShardedParts:
    """The parts of one sharded module.

    Args:
        tables: per table recxla shards (table index t), its TableInfo.
        configs: the same tables' TorchRec configs (init_fn, data_type).
        unsharded: table name -> the unsharded module's weight (values copied unless meta).
        plan: table name -> ParameterSharding (every table of `tables` planned).
        env: the ShardingEnv (its process group carries the all-to-alls).
        fused_params: the sharder's fused_params (fused_optimizer.table_update).
        device: where the shards live (meta: shapes only).
        fwd_comm, bwd_comm: the output dist's wire formats.
        dedup_ids: the input dist may send unique ids.
        is_weighted: batches carry per-sample weights.
        weight_prefix: the attribute the module keeps its tables under ("embedding_bags" or
            "embeddings"): the fused optimizer's keys are `<prefix>.<table>.weight`.
        row_tables: indices of the tables exchanged as unique rows (row_exchange.py).
        replicas: 2D training's ReplicaSync (None: 1D).
        sequence: the sequence module's parts: every table exchanged as unique rows, which the
            receiver expands to its ids' positions (sequence_output.ExpandedAssembly); else
            the pooled module's (output_dist.PooledAssembly).
        max_sequence_length: the longest bag a batch may hold (None: no limit).
        sharding_types: the sharding types the module shards.
        owner: the module's name in error messages.
    """
    device = torch.device(device)
    on_meta = device.type == "meta"
    names = [t.name for t in tables]
    if sequence:
        row_tables = range(len(tables))
    shards = [plan_shards(t, name, plan[name], list(sharding_types), owner)
              for t, name in enumerate(names)]
    layout = ShardLayout.build(tables, shards, env.rank, env.world_size, row_tables=row_tables,
                               owner=owner)
    stats = CommStats()
    updates = [table_update(c.name, unsharded[c.name], fused_params, plan[c.name].compute_kernel,
                            owner) for c in configs]
    for t in row_tables:
        if updates[t].kind == NONE:
            raise ValueError(f"{owner}: table '{names[t]}' is exchanged as rows, which needs a "
                             "fused optimizer (fused_params or apply_optimizer_in_backward)")
    # FP16 tables: float16 values in float32 shards (fp16_tables.py).
    fp16 = Fp16Parts([t for t, c in enumerate(configs) if c.data_type == DataType.FP16])
    for t in fp16.tables:
        check_fp16_table(names[t], updates[t].kind != NONE, t in row_tables, replicas is not None,
                         owner)

    me = env.rank
    local_tables = layout.local_tables[me]
    of_table: Dict[int, List[int]] = {}
    for lt, local in enumerate(local_tables):
        of_table.setdefault(local.table, []).append(lt)
    weights: List[nn.Parameter] = []
    states: List[Optional[torch.Tensor]] = []
    for lt, local in enumerate(local_tables):
        config, shard = configs[local.table], local.shard
        weights.append(nn.Parameter(initial_weight(shard, unsharded[config.name], config, device,
                                                   on_meta)))
        kind, hyper = updates[local.table].kind, updates[local.table].hyperparameters
        states.append(None)
        if kind in (ADAGRAD, ROWWISE_ADAGRAD):
            shape = (shard.rows, shard.cols) if kind == ADAGRAD else (shard.rows,)
            states[lt] = torch.full(shape, float(hyper["initial_accumulator_value"]),
                                    device=device)
    num_pooled = layout.num_pooled[me]
    local = LocalTables(names, weights, of_table, num_pooled)
    local.pooled = PooledTables(tuple(weights[:num_pooled]),
                                tuple(lt for lt, _ in layout.slots[me]),
                                tuple(layout.owner_pooling(me)[:num_pooled]))
    local.has_fused_update = any(updates[lt.table].kind != NONE for lt in local_tables)

    # ShardedTensor views of the weights and optimizer states (same memory).
    view = functools.partial(sharded_tensor, layout, env, device, plan)
    sharded_states = []
    for t in range(len(tables)):
        mine = of_table.get(t, [])
        local.sharded_weights.append(view(
            t, [(local_tables[lt].shard, weights[lt].detach()) for lt in mine],
            rowwise_state=False))
        kind = updates[t].kind
        sharded_states.append(view(t, [(local_tables[lt].shard, states[lt]) for lt in mine],
                                   rowwise_state=kind == ROWWISE_ADAGRAD)
                              if kind in (ADAGRAD, ROWWISE_ADAGRAD) else None)
    # FP16 tables: state_dict shows live float16 copies of their shards (fp16_tables.py).
    fp16_local = {lt: weights[lt] for t in fp16.tables for lt in of_table.get(t, [])}
    if fp16_local:
        fp16.copies = Float16Copies(fp16_local)
        # FP16 shards are all pooled (check_fp16_table): local indices = lookup indices.
        fp16.round_rows = RoundUpdatedRows(fp16.copies)
    fp16.weights = {t: as_fp16(local.sharded_weights[t],
                               [fp16.copies.halves[lt] for lt in of_table.get(t, [])])
                    for t in fp16.tables}
    optim = ShardedFusedOptimizer(
        [f"{weight_prefix}.{name}.weight" for name in names], local.sharded_weights, updates,
        [lt.table for lt in local_tables], states, sharded_states,
        save_step=replicas is not None and replicas.sync == "weights"
        and replicas.sync_every > 1)
    # Per table the Parameters the module registers: its local shards, or a placeholder.
    local.parameters = [[weights[lt] for lt in of_table.get(t, [])] or [placeholder_weight(device)]
                        for t in range(len(tables))]
    for t, params in enumerate(local.parameters):
        if updates[t].kind != NONE:
            # TorchRec's in_backward_optimizer_filter keeps these out of dense optimizers.
            for param in params:
                param._in_backward_optimizers = [optim]

    # On GPU the ids go through the CPU (they come from the loader there): a gloo group
    # carries them, and only the owner's decoded lookup input is copied to the device. No
    # size ever has to come back from the GPU, so the hot path has no host sync.
    group = env.process_group
    id_group = group
    if device.type == "cuda" and group is not None:
        id_group = dist.new_group(ranks=[global_rank(env, r) for r in range(env.world_size)],
                                  backend="gloo")
    router = IdRouter(layout, id_group, torch.device("cpu")
                      if device.type in ("cuda", "meta") else device,
                      is_weighted, dedup_ids, stats, expand_rows=sequence,
                      max_bag_length=max_sequence_length)
    assembly = ExpandedAssembly(layout) if sequence else PooledAssembly(layout)
    return ShardedParts(
        configs=list(configs), layout=layout, env=env, device=device, on_meta=on_meta,
        tables=local, fp16=fp16, optim=optim, router=router,
        output=OutputDist(layout, group, fwd_comm, bwd_comm, stats, assembly),
        replicas=replicas, stats=stats)


def table_holders(parts: ShardedParts, names: Sequence[str],
                  replicated: Dict[str, nn.Parameter]) -> nn.ModuleDict:
    """The module's tables as TorchRec's module keeps them (its `embedding_bags` or
    `embeddings`), in the unsharded module's order `names`: per table an nn.Module holding its
    Parameters. A sharded table holds this rank's shards as `weight`, `weight_1`, ...
    (state_dict shows them as the one ShardedTensor `weight`, sharded_state_dict.py); a
    replicated (data-parallel) table, `replicated[name]`, holds its whole weight as `weight`."""
    holders = {}
    for name, params in zip(parts.tables.names, parts.tables.parameters):
        holders[name] = nn.Module()
        for k, param in enumerate(params):
            holders[name].register_parameter(weight_name(k), param)
    for name, weight in replicated.items():
        holders[name] = nn.Module()
        holders[name].register_parameter("weight", weight)
    return nn.ModuleDict({name: holders[name] for name in names})


def placeholder_weight(device: torch.device) -> nn.Parameter:
    """The Parameter a table of which this rank holds no shard is registered with."""
    return nn.Parameter(torch.empty(0, device=device))
