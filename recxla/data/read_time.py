"""`ReadTimeTable`: a raw table (Parquet or Iceberg) trained on straight from the table: every
unit (row group) read is joined with the feature tables (recxla.data.joins), passed through the
transforms (recxla.data.transforms) and mapped to table rows by the rules of a conversion
(recxla.data.convert_plan, convert_rows), as the batches are read.

Planning pass. Opening the table reads it once, unit by unit (one unit and one bucket of each
feature table in memory): the columns the transforms return (the same for every unit, else an
error naming the unit), the rows of every unit after a filter, the largest timestamp of every
unit (for a held-out split by time) and the ids of the tables that need a vocabulary (mapping
"vocab", or none given: the conversion's default, a vocabulary up to `vocab_limit` distinct
ids, else hashing). That is a conversion's first pass, paid once per job start by each rank
(deterministically: every rank gets the same plan); a table whose mapping is "hash" or
"modulo" in the schema costs no counting. When the experiment is settled, `python -m
recxla.data convert` of the same table makes it a dataset read without either pass.

`info` stands where a converted dataset's `DatasetInfo` does (`ParquetDataset(table, ...)`,
`make_loader(table, ...)`): units are row groups, and their order in an epoch keeps the units
of one bucket together (recxla.data.epoch_plan), so a reader loads each feature bucket once per
run of units.
"""

import dataclasses
import hashlib
import json
from typing import Dict, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.compute as pc

from recxla.data.convert_plan import make_plan
from recxla.data.convert_rows import convert_rows
from recxla.data.errors import DataFormatError
from recxla.data.id_counts import (
    IdCounter,
    dataset_spec,
    flag_measures,
    merge_results,
    table_specs,
)
from recxla.data.joins import BucketJoiner
from recxla.data.schema import Schema, load_schema
from recxla.data.table_source import open_table
from recxla.data.transforms import apply_transforms, identity, load_transforms

OP = "recxla.data.ReadTimeTable"
_SAMPLE_ROWS = 8192  # rows of the first unit that column roles are inferred from (convert's)


@dataclasses.dataclass(frozen=True)
class _File:
    path: str


class ReadTimeInfo:
    """What a reader needs of a ReadTimeTable, in the shape of recxla.data.parquet_layout.
    DatasetInfo: files, row_groups [(file, row group, rows after the transforms)], layout,
    num_rows, fingerprint; plus the bucket and largest timestamp of each row group."""

    def __init__(self, table: "ReadTimeTable", rows: List[int], stamps: List[Optional[int]]):
        source = table.source
        self.path = source.ref
        self.files = [_File(f) for f in source.files]
        self.row_groups: List[Tuple[int, int, int]] = [
            (u.file, u.row_group, r) for u, r in zip(source.units, rows)]
        self.num_rows = sum(rows)
        self.layout = table.plan.layout()
        self.spec = table.spec
        self.unit_of = {(u.file, u.row_group): i for i, u in enumerate(source.units)}
        self._buckets = {(u.file, u.row_group): u.bucket for u in source.units}
        self._stamps = {(u.file, u.row_group): s for u, s in zip(source.units, stamps)}
        ident = {"table": source.fingerprint, "joins": table.joiner.identity(),
                 "transforms": identity(table.transforms), "spec": table.spec.to_json()}
        self.fingerprint = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()
                                        ).hexdigest()[:16]
        self._summary = {"path": source.ref, "kind": source.kind, "snapshot": source.snapshot,
                         "files": len(source.files), "source_rows": source.num_rows,
                         "joins": table.joiner.identity(), "transforms": [
                             t.name for t in table.transforms]}

    def bucket_of_group(self, group: int) -> tuple:
        """The (column, bucket) pairs of row group `group` (an index into row_groups)."""
        fi, gi, _ = self.row_groups[group]
        return self._buckets[(fi, gi)]

    def largest_timestamp(self, group: int) -> int:
        fi, gi, _ = self.row_groups[group]
        s = self._stamps[(fi, gi)]
        return 0 if s is None else s

    def check_tables(self, tables: Sequence, num_dense: Optional[int] = None) -> None:
        """DataFormatError unless every table's features are read, with rows enough for the
        rows the spec maps their ids to."""
        where = f"recxla.data: {self.path}"
        if num_dense is not None and num_dense != self.layout.num_dense:
            raise DataFormatError(f"{where}: the table gives {self.layout.num_dense} dense "
                                  f"features, the model takes {num_dense}")
        for t in tables:
            for feature in t.feature_names:
                if feature not in self.layout.features:
                    raise DataFormatError(f"{where}: table {t.name} reads feature {feature!r}, "
                                          f"which the table does not give (it gives "
                                          f"{list(self.layout.features)})")
                rows = self.spec.table_of(feature).num_rows
                if rows > t.num_embeddings:
                    raise DataFormatError(f"{where}: feature {feature!r} has ids in [0, {rows}), "
                                          f"table {t.name} has {t.num_embeddings} rows")

    def summary(self) -> Dict:
        return {**self._summary, "rows": self.num_rows, "row_groups": len(self.row_groups),
                "layout": json.loads(self.layout.to_json())}


