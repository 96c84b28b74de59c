"""Where every shard of every table lives, and which ids and columns travel where.

This is the static part of recxla's sharded EmbeddingBagCollection, computed once per module
from TorchRec's plan (`ParameterSharding.sharding_spec`, one `ShardMetadata` per shard). Every
sharding type is the same thing here: a table cut into blocks of rows and columns, each block
on one rank. Table-wise is one block, column-wise and table-column-wise cut columns, row-wise
and table-row-wise cut rows. What follows from that:

- A *local table* is one shard as a rank's lookup sees it: one weight [rows, cols]. A rank may
  hold several shards of one table (column-wise may put two column blocks on one rank); each is
  a local table of its own, and the ids of their table go to each of them.
- A table is exchanged in one of two ways. *Pooled* (TorchRec's way): the owner pools every
  bag and sends [B, cols] per feature back. *Rows*: the owner sends the unique rows a rank's
  batch needs (per micro-batch) and that rank pools its own bags; with skewed keys far fewer
  rows than bags cross the links. A rank's local tables list its pooled tables first, then its
  row tables (its *row groups*).
- A *slot* is (pooled local table, feature of that table) on a rank, in a fixed order. The input
  dist sends, per destination rank, the bags of its slots; the owner pools them into a
  [B, cols] column block per slot, and the output all-to-all sends those blocks back.
- An id of feature f of table t goes to every rank that holds a shard of the row block it falls
  in: one rank for table-wise and row-wise, every column owner for column-wise.
- The output columns of the module are TorchRec's (the unsharded module's): one column block
  per (table, feature) in table order, `feature@table` for a feature that several tables read.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch

from recxla.ops.embedding_bag import SUM

OWNER = "recxla.torchrec.ShardedEmbeddingBagCollection"


@dataclass(frozen=True)
class Shard:
    """One block of a table: rows [row_offset, row_offset + rows) x columns
    [col_offset, col_offset + cols), held by `rank`; `index` is its position in the plan's
    shard list (its ShardMetadata)."""

    table: int
    index: int
    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int


@dataclass
class LocalTable:
    """One shard as the owner's lookup sees it: a weight [rows, cols]."""

    table: int
    shard: Shard

    @property
    def row_offset(self) -> int:
        return self.shard.row_offset

    @property
    def rows(self) -> int:
        return self.shard.rows

    @property
    def cols(self) -> int:
        return self.shard.cols


@dataclass
class TableInfo:
    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: List[str]
    pooling: int  # SUM or MEAN (recxla.ops.embedding_bag)


@dataclass
class Route:
    """Where the ids of one input slot's row block go: rank `dest`, its slot `dest_slot` (a
    pooled table) or its row group `row_group` (a row table; dest_slot is then -1), with
    row_offset subtracted (ids arrive local to the owner's rows)."""

    dest: int
    dest_slot: int
    row_offset: int
    row_group: int = -1


