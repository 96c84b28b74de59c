"""The Parquet layout of recxla.data: the columns of a file, its metadata, and how a dataset (one
file or a folder of them) is opened, checked and described.

Columns, one row per sample (B rows make a batch):
    sparse:<feature>   list<int64>    the sample's ids of that feature. Arrow reads a list column
                                      as CSR: int32 offsets [rows + 1] and one flat values buffer,
                                      which is what a KeyedJaggedTensor holds (lengths + values).
    weights:<feature>  list<float32>  per-id weights, only in files of weighted batches
    dense:<j>          float32        dense feature j < num_dense: a column each, since columns
                                      of one feature compress better than interleaved rows
    label              float32
    request_id         int64          only when the batches carry request ids
    timestamp          int64          only in converted datasets whose source has a timestamp
                                      column (see recxla.data.convert); not part of a Batch
Value dtypes follow the batches written (int32 or int64 ids, int32 or int64 lengths, float32 or
float64 floats), so that a read returns exactly what was written.

Metadata (Parquet key-value pairs): "recxla.data.layout" (JSON, written with the schema: the
features, dense width and dtypes above) and "recxla.data.stats" (JSON, written when the file is
complete: rows, the smallest and largest id of every feature, the sort key and the trial that
chose it). Converted datasets also carry "recxla.data.spec" (JSON: feature and table names,
rows, pooling, id mapping; see recxla.data.schema). The writer renames a file into place only
once it is complete, so a file without stats was not written by `write_parquet` or was cut
short.
"""

import dataclasses
import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recxla.data.errors import DataFormatError

LAYOUT_KEY = b"recxla.data.layout"
STATS_KEY = b"recxla.data.stats"
SPEC_KEY = b"recxla.data.spec"
FORMAT_NAME = "recxla.data.parquet"
FORMAT_VERSION = 1

# dtype name -> (torch dtype, Arrow type); the names are what the layout metadata stores.
DTYPES = {
    "int32": (torch.int32, pa.int32()),
    "int64": (torch.int64, pa.int64()),
    "float32": (torch.float32, pa.float32()),
    "float64": (torch.float64, pa.float64()),
}
_NAME_OF = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}
_ALLOWED = {
    "values": ("int32", "int64"),
    "lengths": ("int32", "int64"),
    "weights": ("float32", "float64"),
    "dense": ("float32", "float64"),
    "labels": ("float32", "float64"),
    "request_ids": ("int64",),
}


def sparse_column(feature: str) -> str:
    return f"sparse:{feature}"


def weights_column(feature: str) -> str:
    return f"weights:{feature}"


def dense_column(j: int) -> str:
    return f"dense:{j}"


def _dtype_name(tensor: torch.Tensor, part: str, where: str) -> str:
    name = _NAME_OF.get(tensor.dtype)
    if name not in _ALLOWED[part]:
        raise ValueError(f"{where}: {part} must have dtype {' or '.join(_ALLOWED[part])}, "
                         f"got {tensor.dtype}")
    return name


