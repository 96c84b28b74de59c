"""What `ShardedEmbeddingBagCollection` accepts: the sharding types it shards, the plan's
shards of a table, and the tables named by `row_exchange` (the table configs it takes:
recxla.nn.table_config, shared with recxla.nn's module). Each check raises a
ValueError/TypeError naming the module, the table and the limit.
"""

from typing import List

from torchrec.distributed.types import ParameterSharding, ShardingType

from recxla.torchrec.data_parallel import DATA_PARALLEL
from recxla.torchrec.shard_layout import OWNER, Shard

SUPPORTED_SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    DATA_PARALLEL,  # delegated to TorchRec's data-parallel sharding
]


def row_exchange_tables(row_exchange, names: List[str]) -> List[int]:
    """Indices of the tables named by row_exchange ("off", "all" or a list of names)."""
    if row_exchange == "off":
        return []
    if row_exchange == "all":
        return list(range(len(names)))
    if isinstance(row_exchange, str) or not all(isinstance(n, str) for n in row_exchange):
        raise ValueError(f"{OWNER}: row_exchange must be 'off', 'all' or a list of table names, "
                         f"got {row_exchange!r}")
    unknown = [n for n in row_exchange if n not in names]
    if unknown:
        raise ValueError(f"{OWNER}: row_exchange names unknown table(s) {unknown} (tables: "
                         f"{names})")
    return [names.index(n) for n in row_exchange]


def plan_shards(t: int, name: str, sharding: ParameterSharding,
                supported: List[str] = SUPPORTED_SHARDING_TYPES, owner: str = OWNER) -> List[Shard]:
    """The shards of table t (`name`) in its plan entry, in the plan's order; supported: the
    sharding types the module shards, owner: its name in error messages."""
    if sharding.sharding_type not in supported:
        raise ValueError(f"{owner}: table '{name}' is planned {sharding.sharding_type}; recxla "
                         f"shards {supported}")
    if sharding.sharding_spec is None:
        raise ValueError(f"{owner}: the plan for table '{name}' has no sharding_spec")
    return [Shard(t, k, md.placement.rank(), md.shard_offsets[0], md.shard_sizes[0],
                  md.shard_offsets[1], md.shard_sizes[1])
            for k, md in enumerate(sharding.sharding_spec.shards)]
