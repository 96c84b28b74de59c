"""Balanced sharding for TorchRec embedding tables, from loads measured on data.

- `count_rank_loads(plan, tables, batches)`: what a plan costs every rank on real batches
  (unique ids received, rows looked up, bytes of each all-to-all), as recxla's sharded
  EmbeddingBagCollection moves them (its own layout and block format). The one place that
  counts it.
- `TableLoads`, `CostModel`: expected per-shard load from a sample of batches, and its seconds.
- `place_shards`: shards onto ranks, minimizing the sum over collectives of the busiest rank.
- `BalancedShardingPlanner`: chooses each table's split (table-, column- or row-wise) and runs
  TorchRec's `EmbeddingShardingPlanner` with `BalancedPartitioner` and `BottleneckPerfModel`;
  returns a TorchRec `ShardingPlan`.
- `torchrec_imbalance_stats`: TorchRec's own EmbeddingStats imbalance measures of a plan.

Importing this package imports TorchRec. The sharder offered to the planner is recxla's
(`planning_sharder`); `RowWiseEverywhereSharder` gives TorchRec's own planner the same
sharding types for comparisons.
"""

from recxla.planner.cost import CostModel, ShardLoad, TableLoads
from recxla.planner.loads import RankLoads, ShardPlacement, count_rank_loads, plan_shards
from recxla.planner.partitioner import (
    BalancedPartitioner,
    BottleneckPerfModel,
    torchrec_imbalance_stats,
)
from recxla.planner.placement import place_shards
from recxla.planner.planner import (
    BalancedShardingPlanner,
    SplitResult,
    TableSplit,
    choose_splits,
    split_options,
)
from recxla.planner.sharder import RowWiseEverywhereSharder, planning_sharder

__all__ = [
    "BalancedPartitioner",
    "BalancedShardingPlanner",
    "BottleneckPerfModel",
    "CostModel",
    "RankLoads",
    "RowWiseEverywhereSharder",
    "ShardLoad",
    "ShardPlacement",
    "SplitResult",
    "TableLoads",
    "TableSplit",
    "choose_splits",
    "count_rank_loads",
    "place_shards",
    "plan_shards",
    "planning_sharder",
    "split_options",
    "torchrec_imbalance_stats",
]