class ReadTimeTable:
    """A raw table read with joins and transforms, ids mapped at read time (module doc).

    Args:
        ref: the training table (recxla.data.table_source reference).
        schema: a schema file (path), a parsed Schema, or None: column roles as `convert`
            gives them (docs/your-data.md), over the columns after joins and transforms.
        transforms: "module:function" names, applied in order.
        joins: "KEY=TABLE" strings, applied in order, before the transforms.
        snapshots: the Iceberg snapshots to read, [training table, then each join's] (a
            checkpoint's `snapshots`); None: each table's current one.
    Attributes: source, joiner, transforms, plan, spec (the DatasetSpec), info, snapshots.
    Raises FileNotFoundError, ValueError / DataFormatError naming the table, the unit (file
    and row group) and the transform or join at fault.
    """

    def __init__(self, ref: str, schema=None, transforms: Sequence[str] = (),
                 joins: Sequence[str] = (), snapshots: Optional[Sequence[Optional[int]]] = None):
        snapshots = list(snapshots) if snapshots is not None else [None] * (1 + len(joins))
        if len(snapshots) != 1 + len(joins):
            raise ValueError(f"{OP}: {len(snapshots)} snapshots for the training table and "
                             f"{len(joins)} joins (one each)")
        if schema is None:
            schema = Schema()
        elif not isinstance(schema, Schema):
            schema = load_schema(schema)
        self.source = open_table(ref, snapshots[0], what="--data")
        self.joiner = BucketJoiner(joins, self.source, snapshots[1:])
        self.transforms = load_transforms(transforms)
        self._plan_pass(schema)

    @property
    def snapshots(self) -> List[Optional[int]]:
        """The snapshots read: the training table's, then each join's (None: not Iceberg)."""
        return [self.source.snapshot] + self.joiner.snapshots

    def _rows(self, unit: int, check: bool, source=None, joiner=None) -> pa.Table:
        """Unit `unit` read, joined and transformed (with a reader's own `source` and
        `joiner`, or the table's)."""
        source, joiner = source or self.source, joiner or self.joiner
        where = f"{source.ref}: {source.where(unit)}"
        t = source.read(unit)
        t = joiner.join(t, source.units[unit], where, check)
        return apply_transforms(self.transforms, t, where)

    def _plan_pass(self, schema: Schema) -> None:
        if not self.source.units:
            raise DataFormatError(f"{OP}: {self.source.ref}: the table holds no rows")
        self.plan = counter = columns = None
        rows: List[int] = []
        stamps: List[Optional[int]] = []
        for i in range(len(self.source.units)):
            t = self._rows(i, check=True)
            if self.plan is None:
                where = f"{self.source.ref}: {self.source.where(i)}"
                self.plan = make_plan(schema, t.schema, where, t.slice(0, _SAMPLE_ROWS))
                counter = IdCounter(self.plan)
                columns = t.schema
            elif not t.schema.equals(columns):
                raise DataFormatError(
                    f"{OP}: {self.source.ref}: {self.source.where(i)}: after the joins and "
                    f"transforms the columns are {_describe(t.schema)}, in "
                    f"{self.source.where(0)} {_describe(columns)}: a transform must return the "
                    "same columns for every batch")
            t = t.select(self.plan.columns)
            counter.add(t)
            rows.append(t.num_rows)
            stamps.append(_largest(t, self.plan.timestamp))
        self.joiner.release()  # readers hold their own buckets; this one is done
        counts = merge_results(self.plan, [counter.result()])
        flag_measures(self.plan, counts, sum(rows))
        self.specs, self.vocabs = table_specs(self.plan, counts)
        self.spec = dataset_spec(self.plan, self.specs, f"{OP}: {self.source.ref}")
        self.info = ReadTimeInfo(self, rows, stamps)

    def read(self, file: int, row_group: int, want: int, source=None,
             joiner=None) -> pa.Table:
        """Row group `row_group` of file `file` in recxla's layout (what a converted dataset's
        row group holds). DataFormatError if the transforms give another row count than the
        `want` of the planning pass (a transform that is not a function of its batch).
        source, joiner: a reader's own (ReadTimeReader); None: the table's."""
        unit = self.info.unit_of[(file, row_group)]
        t = self._rows(unit, False, source, joiner)
        where = f"{self.source.ref}: {self.source.where(unit)}"
        if t.num_rows != want:
            raise DataFormatError(f"{OP}: {where}: the transforms gave {t.num_rows} rows, "
                                  f"{want} when the table was planned: a transform must be a "
                                  "function of its batch alone (recxla.data.transforms)")
        return convert_rows(t.select(self.plan.columns), self.plan, self.specs, self.vocabs,
                            where, 0)

    def reader(self) -> "ReadTimeReader":
        return ReadTimeReader(self)


class ReadTimeReader:
    """The reader ParquetDataset uses for a ReadTimeTable (the role of its _GroupReader): its
    own files and held feature buckets, so that readers in several threads do not share
    them."""

    def __init__(self, table: ReadTimeTable):
        self.table, self.info = table, table.info
        self.source, self.joiner = table.source.clone(), table.joiner.clone()

    def read(self, group: int, use_threads: bool = True) -> pa.Table:
        """Row group `group` of `info.row_groups` (`info`: the table's, or a split's)."""
        return self.table.read(*self.info.row_groups[group], self.source, self.joiner)


def _describe(schema: pa.Schema) -> str:
    return "[" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "]"


def _largest(t: pa.Table, column: Optional[str]) -> Optional[int]:
    """The largest timestamp of a unit as convert stores it (int64; dates as days)."""
    if column is None or t.num_rows == 0:
        return None
    col = t.column(column)
    if pa.types.is_date32(col.type):
        col = col.cast(pa.int32())
    value = pc.max(col.cast(pa.int64())).as_py()
    return None if value is None else int(value)
