"""What a dataset is, for the model built on it: `DatasetSpec` (features, tables, dense width,
label, timestamp, id mapping), read from a dataset's metadata; and the schema file (TOML) that
tells `python -m recxla.data convert` what it cannot infer from the source's columns.

A converted dataset (recxla.data.convert) stores its DatasetSpec as JSON under the Parquet
key "recxla.data.spec" in every file; the ids in its `sparse:<feature>` columns are already
table rows, in [0, table.num_rows). A dataset written by `recxla.data.write_parquet` has no
spec: `read_dataset_spec` derives one from its layout and stats (one table per feature, rows =
largest id + 1, sum pooling, dense features dense_0 ...).

The schema file, every key optional (docs/your-data.md has the full description):

    label = "clicked"            # the label column (default: a column named "label")
    label_kind = "binary"        # "binary" (values 0/1) or "float"
    label_positive = ">50K"      # binary: the label's value that is 1, every other one 0
                                 # (a string label, or a class of an integer one)
    timestamp = "ts"             # an integer, date or timestamp column, kept as int64
                                 # "timestamp" (default: a column named "timestamp")
    dense = ["age", "price"]     # dense columns, in this order (default: the float columns)
    dense_log1p = ["price"]      # dense columns stored as log(x + 1), x < 0 and missing -> 0
    ignore = ["comment"]         # columns to leave out
    infer = true                 # false: columns named nowhere are left out, not inferred
    vocab_limit = 1000000        # default mapping: vocab up to this many distinct ids, else hash
    default_rows = 100000        # rows of a hash/modulo table that gives none
    [sparse.<feature>]           # a sparse feature
    column = "user_id"           #   its column (default: the feature's name)
    table = "users"              #   the table it reads (default: its own, "t_<feature>")
    weights = "w"                #   a float (or list<float>) column of per-id weights
    separator = "|"              #   a string column holding a bag: "3|17|4" (CSV lists)
    history_of = "item"          #   a user's history of the items of feature "item": one row
                                 #   per id, unpooled (--model history), in a table of its own
    rows, dim, pooling, mapping, min_count   # table keys, for a feature with its own table
    [tables.<name>]              # a table shared by the features that name it
    rows = 100000                #   rows (vocab: a cap; hash/modulo: the modulus)
    dim = 64                     #   embedding dim (default: the trainer's)
    pooling = "sum"              #   "sum" or "mean"
    mapping = "vocab"            #   "hash", "vocab" or "modulo"
    min_count = 1                #   vocab: ids seen fewer times share the out-of-vocabulary row
"""

import dataclasses
import json
import os
import tomllib
from typing import Dict, List, Optional, Tuple

from recxla.data.errors import DataFormatError