def check_batch(batch, where: str) -> None:
    """TypeError/ValueError unless `batch` is a Batch of one batch size B throughout."""
    from recxla.data.synthetic import Batch  # synthetic imports torchrec: import on use

    if not isinstance(batch, Batch):
        raise TypeError(f"{where}: expected a recxla.data.Batch, got {type(batch).__name__}")
    kjt = batch.sparse
    if kjt.variable_stride_per_key():
        raise ValueError(f"{where}: KeyedJaggedTensors with a batch size per feature "
                         "(variable stride) are not supported")
    b = kjt.stride()
    if batch.dense.dim() != 2 or batch.dense.shape[0] != b:
        raise ValueError(f"{where}: dense must be [B={b}, num_dense], got "
                         f"{tuple(batch.dense.shape)}")
    if tuple(batch.labels.shape) != (b,):
        raise ValueError(f"{where}: labels must be [B={b}], got {tuple(batch.labels.shape)}")
    rid = batch.request_ids
    if rid is not None and tuple(rid.shape) != (b,):
        raise ValueError(f"{where}: request_ids must be [B={b}], got {tuple(rid.shape)}")
    if kjt.lengths().numel() != len(kjt.keys()) * b:
        raise ValueError(f"{where}: lengths has {kjt.lengths().numel()} entries, expected "
                         f"keys x B = {len(kjt.keys()) * b}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What every row of a file holds: feature names, dense width, dtypes (names of DTYPES)."""

    features: Tuple[str, ...]
    num_dense: int
    weighted: bool
    request_ids: bool
    values_dtype: str = "int64"
    lengths_dtype: str = "int32"
    weights_dtype: str = "float32"
    dense_dtype: str = "float32"
    labels_dtype: str = "float32"
    timestamp: bool = False

    @staticmethod
    def of_batch(batch, where: str) -> "Layout":
        """The layout of a `recxla.data.Batch`; TypeError/ValueError if it cannot be stored."""
        check_batch(batch, where)
        kjt, rid = batch.sparse, batch.request_ids
        weights = kjt.weights_or_none()
        return Layout(
            features=tuple(kjt.keys()),
            num_dense=int(batch.dense.shape[1]),
            weighted=weights is not None,
            request_ids=rid is not None,
            values_dtype=_dtype_name(kjt.values(), "values", where),
            lengths_dtype=_dtype_name(kjt.lengths(), "lengths", where),
            weights_dtype="float32" if weights is None else _dtype_name(weights, "weights", where),
            dense_dtype=_dtype_name(batch.dense, "dense", where),
            labels_dtype=_dtype_name(batch.labels, "labels", where),
        )

    def check_same(self, other: "Layout", where: str) -> None:
        """ValueError naming the first field where `other` differs from this layout."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                raise ValueError(f"{where}: {field.name} is {theirs!r}, the first batch had "
                                 f"{mine!r}; every batch of a dataset must have the same layout")

    @property
    def dense_columns(self) -> List[str]:
        return [dense_column(j) for j in range(self.num_dense)]

    def arrow_schema(self) -> pa.Schema:
        ids = pa.list_(DTYPES[self.values_dtype][1])
        fields = [pa.field(sparse_column(f), ids) for f in self.features]
        if self.weighted:
            w = pa.list_(DTYPES[self.weights_dtype][1])
            fields += [pa.field(weights_column(f), w) for f in self.features]
        fields += [pa.field(c, DTYPES[self.dense_dtype][1]) for c in self.dense_columns]
        fields.append(pa.field("label", DTYPES[self.labels_dtype][1]))
        if self.request_ids:
            fields.append(pa.field("request_id", pa.int64()))
        if self.timestamp:
            fields.append(pa.field("timestamp", pa.int64()))
        return pa.schema(fields, metadata={LAYOUT_KEY: self.to_json()})

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["features"] = list(self.features)
        return json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, **d})

    @staticmethod
    def from_json(text: bytes, where: str) -> "Layout":
        try:
            d = json.loads(text)
            if d.pop("format") != FORMAT_NAME:
                raise ValueError("format name")
            version = d.pop("version")
            if version != FORMAT_VERSION:
                raise DataFormatError(f"{where}: layout version {version}; this recxla reads "
                                      f"version {FORMAT_VERSION}")
            layout = Layout(**{**d, "features": tuple(d["features"])})
        except DataFormatError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise DataFormatError(f"{where}: unreadable recxla.data layout metadata ({e})") from e
        for part, allowed in _ALLOWED.items():
            name = getattr(layout, f"{part}_dtype", None)
            if name is not None and name not in allowed:
                raise DataFormatError(f"{where}: layout gives {part} dtype {name!r}")
        return layout


@dataclasses.dataclass(frozen=True)
class FileInfo:
    path: str
    row_group_rows: Tuple[int, ...]
    stats: dict

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows)


# Row groups of a table recxla writes (a conversion, buckets): the unit the trainer's ranks
# share out and its held-out split takes whole.
TARGET_ROW_GROUPS = 64
MIN_ROW_GROUPS = 16
MIN_GROUP_ROWS = 1024  # the trainer's default --batch-size: a held-out group fills a batch
MAX_GROUP_ROWS = 65536


def default_rows_per_group(rows: int) -> int:
    """Rows per row group for a dataset of `rows` rows: TARGET_ROW_GROUPS groups of at least
    MIN_GROUP_ROWS rows and at most MAX_GROUP_ROWS; when that leaves fewer than MIN_ROW_GROUPS
    groups, smaller ones, so that any log of at least 16 rows has at least 16 groups."""
    per = -(-rows // TARGET_ROW_GROUPS)
    if per < MIN_GROUP_ROWS:
        per = min(MIN_GROUP_ROWS, max(1, rows // MIN_ROW_GROUPS))
    return max(1, min(per, MAX_GROUP_ROWS))


def list_files(path: str, op: str) -> List[str]:
    """The Parquet files of a dataset path: the file itself, or a folder's *.parquet by name."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{op}: {path}: no such file or folder")
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".parquet"))
    if not files:
        raise DataFormatError(f"{op}: {path}: the folder holds no .parquet files")
    return files


