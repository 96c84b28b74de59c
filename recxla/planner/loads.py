"""What a sharding plan costs each rank, counted on real batches: the one home of that count.

It counts what recxla's sharded EmbeddingBagCollection (`recxla.torchrec`, pooled exchange,
its default) moves, with that module's own layout (`ShardLayout`: local tables, slots, the
output's wire row width) and the input dist's wire format (`recxla.torchrec.id_wire_format`).
Per step, between a source rank s (a batch of B_s samples) and each owner d:
- input all-to-all: a first exchange of sizes (one row per rank pair), then one block
  of bytes per (s, d): the bag lengths of d's slots (int32, one per sample and slot), and the
  ids of s that fall in d's shards, deduplicated per (d, local table): either raw ids or the
  unique ids plus an inverse index (2 bytes below 65,536 uniques, else 4), whichever is
  smaller; ids as int32 where d's shards have fewer than 2^31 rows; sections 8-byte aligned;
- the owner puts every source's ids together and looks up each local table's unique rows once
  (`lookups`: distinct rows over all sources, the module's own dedup);
- output all-to-all: d's pooled columns for every sample of s (row-wise shards send partial
  sums), cut into rows of the module's wire width (the gcd of all shard widths), each
  row_bytes(width, fwd format): an FP8 row carries one scale per wire row;
- backward: the same rows of gradient, in the bwd format.
Traffic from a rank to itself never leaves the process and is not counted as wire bytes.
Data-parallel tables (TorchRec's planner picks them for tiny tables) have no all-to-all: every
rank looks its own batch up and the weight gradients are all-reduced.

Counting needs, per source, table and row block, the unique ids and the id occurrences:
`block_counts` gets them with recxla's key ops (bucketize_by_rank, then one segmented_unique
per source). The planner's load estimates use the same function on a sample of batches
(`recxla.planner.cost`), so estimate and measurement share their counts.
"""

from dataclasses import dataclass, fields
from typing import Dict, List, Sequence, Tuple

import torch

from recxla.formats import (
    DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, accepts_old_comm_keywords, get_format, row_bytes,
)
from recxla.ops.dedup import bucketize_by_rank, segmented_unique
from recxla.torchrec import id_wire_format as wire
from recxla.torchrec.shard_layout import Shard, ShardLayout, TableInfo

OP = "recxla.planner.count_rank_loads"
# The rank of a data-parallel table's one "shard": every rank holds it.
REPLICATED = -1


@dataclass(frozen=True)
class ShardPlacement:
    """One shard of one table: rows [row_start, row_end) x columns [col_start, col_end) on
    `rank` (REPLICATED: a data-parallel table, on every rank)."""

    table: str
    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def cols(self) -> int:
        return self.col_end - self.col_start


COLLECTIVES = ("ids", "fwd", "bwd")


@dataclass
class RankLoads:
    """Per-rank load of one step; every field is an int64 tensor [R] indexed by rank.

    ids_received: unique ids this rank receives from other ranks as an owner (per source
        and local table).
    lookups: rows this rank looks up: distinct ids of each of its shards over all sources
        (data-parallel tables: its own batch's).
    {ids,fwd,bwd}_bytes_{sent,received}: bytes of the input all-to-all (sizes, lengths, ids,
        inverse index), of the forward output all-to-all (pooled rows) and of the backward one
        (their gradients), at the formats counted.
    allreduce_bytes: bytes each rank sends (and receives) in the ring all-reduce of the fp32
        weight gradients of data-parallel tables: 2 (R - 1) / R of their size.
    """

    ids_received: torch.Tensor
    lookups: torch.Tensor
    ids_bytes_sent: torch.Tensor
    ids_bytes_received: torch.Tensor
    fwd_bytes_sent: torch.Tensor
    fwd_bytes_received: torch.Tensor
    bwd_bytes_sent: torch.Tensor
    bwd_bytes_received: torch.Tensor
    allreduce_bytes: torch.Tensor

    @property
    def wire_bytes(self) -> torch.Tensor:
        """Bytes each rank puts on and takes off the wire in one step: int64 [R]."""
        return 2 * self.allreduce_bytes + sum(
            getattr(self, f"{c}_bytes_{d}") for c in COLLECTIVES for d in ("sent", "received"))

    @property
    def owner_bytes(self) -> torch.Tensor:
        """The plan-dependent part of the wire, int64 [R]: ids received, pooled rows sent and
        gradients received, all as an owner. (As a source every rank moves about the same
        bytes whatever the placement: its batch's ids out, its pooled rows in, gradients out.)
        """
        return self.ids_bytes_received + self.fwd_bytes_sent + self.bwd_bytes_received

    def collective_bytes(self, collective: str) -> torch.Tensor:
        """max(sent, received) per rank in one all-to-all ("ids", "fwd" or "bwd"): what the
        rank's full-duplex link carries one way; the all-to-all waits for the largest."""
        if collective not in COLLECTIVES:
            raise ValueError(f"RankLoads.collective_bytes: collective must be one of "
                             f"{COLLECTIVES}, got {collective!r}")
        return torch.maximum(getattr(self, f"{collective}_bytes_sent"),
                             getattr(self, f"{collective}_bytes_received"))

    @property
    def critical_bytes(self) -> int:
        """Sum over the three all-to-alls (and the data-parallel all-reduce) of their largest
        per-rank one-way bytes: the bytes that set the communication time of a step run one
        collective after the other."""
        return int(self.allreduce_bytes.max()) + sum(
            int(self.collective_bytes(c).max()) for c in COLLECTIVES)

    @property
    def world_size(self) -> int:
        return self.lookups.numel()

    def max_over_mean(self, metric: str) -> float:
        """max / mean over ranks of a field, of `wire_bytes` or `owner_bytes` (1.0 = even)."""
        values = getattr(self, metric).to(torch.float64)
        mean = float(values.mean())
        return float(values.max()) / mean if mean > 0 else 1.0