SPEC_FORMAT = "recxla.data.spec"
SPEC_VERSION = 1
POOLINGS = ("sum", "mean")
MAPPINGS = ("hash", "vocab", "modulo")
LABEL_KINDS = ("binary", "float")
DEFAULT_VOCAB_LIMIT = 1_000_000
# The trainer's default --max-rows and TorchRec's DLRM example's --num_embeddings.
DEFAULT_ROWS = 100_000
OP = "recxla.data.schema"


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table of the dataset.

    name: the table's name. features: the sparse features that read it (shared tables list
    several). num_rows: rows; every stored id of these features is in [0, num_rows).
    embedding_dim: the schema's dim, or None (the trainer's choice). pooling: "sum" or "mean".
    weighted: the features carry per-id weights (KeyedJaggedTensor weights).
    mapping: how raw ids became rows: "hash", "vocab", "modulo", or "given" (written by
    write_parquet: the ids are rows as they are). min_count: vocab only, the least count of an
    id with a row of its own. vocabulary: vocab only, the vocabulary file's path relative to
    the dataset folder (see recxla.data.id_mapping). id_type: "int" or "string", the raw
    ids' type (strings and integers hash differently).
    """

    name: str
    features: Tuple[str, ...]
    num_rows: int
    embedding_dim: Optional[int]
    pooling: str
    weighted: bool
    mapping: str = "given"
    min_count: int = 1
    vocabulary: Optional[str] = None
    id_type: str = "int"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Everything the model needs from a dataset.

    sparse_features: the KeyedJaggedTensor keys, in the order batches hold them.
    dense_features: names of the dense columns; the dense input is float32 [B, len(...)] in
    this order. label: the source's label column (stored as float32 "label"). tables: the
    embedding tables; every sparse feature is read by exactly one. timestamp: the source's
    timestamp column (stored as int64 "timestamp"), or None. label_kind: "binary" (0/1 labels:
    a click task) or "float" (regression targets). histories: (history feature, candidate
    feature) pairs: the history feature holds a user's history of the items the candidate
    feature names, read one row per id (an EmbeddingCollection: `--model history`), not pooled.
    """

    sparse_features: Tuple[str, ...]
    dense_features: Tuple[str, ...]
    label: str
    tables: Tuple[TableSpec, ...]
    timestamp: Optional[str]
    label_kind: str = "binary"
    histories: Tuple[Tuple[str, str], ...] = ()

    def table_of(self, feature: str) -> TableSpec:
        """The table that `feature` reads; KeyError naming the features if none does."""
        for t in self.tables:
            if feature in t.features:
                return t
        raise KeyError(f"{OP}: no table reads feature {feature!r}; the sparse features are "
                       f"{list(self.sparse_features)}")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps({"format": SPEC_FORMAT, "version": SPEC_VERSION, **d})

    @staticmethod
    def from_json(text, where: str) -> "DatasetSpec":
        try:
            d = json.loads(text)
            if d.pop("format") != SPEC_FORMAT or d.pop("version") != SPEC_VERSION:
                raise ValueError(f"not {SPEC_FORMAT} version {SPEC_VERSION}")
            tables = tuple(TableSpec(**{**t, "features": tuple(t["features"])})
                           for t in d.pop("tables"))
            spec = DatasetSpec(**{**d, "tables": tables,
                                  "sparse_features": tuple(d["sparse_features"]),
                                  "dense_features": tuple(d["dense_features"]),
                                  "histories": tuple(tuple(h) for h in d.get("histories", ()))})
        except (ValueError, KeyError, TypeError) as e:
            raise DataFormatError(f"{where}: unreadable dataset spec metadata ({e})") from e
        spec.check(where)
        return spec

    def check(self, where: str) -> None:
        """DataFormatError unless every feature has one table and every table is valid."""
        seen: Dict[str, str] = {}
        for t in self.tables:
            if t.pooling not in POOLINGS or t.num_rows < 1 or (
                    t.embedding_dim is not None and t.embedding_dim < 1):
                raise DataFormatError(f"{where}: table {t.name}: invalid pooling, rows or dim "
                                      f"({t.pooling!r}, {t.num_rows}, {t.embedding_dim})")
            for f in t.features:
                if f in seen:
                    raise DataFormatError(f"{where}: feature {f!r} is read by tables "
                                          f"{seen[f]} and {t.name}")
                seen[f] = t.name
        if set(seen) != set(self.sparse_features):
            raise DataFormatError(f"{where}: the tables read {sorted(seen)}, the sparse "
                                  f"features are {sorted(self.sparse_features)}")
        self._check_histories(where)

    def _check_histories(self, where: str) -> None:
        """A history feature and its candidate are two sparse features; the history reads a
        table of its own (TorchRec's EmbeddingCollection owns its tables: no pooled feature
        can read them), unweighted (an EmbeddingCollection takes no per-id weights)."""
        for history, candidate in self.histories:
            for name in (history, candidate):
                if name not in self.sparse_features:
                    raise DataFormatError(
                        f"{where}: history {history!r} (history_of = {candidate!r}): no sparse "
                        f"feature {name!r}; the sparse features are "
                        f"{list(self.sparse_features)}")
            if history == candidate:
                raise DataFormatError(f"{where}: feature {history!r} is its own history_of")
            table = self.table_of(history)
            problem = history_table_problem(history, table.name, table.features, table.weighted)
            if problem:
                raise DataFormatError(f"{where}: {problem}")
        names = [h for h, _ in self.histories]
        if len(set(names)) != len(names):
            raise DataFormatError(f"{where}: a feature is a history twice: {names}")


