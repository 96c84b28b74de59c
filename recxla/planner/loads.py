"""What a sharding plan costs each rank, counted on real batches: the one home of that count.

recxla's sharded embedding path (see DESIGN.md, "One training step") moves, per step and per
table shard, between a source rank s (which holds a batch of B_s samples) and the shard's
owner r:
- input all-to-all: the ids of s that fall in the shard's rows, deduplicated per (table,
  destination rank): U unique ids of ID_BYTES each, plus the bag structure the owner needs
  to pool them: one INDEX_BYTES position into the unique list per id occurrence (N of them)
  and one LENGTH_BYTES length per sample (B_s);
- the owner looks up its U rows (a column-wise shard reads the same rows, narrower);
- output all-to-all: one pooled row per sample of s, row_bytes(shard columns, fwd format),
  B_s rows whatever the bags hold (a row-wise shard sends pooled partial sums that the source
  adds up);
- backward: the same B_s rows of gradient back to the owner, in the bwd format.
Traffic from a rank to itself never leaves the process and is not counted as wire bytes; the
owner still looks its own source's rows up.

Counting needs, per source, table and row block, the unique ids and the id occurrences:
`block_counts` gets them with recxla's own key ops (bucketize_by_rank, then one
segmented_unique per source). The planner's load estimates use the same function on a sample
of batches (`recxla.planner.cost`), so estimate and measurement cannot drift apart.
"""

from dataclasses import dataclass, fields
from typing import Dict, List, Sequence, Tuple

import torch

from recxla.formats import get_format, row_bytes
from recxla.ops.dedup import bucketize_by_rank, segmented_unique

# Bytes of the input all-to-all's entries (int64 ids; int32 positions and lengths).
ID_BYTES = 8
INDEX_BYTES = 4
LENGTH_BYTES = 4

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

    ids_received: unique ids this rank receives from other ranks as an owner.
    lookups: rows this rank looks up as an owner: unique ids per (source, shard), its own
        source included.
    {ids,fwd,bwd}_bytes_{sent,received}: bytes of the input all-to-all (ids, positions,
        lengths), of the forward output all-to-all (pooled rows) and of the backward one
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
    """Unique ids and id occurrences per (source batch, table, row block).

    Args:
        batches: S batches (KeyedJaggedTensor or recxla.data.Batch), one per source.
        tables: T EmbeddingBagConfig.
        block_bounds: int64 [T, K + 1], each row non-decreasing from 0 to the table's rows:
            block k of table t is rows [block_bounds[t, k], block_bounds[t, k + 1]) (empty
            blocks pad tables with fewer blocks).
    Returns:
        unique: int64 [S, T, K], distinct ids of source s in block k of table t;
        occurrences: int64 [S, T, K], ids (with repeats) there;
        batch_sizes: int64 [S], samples of each source.
    """
    num_tables, num_blocks = block_bounds.shape[0], block_bounds.shape[1] - 1
    unique = torch.zeros(len(batches), num_tables, num_blocks, dtype=torch.int64)
    occurrences = torch.zeros_like(unique)
    batch_sizes = torch.zeros(len(batches), dtype=torch.int64)
    for s, batch in enumerate(batches):
        kjt = _sparse_features(batch)
        batch_sizes[s] = kjt.stride()
        values, offsets = table_ids(kjt, tables)
        # Buckets are block-major (bucket b = k * T + t), as for the ranks of an all-to-all.
        permutation, bucket_offsets = bucketize_by_rank(values, offsets, block_bounds)
        _, unique_offsets, _ = segmented_unique(values[permutation], bucket_offsets)
        unique[s] = unique_offsets.diff().reshape(num_blocks, num_tables).t()
        occurrences[s] = bucket_offsets.diff().reshape(num_blocks, num_tables).t()
    return unique, occurrences, batch_sizes


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


def count_rank_loads(
    plan,
    tables,
    batches,
    fwd_fmt: str = "e4m3",
    bwd_fmt: str = "bf16",
    module_path: str = "",
) -> RankLoads:
    """Per-rank load of one training step of `plan` on real batches, as recxla's sharded path
    would move it (see the module docstring for what is counted).

    Args:
        plan: TorchRec ShardingPlan (module at `module_path`) or one module's plan.
        tables: the EmbeddingBagConfig of the sharded tables.
        batches: R batches (KeyedJaggedTensor or recxla.data.Batch): batch s is source rank
            s's, so len(batches) is the world size.
        fwd_fmt / bwd_fmt: wire formats of the pooled rows and of their gradients
            (`recxla.FORMATS`).
    Returns:
        RankLoads with int64 tensors [R].
    Raises:
        ValueError: an unknown format, a plan that does not tile a table or names a rank
            outside [0, len(batches)), ids outside a table.
    """
    get_format(fwd_fmt, OP, "fwd_fmt")
    get_format(bwd_fmt, OP, "bwd_fmt")
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
    unique, occurrences, batch_sizes = block_counts(batches, tables, bounds)
    index = {c.name: t for t, c in enumerate(tables)}
    return loads_from_counts(shards, index, bounds, unique, occurrences, batch_sizes, fwd_fmt,
                             bwd_fmt)


def loads_from_counts(shards, table_index, bounds, unique, occurrences, batch_sizes, fwd_fmt,
                      bwd_fmt) -> RankLoads:
    """RankLoads of `shards` from `block_counts` output (source s is rank s)."""
    world_size = unique.shape[0]
    loads = RankLoads(*(torch.zeros(world_size, dtype=torch.int64) for _ in fields(RankLoads)))
    remote = torch.ones(world_size, dtype=torch.bool)
    for shard in shards:
        t = table_index[shard.table]
        k0 = int(torch.searchsorted(bounds[t], shard.row_start, right=True)) - 1
        k1 = int(torch.searchsorted(bounds[t], shard.row_end, right=False))
        u = unique[:, t, k0:k1].sum(1)  # [S]
        n = occurrences[:, t, k0:k1].sum(1)
        r = shard.rank
        if r == REPLICATED:  # every rank looks its own batch up; gradients all-reduced
            loads.lookups += u
            size = (shard.row_end - shard.row_start) * shard.cols * 4
            loads.allreduce_bytes += 2 * (world_size - 1) * size // world_size
            continue
        remote.fill_(True)
        remote[r] = False
        per_source = {
            "ids": u * ID_BYTES + n * INDEX_BYTES + batch_sizes * LENGTH_BYTES,
            "fwd": batch_sizes * row_bytes(shard.cols, fwd_fmt),
            "bwd": batch_sizes * row_bytes(shard.cols, bwd_fmt),
        }
        loads.lookups[r] += int(u.sum())
        loads.ids_received[r] += int(u[remote].sum())
        for collective, nbytes in per_source.items():
            # ids and gradients flow from the sources to the owner, pooled rows back.
            to_owner = collective != "fwd"
            owner_side = f"{collective}_bytes_{'received' if to_owner else 'sent'}"
            source_side = f"{collective}_bytes_{'sent' if to_owner else 'received'}"
            getattr(loads, owner_side)[r] += int(nbytes[remote].sum())
            getattr(loads, source_side).add_(torch.where(remote, nbytes, 0))
    return loads
