"""`write_parquet`: batches -> Parquet files with CSR sparse columns, zstd, optional ID sort.

Sorting. Rows are sorted within each row group (never across), by the first id of one feature
(or by request id). What compresses is repetition: sorted by user id, the samples of a user sit
next to each other, so the user-side bags (the 55-id history above all) repeat row after row and
zstd stores each repeat as a short back-reference. Which key repeats the most bytes depends on
the data, so it is measured: `sort_by="auto"` writes the first row group once per candidate key
(every feature, and request_id) into memory and keeps the key of the smallest result.

Encodings, measured the same way on the first row group: every column is written once with a
dictionary and once without (PLAIN for ids, BYTE_STREAM_SPLIT for floats), and each column keeps
the smaller. Dictionary indices are bit-packed at widths that are not whole bytes, so a repeated
bag does not repeat byte for byte; sorted files therefore store bags PLAIN, unsorted ones mostly
with a dictionary. Pages carry CRC checksums, which the reader verifies.
"""

import json
import os
import uuid
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recxla.data.parquet_layout import (
    LAYOUT_KEY,
    STATS_KEY,
    Layout,
    dense_column,
    sparse_column,
    weights_column,
)

OP = "recxla.data.write_parquet"
COMPRESSIONS = ("zstd", "snappy", "lz4", "gzip", "brotli", "none")
AUTO = "auto"


def batch_to_table(batch, layout: Layout) -> pa.Table:
    """One Batch as an Arrow table of the layout's schema (rows = samples; values not copied
    where Arrow can take the numpy memory as is)."""
    kjt = batch.sparse
    b = kjt.stride()
    lengths = kjt.lengths().cpu().numpy()
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"{OP}: the KeyedJaggedTensor has negative lengths")
    values = kjt.values().cpu().numpy()
    if int(lengths.sum()) != values.size:
        raise ValueError(f"{OP}: lengths sum to {int(lengths.sum())}, values has {values.size}")
    weights = None if not layout.weighted else kjt.weights().cpu().numpy()
    ends = np.cumsum(lengths.reshape(len(layout.features), b), axis=1, dtype=np.int64)
    columns: Dict[str, pa.Array] = {}
    start = 0
    for i, f in enumerate(layout.features):
        offsets = np.zeros(b + 1, dtype=np.int32)
        offsets[1:] = ends[i]
        stop = start + int(offsets[-1])
        columns[sparse_column(f)] = pa.ListArray.from_arrays(offsets, values[start:stop])
        if weights is not None:
            columns[weights_column(f)] = pa.ListArray.from_arrays(offsets, weights[start:stop])
        start = stop
    dense = batch.dense.cpu().t().contiguous().numpy()
    for j in range(layout.num_dense):
        columns[dense_column(j)] = pa.array(dense[j])
    columns["label"] = pa.array(batch.labels.cpu().numpy())
    if layout.request_ids:
        columns["request_id"] = pa.array(batch.request_ids.cpu().numpy())
    schema = layout.arrow_schema()
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def sort_keys(layout: Layout) -> List[str]:
    """The keys a file can be sorted by: every feature (by its first id), and request_id."""
    return list(layout.features) + (["request_id"] if layout.request_ids else [])


def sort_order(table: pa.Table, key: str) -> np.ndarray:
    """Row order sorting `table` by `key`: a feature's first id (empty bags first) or
    request_id; stable, so ties keep their order. int64 [rows]."""
    if key == "request_id":
        k = table.column("request_id").to_numpy()
    else:
        col = table.column(sparse_column(key)).combine_chunks()
        offsets = col.offsets.to_numpy()
        values = col.flatten().to_numpy()
        if not values.size:  # every bag empty (a row group of a sparse feature's nulls)
            return np.arange(table.num_rows)
        first = values[np.minimum(offsets[:-1] - offsets[0], values.size - 1)]
        k = np.where(np.diff(offsets) > 0, first, np.iinfo(np.int64).min)
    return np.argsort(k, kind="stable")


def _leaf_path(field: pa.Field) -> str:
    """The Parquet column path of a top-level field (lists have one leaf: name.list.element)."""
    return f"{field.name}.list.element" if pa.types.is_list(field.type) else field.name


def _is_float(field: pa.Field) -> bool:
    t = field.type.value_type if pa.types.is_list(field.type) else field.type
    return pa.types.is_floating(t)


class Encoding:
    """Per-column Parquet encodings: `dictionary` leaf paths use a dictionary; the float ones
    that do not use BYTE_STREAM_SPLIT, the rest PLAIN."""

    def __init__(self, schema: pa.Schema, dictionary):
        self.dictionary = sorted(dictionary)
        self.byte_stream_split = sorted(
            _leaf_path(f) for f in schema if _is_float(f) and _leaf_path(f) not in dictionary
        )

    def writer_options(self, compression: str, level: Optional[int]) -> dict:
        return dict(
            compression=compression, compression_level=level,
            use_dictionary=self.dictionary or False,
            use_byte_stream_split=self.byte_stream_split or False, write_page_checksum=True,
        )  # fmt: skip