def is_recxla_layout(path: str) -> bool:
    """Whether `path` (a file or folder) holds Parquet files in recxla's layout (converted or
    written by recxla): its first .parquet file's footer names the layout. False for a folder
    without .parquet files directly in it (a bucketed raw table); FileNotFoundError if the path
    does not exist."""
    if os.path.isdir(path) and not any(n.endswith(".parquet") for n in os.listdir(path)):
        return False
    first = list_files(path, "recxla.data")[0]
    try:
        kv = pq.read_metadata(first).metadata or {}
    except (OSError, pa.ArrowException):
        return True  # unreadable: reported by the reader of the layout, naming the file
    return LAYOUT_KEY in kv


def open_file(path: str, where: str) -> pq.ParquetFile:
    """A ParquetFile that verifies page checksums; DataFormatError if the footer is unreadable."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: {path}: no such file") from None
    except (OSError, pa.ArrowException) as e:
        raise DataFormatError(f"{where}: {path}: not a readable Parquet file (truncated or "
                              f"corrupt?): {e}") from e


def _read_file_info(path: str, op: str) -> Tuple[Layout, FileInfo]:
    md = open_file(path, op).metadata
    kv = md.metadata or {}
    if LAYOUT_KEY not in kv:
        raise DataFormatError(f"{op}: {path}: no '{LAYOUT_KEY.decode()}' metadata: not written "
                              "by recxla.data.write_parquet")
    where = f"{op}: {path}"
    layout = Layout.from_json(kv[LAYOUT_KEY], where)
    if STATS_KEY not in kv:
        raise DataFormatError(f"{where}: no '{STATS_KEY.decode()}' metadata: the writer did not "
                              "finish this file")
    try:
        stats = json.loads(kv[STATS_KEY])
    except ValueError as e:
        raise DataFormatError(f"{where}: unreadable stats metadata ({e})") from e
    got = md.schema.to_arrow_schema().remove_metadata()
    want = layout.arrow_schema().remove_metadata()
    if not got.equals(want):
        missing = [f.name for f in want if got.get_field_index(f.name) < 0]
        other = [f"{f.name}: {got.field(f.name).type} (layout says {f.type})" for f in want
                 if got.get_field_index(f.name) >= 0 and not got.field(f.name).type.equals(f.type)]
        extra = [f.name for f in got if want.get_field_index(f.name) < 0]
        raise DataFormatError(f"{where}: columns do not match the layout metadata: missing "
                              f"{missing}, other types {other}, unexpected {extra}")
    rows = tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))
    if stats.get("rows") != sum(rows):
        raise DataFormatError(f"{where}: stats count {stats.get('rows')} rows, the row groups "
                              f"hold {sum(rows)}")
    return layout, FileInfo(path, rows, stats)


class DatasetInfo:
    """A dataset's files, layout and row groups, read from the footers only (no data).

    row_groups: (file index, row group index in that file, rows) for every row group, in file
    order: the unit of sharding and shuffling.
    """

    def __init__(self, path: str, op: str = "recxla.data.ParquetDataset"):
        self.path = path
        self.files: List[FileInfo] = []
        self.layout: Optional[Layout] = None
        for f in list_files(path, op):
            layout, info = _read_file_info(f, op)
            if self.layout is None:
                self.layout = layout
            elif layout != self.layout:
                try:
                    self.layout.check_same(layout, f"{op}: {f}")
                except ValueError as e:
                    raise DataFormatError(f"{e} (compared with {self.files[0].path})") from None
            self.files.append(info)
        self.row_groups: List[Tuple[int, int, int]] = [
            (fi, gi, rows) for fi, f in enumerate(self.files) for gi, rows in
            enumerate(f.row_group_rows)
        ]  # fmt: skip
        self.num_rows = sum(r for _, _, r in self.row_groups)
        ident = [(os.path.basename(f.path), f.row_group_rows) for f in self.files]
        self.fingerprint = hashlib.sha1(repr(ident).encode()).hexdigest()[:16]

    def id_range(self, feature: str) -> Tuple[Optional[int], Optional[int]]:
        """Smallest and largest id of `feature` over all files (None, None if it has no ids)."""
        lows = [f.stats["min_ids"][feature] for f in self.files]
        highs = [f.stats["max_ids"][feature] for f in self.files]
        lows, highs = [v for v in lows if v is not None], [v for v in highs if v is not None]
        return (min(lows) if lows else None), (max(highs) if highs else None)

    def check_tables(self, tables: Sequence, num_dense: Optional[int] = None) -> None:
        """DataFormatError unless every table's features are in the files with ids in [0, rows).

        tables: TorchRec EmbeddingBagConfig/EmbeddingConfig (anything with name, feature_names
        and num_embeddings). num_dense: the model's dense input width (None: not checked).
        """
        layout = self.layout
        where = f"recxla.data: {self.path}"
        if num_dense is not None and num_dense != layout.num_dense:
            raise DataFormatError(f"{where}: the files hold {layout.num_dense} dense features, "
                                  f"the model takes {num_dense}")
        for table in tables:
            for feature in table.feature_names:
                if feature not in layout.features:
                    raise DataFormatError(f"{where}: table {table.name} reads feature "
                                          f"{feature!r}, which the files do not hold (they hold "
                                          f"{list(layout.features)})")
                lo, hi = self.id_range(feature)
                if lo is not None and (lo < 0 or hi >= table.num_embeddings):
                    raise DataFormatError(
                        f"{where}: feature {feature!r} has ids in [{lo}, {hi}], table "
                        f"{table.name} has {table.num_embeddings} rows (ids must be in [0, "
                        f"{table.num_embeddings}))")

    def summary(self) -> Dict:
        """A JSON-able description: layout, rows, row groups, bytes, and the writer's report."""
        report = self.files[0].stats.get("write", {})
        on_disk = sum(os.path.getsize(f.path) for f in self.files)
        unsorted = [f.stats.get("write", {}).get("unsorted_bytes") for f in self.files]
        return {
            "path": self.path,
            "files": len(self.files),
            "rows": self.num_rows,
            "row_groups": len(self.row_groups),
            "bytes": on_disk,
            "unsorted_bytes": None if None in unsorted else sum(unsorted),
            "sort_by": report.get("sort_by"),
            "sort_trial": report.get("trial"),
            "layout": json.loads(self.layout.to_json()),
        }
