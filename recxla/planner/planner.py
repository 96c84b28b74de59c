"""Balanced sharding: how to split each table, and a TorchRec planner that places the pieces.

The split decides what can be balanced at all. A table-wise shard is one piece; column-wise
cuts the pooled rows (bytes) into k narrower pieces, each of which still receives every id and
looks up every row; row-wise cuts the ids and lookups into R row blocks, but every block sends
a full pooled partial row per sample, so its bytes grow with R. Which is best depends on the
table's measured load (`recxla.planner.cost.TableLoads`) and the world size.

`choose_splits` searches greedily, twice: from table-wise everywhere and from the best of a few
uniform starts (every table in k column blocks; every table cut until no piece carries much
more than a fraction of a rank's mean bytes: row-wise where the bytes are mostly ids, finer
column blocks otherwise). At each step it
tries every other split of each table that has a shard on a busiest rank (of an all-to-all,
or of lookups), places all shards (`place_shards`), and keeps the change that lowers the
modeled step seconds (`CostModel.step_seconds`: each all-to-all waits for its busiest rank) the
most, or, where several ranks tie for the maximum, evens them out; it stops when no change
helps, and the better of the two ends wins.

The result becomes TorchRec constraints (one sharding type per table, the column-wise width as
`min_partition`), and TorchRec's `EmbeddingShardingPlanner` runs with recxla's partitioner and
perf model (`recxla.planner.partitioner`), so its output is a plain TorchRec `ShardingPlan`.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.proposers import GreedyProposer
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, accepts_old_comm_keywords
from recxla.ops.dedup import row_wise_bounds
from recxla.planner.cost import CostModel, TableLoads, rank_totals
from recxla.planner.partitioner import (
    BalancedPartitioner,
    BottleneckPerfModel,
    placement_loads,
    placement_weights,
)
from recxla.planner.placement import place_shards

OP = "recxla.planner"
TABLE_WISE, COLUMN_WISE, ROW_WISE = (
    ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.ROW_WISE.value
)
SPLIT_TYPES = (TABLE_WISE, COLUMN_WISE, ROW_WISE)


@dataclass(frozen=True)
class TableSplit:
    """How one table is cut: table_wise (1 piece), column_wise into `pieces` equal column
    blocks, or row_wise into one row block per rank."""

    sharding_type: str
    pieces: int = 1

    def cols(self, dim: int) -> int:
        return dim if self.sharding_type == ROW_WISE else dim // self.pieces

    def __str__(self) -> str:
        return self.sharding_type if self.pieces == 1 else f"{self.sharding_type}/{self.pieces}"


def split_options(dim: int, rows: int, world_size: int, sharding_types=SPLIT_TYPES,
                  min_cw_cols: int = 4) -> List[TableSplit]:
    """The splits open to a table of `rows` x `dim`: column blocks are multiples of 4 columns
    (FBGEMM's kernels need it), at least `min_cw_cols` wide, at most one per rank."""
    options = []
    if TABLE_WISE in sharding_types:
        options.append(TableSplit(TABLE_WISE))
    if COLUMN_WISE in sharding_types:
        k = 2
        while k <= world_size and dim % k == 0 and dim // k >= max(min_cw_cols, 4):
            if (dim // k) % 4 == 0:
                options.append(TableSplit(COLUMN_WISE, k))
            k *= 2
    if ROW_WISE in sharding_types and world_size > 1 and rows >= world_size:
        options.append(TableSplit(ROW_WISE, world_size))
    return options


def split_shards(config, split: TableSplit, world_size: int):
    """(row_start, row_end, cols, fixed rank or -1) of every shard of a split table."""
    if split.sharding_type == ROW_WISE:
        bounds = row_wise_bounds([config.num_embeddings], world_size)[0].tolist()
        return [(bounds[r], bounds[r + 1], config.embedding_dim, r) for r in range(world_size)]
    cols = split.cols(config.embedding_dim)
    return [(0, config.num_embeddings, cols, -1)] * split.pieces


@dataclass
class SplitResult:
    """A placed split: splits by table, the ranks of each table's shards (`split_shards`
    order), the modeled step seconds, and per rank the estimated owner bytes of the three
    all-to-alls (float64 [R, 3]) and rows looked up (float64 [R])."""

    splits: Dict[str, TableSplit]
    ranks: Dict[str, List[int]]
    seconds: float
    owner_bytes: torch.Tensor
    lookups: torch.Tensor

    def max_over_mean(self, values: torch.Tensor) -> float:
        mean = float(values.mean())
        return float(values.max()) / mean if mean > 0 else 1.0


def evaluate_splits(splits: Dict[str, TableSplit], loads: TableLoads, cost: CostModel,
                    cache: Optional[dict] = None, rounds: Optional[int] = None) -> SplitResult:
    """Place the shards of `splits` (`place_shards`, `rounds` local-search moves, default
    its full search) and model the step."""
    cache = {} if cache is None else cache
    shard_loads, fixed, owner, groups = [], [], [], []
    width = wire_width(splits, loads.tables)
    for t, config in enumerate(loads.tables):
        for load, rank in _shard_loads(config, splits[config.name], loads, cost, cache, width):
            shard_loads.append(load)
            fixed.append(rank)
            owner.append(config.name)
            groups.append(t)
    ranks = place_shards(placement_loads(shard_loads), loads.world_size, fixed,
                         max_rounds=rounds, groups=groups, weights=placement_weights(cost))
    owner_bytes, source_bytes, lookups, lookup_seconds = rank_totals(shard_loads, ranks,
                                                                     loads.world_size)
    by_table: Dict[str, List[int]] = {}
    for name, rank in zip(owner, ranks.tolist()):
        by_table.setdefault(name, []).append(rank)
    seconds = cost.step_seconds(owner_bytes, source_bytes, lookup_seconds)
    return SplitResult(dict(splits), by_table, seconds, owner_bytes, lookups)


def _key(result: SplitResult) -> Tuple[float, float]:
    """Order of results: modeled seconds, then a smooth stand-in for the maxima it is made of
    (the L16 norm over ranks of each all-to-all's owner bytes and of the lookups, each over
    its mean, summed), which also falls when one of several equally busy ranks gets lighter.
    numpy: these arrays are tiny, and torch's per-op cost dominates the search otherwise."""
    parts = np.concatenate([result.owner_bytes.numpy(), result.lookups.numpy()[:, None]], 1)
    scale = np.maximum(parts.max(0), 1e-30)
    norm = ((parts / scale) ** 16).sum(0) ** (1.0 / 16) * scale
    return result.seconds, float((norm / np.maximum(parts.sum(0), 1e-30)).sum())


def _better(a: SplitResult, b: SplitResult) -> bool:
    """a is faster than b, or as fast (to rounding) and smoother."""
    ka, kb = _key(a), _key(b)
    if ka[0] < kb[0] * (1 - 1e-6):
        return True
    return ka[0] <= kb[0] * (1 + 1e-9) and ka[1] < kb[1] * (1 - 1e-3)


def wire_width(splits: Dict[str, TableSplit], tables) -> int:
    """The module's output wire row width for these splits: the gcd of all shard widths."""
    return math.gcd(*(splits[c.name].cols(c.embedding_dim) for c in tables))


def _shard_loads(config, split: TableSplit, loads: TableLoads, cost: CostModel, cache: dict,
                 width: int):
    """[(ShardLoad, fixed rank)] of a split table, computed once per (table, split, width)."""
    key = (config.name, split, width)
    if key not in cache:
        shards = split_shards(config, split, loads.world_size)
        if split.sharding_type == ROW_WISE:
            cache[key] = [(loads.shard_load(config.name, r0, r1, cols, cost, width), rank)
                          for r0, r1, cols, rank in shards]
        else:  # equal pieces of all rows: one load
            r0, r1, cols, rank = shards[0]
            load = loads.shard_load(config.name, r0, r1, cols, cost, width)
            cache[key] = [(load, rank)] * len(shards)
    return cache[key]


def _piece(config, split, loads, cost, cache, width) -> Tuple[torch.Tensor, torch.Tensor]:
    """(largest piece, total) of a split table's owner bytes (ids, fwd, bwd): float64 [3]."""
    parts = placement_loads([load for load, _ in _shard_loads(config, split, loads, cost, cache,
                                                               width)])
    parts = parts[:, :3]
    return parts[parts.sum(1).argmax()], parts.sum(0)


def _refined(loads: TableLoads, cost: CostModel, options, alpha: float, cache: dict):
    """Splits where no piece of a table carries more than `alpha` times a rank's mean owner
    bytes, where the splits allow: a piece whose bytes are mostly ids (which column blocks do
    not divide) goes row-wise, any other one column-wise step finer."""
    splits = {c.name: options[c.name][0] for c in loads.tables}
    for _ in range(8 * len(loads.tables)):
        width = wire_width(splits, loads.tables)
        pieces = {c.name: _piece(c, splits[c.name], loads, cost, cache, width)
                  for c in loads.tables}
        mean = float(sum(total.sum() for _, total in pieces.values())) / loads.world_size
        changed = False
        for config in loads.tables:
            piece = pieces[config.name][0]
            if float(piece.sum()) <= alpha * mean:
                continue
            opts, current = options[config.name], splits[config.name]
            row_wise = [o for o in opts if o.sharding_type == ROW_WISE]
            finer_cw = [o for o in opts[opts.index(current) + 1:]
                        if o.sharding_type == COLUMN_WISE]
            if float(piece[0]) > float(piece[1:].sum()) and row_wise and current not in row_wise:
                splits[config.name] = row_wise[0]
            elif finer_cw and current.sharding_type != ROW_WISE:
                splits[config.name] = finer_cw[0]
            else:
                continue
            changed = True
        if not changed:
            break
    return splits


def choose_splits(loads: TableLoads, cost: CostModel = CostModel(),
                  sharding_types: Sequence[str] = SPLIT_TYPES, min_cw_cols: int = 4,
                  max_steps: Optional[int] = None, search_rounds: int = 8,
                  fixed_splits: Optional[Dict[str, TableSplit]] = None) -> SplitResult:
    """The per-table splits whose placed shards give the fastest modeled step.

    Start from table-wise everywhere and from the best of: every table in k column blocks
    (k = 2 ... 32), and the `_refined` splits (no piece above 1, 1/2, ... 1/16 of a rank's
    mean owner bytes). From each, improve greedily: try
    every other split of each table that has a shard on a busiest rank (of an all-to-all, or
    of lookups) and keep the change that lowers the modeled seconds most, or evens out ranks
    tied at the maximum, until nothing helps. Keep the better end. Candidates are placed with
    `search_rounds` local-search moves, the result with the full search.

    Args:
        loads: measured table loads (their world size is the plan's).
        cost: seconds of bytes and lookups.
        sharding_types: splits allowed; table_wise must be among them.
        min_cw_cols: narrowest column-wise block.
        max_steps: bound on the greedy changes (default 8 per table).
        search_rounds: local-search moves when placing a candidate.
        fixed_splits: tables whose split is given (and left alone), by name.
    """
    unknown = set(sharding_types) - set(SPLIT_TYPES)
    if unknown or TABLE_WISE not in sharding_types:
        raise ValueError(
            f"{OP}.choose_splits: sharding_types must include table_wise and be among "
            f"{list(SPLIT_TYPES)}, got {list(sharding_types)}"
        )
    options = {
        c.name: split_options(c.embedding_dim, c.num_embeddings, loads.world_size,
                              sharding_types, min_cw_cols)
        for c in loads.tables
    }
    for name, split in (fixed_splits or {}).items():
        if name not in options:
            raise ValueError(f"{OP}.choose_splits: fixed_splits names unknown table {name!r}")
        config = loads.tables[loads.index[name]]
        allowed = split_options(config.embedding_dim, config.num_embeddings, loads.world_size,
                                SPLIT_TYPES, 4)
        if split not in allowed:
            raise ValueError(f"{OP}.choose_splits: {split} is not a split of {name} at "
                             f"{loads.world_size} ranks; choose among {[str(o) for o in allowed]}")
        options[name] = [split]
    cache: dict = {}

    def evaluate(splits):
        return evaluate_splits(splits, loads, cost, cache, search_rounds)

    coarse = evaluate({c.name: options[c.name][0] for c in loads.tables})
    if loads.world_size == 1:
        return coarse
    # Starts: every table as one piece; every table cut into k column blocks (one wire width
    # for all: a single narrow block would make every table pay its FP8 scales); every table
    # cut until no piece dominates a rank.
    starts = [coarse]
    for k in (2, 4, 8, 16, 32):
        uniform = {c.name: next((o for o in options[c.name] if o.sharding_type == COLUMN_WISE
                                 and o.pieces == k), options[c.name][0]) for c in loads.tables}
        starts.append(evaluate(uniform))
    for alpha in (1.0, 0.5, 0.25, 0.125, 0.0625):
        starts.append(evaluate(_refined(loads, cost, options, alpha, cache)))
    # Greedy from the coarsest start and from the best other one: each finds what the other
    # misses (few ranks: a handful of well-chosen splits; many: fine splits everywhere).
    others = sorted(starts[1:], key=_key)
    steps = 8 * len(loads.tables) if max_steps is None else max_steps
    best = None
    for start in (coarse, others[0]):
        found = _greedy(start, options, evaluate, steps)
        if best is None or _better(found, best):
            best = found
    return evaluate_splits(best.splits, loads, cost, cache)


def _greedy(best: SplitResult, options, evaluate, steps: int) -> SplitResult:
    """Accept the best single-table change while it helps (`_better`), at most `steps`."""
    for _ in range(steps):
        # Tables on a rank that is the busiest in some all-to-all, or looks up the most.
        busiest = set(best.owner_bytes.numpy().argmax(0).tolist()) | {
            int(best.lookups.numpy().argmax())}
        found = None
        for name, ranks in best.ranks.items():
            if not busiest & set(ranks):
                continue
            for option in options[name]:
                if option != best.splits[name]:
                    trial = evaluate({**best.splits, name: option})
                    if found is None or _better(trial, found):
                        found = trial
        if found is None or not _better(found, best):
            break
        best = found
    return best


def _embedding_bag_tables(module) -> list:
    """EmbeddingBagConfig of every EmbeddingBagCollection in `module` (itself included)."""
    tables = []
    for sub in module.modules():
        if hasattr(sub, "embedding_bag_configs") and callable(sub.embedding_bag_configs):
            tables.extend(sub.embedding_bag_configs())
    return tables


class BalancedShardingPlanner:
    """A TorchRec planner whose splits and placement follow measured loads.

    Args:
        topology: TorchRec Topology (any world size; no process group needed).
        sample_batches: a few batches of one rank (KeyedJaggedTensor or recxla.data.Batch);
            their size is the per-rank batch size.
        fwd_comm / bwd_comm: wire formats of pooled rows and of their gradients.
        cost: seconds per wire byte and per byte looked up.
        sharding_types: the splits allowed (table_wise required; column_wise, row_wise).
        min_cw_cols: narrowest column-wise block.
        fixed_splits: tables whose split is given, by name (TableSplit).
    After `plan()`: `splits` (SplitResult of the search), `loads` (TableLoads) and
    `torchrec_planner` (the EmbeddingShardingPlanner that produced the plan).
    """

    @accepts_old_comm_keywords
    def __init__(self, topology: Topology, sample_batches, fwd_comm: str = DEFAULT_FWD_COMM,
                 bwd_comm: str = DEFAULT_BWD_COMM, cost: CostModel = CostModel(),
                 sharding_types: Sequence[str] = SPLIT_TYPES, min_cw_cols: int = 4,
                 fixed_splits: Optional[Dict[str, TableSplit]] = None):
        if not isinstance(topology, Topology):
            raise TypeError(f"{OP}.BalancedShardingPlanner: topology must be a TorchRec Topology")
        self.topology = topology
        self.sample_batches = list(sample_batches)
        self.fwd_comm, self.bwd_comm = fwd_comm, bwd_comm
        self.cost = cost
        self.sharding_types = tuple(sharding_types)
        self.min_cw_cols = min_cw_cols
        self.fixed_splits = dict(fixed_splits or {})
        self.loads: Optional[TableLoads] = None
        self.splits: Optional[SplitResult] = None
        self.torchrec_planner: Optional[EmbeddingShardingPlanner] = None

    def constraints(self) -> Dict[str, ParameterConstraints]:
        """TorchRec constraints that pin every table to its chosen split."""
        pooling = self.loads.pooling_factors()
        out = {}
        for config in self.loads.tables:
            split = self.splits.splits[config.name]
            out[config.name] = ParameterConstraints(
                sharding_types=[split.sharding_type],
                compute_kernels=["fused"],
                min_partition=split.cols(config.embedding_dim)
                if split.sharding_type == COLUMN_WISE else None,
                pooling_factors=[pooling[config.name]],
            )
        return out

    def plan(self, module, sharders=None):
        """A TorchRec ShardingPlan for `module` (an EmbeddingBagCollection or a model holding
        some), planned for `topology` without a process group."""
        from recxla.planner.sharder import planning_sharder

        tables = _embedding_bag_tables(module)
        if not tables:
            raise ValueError(f"{OP}.BalancedShardingPlanner: module has no EmbeddingBagCollection")
        self.loads = TableLoads.measure(tables, self.sample_batches, self.topology.world_size,
                                        self.fwd_comm, self.bwd_comm)
        self.splits = choose_splits(self.loads, self.cost, self.sharding_types, self.min_cw_cols,
                                    fixed_splits=self.fixed_splits)
        self.torchrec_planner = EmbeddingShardingPlanner(
            topology=self.topology,
            batch_size=max(1, round(self.loads.batch_size)),
            constraints=self.constraints(),
            proposer=GreedyProposer(),
            partitioner=BalancedPartitioner(self.loads, self.cost),
            performance_model=BottleneckPerfModel(self.loads, self.cost),
            debug=False,
        )
        return self.torchrec_planner.plan(module, sharders or [planning_sharder()])