def _column_bytes(table: pa.Table, encoding: Encoding, compression, level) -> List[int]:
    """Compressed bytes of each column of `table` written as one row group."""
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema, **encoding.writer_options(compression, level)) as w:
        w.write_table(table, row_group_size=max(table.num_rows, 1))
    md = pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata.row_group(0)
    return [md.column(i).total_compressed_size for i in range(md.num_columns)]


def choose_encoding(table: pa.Table, compression, level) -> Tuple[Encoding, int]:
    """The encoding of each column that writes `table` smallest, and the bytes it takes."""
    paths = [_leaf_path(f) for f in table.schema]
    with_dict = _column_bytes(table, Encoding(table.schema, paths), compression, level)
    without = _column_bytes(table, Encoding(table.schema, []), compression, level)
    chosen = [p for p, d, n in zip(paths, with_dict, without) if d < n]
    return Encoding(table.schema, chosen), sum(map(min, with_dict, without))


def choose_sort(table: pa.Table, layout: Layout, sort_by, compression, level) -> dict:
    """The trial on the first row group: bytes for each candidate key (None = unsorted), the
    key kept (the given one, or for "auto" the smallest) and the encodings of both layouts."""
    candidates = [None] + (sort_keys(layout) if sort_by == AUTO else [sort_by] if sort_by else [])
    trial, encodings = {}, {}
    for key in candidates:
        t = table if key is None else table.take(pa.array(sort_order(table, key)))
        encodings[key], trial[str(key).lower()] = choose_encoding(t, compression, level)
    if sort_by == AUTO:
        sort_by = min(candidates, key=lambda k: trial[str(k).lower()])
    return {"sort_by": sort_by, "trial": {"rows": table.num_rows, "bytes": trial},
            "encoding": encodings[sort_by], "unsorted_encoding": encodings[None]}


class _FileSink:
    """One output file, written under a temporary name and renamed when complete; with
    `unsorted_encoding`, the same row groups unsorted go to a byte-counting sink too."""

    def __init__(self, final_path, layout, choice, compression, level, measure_unsorted):
        self.final_path = final_path
        self.tmp_path = f"{final_path}.{uuid.uuid4().hex[:8]}.tmp"
        self.layout, self.choice, self.rows = layout, choice, 0
        schema = layout.arrow_schema()
        options = choice["encoding"].writer_options(compression, level)
        self.writer = pq.ParquetWriter(self.tmp_path, schema, **options)
        self.mock = self.unsorted = None
        if measure_unsorted:
            self.mock = pa.MockOutputStream()
            opts = choice["unsorted_encoding"].writer_options(compression, level)
            self.unsorted = pq.ParquetWriter(self.mock, schema, **opts)
        self.min_ids: Dict[str, Optional[int]] = {f: None for f in layout.features}
        self.max_ids: Dict[str, Optional[int]] = {f: None for f in layout.features}

    def write(self, group: pa.Table) -> None:
        if self.unsorted is not None:
            self.unsorted.write_table(group, row_group_size=group.num_rows)
        key = self.choice["sort_by"]
        if key is not None:
            group = group.take(pa.array(sort_order(group, key)))
        self.writer.write_table(group, row_group_size=group.num_rows)
        self.rows += group.num_rows
        for f in self.layout.features:
            mm = pc.min_max(group.column(sparse_column(f)).combine_chunks().flatten())
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            if lo is not None:
                old_lo, old_hi = self.min_ids[f], self.max_ids[f]
                self.min_ids[f] = lo if old_lo is None else min(lo, old_lo)
                self.max_ids[f] = hi if old_hi is None else max(hi, old_hi)

    def close(self) -> None:
        unsorted_bytes = None
        if self.unsorted is not None:
            self.unsorted.close()
            unsorted_bytes = self.mock.size()
        report = {k: self.choice[k] for k in ("sort_by", "trial")}
        report["unsorted_bytes"] = unsorted_bytes
        stats = {"rows": self.rows, "min_ids": self.min_ids, "max_ids": self.max_ids,
                 "write": report}
        self.writer.add_key_value_metadata({STATS_KEY: json.dumps(stats)})
        self.writer.close()

    def abort(self) -> None:
        for w in (self.writer, self.unsorted):
            try:
                if w is not None:
                    w.close()
            except Exception:  # noqa: BLE001 - already failing; the caller re-raises the cause
                pass
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)


def _row_groups(batches: Iterable, rows_per_group: Optional[int]):
    """(layout, Arrow table of one row group) for the batches: one group per batch, or
    `rows_per_group` rows each (the last may be shorter)."""
    layout, pending, pending_rows = None, [], 0
    for i, batch in enumerate(batches):
        where = f"{OP}: batch {i}"
        got = Layout.of_batch(batch, where)
        if layout is None:
            layout = got
        else:
            layout.check_same(got, where)
        table = batch_to_table(batch, layout)
        if rows_per_group is None:
            if table.num_rows:
                yield layout, table
            continue
        pending.append(table)
        pending_rows += table.num_rows
        while pending_rows >= rows_per_group:
            whole = pa.concat_tables(pending)
            yield layout, whole.slice(0, rows_per_group)
            pending = [whole.slice(rows_per_group)]
            pending_rows -= rows_per_group
    if layout is None:
        raise ValueError(f"{OP}: no batches to write")
    if pending_rows:
        yield layout, pa.concat_tables(pending)