def history_table_problem(history: str, table: str, features: Tuple[str, ...],
                          weighted: bool) -> Optional[str]:
    """Why the table a history feature reads cannot hold a history, or None: its rows are read
    unpooled by an EmbeddingCollection, which owns its tables (no pooled feature may read
    them) and takes no per-id weights."""
    if tuple(features) == (history,) and not weighted:
        return None
    return (f"history {history!r} reads table {table} (features {list(features)}, weighted "
            f"{weighted}): a history needs an unweighted table of its own, its rows read "
            "unpooled by an EmbeddingCollection")


def read_dataset_spec(path) -> DatasetSpec:
    """The DatasetSpec of a dataset: a converted folder or file, or one written by
    `recxla.data.write_parquet` (spec derived from its layout and id stats).

    Raises FileNotFoundError, or DataFormatError naming the file: unreadable footers, files
    whose specs differ, or a spec that does not match the columns.
    """
    from recxla.data.parquet_layout import SPEC_KEY, DatasetInfo

    path = os.fspath(path)
    info = DatasetInfo(path, "recxla.data.read_dataset_spec")
    layout = info.layout
    specs = [_file_spec(f.path, SPEC_KEY) for f in info.files]
    if specs[0] is None:
        if any(s is not None for s in specs):
            raise DataFormatError(f"{OP}: {path}: some files carry a dataset spec, others not")
        return _derived_spec(info)
    for f, s in zip(info.files, specs):
        if s != specs[0]:
            raise DataFormatError(f"{OP}: {f.path}: its dataset spec differs from that of "
                                  f"{info.files[0].path}")
    spec = specs[0]
    where = f"{OP}: {info.files[0].path}"
    if tuple(layout.features) != spec.sparse_features or \
            layout.num_dense != len(spec.dense_features):
        raise DataFormatError(f"{where}: the spec names features {list(spec.sparse_features)} "
                              f"and {len(spec.dense_features)} dense, the columns hold "
                              f"{list(layout.features)} and {layout.num_dense}")
    if (spec.timestamp is not None) != layout.timestamp:
        raise DataFormatError(f"{where}: the spec and the columns disagree on a timestamp")
    return spec


def row_group_timestamps(path) -> List[Tuple[int, int, int, int]]:
    """(file index, row group index, smallest, largest timestamp) of every row group of a
    dataset with a timestamp column, in the order of DatasetInfo.row_groups (files by name),
    from the Parquet footers' column statistics (no data read): what a split by time needs.
    DataFormatError if the dataset has no timestamp column or a group lacks statistics."""
    import pyarrow.parquet as pq

    from recxla.data.parquet_layout import DatasetInfo

    info = DatasetInfo(os.fspath(path), "recxla.data.row_group_timestamps")
    if not info.layout.timestamp:
        raise DataFormatError(f"{OP}: {info.path}: the dataset has no timestamp column")
    out = []
    for fi, f in enumerate(info.files):
        md = pq.read_metadata(f.path)
        col = md.schema.to_arrow_schema().get_field_index("timestamp")
        for gi in range(md.num_row_groups):
            stats = md.row_group(gi).column(col).statistics
            if stats is None or not stats.has_min_max:
                raise DataFormatError(f"{OP}: {f.path}: row group {gi} has no timestamp "
                                      "statistics")
            out.append((fi, gi, int(stats.min), int(stats.max)))
    return out


def _file_spec(path: str, key: bytes) -> Optional[DatasetSpec]:
    import pyarrow.parquet as pq

    kv = pq.read_metadata(path).metadata or {}
    return None if key not in kv else DatasetSpec.from_json(kv[key], f"{OP}: {path}")


