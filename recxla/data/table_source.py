"""Tables read as they are, without a conversion: a Parquet file, a folder of Parquet files
(bucketed or not), or an Apache Iceberg table, each seen as a list of units (one Parquet row
group each) with the bucket of each unit.

A table is named by a string (`open_table(ref)`):
    data/ratings.parquet                      one Parquet file
    data/ratings                              a folder: its *.parquet files by name, or its
                                              bucket folders <column>_bucket=<i>/ (nested for
                                              several bucketed columns), the layout that
                                              `python -m recxla.data bucket` writes and
                                              Iceberg's own data folders have
    iceberg:sqlite:////abs/catalog.db#db.ratings    an Iceberg table in pyiceberg's SQL catalog
                                              on SQLite (no server); ...catalog.db?catalog=
                                              NAME#... when the database holds several
    iceberg:https://host:8181#db.ratings      ... in a REST catalog
    iceberg:prod#db.ratings                   ... in the catalog named "prod" in pyiceberg's
                                              configuration (~/.pyiceberg.yaml)
    any Iceberg reference + "@<snapshot id>"  that snapshot instead of the current one

Buckets (`TableSource.buckets`: column -> number of buckets): a column is bucketed when every
unit lies in a bucket of it, all with the same count: in a folder, every file sits under
<column>_bucket=<i> folders, i = 0 .. N-1 all present; in Iceberg, every data file's partition
spec has bucket[N](column) (an Iceberg file of null keys: NULL_BUCKET). The bucket of a key is
Iceberg's bucket transform
(recxla.data.buckets.bucket_of) either way, so folders and Iceberg tables join alike.

Iceberg: the snapshot is pinned when the table is opened (the current one, or the one asked
for, e.g. from a checkpoint: a snapshot that no longer exists is an error naming it), so
appends made while a job runs or before it resumes are not read. Data files are read with
pyarrow straight from the table's FileIO, their columns matched to the snapshot's schema by
Iceberg field id (a renamed column keeps its data; a column added later reads as nulls). The
snapshot's schema, as pyiceberg's scan of a given snapshot, not the table's current one: what
a snapshot reads never changes, so a resumed job reads the columns its first start read; a
rename is seen from the next snapshot (the next write) on.
Merge-on-read deletes are not applied by this reader: a snapshot with delete files is refused
(compact the table first), never read as if the deleted rows were there.
"""

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import os
import re
from typing import Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from recxla.data.buckets import parse_bucket_folder
from recxla.data.errors import DataFormatError