def _sparse_features(batch):
    """The KeyedJaggedTensor of a recxla.data.Batch, or the KJT itself."""
    return getattr(batch, "sparse", batch)


def table_ids(kjt, tables) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ids of every table of `tables` (features of a table concatenated), laid table after
    table.

    Args:
        kjt: torchrec KeyedJaggedTensor holding every feature of `tables`.
        tables: sequence of EmbeddingBagConfig (name, num_embeddings, feature_names).
    Returns:
        values: int64 [N]; offsets: int64 [T + 1] (table t is values[offsets[t]:offsets[t+1]]).
    Raises:
        ValueError: a feature is missing or an id lies outside [0, num_embeddings).
    """
    keys = set(kjt.keys())
    parts, sizes = [], []
    for config in tables:
        for feature in config.feature_names:
            if feature not in keys:
                raise ValueError(f"{OP}: batch has no feature {feature!r} of table {config.name}")
        ids = [kjt[f].values().to(torch.int64) for f in config.feature_names]
        ids = torch.cat(ids) if len(ids) > 1 else ids[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.num_embeddings):
            raise ValueError(
                f"{OP}: table {config.name} has ids in [{int(ids.min())}, {int(ids.max())}], "
                f"outside its rows [0, {config.num_embeddings})"
            )
        parts.append(ids)
        sizes.append(ids.numel())
    offsets = torch.zeros(len(tables) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0)
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return values, offsets


def block_counts(batches, tables, block_bounds: torch.Tensor):
    """Unique ids and id occurrences per (source batch, table, row block), and unique ids per
    (table, row block) over all batches together.

    Args:
        batches: S batches (KeyedJaggedTensor or recxla.data.Batch), one per source.
        tables: T EmbeddingBagConfig.
        block_bounds: int64 [T, K + 1], each row non-decreasing from 0 to the table's rows:
            block k of table t is rows [block_bounds[t, k], block_bounds[t, k + 1]) (empty
            blocks pad tables with fewer blocks).
    Returns:
        unique: int64 [S, T, K], distinct ids of source s in block k of table t;
        occurrences: int64 [S, T, K], ids (with repeats) there;
        batch_sizes: int64 [S], samples of each source;
        union: int64 [T, K], distinct ids of all sources together.
    """
    num_tables, num_blocks = block_bounds.shape[0], block_bounds.shape[1] - 1
    unique = torch.zeros(len(batches), num_tables, num_blocks, dtype=torch.int64)
    occurrences = torch.zeros_like(unique)
    batch_sizes = torch.zeros(len(batches), dtype=torch.int64)
    per_table: List[List[torch.Tensor]] = [[] for _ in range(num_tables)]
    for s, batch in enumerate(batches):
        kjt = _sparse_features(batch)
        batch_sizes[s] = kjt.stride()
        values, offsets = table_ids(kjt, tables)
        unique[s], occurrences[s] = _bucket_counts(values, offsets, block_bounds)
        bounds = offsets.tolist()
        for t in range(num_tables):
            per_table[t].append(values[bounds[t]:bounds[t + 1]])
    values = [torch.cat(v) if v else torch.zeros(0, dtype=torch.int64) for v in per_table]
    offsets = torch.zeros(num_tables + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([v.numel() for v in values], dtype=torch.int64), 0)
    flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64)
    union, _ = _bucket_counts(flat, offsets, block_bounds)
    return unique, occurrences, batch_sizes, union


def _bucket_counts(values, offsets, block_bounds):
    """(unique, occurrences), int64 [T, K]: keys of table t in row block k."""
    num_tables, num_blocks = block_bounds.shape[0], block_bounds.shape[1] - 1
    # Buckets are block-major (bucket b = k * T + t), as for the ranks of an all-to-all.
    permutation, bucket_offsets = bucketize_by_rank(values, offsets, block_bounds)
    _, unique_offsets, _ = segmented_unique(values[permutation], bucket_offsets)
    return (unique_offsets.diff().reshape(num_blocks, num_tables).t(),
            bucket_offsets.diff().reshape(num_blocks, num_tables).t())


def plan_shards(plan, tables, module_path: str = "") -> List[ShardPlacement]:
    """The shards of `tables` in a TorchRec plan.

    Args:
        plan: a ShardingPlan (the module at `module_path` is read) or one module's plan (a
            mapping from table name to ParameterSharding).
        tables: EmbeddingBagConfig of the tables to read.
    Raises:
        ValueError: a table is missing from the plan or its shards do not tile it exactly
            once. A data-parallel table is one shard of the whole table on rank REPLICATED.
    """
    module_plan = plan.plan.get(module_path) if hasattr(plan, "plan") else plan
    if module_plan is None:
        raise ValueError(f"{OP}: the plan has no module {module_path!r}")
    shards = []
    for config in tables:
        if config.name not in module_plan:
            raise ValueError(f"{OP}: table {config.name} is not in the plan")
        sharding = module_plan[config.name]
        spec = sharding.sharding_spec
        if spec is None:
            if sharding.sharding_type != "data_parallel":
                raise ValueError(f"{OP}: table {config.name} is {sharding.sharding_type} "
                                 "without a sharding spec")
            shards.append(ShardPlacement(config.name, REPLICATED, 0, config.num_embeddings, 0,
                                         config.embedding_dim))
            continue
        area = 0
        for meta in spec.shards:
            (row, col), (rows, cols) = meta.shard_offsets, meta.shard_sizes
            if row < 0 or col < 0 or row + rows > config.num_embeddings or (
                col + cols > config.embedding_dim
            ):
                raise ValueError(f"{OP}: a shard of {config.name} lies outside the table")
            shards.append(
                ShardPlacement(config.name, meta.placement.rank(), row, row + rows, col, col + cols)
            )
            area += rows * cols
        if area != config.num_embeddings * config.embedding_dim:
            raise ValueError(
                f"{OP}: the shards of {config.name} cover {area} of its "
                f"{config.num_embeddings * config.embedding_dim} weights"
            )
    return shards


def shard_block_bounds(shards: Sequence[ShardPlacement], tables) -> torch.Tensor:
    """Row blocks fine enough for every shard's row range: int64 [T, K + 1] (padded)."""
    cuts: Dict[str, set] = {c.name: {0, c.num_embeddings} for c in tables}
    for shard in shards:
        cuts[shard.table].update((shard.row_start, shard.row_end))
    rows = [sorted(cuts[c.name]) for c in tables]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int64)