@dataclass
class ShardLayout:
    """Everything static about a sharded collection, seen from one rank.

    Built by `ShardLayout.build`; see the module docstring for the terms.
    """

    rank: int
    world_size: int
    tables: List[TableInfo]
    shards: List[List[Shard]]  # per table, in plan order
    # Per rank: its local tables (pooled ones, then row ones; each by table, then row offset),
    # how many are pooled, and the slots of the pooled ones.
    local_tables: List[List[LocalTable]]
    num_pooled: List[int]
    slots: List[List[Tuple[int, str]]]  # per rank: (local table index, feature name)
    row_tables: FrozenSet[int] = frozenset()
    # The module's output: embedding names and dims in table order; one input slot per name.
    embedding_names: List[str] = field(default_factory=list)
    embedding_dims: List[int] = field(default_factory=list)
    input_slot_table: List[int] = field(default_factory=list)
    input_slot_feature: List[str] = field(default_factory=list)
    # Per input slot: the first row of each row block of its table (ascending) and, per block,
    # the routes of its ids.
    block_starts: List[List[int]] = field(default_factory=list)
    block_routes: List[List[List[Route]]] = field(default_factory=list)
    # Width of one row of the output all-to-all: divides every shard's width.
    wire_row_dim: int = 0
    # The module's name, for the messages of the parts built on this layout.
    owner: str = OWNER

    @property
    def feature_names(self) -> List[str]:
        """The distinct features the module reads, in first-use order."""
        return list(dict.fromkeys(self.input_slot_feature))

    def slot_cols(self, rank: int) -> List[int]:
        return [self.local_tables[rank][lt].cols for lt, _ in self.slots[rank]]

    def output_dim(self, rank: int) -> int:
        """Columns of rank's lookup output (the sum of its slots' widths)."""
        return sum(self.slot_cols(rank))

    def row_groups(self, rank: int) -> List[LocalTable]:
        """rank's local tables exchanged as rows, in order (row group g = local table
        num_pooled[rank] + g)."""
        return self.local_tables[rank][self.num_pooled[rank]:]

    def row_sharded(self, table: int) -> bool:
        """True when the table's rows are cut: its pooled sums arrive in parts."""
        return any(s.rows != self.tables[table].num_embeddings for s in self.shards[table])

    @staticmethod
    def build(tables: Sequence[TableInfo], shards: Sequence[Sequence[Shard]], rank: int,
              world_size: int, max_wire_row_dim: Optional[int] = None,
              row_tables: Iterable[int] = (), owner: str = OWNER) -> "ShardLayout":
        """row_tables: indices of the tables exchanged as rows (the others are pooled); owner:
        the module's name in error messages."""
        _check_shards(tables, shards, world_size, owner)
        row_tables = frozenset(row_tables)
        if not row_tables <= set(range(len(tables))):
            raise ValueError(f"{owner}: row_tables {sorted(row_tables)} must index the "
                             f"{len(tables)} tables")
        local_tables: List[List[LocalTable]] = [[] for _ in range(world_size)]
        for rows_pass in (False, True):
            for t, table_shards in enumerate(shards):
                if (t in row_tables) != rows_pass:
                    continue
                for s in sorted(table_shards, key=lambda s: (s.row_offset, s.col_offset)):
                    local_tables[s.rank].append(LocalTable(t, s))
        num_pooled = [sum(1 for lt in rank_tables if lt.table not in row_tables)
                      for rank_tables in local_tables]
        slots = [
            [(lt, f) for lt, local in enumerate(local_tables[r][:num_pooled[r]])
             for f in tables[local.table].feature_names]
            for r in range(world_size)
        ]
        layout = ShardLayout(rank, world_size, list(tables), [list(s) for s in shards],
                             local_tables, num_pooled, slots, row_tables, owner=owner)
        layout._build_inputs()
        widths = [s.cols for table_shards in shards for s in table_shards]
        layout.wire_row_dim = math.gcd(*widths) if widths else 1
        if max_wire_row_dim is not None:
            # The largest divisor of the gcd that fits: still divides every width.
            layout.wire_row_dim = max(d for d in range(1, min(max_wire_row_dim,
                                                               layout.wire_row_dim) + 1)
                                      if layout.wire_row_dim % d == 0)
        return layout

    def _build_inputs(self) -> None:
        shared: Dict[str, int] = {}
        for table in self.tables:
            for f in table.feature_names:
                shared[f] = shared.get(f, 0) + 1
        slot_index = [
            {(lt, f): j for j, (lt, f) in enumerate(rank_slots)} for rank_slots in self.slots
        ]
        local_of = [
            {local.shard: lt for lt, local in enumerate(rank_tables)}
            for rank_tables in self.local_tables
        ]
        for t, table in enumerate(self.tables):
            starts = sorted({s.row_offset for s in self.shards[t]})
            for f in table.feature_names:
                self.embedding_names.append(f if shared[f] == 1 else f"{f}@{table.name}")
                self.embedding_dims.append(table.embedding_dim)
                self.input_slot_table.append(t)
                self.input_slot_feature.append(f)
                self.block_starts.append(starts)
                routes = []
                for start in starts:
                    block = sorted((s for s in self.shards[t] if s.row_offset == start),
                                   key=lambda s: (s.rank, s.col_offset))
                    if t in self.row_tables:
                        routes.append([Route(s.rank, -1, start, local_of[s.rank][s]
                                             - self.num_pooled[s.rank]) for s in block])
                    else:
                        routes.append([Route(s.rank, slot_index[s.rank][(local_of[s.rank][s], f)],
                                             start) for s in block])
                self.block_routes.append(routes)

    def owner_pooling(self, rank: int) -> List[int]:
        """Pooling of each of rank's local tables at the owner: a row-sharded MEAN table is
        summed there and divided by the whole bag's length at the receiver."""
        return [
            SUM if self.row_sharded(local.table) else self.tables[local.table].pooling
            for local in self.local_tables[rank]
        ]

    def output_offset(self, table: int, feature: str) -> int:
        """The first output column of (table, feature)."""
        offset = 0
        for t, f, dim in zip(self.input_slot_table, self.input_slot_feature,
                             self.embedding_dims):
            if (t, f) == (table, feature):
                return offset
            offset += dim
        raise KeyError((table, feature))

    def output_columns(self, rank: int) -> torch.Tensor:
        """For each column of the received pooled blocks, from owner 0, 1, ... in turn (each
        owner's slots in order): the module output column it lands in.
        int64 [sum over owners of output_dim(owner)]."""
        name_offset, offset = {}, 0
        for t, f, dim in zip(self.input_slot_table, self.input_slot_feature,
                             self.embedding_dims):
            name_offset[(t, f)] = offset
            offset += dim
        columns: List[int] = []
        for owner in range(self.world_size):
            for lt, f in self.slots[owner]:
                s = self.local_tables[owner][lt].shard
                base = name_offset[(s.table, f)]
                columns.extend(range(base + s.col_offset, base + s.col_offset + s.cols))
        return torch.tensor(columns, dtype=torch.int64)


def _check_shards(tables: Sequence[TableInfo], shards: Sequence[Sequence[Shard]],
                  world_size: int, owner: str) -> None:
    """Each table must be covered exactly once by its shards, on ranks of the group."""
    for t, table in enumerate(tables):
        covered = 0
        for s in shards[t]:
            if not 0 <= s.rank < world_size:
                raise ValueError(f"{owner}: a shard of table '{table.name}' is placed on rank "
                                 f"{s.rank}, outside the group of {world_size} ranks")
            if (s.row_offset < 0 or s.col_offset < 0 or s.rows < 0 or s.cols < 0
                    or s.row_offset + s.rows > table.num_embeddings
                    or s.col_offset + s.cols > table.embedding_dim):
                raise ValueError(
                    f"{owner}: a shard of table '{table.name}' ({table.num_embeddings} x "
                    f"{table.embedding_dim}) covers rows {s.row_offset}+{s.rows}, columns "
                    f"{s.col_offset}+{s.cols}: outside the table"
                )
            covered += s.rows * s.cols
        if covered != table.num_embeddings * table.embedding_dim:
            raise ValueError(f"{owner}: the shards of table '{table.name}' cover {covered} of its "
                             f"{table.num_embeddings * table.embedding_dim} values")