OP = "recxla.data.open_table"
ICEBERG_PREFIX = "iceberg:"
# The bucket of an Iceberg data file whose bucket partition value is null (rows whose key is
# null): it joins no feature row, and sorts before every bucket.
NULL_BUCKET = -1
_SNAPSHOT = re.compile(r"^(?P<table>.+)@(?P<snapshot>\d+)$")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One row group of one data file: the unit of reading, sharding and shuffling.

    file: index into TableSource.files. row_group: the row group in that file. rows: its rows.
    bucket: (column, bucket index) for each bucketed column of the table."""

    file: int
    row_group: int
    rows: int
    bucket: Tuple[Tuple[str, int], ...] = ()

    def bucket_of(self, column: str) -> int:
        return dict(self.bucket).get(column, 0)


class TableSource:
    """A table opened for reading (see the module doc): files, units, schema, buckets.

    Attributes:
        ref: the reference it was opened with (without a snapshot suffix).
        kind: "parquet" or "iceberg".
        files: the data files (paths or URIs), in reading order.
        units: every row group of every file, in file order.
        schema: the table's columns (Arrow); every read returns them, in this order.
        buckets: {column: number of buckets} of the bucketed columns.
        snapshot: the pinned Iceberg snapshot id, None for Parquet.
        fingerprint: changes when the data read changes (Parquet: file names, sizes and
            modification times; Iceberg: the table and snapshot).
    Reading is by unit (`read`) or by bucket (`read_bucket`). Picklable: open files are not
    carried to worker processes; each process opens its own.
    """

    def __init__(self, ref: str, kind: str, files: List[str], units: List[Unit],
                 schema: pa.Schema, buckets: Dict[str, int], snapshot: Optional[int],
                 fingerprint: str, field_names: Optional[Dict[int, str]] = None, io=None):
        self.ref, self.kind, self.files, self.units = ref, kind, files, units
        self.schema, self.buckets, self.snapshot = schema, buckets, snapshot
        self.fingerprint = fingerprint
        self._field_names = field_names  # Iceberg: field id -> column name in the snapshot
        self._io = io
        self._open: Dict[int, pq.ParquetFile] = {}
        self._pid = os.getpid()

    @property
    def num_rows(self) -> int:
        return sum(u.rows for u in self.units)

    def where(self, unit: int) -> str:
        """The unit's file and row group, for messages."""
        u = self.units[unit]
        return f"{self.files[u.file]} row group {u.row_group}"

    def _file(self, fi: int) -> pq.ParquetFile:
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        if fi not in self._open:
            self._open[fi] = _open_parquet(self.files[fi], self._io)
        return self._open[fi]

    def read(self, unit: int) -> pa.Table:
        """The rows of one unit, with the table's columns. DataFormatError naming the file and
        row group if it cannot be read."""
        u = self.units[unit]
        try:
            t = self._file(u.file).read_row_group(u.row_group)
        except FileNotFoundError:
            raise FileNotFoundError(f"{OP}: {self.ref}: {self.files[u.file]}: no such file "
                                    "(removed while reading?)") from None
        except (OSError, pa.ArrowException) as e:
            raise DataFormatError(f"{OP}: {self.ref}: {self.where(unit)}: unreadable "
                                  f"({e})") from e
        if t.num_rows != u.rows:
            raise DataFormatError(f"{OP}: {self.ref}: {self.where(unit)} holds {t.num_rows} "
                                  f"rows, its footer said {u.rows}")
        return self._as_schema(t, unit)

    def _as_schema(self, t: pa.Table, unit: int) -> pa.Table:
        if self._field_names is not None:
            t = _by_field_id(t, self._field_names)
        arrays = []
        for f in self.schema:
            if f.name in t.column_names:
                col = t.column(f.name)
                if not col.type.equals(f.type):
                    try:
                        col = col.cast(f.type)
                    except (pa.ArrowException, ValueError) as e:
                        raise DataFormatError(
                            f"{OP}: {self.ref}: {self.where(unit)}: column {f.name!r} holds "
                            f"{col.type}, the table's schema says {f.type} ({e})") from e
                arrays.append(col)
            elif self.kind == "iceberg":  # a column added after this file was written
                arrays.append(pa.nulls(t.num_rows, f.type))
            else:
                raise DataFormatError(f"{OP}: {self.ref}: {self.files[self.units[unit].file]}"
                                      f": column {f.name!r} is missing (the first file has it)")
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def units_in_bucket(self, column: str, bucket: int) -> List[int]:
        """The units in bucket `bucket` of `column` (all units when the column is not
        bucketed and bucket is 0)."""
        if column not in self.buckets:
            return list(range(len(self.units))) if bucket == 0 else []
        return [i for i, u in enumerate(self.units) if u.bucket_of(column) == bucket]

    def read_bucket(self, column: str, bucket: int) -> pa.Table:
        """Every row of one bucket of `column` (the whole table when it is not bucketed)."""
        units = self.units_in_bucket(column, bucket)
        if not units:
            return self.schema.empty_table()
        return pa.concat_tables([self.read(i) for i in units])

    def clone(self) -> "TableSource":
        """The same table with files of its own: a ParquetFile is not safe to read from two
        threads at once, so every reader (a prefetch thread, an evaluation) gets a clone."""
        other = copy.copy(self)
        other._open, other._pid = {}, os.getpid()
        return other

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"] = {}
        return state


def open_table(ref: str, snapshot: Optional[int] = None, what: str = "table") -> TableSource:
    """Open the table `ref` names (module doc); `snapshot` pins an Iceberg snapshot (it wins
    over an "@<id>" in the reference). FileNotFoundError for a missing path, ValueError or
    DataFormatError naming `what` and the table for anything else."""
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"{OP}: {what} must be a path or an iceberg: reference, got {ref!r}")
    if ref.startswith(ICEBERG_PREFIX):
        return _open_iceberg(ref, snapshot, what)
    if snapshot is not None:
        raise ValueError(f"{OP}: {what} {ref}: a snapshot applies to Iceberg tables only")
    return _open_parquet_table(ref, what)


def is_table_ref(ref: str) -> bool:
    """Whether `ref` names an Iceberg table (a path may name either a converted dataset or a
    raw Parquet table)."""
    return isinstance(ref, str) and ref.startswith(ICEBERG_PREFIX)


def _open_parquet(path: str, io) -> pq.ParquetFile:
    if io is None:
        return pq.ParquetFile(path)
    return pq.ParquetFile(io.new_input(path).open())


