"""recxla's placement inside TorchRec's planner: a Partitioner, a PerfModel, and TorchRec's own
imbalance statistics of a plan.

`EmbeddingShardingPlanner(topology, batch_size, constraints=..., partitioner=
BalancedPartitioner(loads), performance_model=BottleneckPerfModel(loads))` keeps TorchRec's
enumerator, estimators (storage), proposers and plan output, so the result is a TorchRec
`ShardingPlan` that `DistributedModelParallel` accepts; only where shards go, and how a plan is
rated, come from recxla's measured loads (`recxla.planner.cost`).
"""

import copy
import math
from typing import Dict, List

import torch
from torchrec.distributed.planner.types import (
    Partitioner,
    PartitionByType,
    PerfModel,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Topology,
)
from torchrec.distributed.types import ShardingType

from recxla.planner.cost import CostModel, ShardLoad, TableLoads, rank_totals
from recxla.planner.placement import place_shards

_PLACEABLE = {
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
}


def _storage_kind(topology: Topology) -> str:
    """Where a shard's weights live: HBM on a GPU, host memory otherwise."""
    return "hbm" if topology.compute_device == "cuda" else "ddr"


def _check_option(option: ShardingOption) -> None:
    if option.sharding_type not in _PLACEABLE:
        raise PlannerError(
            error_type=PlannerErrorType.PARTITION,
            message=(
                f"recxla BalancedPartitioner: table {option.name} is {option.sharding_type}; it "
                f"places {sorted(_PLACEABLE)} shards (constrain the table's sharding_types)"
            ),
        )


def option_loads(options: List[ShardingOption], loads: TableLoads,
                 cost: CostModel) -> List[ShardLoad]:
    """ShardLoad of every shard of sharding options, in option then shard order, pooled rows
    cut at the module's wire width (the gcd of all shard widths)."""
    width = math.gcd(*(shard.size[1] for option in options for shard in option.shards))
    return [
        loads.shard_load(option.name, shard.offset[0], shard.offset[0] + shard.size[0],
                         shard.size[1], cost, width)
        for option in options
        for shard in option.shards
    ]


def placement_loads(shard_loads: List[ShardLoad]) -> torch.Tensor:
    """What placement weighs, float64 [N, 5]: an owner's bytes in each of the three
    all-to-alls, its lookup seconds and its rows looked up."""
    return torch.tensor([[*s.owner, s.lookup_seconds, s.lookups] for s in shard_loads],
                        dtype=torch.float64).reshape(-1, 5)


def placement_weights(cost: CostModel) -> List[float]:
    """Seconds per unit of each `placement_loads` column: the step pays each all-to-all's
    busiest rank at the link rate and the slowest lookup; rows looked up only break ties."""
    per_byte = 1.0 / cost.wire_bytes_per_s
    return [per_byte, per_byte, per_byte, 1.0, 0.0]


def step_seconds(shard_loads: List[ShardLoad], ranks, world_size: int,
                 cost: CostModel) -> float:
    """`CostModel.step_seconds` of placed shards."""
    owner, source, _, lookup_seconds = rank_totals(
        shard_loads, torch.as_tensor(ranks, dtype=torch.int64), world_size)
    return cost.step_seconds(owner, source, lookup_seconds)


class BalancedPartitioner(Partitioner):
    """Places every shard of a proposal so that each all-to-all's bytes and the lookups come
    out even over the ranks (`recxla.planner.placement.place_shards`); row-wise blocks stay on their
    rank (block i on rank i), as TorchRec's uniform partition puts them.

    Args:
        loads: the sampled table loads, measured for the topology's world size.
        cost: seconds per wire byte and per byte looked up.
    """

    def __init__(self, loads: TableLoads, cost: CostModel = CostModel()):
        self._loads = loads
        self._cost = cost

    def partition(
        self, proposal: List[ShardingOption], storage_constraint: Topology
    ) -> List[ShardingOption]:
        world_size = storage_constraint.world_size
        if world_size != self._loads.world_size:
            raise PlannerError(
                error_type=PlannerErrorType.PARTITION,
                message=(
                    f"recxla BalancedPartitioner: loads were measured for {self._loads.world_size}"
                    f" ranks, the topology has {world_size}"
                ),
            )
        plan = copy.deepcopy(proposal)
        for option in plan:
            _check_option(option)
        kind = _storage_kind(storage_constraint)
        shard_loads = option_loads(plan, self._loads, self._cost)
        fixed, need, groups = [], [], []
        for t, option in enumerate(plan):
            uniform = option.partition_by == PartitionByType.UNIFORM.value
            for i, shard in enumerate(option.shards):
                fixed.append(i if uniform else -1)
                groups.append(t)
                need.append(float(getattr(shard.storage, kind)) if shard.storage else 0.0)
        capacity = [float(getattr(d.storage, kind)) for d in storage_constraint.devices]
        try:
            ranks = place_shards(placement_loads(shard_loads), world_size, fixed, need,
                                 capacity, groups=groups,
                                 weights=placement_weights(self._cost))
        except ValueError as e:
            raise PlannerError(error_type=PlannerErrorType.INSUFFICIENT_STORAGE, message=str(e))
        flat = iter(ranks.tolist())
        for option in plan:
            for shard in option.shards:
                shard.rank = next(flat)
        return plan


class BottleneckPerfModel(PerfModel):
    """Rates a plan by the modeled seconds of its three all-to-alls and lookups, each waiting
    for its busiest rank (`CostModel.step_seconds`)."""

    def __init__(self, loads: TableLoads, cost: CostModel = CostModel()):
        self._loads = loads
        self._cost = cost

    def rate(self, plan: List[ShardingOption]) -> float:
        ranks = [shard.rank for option in plan for shard in option.shards]
        return step_seconds(option_loads(plan, self._loads, self._cost), ranks,
                            self._loads.world_size, self._cost)


def torchrec_imbalance_stats(plan: List[ShardingOption], world_size: int) -> Dict[str, float]:
    """TorchRec's own view of a placed plan: the imbalance measures EmbeddingStats prints
    ("Total Perf Imbalance Statistics": total variation, total distance, chi and KL divergence,
    0 = even, 1 = all on one rank) over its estimated per-rank perf, and that perf's max/mean.

    Args:
        plan: the selected ShardingOptions (`EmbeddingShardingPlanner.get_selected_options()`).
    """
    from torchrec.distributed.planner.stats import IMBALANCE_STAT_MEASURE, _normalize_float

    perf = [0.0] * world_size
    for option in plan:
        for shard in option.shards:
            perf[shard.rank] += shard.perf.total
    stats = {name: float(measure(_normalize_float(perf), **kwargs))
             for name, (measure, kwargs) in IMBALANCE_STAT_MEASURE.items()}
    mean = sum(perf) / world_size
    stats["perf max/mean"] = max(perf) / mean if mean > 0 else 1.0
    return stats
