"""FP16 tables (`DataType.FP16` in an EmbeddingBagConfig) in recxla's sharded module.

What TorchRec's sharder does with an FP16 table on CPU (FBGEMM's table-batched kernels):
stores the shard in float16 (state_dict: a float16 ShardedTensor), pools in float32 (the
output is float32) and applies the fused optimizer's update to the float16 rows.

recxla's kernels are float32. An FP16 table keeps its shard in a float32 tensor whose values
are always float16 values: rounded when the shard is initialized or loaded, and after every
fused update, where only the rows the update touched are rounded (`RoundUpdatedRows`), once,
to nearest-even. So every lookup reads exactly the float16 weights TorchRec would, sums them in
float32 as TorchRec does, and each update is computed in float32 and rounded into float16 once.
state_dict presents the shard as float16 (TorchRec's dtype); a loaded float16 shard is stored
exactly. The cost: the shard takes float32's memory (twice float16's), and each step rounds the
updated rows (one pass over them).
"""

from typing import Iterable, List, Sequence

import torch
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from recxla.torchrec.shard_layout import OWNER


def round_to_fp16_(weight: torch.Tensor) -> torch.Tensor:
    """weight float32 [rows, cols], in place: every value rounded to the nearest float16
    (values beyond float16's range become +-inf, as a float16 store would)."""
    with torch.no_grad():
        weight.copy_(weight.to(torch.float16))
    return weight


class RoundUpdatedRows:
    """LookupPlan.after_update for a lookup whose local tables `fp16` (indices into its
    weights) are FP16 tables: rounds the rows the fused update just changed.

    Called with weights (float32 [rows_t, cols_t] each), unique_values (int64 [U], the
    updated rows, table by table) and unique_offsets (int64 [T + 1])."""

    def __init__(self, fp16: Iterable[int]) -> None:
        self.fp16: List[int] = sorted(set(fp16))

    def __call__(self, weights: Sequence[torch.Tensor], unique_values: torch.Tensor,
                 unique_offsets: torch.Tensor) -> None:
        bounds = unique_offsets.tolist()
        for t in self.fp16:
            rows = unique_values[bounds[t]: bounds[t + 1]].long()
            if rows.numel():
                weights[t].index_copy_(0, rows, weights[t].index_select(0, rows)
                                       .to(torch.float16).to(torch.float32))


def as_fp16(sharded: ShardedTensor) -> ShardedTensor:
    """A float16 copy of a float32 ShardedTensor: same shards, placements and global size."""
    metadata = sharded.metadata()
    properties = metadata.tensor_properties
    half_metadata = ShardedTensorMetadata(
        shards_metadata=metadata.shards_metadata, size=metadata.size,
        tensor_properties=TensorProperties(dtype=torch.float16, layout=properties.layout,
                                           requires_grad=False,
                                           memory_format=properties.memory_format,
                                           pin_memory=properties.pin_memory))
    local = [LocalShard(tensor=s.tensor.detach().to(torch.float16), metadata=s.metadata)
             for s in sharded.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=local, sharded_tensor_metadata=half_metadata,
        process_group=sharded._process_group)


def check_fp16_table(name: str, fused: bool, row_exchange: bool, replicas: bool) -> None:
    """An FP16 table needs recxla's fused update (where its rows are rounded) on the pooled
    path: no dense gradient, no row exchange, no 2D replicas (not supported for it yet)."""
    if not fused:
        raise ValueError(f"{OWNER}: FP16 table '{name}' needs a fused optimizer (fused_params "
                         "or apply_optimizer_in_backward): its float16 rows are rounded by the "
                         "fused update")
    if row_exchange:
        raise ValueError(f"{OWNER}: FP16 table '{name}' cannot be in row_exchange (not "
                         "supported for FP16 tables yet)")
    if replicas:
        raise ValueError(f"{OWNER}: FP16 table '{name}' with 2D replicas is not supported yet")