# ---------------------------------------------------------------------------------------------
# Parquet files and folders.

def _walk(folder: str, what: str) -> List[Tuple[str, Tuple[Tuple[str, int], ...]]]:
    """(file, its buckets) of a folder: *.parquet directly in it, or bucket folders (nested)
    holding them; not both."""
    names = sorted(os.listdir(folder))
    files = [n for n in names if n.endswith(".parquet") and
             os.path.isfile(os.path.join(folder, n))]
    dirs = [n for n in names if os.path.isdir(os.path.join(folder, n)) and
            parse_bucket_folder(n) is not None]
    if files and dirs:
        raise DataFormatError(f"{OP}: {what} {folder}: holds both Parquet files "
                              f"({files[0]}, ...) and bucket folders ({dirs[0]}, ...): a table "
                              "is one or the other")
    if files:
        return [(os.path.join(folder, n), ()) for n in files]
    out = []
    for d in dirs:
        column, index = parse_bucket_folder(d)
        for path, inner in _walk(os.path.join(folder, d), what):
            out.append((path, ((column, index),) + inner))
    return out


def _bucket_counts(found: List[Tuple[str, Tuple[Tuple[str, int], ...]]], ref: str,
                   what: str) -> Dict[str, int]:
    """{column: N} for the columns every file is bucketed by; DataFormatError if a column's
    bucket folders are not 0 .. N-1 or only some files lie in one."""
    seen: Dict[str, set] = {}
    for _, buckets in found:
        for column, i in buckets:
            seen.setdefault(column, set()).add(i)
    out = {}
    for column, indices in seen.items():
        n = max(indices) + 1
        missing = sorted(set(range(n)) - indices)
        if missing:
            raise DataFormatError(f"{OP}: {what} {ref}: bucket folder(s) {column}_bucket="
                                  f"{missing[0]} missing of {n} (0 .. {n - 1}); a bucket with "
                                  "no rows still needs its folder")
        if any(column not in dict(b) for _, b in found):
            raise DataFormatError(f"{OP}: {what} {ref}: only some files lie in "
                                  f"{column}_bucket= folders")
        out[column] = n
    return out


def _open_parquet_table(ref: str, what: str) -> TableSource:
    if os.path.isfile(ref):
        found = [(ref, ())]
    elif os.path.isdir(ref):
        found = _walk(ref, what)
        if not found:
            raise DataFormatError(f"{OP}: {what} {ref}: the folder holds no .parquet files")
    else:
        raise FileNotFoundError(f"{OP}: {what} {ref}: no such file or folder")
    buckets = _bucket_counts(found, ref, what)
    files, units, schema, ident = [], [], None, []
    for fi, (path, b) in enumerate(found):
        try:
            md = pq.read_metadata(path)
        except (OSError, pa.ArrowException) as e:
            raise DataFormatError(f"{OP}: {what} {ref}: {path}: not a readable Parquet file "
                                  f"({e})") from e
        file_schema = md.schema.to_arrow_schema().remove_metadata()
        if schema is None:
            schema = file_schema
        else:
            _check_same_schema(schema, file_schema, path, found[0][0], what)
        files.append(path)
        for gi in range(md.num_row_groups):
            units.append(Unit(fi, gi, md.row_group(gi).num_rows, b))
        st = os.stat(path)
        ident.append((os.path.relpath(path, ref) if path != ref else os.path.basename(path),
                      st.st_size, st.st_mtime_ns))
    fingerprint = hashlib.sha1(repr(ident).encode()).hexdigest()[:16]
    return TableSource(ref, "parquet", files, units, schema, buckets, None, fingerprint)


def _check_same_schema(first: pa.Schema, other: pa.Schema, path: str, first_path: str,
                       what: str) -> None:
    for f in first:
        i = other.get_field_index(f.name)
        if i < 0:
            raise DataFormatError(f"{OP}: {what}: {path}: column {f.name!r} is not in the file "
                                  f"({first_path} has it)")
        if not other.field(i).type.equals(f.type):
            raise DataFormatError(f"{OP}: {what}: {path}: column {f.name!r} holds "
                                  f"{other.field(i).type}, {first_path}'s holds {f.type}")


# ---------------------------------------------------------------------------------------------
# Iceberg.

def _import_pyiceberg():
    try:
        importlib.import_module("pyiceberg")
    except ImportError as e:
        raise ImportError(f"{OP}: Iceberg tables need pyiceberg: pip install 'recxla[iceberg]' "
                          f"({e})") from e


