"""A sharded module's weights as TorchRec lays them out: ShardedTensor views of the local
shards, state_dict and load_state_dict hooks (`TableStateDict`), and the shards' initial values.

Each rank holds, per table, one Parameter per local shard (`weight`, `weight_1`, ...);
state_dict shows them as one ShardedTensor `<prefix>.<table>.weight` (`embedding_bags` for the
pooled module, `embeddings` for the sequence one, as TorchRec's) in TorchRec's layout and dtype
(FP16 tables as float16: their live float16 copies, fp16_tables.py), and load_state_dict takes
ShardedTensors saved with the same plan or full unsharded tensors.
"""

from typing import Dict

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import DataType

from recxla.torchrec.fp16_tables import round_to_fp16_
from recxla.torchrec.fused_optimizer import rowwise_state_layout
from recxla.torchrec.shard_layout import Shard, ShardLayout
from recxla.torchrec.sharded_parts import ShardedParts


def weight_name(k: int) -> str:
    """The name of a table's k-th local shard Parameter."""
    return "weight" if k == 0 else f"weight_{k}"


def initial_weight(shard: Shard, unsharded: torch.Tensor, config, device: torch.device,
                   on_meta: bool) -> torch.Tensor:
    """One local shard's starting values: a copy of the unsharded weight's block when it has
    values, else the table's init_fn; FP16 tables rounded to float16 values; on the meta
    device, the shape only."""
    weight = torch.empty((shard.rows, shard.cols), dtype=torch.float32, device=device)
    if on_meta:
        return weight
    with torch.no_grad():
        if unsharded.device.type != "meta":
            weight.copy_(unsharded[shard.row_offset: shard.row_offset + shard.rows,
                                   shard.col_offset: shard.col_offset + shard.cols])
        else:
            config.init_fn(weight)
    if config.data_type == DataType.FP16:
        round_to_fp16_(weight)
    return weight


def global_rank(env: ShardingEnv, group_rank: int) -> int:
    """The global rank of rank `group_rank` of the sharding group."""
    group = env.process_group
    if group is None or group is dist.group.WORLD or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def sharded_tensor(layout: ShardLayout, env: ShardingEnv, device: torch.device,
                   plan: Dict[str, ParameterSharding], t: int, local,
                   rowwise_state: bool) -> ShardedTensor:
    """ShardedTensor over table t's weight (or optimizer state: Adagrad's has the weight's
    layout; row-wise Adagrad's is TorchRec's 1-D layout, fused_optimizer.py
    `rowwise_state_layout`), from this rank's (shard, tensor) pairs; plan: the module's
    sharding plan (table name -> ParameterSharding)."""
    table = layout.tables[t]
    plan_shards = plan[table.name].sharding_spec.shards
    all_shards = layout.shards[t]
    if rowwise_state:
        size, order = rowwise_state_layout(all_shards, table.num_embeddings,
                                           table.embedding_dim, layout.owner)
        size = [size]
        all_shards = [s for s, _ in order]
        offsets = [[offset] for _, offset in order]
        sizes = [[s.rows] for s in all_shards]
    else:
        size = [table.num_embeddings, table.embedding_dim]
        offsets = [[s.row_offset, s.col_offset] for s in all_shards]
        sizes = [[s.rows, s.cols] for s in all_shards]
    metadata = []
    for s, offset, shape in zip(all_shards, offsets, sizes):
        # ShardedTensor places shards by global rank; the plan numbers the group's ranks.
        shard_device = plan_shards[s.index].placement.device()
        if shard_device.type != device.type:
            # A plan made for another device (e.g. CPU, used for a meta-device module).
            shard_device = device
        placement = f"rank:{global_rank(env, s.rank)}/{shard_device}"
        metadata.append(ShardMetadata(shard_offsets=offset, shard_sizes=shape,
                                      placement=placement))
    global_metadata = ShardedTensorMetadata(
        shards_metadata=metadata, size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=torch.float32, layout=torch.strided,
                                           requires_grad=False,
                                           memory_format=torch.contiguous_format,
                                           pin_memory=False))
    local_shards = [
        LocalShard(tensor=tensor, metadata=metadata[all_shards.index(shard)])
        for shard, tensor in local
    ]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=local_shards, sharded_tensor_metadata=global_metadata,
        process_group=env.process_group)