def _derived_spec(info) -> DatasetSpec:
    layout = info.layout
    tables = []
    for f in layout.features:
        _, hi = info.id_range(f)
        tables.append(TableSpec(name=f"t_{f}", features=(f,), num_rows=max(1, (hi or 0) + 1),
                                embedding_dim=None, pooling="sum", weighted=layout.weighted))
    return DatasetSpec(sparse_features=tuple(layout.features),
                       dense_features=tuple(f"dense_{j}" for j in range(layout.num_dense)),
                       label="label", tables=tuple(tables),
                       timestamp="timestamp" if layout.timestamp else None)


# ---------------------------------------------------------------------------------------------
# The schema file.

@dataclasses.dataclass(frozen=True)
class TableSchema:
    """A table's keys in the schema file (None: not given, the converter's default)."""

    rows: Optional[int] = None
    dim: Optional[int] = None
    pooling: str = "sum"
    mapping: Optional[str] = None
    min_count: int = 1


@dataclasses.dataclass(frozen=True)
class SparseSchema:
    """A sparse feature's keys: its column, its table's name (None: a table of its own), the
    column of its per-id weights (None: unweighted), the separator of ids in a string
    column that holds a bag (None: one id per row, or a list column), and for a user history
    the feature of the items it holds (None: a pooled feature)."""

    column: str
    table: Optional[str] = None
    weights: Optional[str] = None
    separator: Optional[str] = None
    history_of: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Schema:
    """A parsed schema file (see the module docstring); `Schema()` is "infer everything"."""

    label: Optional[str] = None
    label_kind: str = "binary"
    label_positive: Optional[object] = None  # str or int: the value stored as label 1
    timestamp: Optional[str] = None
    dense: Optional[Tuple[str, ...]] = None
    dense_log1p: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()
    infer: bool = True
    vocab_limit: int = DEFAULT_VOCAB_LIMIT
    default_rows: int = DEFAULT_ROWS
    sparse: Tuple[Tuple[str, SparseSchema], ...] = ()
    tables: Tuple[Tuple[str, TableSchema], ...] = ()

    def table(self, name: str) -> TableSchema:
        return dict(self.tables).get(name, TableSchema())

    def named_columns(self) -> set:
        """Every column the schema gives a role (label, timestamp, dense, sparse, weights)."""
        cols = {self.label, self.timestamp, *(self.dense or ()), *self.ignore}
        for _, s in self.sparse:
            cols.update((s.column, s.weights))
        return cols - {None}


_TOP = {"label", "label_kind", "label_positive", "timestamp", "dense", "dense_log1p", "ignore",
        "infer", "vocab_limit", "default_rows", "sparse", "tables"}
_TABLE_KEYS = {"rows", "dim", "pooling", "mapping", "min_count"}
_SPARSE_KEYS = {"column", "table", "weights", "separator", "history_of"}


def _get(d: dict, key: str, kind, where: str, default=None, lo=None):
    value = d.get(key, default)
    if value is default:
        return value
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{where}: {key} must be a {name}, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{where}: {key} must be >= {lo}, got {value}")
    return value


def _names(d: dict, key: str, where: str) -> Optional[Tuple[str, ...]]:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key} must be a list of column names, got {value!r}")
    return tuple(value)


def _table_schema(d: dict, where: str) -> TableSchema:
    t = TableSchema(rows=_get(d, "rows", int, where, lo=1), dim=_get(d, "dim", int, where, lo=1),
                    pooling=_get(d, "pooling", str, where, "sum"),
                    mapping=_get(d, "mapping", str, where),
                    min_count=_get(d, "min_count", int, where, 1, lo=1))
    if t.pooling not in POOLINGS:
        raise ValueError(f"{where}: pooling must be one of {POOLINGS}, got {t.pooling!r}")
    if t.mapping is not None and t.mapping not in MAPPINGS:
        raise ValueError(f"{where}: mapping must be one of {MAPPINGS}, got {t.mapping!r}")
    return t