def load_catalog(uri: str):
    """A pyiceberg catalog: "sqlite:///PATH[?catalog=NAME]" (SQL catalog; warehouse folder
    PATH's folder/warehouse), "http(s)://..." (REST), else a catalog named in pyiceberg's
    configuration. Its tables' metadata may not name code to run (`_refuse_table_code`).

    pyiceberg's SQL catalog keeps the tables of every catalog name in one database and shows
    a catalog only its own: the name is the one the database holds (its only one; "default"
    for a new database), or `?catalog=NAME` when it holds several."""
    _import_pyiceberg()
    if uri.startswith("sqlite:"):
        from pyiceberg.catalog.sql import SqlCatalog

        uri, _, query = uri.partition("?catalog=")
        db = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if not db or not os.path.isfile(db):
            raise FileNotFoundError(f"{OP}: Iceberg catalog {uri}: no such SQLite database")
        name = query or _sqlite_catalog_name(db, uri)
        warehouse = "file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "warehouse")
        return _refuse_table_code(SqlCatalog(name, uri=uri, warehouse=warehouse))
    if uri.startswith(("http://", "https://")):
        from pyiceberg.catalog.rest import RestCatalog

        return _refuse_table_code(RestCatalog("recxla", uri=uri))
    from pyiceberg.catalog import load_catalog as by_name

    return _refuse_table_code(by_name(uri))


# pyiceberg imports and instantiates the class a table's metadata names under this property.
PY_IO_IMPL = "py-io-impl"


def _refuse_table_code(catalog):
    """`catalog`, refusing a table whose metadata names a FileIO class (pyiceberg's
    `py-io-impl`), which pyiceberg would import and run in every rank: a table is data, and
    anyone who can write one must not thereby run code in the job. A class named in the
    catalog's own configuration (the user's) stays allowed."""
    load = catalog._load_file_io
    own = catalog.properties.get(PY_IO_IMPL)

    def load_file_io(properties=None, location=None):
        named = (properties or {}).get(PY_IO_IMPL)
        if named is not None and named != own:
            raise DataFormatError(
                f"{OP}: Iceberg table at {location}: its metadata names a Python class to load "
                f"({PY_IO_IMPL} = {named!r}); recxla runs no code that a table names. Remove "
                f"the table property, or set {PY_IO_IMPL} in the catalog's own configuration")
        return load(properties or {}, location)

    catalog._load_file_io = load_file_io
    return catalog


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _sqlite_catalog_name(db: str, uri: str) -> str:
    """The one catalog name a pyiceberg SQL catalog database holds ("default" if none)."""
    import sqlite3

    names = set()
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        for table in ("iceberg_tables", "iceberg_namespace_properties"):
            try:
                names.update(r[0] for r in conn.execute(
                    f"SELECT DISTINCT catalog_name FROM {table}"))
            except sqlite3.OperationalError:  # not created yet: no table of that kind
                pass
    if len(names) > 1:
        raise ValueError(f"{OP}: Iceberg catalog {uri}: the database holds the catalogs "
                         f"{sorted(names)}: name one, {uri}?catalog=NAME")
    return names.pop() if names else "default"


def split_iceberg_ref(ref: str, what: str = "table") -> Tuple[str, str, Optional[int]]:
    """(catalog uri, table identifier, snapshot or None) of an "iceberg:" reference."""
    body = ref[len(ICEBERG_PREFIX):]
    if "#" not in body:
        raise ValueError(f"{OP}: {what} {ref}: an Iceberg reference is iceberg:<catalog>#"
                         "<namespace>.<table>[@<snapshot id>], e.g. iceberg:sqlite:////data/"
                         "catalog.db#db.ratings")
    catalog, table = body.rsplit("#", 1)
    snapshot = None
    m = _SNAPSHOT.match(table)
    if m:
        table, snapshot = m.group("table"), int(m.group("snapshot"))
    if not catalog or "." not in table:
        raise ValueError(f"{OP}: {what} {ref}: name the catalog and the table as "
                         "iceberg:<catalog>#<namespace>.<table>")
    return catalog, table, snapshot