@accepts_old_comm_keywords
def count_rank_loads(
    plan,
    tables,
    batches,
    fwd_comm: str = DEFAULT_FWD_COMM,
    bwd_comm: str = DEFAULT_BWD_COMM,
    module_path: str = "",
) -> RankLoads:
    """Per-rank load of one training step of `plan` on real batches, as recxla's sharded
    EmbeddingBagCollection moves it (see the module docstring for what is counted).

    Args:
        plan: TorchRec ShardingPlan (module at `module_path`) or one module's plan.
        tables: the EmbeddingBagConfig of the module's tables.
        batches: R batches (KeyedJaggedTensor or recxla.data.Batch): batch s is source rank
            s's, so len(batches) is the world size.
        fwd_comm / bwd_comm: wire formats of the pooled rows and of their gradients
            (`recxla.FORMATS`).
    Returns:
        RankLoads with int64 tensors [R].
    Raises:
        ValueError: an unknown format, a plan that does not tile a table or names a rank
            outside [0, len(batches)), ids outside a table.
    """
    get_format(fwd_comm, OP, "fwd_comm")
    get_format(bwd_comm, OP, "bwd_comm")
    world_size = len(batches)
    if world_size < 1:
        raise ValueError(f"{OP}: batches must hold one batch per rank, got none")
    shards = plan_shards(plan, tables, module_path)
    for shard in shards:
        if shard.rank != REPLICATED and not 0 <= shard.rank < world_size:
            raise ValueError(
                f"{OP}: table {shard.table} has a shard on rank {shard.rank}, outside the "
                f"{world_size} ranks of the batches"
            )
    bounds = shard_block_bounds(shards, tables)
    counts = block_counts(batches, tables, bounds)
    return loads_from_counts(shards, tables, bounds, *counts, fwd_comm, bwd_comm)