def _check_int(value, name, lo=1):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lo):
        raise ValueError(f"{OP}: {name} must be None or an int >= {lo}, got {value!r}")


def _written_by_recxla(path: str) -> bool:
    """The file is a Parquet file whose footer carries recxla's layout (write_parquet's)."""
    try:
        return LAYOUT_KEY in (pq.read_schema(path).metadata or {})
    except (OSError, pa.ArrowException):
        return False


def write_parquet(
    batches: Iterable,
    path: str,
    sort_by: Optional[str] = None,
    compression: str = "zstd",
    *,
    compression_level: Optional[int] = None,
    rows_per_group: Optional[int] = None,
    rows_per_file: Optional[int] = None,
    measure_unsorted: bool = False,
    overwrite: bool = False,
) -> str:
    """Write `recxla.data.Batch`es to a Parquet dataset; returns `path`.

    Args:
        batches: iterable of Batch (KJT with int32/int64 ids and lengths, optional float
            weights; dense float [B, D]; labels float [B]; optional int64 request_ids [B]), all
            with the same features, dense width and dtypes.
        path: "<name>.parquet" writes one file; any other path is a folder of
            part-00000.parquet, part-00001.parquet, ... (created if missing).
        sort_by: None (rows as given), a feature name (sort by its first id), "request_id",
            or "auto" (the key that writes the first row group smallest, see the module doc).
        compression: "zstd" (default), "snappy", "lz4", "gzip", "brotli" or "none".
        compression_level: the codec's level (None: Arrow's default, 1 for zstd).
        rows_per_group: rows of a row group, the unit of sorting, sharding and shuffling
            (None: one row group per batch).
        rows_per_file: start a new file once a file holds this many rows (folders only;
            None: one file).
        measure_unsorted: also write every row group unsorted to a byte counter, so that
            `recxla.data.ParquetDataset(path).metadata["unsorted_bytes"]` reports the size of
            the unsorted layout next to the file's (costs a second compression of the data).
        overwrite: replace existing .parquet files at `path` (else FileExistsError), each one
            written by recxla (its layout footer; anything else at `path` is a FileExistsError
            naming it). Old files are removed only once the new ones are complete.
    Raises:
        TypeError/ValueError for bad arguments or batches that differ in layout (naming the
        batch); nothing is left at `path` when writing fails.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{OP}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if compression not in COMPRESSIONS:
        raise ValueError(f"{OP}: compression must be one of {COMPRESSIONS}, got {compression!r}")
    if sort_by is not None and not isinstance(sort_by, str):
        raise TypeError(f"{OP}: sort_by must be None or a str, got {type(sort_by).__name__}")
    _check_int(rows_per_group, "rows_per_group")
    _check_int(rows_per_file, "rows_per_file")
    single = path.endswith(".parquet")
    if single and rows_per_file is not None:
        raise ValueError(f"{OP}: rows_per_file needs a folder path, got the file {path}")
    if single:
        old = [path] if os.path.exists(path) else []
    else:
        os.makedirs(path, exist_ok=True)
        old = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".parquet")]
    if old and not overwrite:
        raise FileExistsError(f"{OP}: {path} already holds {len(old)} .parquet file(s); pass "
                              "overwrite=True to replace them")
    # A tool never deletes what it did not write: only files with recxla's layout footer go.
    foreign = [f for f in old if not _written_by_recxla(f)]
    if foreign:
        raise FileExistsError(
            f"{OP}: {path}: {', '.join(sorted(foreign))} {'is' if len(foreign) == 1 else 'are'} "
            "not recxla's (no recxla.data.layout footer); overwrite replaces only files recxla "
            "wrote: move them away or write elsewhere")
    if compression == "none":
        compression, compression_level = "NONE", None

    sinks: List[_FileSink] = []
    choice = None
    try:
        for layout, group in _row_groups(batches, rows_per_group):
            if choice is None:
                if sort_by is not None and sort_by != AUTO and sort_by not in sort_keys(layout):
                    raise ValueError(f"{OP}: sort_by must be None, 'auto' or one of "
                                     f"{sort_keys(layout)}, got {sort_by!r}")
                choice = choose_sort(group, layout, sort_by, compression, compression_level)
            sink = sinks[-1] if sinks else None
            if sink is None or (rows_per_file and sink.rows + group.num_rows > rows_per_file
                                and sink.rows):
                if sink is not None:
                    sink.close()
                final = path if single else os.path.join(path, f"part-{len(sinks):05d}.parquet")
                sinks.append(_FileSink(final, layout, choice, compression, compression_level,
                                       measure_unsorted))
            sinks[-1].write(group)
        sinks[-1].close()
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    finals = {s.final_path for s in sinks}
    for f in old:
        if f not in finals:
            os.remove(f)
    for s in sinks:
        os.replace(s.tmp_path, s.final_path)
    return path