def _open_iceberg(ref: str, snapshot: Optional[int], what: str) -> TableSource:
    catalog_uri, name, in_ref = split_iceberg_ref(ref, what)
    snapshot = in_ref if snapshot is None else snapshot
    base_ref = f"{ICEBERG_PREFIX}{catalog_uri}#{name}"
    catalog = load_catalog(catalog_uri)
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.transforms import BucketTransform

    try:
        table = catalog.load_table(name)
    except NoSuchTableError:
        raise FileNotFoundError(f"{OP}: {what} {base_ref}: no such table in the catalog") from None
    except DataFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - pyiceberg's many errors of damaged metadata
        raise DataFormatError(f"{OP}: {what} {base_ref}: unreadable table metadata "
                              f"({type(e).__name__}: {_one_line(e)})") from None
    if snapshot is None:
        snap = table.current_snapshot()
        if snap is None:
            raise DataFormatError(f"{OP}: {what} {base_ref}: the table has no snapshot (no data "
                                  "was ever written)")
    else:
        snap = table.snapshot_by_id(snapshot)
        if snap is None:
            raise ValueError(f"{OP}: {what} {base_ref}: snapshot {snapshot} no longer exists "
                             "(expired or never made); the table's snapshots are "
                             f"{[s.snapshot_id for s in table.snapshots()][-5:]} (latest last)")
    schema = table.schemas()[snap.schema_id] if snap.schema_id is not None else table.schema()
    arrow = schema.as_arrow().remove_metadata()
    field_names = {f.field_id: f.name for f in schema.fields}
    try:
        tasks = list(table.scan(snapshot_id=snap.snapshot_id).plan_files())
    except Exception as e:  # noqa: BLE001 - a damaged manifest list or manifest
        raise DataFormatError(
            f"{OP}: {what} {base_ref}: snapshot {snap.snapshot_id}: unreadable manifests "
            f"({type(e).__name__}: {_one_line(e)})") from None
    specs = table.specs()
    files, units, per_file = [], [], []
    for task in tasks:
        if task.delete_files:
            raise DataFormatError(f"{OP}: {what} {base_ref}: snapshot {snap.snapshot_id} has "
                                  f"delete files for {task.file.file_path}: merge-on-read "
                                  "deletes are not applied here; compact the table (rewrite its "
                                  "data files) first")
        spec = specs[task.file.spec_id]
        b = []
        for pos, field in enumerate(spec.fields):
            if isinstance(field.transform, BucketTransform):
                column = schema.find_column_name(field.source_id)
                value = task.file.partition[pos]
                b.append((column, field.transform.num_buckets,
                          NULL_BUCKET if value is None else int(value)))
        per_file.append(b)
        files.append(task.file.file_path)
    buckets = _iceberg_buckets(per_file, base_ref, what)
    for fi, path in enumerate(files):
        bucket = tuple((c, i) for c, _, i in per_file[fi] if c in buckets)
        md = _open_parquet(path, table.io).metadata
        for gi in range(md.num_row_groups):
            units.append(Unit(fi, gi, md.row_group(gi).num_rows, bucket))
    fingerprint = hashlib.sha1(f"{base_ref}@{snap.snapshot_id}".encode()).hexdigest()[:16]
    return TableSource(base_ref, "iceberg", files, units, arrow, buckets, snap.snapshot_id,
                       fingerprint, field_names, table.io)


def _iceberg_buckets(per_file: List[List[Tuple[str, int, int]]], ref: str, what: str
                     ) -> Dict[str, int]:
    """{column: N} for the columns every data file is bucketed by (partition evolution may
    leave some files unbucketed: then the column is not bucketed for the reader)."""
    if not per_file:
        return {}
    counts: Dict[str, set] = {}
    for b in per_file:
        for column, n, _ in b:
            counts.setdefault(column, set()).add(n)
    out = {}
    for column, ns in counts.items():
        if all(any(c == column for c, _, _ in b) for b in per_file):
            if len(ns) > 1:
                raise DataFormatError(f"{OP}: {what} {ref}: its data files are bucketed by "
                                      f"{column!r} into different counts {sorted(ns)} "
                                      "(partition evolution): rewrite the table with one")
            out[column] = ns.pop()
    return out


def _by_field_id(t: pa.Table, names: Dict[int, str]) -> pa.Table:
    """A data file's columns renamed to the snapshot's names by their Iceberg field ids
    (columns of fields the snapshot no longer has are dropped)."""
    cols, out_names = [], []
    for field, col in zip(t.schema, t.columns):
        meta = field.metadata or {}
        fid = meta.get(b"PARQUET:field_id")
        name = names.get(int(fid)) if fid is not None else field.name
        if name is not None:
            cols.append(col)
            out_names.append(name)
    return pa.Table.from_arrays(cols, names=out_names)
