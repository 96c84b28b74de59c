"""Bandwidth-aware embedding sizes: each table's share of the wire, and smaller dims for the
tables whose bytes dominate, under a byte budget.

Where the link binds, the embeddings' bytes are the step's time, and they grow with the dims:
each sample's pooled row of a table crosses the wire forward and its gradient backward, at
the wire format's bytes per value (plus one scale per FP8 row). Halving the dims of the tables
that carry most bytes (as Pinterest did on its way to near-linear scaling) trades a little
model capacity for the link's time; `propose_dims` makes that proposal and the trainer's
`--embedding-dims auto` takes it, so a user sees the trade (bench/results/training.md) before
taking it.

How the bytes are counted (`table_wire_bytes`): with recxla's own count of what its sharded
module moves (recxla.planner.loads), for each table alone placed table-wise round robin over
the ranks, on real batches: the ids in (deduplicated, in the input dist's wire format), the
pooled rows out and their gradients back, in the run's formats. A table the trainer exchanges
as rows or shards row-wise moves other bytes, in proportion to its dim all the same, so the
proposal, which only compares tables' dim-dependent bytes, holds for them too.
"""

import dataclasses
from typing import Dict, List, Sequence

from recxla.formats import (
    DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, accepts_old_comm_keywords, row_bytes,
)
from recxla.planner.loads import (
    ShardPlacement,
    block_counts,
    loads_from_counts,
    shard_block_bounds,
)

OP = "recxla.planner.embedding_dims"
MIN_DIM = 8  # the smallest dim proposed: below it a table's rows carry little but their scale
DEFAULT_KEEP = 0.5  # `auto`: the embeddings' dim-dependent bytes kept


@dataclasses.dataclass(frozen=True)
class TableWire:
    """One table's bytes on the wire per step (all ranks together).

    ids: the input all-to-all's bytes (the ids: no dim in them); rows: the pooled rows and their
    gradients (proportional to the dim, per wire row); share: (ids + rows) over all tables'."""

    table: str
    dim: int
    features: int
    ids: int
    rows: int
    share: float = 0.0

    @property
    def bytes(self) -> int:
        return self.ids + self.rows


@accepts_old_comm_keywords
def table_wire_bytes(tables: Sequence, batches: Sequence, fwd_comm: str = DEFAULT_FWD_COMM,
                     bwd_comm: str = DEFAULT_BWD_COMM) -> List[TableWire]:
    """Each table's bytes per step (module doc), on `batches` (one per rank: batch r is rank
    r's; recxla.data.Batch or KeyedJaggedTensor). tables: EmbeddingBagConfigs."""
    world = len(batches)
    if world < 2:
        raise ValueError(f"{OP}: table_wire_bytes needs the batches of 2 ranks or more (nothing "
                         f"crosses the wire on one), got {world}")
    out = []
    for i, t in enumerate(tables):
        shards = [ShardPlacement(t.name, i % world, 0, t.num_embeddings, 0, t.embedding_dim)]
        bounds = shard_block_bounds(shards, [t])
        loads = loads_from_counts(shards, [t], bounds, *block_counts(batches, [t], bounds),
                                  fwd_comm, bwd_comm)
        ids = int(loads.ids_bytes_sent.sum())
        rows = int(loads.fwd_bytes_sent.sum() + loads.bwd_bytes_sent.sum()
                   + loads.allreduce_bytes.sum())
        out.append(TableWire(t.name, t.embedding_dim, len(t.feature_names), ids, rows))
    total = sum(w.bytes for w in out) or 1
    return [dataclasses.replace(w, share=w.bytes / total) for w in out]


def _rows_at(wire: TableWire, dim: int, fwd_comm: str, bwd_comm: str) -> float:
    """The table's row bytes at another dim: per row, the format's bytes of `dim` values."""
    per_row = row_bytes(wire.dim, fwd_comm) + row_bytes(wire.dim, bwd_comm)
    return wire.rows * (row_bytes(dim, fwd_comm) + row_bytes(dim, bwd_comm)) / per_row


@accepts_old_comm_keywords
def propose_dims(wire: Sequence[TableWire], keep: float = DEFAULT_KEEP,
                 min_dim: int = MIN_DIM, fwd_comm: str = DEFAULT_FWD_COMM,
                 bwd_comm: str = DEFAULT_BWD_COMM) -> Dict[str, int]:
    """Dims under a budget of `keep` times the tables' row bytes: the dim of the table whose
    rows carry most bytes is halved (not below `min_dim`, a multiple of 4 as the FP8 codec's
    vector loads want), again and again, until the budget holds or no table can shrink.
    Ties: the table listed first. Returns {table: dim} for every table."""
    if not 0 < keep <= 1:
        raise ValueError(f"{OP}: keep must be in (0, 1], got {keep!r}")
    if min_dim < 4 or min_dim % 4:
        raise ValueError(f"{OP}: min_dim must be a multiple of 4, >= 4, got {min_dim!r}")
    dims = {w.table: w.dim for w in wire}
    rows = {w.table: float(w.rows) for w in wire}
    budget = keep * sum(rows.values())
    by_name = {w.table: w for w in wire}
    while sum(rows.values()) > budget:
        shrinkable = [w.table for w in wire if dims[w.table] // 2 >= min_dim and
                      (dims[w.table] // 2) % 4 == 0]
        if not shrinkable:
            break
        name = max(shrinkable, key=lambda n: (rows[n], -list(dims).index(n)))
        dims[name] //= 2
        rows[name] = _rows_at(by_name[name], dims[name], fwd_comm, bwd_comm)
    return dims


def wire_report(wire: Sequence[TableWire], proposed: Dict[str, int],
                link_bits_per_s: float = 0.0, fwd_comm: str = DEFAULT_FWD_COMM,
                bwd_comm: str = DEFAULT_BWD_COMM) -> List[str]:
    """Markdown lines: each table's dim, bytes per step, share of the wire, and with a link
    rate its milliseconds a step on the link; the proposed dim and bytes beside them."""
    ms = "| ms a step on the link " if link_bits_per_s else ""
    lines = [f"| table | features | dim | MB a step | share {ms}| proposed dim | MB a step |",
             "|---|---|---|---|---" + ("|---" if link_bits_per_s else "") + "|---|---|"]
    before = after = 0.0
    for w in sorted(wire, key=lambda w: -w.bytes):
        new = w.ids + _rows_at(w, proposed[w.table], fwd_comm, bwd_comm)
        before, after = before + w.bytes, after + new
        link = f"| {w.bytes * 8 / link_bits_per_s * 1e3:.1f} " if link_bits_per_s else ""
        lines.append(f"| {w.table} | {w.features} | {w.dim} | {w.bytes / 1e6:.3f} | "
                     f"{w.share:.1%} {link}| {proposed[w.table]} | {new / 1e6:.3f} |")
    link = f"| {before * 8 / link_bits_per_s * 1e3:.1f} " if link_bits_per_s else ""
    lines.append(f"| all | | | {before / 1e6:.3f} | 100% {link}| | {after / 1e6:.3f} |")
    return lines

