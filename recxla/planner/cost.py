"""Expected load of a table shard, estimated from a sample of batches, and what it costs in time.

`TableLoads.measure` counts, on a few sample batches of one rank, the unique ids and the id
occurrences of every table per row-wise block (with `recxla.planner.loads.block_counts`, the
counter the measured report uses too). Every rank's batch follows the same distribution, so a
shard's load over the whole world follows from one source's: the planner needs no batch from
the other ranks. From those counts `TableLoads.shard_load` prices any shard (rows x columns)
as recxla's sharded module moves it (see `recxla.planner.loads`), per other rank:

    ids  min(N x 4, U x 4 + N x 2) + F x B x 4   to the owner (int32 ids, 2-byte inverse)
    fwd  F x B x (c / w) x row_bytes(w, fwd)     from the owner (pooled rows, wire width w)
    bwd  F x B x (c / w) x row_bytes(w, bwd)     to the owner (their gradients)
    lookups  U x R^a rows: the sources' ids together, distinct (a from the sample)

U and N are the expected unique ids and occurrences of one source in the shard's rows (key
skew and dedup enter through the sample), F the table's features, B the per-rank batch, c the
shard's columns and w the module's wire row width (the gcd of all shard widths: one narrow
column block makes every table's FP8 rows carry a scale per w values). How the distinct ids
grow with the number of sources, R^a, is measured on the sample batches together. Row ranges
that cut a sampled block take the block's counts in proportion to the rows they cover. (The
module chooses the id encoding per destination over all its tables and aligns sections to
8 bytes; estimates price each shard on its own.)

`CostModel` turns loads into seconds: each all-to-all waits for its busiest rank's link, rows
are read at memory speed. Its defaults are published H100 figures (cited below); recxla.sim holds
the same figures for the step model.
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, get_format, row_bytes
from recxla.ops.dedup import row_wise_bounds
from recxla.planner.loads import block_counts
from recxla.torchrec import id_wire_format as wire

OP = "recxla.planner.TableLoads"


@dataclass(frozen=True)
class CostModel:
    """Seconds per byte on the wire and per byte of rows looked up, for one rank.

    wire_bytes_per_s: what one rank's all-to-all traffic gets. Default 50e9: one 400 Gbit/s
        NIC per GPU (NVIDIA DGX H100: eight ConnectX-7 400 Gb/s ports for eight GPUs), the link
        the traffic of a 1D all-to-all across nodes crosses.
    lookup_bytes_per_s: rows read by the lookup. Default 3.35e12: H100 SXM HBM3 bandwidth
        (NVIDIA H100 datasheet), an upper bound on an embedding kernel's read rate.
    weight_bytes: bytes of one stored weight (fp32 tables).
    read_granule: memory is read in whole granules: a row costs its bytes rounded up to it.
        Default 64: two 32-byte DRAM sectors of a GPU, one CPU cache line.
    Tables kept in host memory and read over PCIe (TorchRec's UVM kernels) make lookups dear:
    `CostModel(lookup_bytes_per_s=64e9)` (PCIe 5.0 x16, 64 GB/s each way).
    """

    wire_bytes_per_s: float = 50e9
    lookup_bytes_per_s: float = 3.35e12
    weight_bytes: int = 4
    read_granule: int = 64

    def __post_init__(self):
        for name in ("wire_bytes_per_s", "lookup_bytes_per_s", "weight_bytes", "read_granule"):
            if not getattr(self, name) > 0:
                raise ValueError(f"recxla.planner.CostModel: {name} must be > 0")

    def lookup_seconds(self, lookups, cols):
        """Read time of `lookups` rows of `cols` weights, each rounded up to whole granules."""
        granules = -(-cols * self.weight_bytes // self.read_granule)
        return lookups * granules * self.read_granule / self.lookup_bytes_per_s

    def step_seconds(self, owner_bytes, source_bytes, lookup_seconds) -> float:
        """Time of the sparse part of one step, the three all-to-alls run one after another.

        Each all-to-all ends when its busiest rank is done; a rank's link carries the larger
        of what it sends and what it receives (full duplex). The owners' lookups run before
        the output all-to-all, so the slowest one adds.

        Args:
            owner_bytes: float64 [R, 3], bytes of (ids in, pooled rows out, gradients in) of
                each rank as an owner.
            source_bytes: float64 [R, 3], the other direction of the same collectives, each
                rank as a source (ids out, pooled rows in, gradients out).
            lookup_seconds: float64 [R].
        """
        owner, source = np.asarray(owner_bytes), np.asarray(source_bytes)
        busiest = np.maximum(owner, source).max(0)
        lookups = float(np.asarray(lookup_seconds).max())
        return float(busiest.sum()) / self.wire_bytes_per_s + lookups


@dataclass(frozen=True)
class ShardLoad:
    """Expected per-step load of one shard.

    owner: bytes its owner receives (ids), sends (pooled rows) and receives (gradients) in the
        three all-to-alls, a tuple (ids, fwd, bwd) over all other ranks.
    per_source: the same three, between the owner and one other rank.
    lookups: rows the owner looks up; lookup_seconds: their read time (`CostModel`).
    """

    owner: Tuple[float, float, float]
    per_source: Tuple[float, float, float]
    lookups: float
    lookup_seconds: float


class TableLoads:
    """Per-source unique ids and occurrences of every table, by row-wise block, from a sample.

    Attributes:
        tables: the EmbeddingBagConfig measured, by name in `index`.
        world_size: R, the ranks the load is scaled to (and the row-wise blocks of the sample).
        bounds: int64 [T, R + 1], the row-wise block bounds (TorchRec's row-wise split).
        cum_unique / cum_occurrences: float64 [T, R + 1], per-source means accumulated over
            blocks (entry k: rows below bounds[t, k]).
        batch_size: mean samples per source batch, B.
    """

    def __init__(self, tables, world_size: int, bounds, unique, occurrences, batch_size: float,
                 fwd_comm: str, bwd_comm: str, growth=None):
        self.tables = list(tables)
        self.index = {c.name: t for t, c in enumerate(self.tables)}
        self.world_size = world_size
        self.bounds = bounds
        zero = torch.zeros(len(self.tables), 1, dtype=torch.float64)
        self.cum_unique = torch.cat([zero, unique.cumsum(1)], 1)
        self.cum_occurrences = torch.cat([zero, occurrences.cumsum(1)], 1)
        self.batch_size = float(batch_size)
        self.fwd_comm, self.bwd_comm = fwd_comm, bwd_comm
        # Distinct ids of k sources ~ one source's x k ** growth, per table (1: no repeats).
        self.growth = torch.ones(len(self.tables), dtype=torch.float64) if growth is None \
            else growth

    @classmethod
    def measure(cls, tables, sample_batches, world_size: int, fwd_comm: str = DEFAULT_FWD_COMM,
                bwd_comm: str = DEFAULT_BWD_COMM) -> "TableLoads":
        """Count the sample.

        Args:
            tables: T EmbeddingBagConfig.
            sample_batches: a few batches of one rank's size (KeyedJaggedTensor or
                recxla.data.Batch); their mean stands for every rank's batch.
            world_size: R >= 1.
            fwd_comm / bwd_comm: wire formats of pooled rows and of their gradients.
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"{OP}: world_size must be an int >= 1, got {world_size!r}")
        get_format(fwd_comm, OP, "fwd_comm")
        get_format(bwd_comm, OP, "bwd_comm")
        if len(sample_batches) < 1:
            raise ValueError(f"{OP}: sample_batches must hold at least one batch")
        bounds = row_wise_bounds([c.num_embeddings for c in tables], world_size)
        unique, occurrences, sizes, union = block_counts(sample_batches, tables, bounds)
        mean_unique = unique.to(torch.float64).mean(0)
        growth = torch.ones(len(tables), dtype=torch.float64)
        if len(sample_batches) > 1:
            ratio = union.sum(1).to(torch.float64) / mean_unique.sum(1).clamp(min=1e-30)
            growth = (ratio.clamp(min=1.0).log() / math.log(len(sample_batches))).clamp(max=1.0)
        return cls(
            tables, world_size, bounds, mean_unique,
            occurrences.to(torch.float64).mean(0), float(sizes.to(torch.float64).mean()),
            fwd_comm, bwd_comm, growth,
        )

    def _cumulative(self, t: int, row: int) -> Tuple[float, float]:
        """Per-source (unique, occurrences) below `row` of table t, linear inside a block."""
        bounds = self.bounds[t]
        k = int(torch.searchsorted(bounds, row, right=True)) - 1
        k = min(max(k, 0), bounds.numel() - 2)
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        frac = 0.0 if hi == lo else min(max((row - lo) / (hi - lo), 0.0), 1.0)
        u = self.cum_unique[t, k] + frac * (self.cum_unique[t, k + 1] - self.cum_unique[t, k])
        n = self.cum_occurrences[t, k] + frac * (
            self.cum_occurrences[t, k + 1] - self.cum_occurrences[t, k]
        )
        return float(u), float(n)

    def per_source(self, table: str, row_start: int, row_end: int) -> Tuple[float, float]:
        """Expected (unique ids, occurrences) of one source batch in rows [row_start, row_end)."""
        if table not in self.index:
            raise ValueError(f"{OP}: unknown table {table!r}")
        t = self.index[table]
        u0, n0 = self._cumulative(t, row_start)
        u1, n1 = self._cumulative(t, row_end)
        return u1 - u0, n1 - n0

    def shard_load(self, table: str, row_start: int, row_end: int, cols: int,
                   cost: CostModel, wire_dim: Optional[int] = None) -> ShardLoad:
        """Expected load of a shard (rows [row_start, row_end) x `cols` columns), its pooled
        rows cut into `wire_dim`-wide wire rows (default: its own width)."""
        u, n = self.per_source(table, row_start, row_end)
        config = self.tables[self.index[table]]
        features, b = len(config.feature_names), self.batch_size
        id_bytes = wire.owner_id_bytes([row_end - row_start])
        width = wire_dim or cols
        wire_rows = features * b * (cols // width)
        per_source = (
            wire.encoded_ids_bytes(n, u, id_bytes) + features * b * wire.LENGTH_BYTES,
            wire_rows * row_bytes(width, self.fwd_comm),
            wire_rows * row_bytes(width, self.bwd_comm),
        )
        owner = tuple((self.world_size - 1) * x for x in per_source)
        rows = row_end - row_start
        lookups = min(u * self.world_size ** float(self.growth[self.index[table]]), rows)
        return ShardLoad(owner, per_source, lookups, cost.lookup_seconds(lookups, cols))

    def pooling_factors(self) -> Dict[str, float]:
        """Mean ids per sample of every table (TorchRec's `pooling_factors` constraint)."""
        total = self.cum_occurrences[:, -1]
        return {c.name: float(total[t]) / max(self.batch_size, 1.0)
                for t, c in enumerate(self.tables)}


def rank_totals(shard_loads: Sequence[ShardLoad], ranks: torch.Tensor, world_size: int):
    """Per-rank sums of placed shards.

    Args:
        shard_loads: N ShardLoad; ranks: int64 [N], each shard's rank.
    Returns:
        owner: float64 [R, 3] (ids in, rows out, gradients in as an owner); source: float64
        [R, 3] (the same collectives' other direction, as a source: every other rank's shards
        exchange per_source bytes with it); lookups: float64 [R]; lookup_seconds: float64 [R].
    """
    # numpy: the planner calls this for every candidate, on tiny arrays.
    ranks = np.asarray(ranks, dtype=np.int64)
    per_owner = np.array([s.owner for s in shard_loads], np.float64).reshape(-1, 3)
    per_source = np.array([s.per_source for s in shard_loads], np.float64).reshape(-1, 3)
    owner = np.zeros((world_size, 3))
    np.add.at(owner, ranks, per_owner)
    own = np.zeros((world_size, 3))
    np.add.at(own, ranks, per_source)
    source = per_source.sum(0)[None, :] - own
    lookups = np.zeros(world_size)
    np.add.at(lookups, ranks, np.array([s.lookups for s in shard_loads], np.float64))
    seconds = np.zeros(world_size)
    np.add.at(seconds, ranks, np.array([s.lookup_seconds for s in shard_loads], np.float64))
    return tuple(torch.from_numpy(x) for x in (owner, source, lookups, seconds))