def parse_schema(d: dict, where: str) -> Schema:
    """A Schema from the TOML file's parsed dict; ValueError naming `where` and the key."""
    unknown = set(d) - _TOP
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; the keys are "
                         f"{sorted(_TOP)}")
    tables: Dict[str, TableSchema] = {}
    raw_tables = _get(d, "tables", dict, where, {})
    for name, td in raw_tables.items():
        w = f"{where}: [tables.{name}]"
        if not isinstance(td, dict) or set(td) - _TABLE_KEYS:
            raise ValueError(f"{w}: the keys of a table are {sorted(_TABLE_KEYS)}, got "
                             f"{td!r}")
        tables[name] = _table_schema(td, w)
    sparse = []
    for feature, sd in _get(d, "sparse", dict, where, {}).items():
        w = f"{where}: [sparse.{feature}]"
        if not isinstance(sd, dict) or set(sd) - _SPARSE_KEYS - _TABLE_KEYS:
            raise ValueError(f"{w}: the keys of a sparse feature are "
                             f"{sorted(_SPARSE_KEYS | _TABLE_KEYS)}, got {sd!r}")
        s = SparseSchema(column=_get(sd, "column", str, w, feature),
                         table=_get(sd, "table", str, w), weights=_get(sd, "weights", str, w),
                         separator=_get(sd, "separator", str, w),
                         history_of=_get(sd, "history_of", str, w))
        if s.separator == "":
            raise ValueError(f"{w}: separator must not be empty")
        own = {k: v for k, v in sd.items() if k in _TABLE_KEYS}
        if s.table is not None:
            if s.table not in tables:
                raise ValueError(f"{w}: table {s.table!r} has no [tables.{s.table}] section")
            if own:
                raise ValueError(f"{w}: {sorted(own)} belong in [tables.{s.table}], the table "
                                 "this feature shares")
        else:
            name = f"t_{feature}"
            if name in tables:
                raise ValueError(f"{w}: a [tables.{name}] section exists; name it with "
                                 f"table = {name!r}")
            tables[name] = _table_schema(own, w)
            s = dataclasses.replace(s, table=name)
        sparse.append((feature, s))
    schema = Schema(
        label=_get(d, "label", str, where), label_kind=_get(d, "label_kind", str, where, "binary"),
        label_positive=_get(d, "label_positive", (str, int), where),
        timestamp=_get(d, "timestamp", str, where), dense=_names(d, "dense", where),
        dense_log1p=_names(d, "dense_log1p", where) or (), ignore=_names(d, "ignore", where) or (),
        infer=_get(d, "infer", bool, where, True),
        vocab_limit=_get(d, "vocab_limit", int, where, DEFAULT_VOCAB_LIMIT, lo=1),
        default_rows=_get(d, "default_rows", int, where, DEFAULT_ROWS, lo=1),
        sparse=tuple(sparse), tables=tuple(tables.items()))
    if schema.label_kind not in LABEL_KINDS:
        raise ValueError(f"{where}: label_kind must be one of {LABEL_KINDS}, got "
                         f"{schema.label_kind!r}")
    if schema.label_positive is not None and schema.label_kind != "binary":
        raise ValueError(f"{where}: label_positive makes a binary label; label_kind is "
                         f"{schema.label_kind!r}")
    unused = set(raw_tables) - {s.table for _, s in sparse}
    if unused:
        raise ValueError(f"{where}: no sparse feature reads table(s) {sorted(unused)}")
    return schema


def load_schema(toml_path) -> Schema:
    """Parse and check a schema file (TOML). FileNotFoundError, or ValueError naming the file
    and the key (a TOML syntax error names the line)."""
    path = os.fspath(toml_path)
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{OP}: schema file {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{OP}: schema file {path}: not valid TOML: {e}") from None
    return parse_schema(d, f"{OP}: schema file {path}")