class TableStateDict:
    """A sharded module's tables in its state_dict, as TorchRec lays them out: one ShardedTensor
    `<prefix>.<table>.weight` per table (see the module docstring). An object over the
    module's parts, its hooks installed on the module by `install`.

    Args:
        parts: the module's ShardedParts.
        prefix: the attribute the module keeps its tables under ("embedding_bags" or
            "embeddings").
    """

    def __init__(self, parts: ShardedParts, prefix: str):
        self.parts, self.prefix = parts, prefix

    def install(self, module: torch.nn.Module) -> None:
        """Registers the state_dict hook and the load_state_dict hooks on `module`."""
        module._register_state_dict_hook(self.state_dict_hook)
        module._register_load_state_dict_pre_hook(self.load_state_dict_pre_hook)
        module.register_load_state_dict_post_hook(self.round_fp16_tables)

    def state_dict_hook(self, module, destination, prefix, local_metadata) -> None:
        """The tables' ShardedTensors in place of their local shards' Parameters."""
        tables = self.parts.tables
        if self.parts.fp16.copies is not None:
            self.parts.fp16.copies.sync()
        for t, (name, sharded) in enumerate(zip(tables.names, tables.sharded_weights)):
            destination[f"{prefix}{self.prefix}.{name}.weight"] = \
                self.parts.fp16.weights.get(t, sharded)
            for k in range(1, len(tables.of_table.get(t, []))):
                destination.pop(f"{prefix}{self.prefix}.{name}.{weight_name(k)}", None)

    def round_fp16_tables(self, module, incompatible_keys) -> None:
        """The load_state_dict post hook: round_fp16_tables."""
        round_fp16_tables(self.parts)

    def load_state_dict_pre_hook(self, state_dict, prefix, local_metadata, strict,
                                 missing_keys, unexpected_keys, error_msgs) -> None:
        """Each table's ShardedTensor or full tensor cut into this rank's local shards."""
        tables = self.parts.tables
        local_tables = self.parts.layout.local_tables[self.parts.layout.rank]
        for t, name in enumerate(tables.names):
            key = f"{prefix}{self.prefix}.{name}.weight"
            if key not in state_dict:
                continue
            value = state_dict[key]
            mine = tables.of_table.get(t, [])
            if not mine:
                state_dict[key] = tables.parameters[t][0].detach()
            for k, lt in enumerate(mine):
                state_dict[f"{prefix}{self.prefix}.{name}.{weight_name(k)}"] = \
                    self._local_value(key, value, local_tables[lt].shard)

    def _local_value(self, key: str, value, shard: Shard) -> torch.Tensor:
        """One local shard of a table, from a ShardedTensor (same plan) or a full tensor."""
        table = self.parts.layout.tables[shard.table]
        if isinstance(value, ShardedTensor):
            for local in value.local_shards():
                if list(local.metadata.shard_offsets) == [shard.row_offset, shard.col_offset] \
                        and list(local.metadata.shard_sizes) == [shard.rows, shard.cols]:
                    return local.tensor
            raise ValueError(f"{self.parts.layout.owner}: {key} holds no shard at rows "
                             f"{shard.row_offset}+{shard.rows}, columns "
                             f"{shard.col_offset}+{shard.cols} on rank "
                             f"{self.parts.layout.rank}: it was saved with another plan")
        if isinstance(value, torch.Tensor) and \
                tuple(value.shape) == (table.num_embeddings, table.embedding_dim):
            return value[shard.row_offset: shard.row_offset + shard.rows,
                         shard.col_offset: shard.col_offset + shard.cols]
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{self.parts.layout.owner}: {key} must be a ShardedTensor or a full "
                         f"[{table.num_embeddings}, {table.embedding_dim}] tensor, got {shape}")


def round_fp16_tables(parts: ShardedParts) -> None:
    """FP16 tables hold float16 values, whatever was loaded or initialized."""
    if parts.on_meta:
        return
    for local, weight in zip(parts.layout.local_tables[parts.layout.rank], parts.tables.weights):
        if local.table in parts.fp16.tables:
            round_to_fp16_(weight)
    if parts.fp16.copies is not None:
        parts.fp16.copies.refresh()


def reset_local_shards(parts: ShardedParts) -> None:
    """Re-initializes every local shard with its table's init_fn (FP16 tables rounded)."""
    with torch.no_grad():
        for local, weight in zip(parts.layout.local_tables[parts.layout.rank],
                                 parts.tables.weights):
            parts.configs[local.table].init_fn(weight)
    round_fp16_tables(parts)