def module_layout(shards: Sequence[ShardPlacement], tables, world_size: int) -> ShardLayout:
    """The sharded module's layout (seen from rank 0) of the all-to-all tables of `shards`."""
    infos, per_table = [], []
    for config in tables:
        mine = [s for s in shards if s.table == config.name and s.rank != REPLICATED]
        if not mine:
            continue
        t = len(infos)
        infos.append(TableInfo(config.name, config.num_embeddings, config.embedding_dim,
                               list(config.feature_names), 0))
        per_table.append([Shard(t, k, s.rank, s.row_start, s.row_end - s.row_start,
                                s.col_start, s.cols) for k, s in enumerate(mine)])
    return ShardLayout.build(infos, per_table, 0, world_size)


def loads_from_counts(shards, tables, bounds, unique, occurrences, batch_sizes, union,
                      fwd_comm, bwd_comm) -> RankLoads:
    """RankLoads of `shards` from `block_counts` output (source s is rank s)."""
    world_size = unique.shape[0]
    loads = RankLoads(*(torch.zeros(world_size, dtype=torch.int64) for _ in fields(RankLoads)))
    index = {c.name: t for t, c in enumerate(tables)}

    def rows_of(t, row_start, row_end):
        k0 = int(torch.searchsorted(bounds[t], row_start, right=True)) - 1
        k1 = int(torch.searchsorted(bounds[t], row_end, right=False))
        return slice(k0, k1)

    for shard in shards:
        if shard.rank == REPLICATED:  # every rank looks its own batch up; gradients all-reduced
            t = index[shard.table]
            loads.lookups += unique[:, t].sum(1)
            size = (shard.row_end - shard.row_start) * shard.cols * 4
            loads.allreduce_bytes += 2 * (world_size - 1) * size // world_size
    layout = module_layout(shards, tables, world_size)
    if not layout.tables:
        return loads
    # Per owner d: [S] ids and unique ids of every source in d's local tables, and the rows d
    # looks up (each local table's distinct ids over all sources).
    n_to = torch.zeros(world_size, world_size, dtype=torch.int64)  # [d, s]
    u_to = torch.zeros_like(n_to)
    for d in range(world_size):
        for local in layout.local_tables[d]:
            t = index[layout.tables[local.table].name]
            blocks = rows_of(t, local.row_offset, local.row_offset + local.rows)
            n_to[d] += occurrences[:, t, blocks].sum(1)
            u_to[d] += unique[:, t, blocks].sum(1)
            loads.lookups[d] += int(union[t, blocks].sum())
    meta = (world_size - 1) * wire.meta_row_bytes(1)
    loads.ids_bytes_sent += meta
    loads.ids_bytes_received += meta
    width = layout.wire_row_dim
    fwd_row, bwd_row = row_bytes(width, fwd_comm), row_bytes(width, bwd_comm)
    for d in range(world_size):
        slots = len(layout.slots[d])
        id_bytes = wire.owner_id_bytes(lt.rows for lt in layout.local_tables[d])
        rows = layout.output_dim(d) // width  # wire rows per sample
        for s in range(world_size):
            if s == d:
                continue
            n, u, b = int(n_to[d, s]), int(u_to[d, s]), int(batch_sizes[s])
            block = sum(wire.section_bytes(slots, b, n, u, wire.choose_encoding(n, u, id_bytes),
                                           id_bytes, False, 0, 0))
            loads.ids_bytes_sent[s] += block
            loads.ids_bytes_received[d] += block
            loads.ids_received[d] += u
            loads.fwd_bytes_sent[d] += b * rows * fwd_row
            loads.fwd_bytes_received[s] += b * rows * fwd_row
            loads.bwd_bytes_sent[s] += b * rows * bwd_row
            loads.bwd_bytes_received[d] += b * rows * bwd_row
    return loads
