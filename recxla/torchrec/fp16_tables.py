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
exactly.

state_dict's float16 tensors are live, as TorchRec's are (they are FBGEMM's weights
themselves): callers write into them in place and expect the table to change (TorchRec's test
harness loads its reference weights so, `copy_state_dict`; so do `torch.distributed.checkpoint`
loads that skip `load_state_dict`). So each FP16 shard also has a float16 copy
(`Float16Copies`), which state_dict hands out and the module keeps equal to the float32 shard:
the fused update writes its rounded rows to both, and a write to either side alone (seen by the
tensors' version counters) is taken into the other before the next lookup or state_dict.

The cost: the shard takes float32's memory plus float16's (three times TorchRec's), and each
step rounds the updated rows and copies them to float16 (one pass over them).
"""

from typing import Dict, List, Sequence

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


class Float16Copies:
    """The float16 face of a rank's FP16 shards: per shard (key: its index among the module's
    local weights) a float16 tensor holding the float32 shard's values (`halves`, what
    state_dict shows). The two stay equal: whichever side was written since the last `sync`
    (by its version counter) is copied to the other; the float16 side wins when both were.

    weights: {local index: float32 [rows, cols] Parameter}, the shards the kernels read."""

    def __init__(self, weights: Dict[int, torch.Tensor]) -> None:
        self.weights = weights
        self.halves: Dict[int, torch.Tensor] = {
            lt: torch.empty_like(w, dtype=torch.float16, requires_grad=False)
            for lt, w in weights.items()}
        self._seen: Dict[int, tuple] = {}
        self.refresh()

    def refresh(self) -> None:
        """Every float16 copy from its float32 shard (after an initialization or a load)."""
        with torch.no_grad():
            for lt, weight in self.weights.items():
                self.halves[lt].copy_(weight)
                self._mark(lt)

    def sync(self) -> None:
        """Takes writes made to one side since the last sync into the other (a float32 write
        is rounded to float16 first)."""
        with torch.no_grad():
            for lt, weight in self.weights.items():
                half = self.halves[lt]
                seen_weight, seen_half = self._seen[lt]
                if half._version != seen_half:
                    weight.copy_(half)
                elif weight._version != seen_weight:
                    round_to_fp16_(weight)
                    half.copy_(weight)
                else:
                    continue
                self._mark(lt)

    def write_rows(self, lt: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Rows `rows` (int64 [R]) of shard lt set to `values` (float16 [R, cols]) on both
        sides."""
        with torch.no_grad():
            self.weights[lt].index_copy_(0, rows, values.to(torch.float32))
            self.halves[lt].index_copy_(0, rows, values)
        self._mark(lt)

    def versions(self) -> List[int]:
        """The float16 copies' version counters (a write to them changes the tables)."""
        return [half._version for half in self.halves.values()]

    def _mark(self, lt: int) -> None:
        self._seen[lt] = (self.weights[lt]._version, self.halves[lt]._version)


class RoundUpdatedRows:
    """LookupPlan.after_update for a lookup whose local tables `copies.weights` (indices into
    its weights) are FP16 tables: rounds the rows the fused update just changed, and writes
    them to the float16 copies.

    Called with weights (float32 [rows_t, cols_t] each), unique_values (int64 [U], the
    updated rows, table by table) and unique_offsets (int64 [T + 1])."""

    def __init__(self, copies: Float16Copies) -> None:
        self.copies = copies
        self.fp16: List[int] = sorted(copies.weights)

    def __call__(self, weights: Sequence[torch.Tensor], unique_values: torch.Tensor,
                 unique_offsets: torch.Tensor) -> None:
        bounds = unique_offsets.tolist()
        for t in self.fp16:
            rows = unique_values[bounds[t]: bounds[t + 1]].long()
            if rows.numel():
                self.copies.write_rows(t, rows, weights[t].index_select(0, rows)
                                       .to(torch.float16))


def as_fp16(sharded: ShardedTensor, halves: Sequence[torch.Tensor]) -> ShardedTensor:
    """A float16 ShardedTensor over `halves` (float16, one per local shard of the float32
    `sharded`, in its local_shards() order): same shards, placements and global size; the
    local shards are the tensors themselves, not copies."""
    metadata = sharded.metadata()
    properties = metadata.tensor_properties
    half_metadata = ShardedTensorMetadata(
        shards_metadata=metadata.shards_metadata, size=metadata.size,
        tensor_properties=TensorProperties(dtype=torch.float16, layout=properties.layout,
                                           requires_grad=False,
                                           memory_format=properties.memory_format,
                                           pin_memory=properties.pin_memory))
    local = [LocalShard(tensor=half, metadata=s.metadata)
             for s, half in zip(sharded.local_shards(), halves, strict=True)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=local, sharded_tensor_metadata=half_metadata,
        process_group=sharded._process_group)


def check_fp16_table(name: str, fused: bool, row_exchange: bool, replicas: bool,
                     owner: str = OWNER) -> None:
    """An FP16 table needs recxla's fused update (where its rows are rounded) on the pooled
    path: no dense gradient, no row exchange, no 2D replicas (not supported for it yet)."""
    if not fused:
        raise ValueError(f"{owner}: FP16 table '{name}' needs a fused optimizer (fused_params "
                         "or apply_optimizer_in_backward): its float16 rows are rounded by the "
                         "fused update")
    if row_exchange:
        raise ValueError(f"{owner}: FP16 table '{name}' cannot be in row_exchange (not "
                         "supported for FP16 tables yet)")
    if replicas:
        raise ValueError(f"{owner}: FP16 table '{name}' with 2D replicas is not supported yet")
