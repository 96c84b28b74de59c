"""Reading for `ParquetDataset`: row groups -> `recxla.data.Batch`es, straight from Arrow
buffers, in the order an `EpochPlan` (recxla.data.epoch_plan) gives.

A run of the plan is one shuffle window: its row groups are read with pyarrow (decompression and
decoding in C++), put in the window's random order by one Arrow `take`, and cut into pieces at
batch boundaries; every piece becomes a Batch by whole-array operations on the list columns'
offsets and values buffers (lengths = diff(offsets)), no Python code per row. A batch that
straddles two windows arrives as two pieces (more when windows are smaller than a batch), which
`whole_batches` joins: each window is read once, by one reader, whichever process reads it.
"""

import os
from typing import Dict, Iterable, Iterator, List, Tuple

import numpy as np
import pyarrow as pa
import torch

from recxla.data.epoch_plan import EpochPlan
from recxla.data.errors import DataFormatError
from recxla.data.parquet_layout import (
    DTYPES,
    DatasetInfo,
    Layout,
    dense_column,
    open_file,
    sparse_column,
    weights_column,
)

OP = "recxla.data.ParquetDataset"


def _numpy_dtype(name: str):
    return torch.empty(0, dtype=DTYPES[name][0]).numpy().dtype


def _writable(a: np.ndarray) -> np.ndarray:
    """Arrow hands out read-only views of its buffers; torch wants memory it may write."""
    return a if a.flags.writeable else a.copy()


def table_to_batch(table: pa.Table, layout: Layout, where: str):
    """An Arrow table of the layout's schema (any chunking) -> Batch of table.num_rows samples.

    DataFormatError (naming `where`) for nulls, or weights whose bags differ from the ids'.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recxla.data.synthetic import Batch

    b = table.num_rows
    for name, col in zip(table.column_names, table.columns):
        if col.null_count:
            raise DataFormatError(f"{where}: column {name!r} has {col.null_count} null rows")
    values, lengths, weights = [], [], []
    for f in layout.features:
        col = table.column(sparse_column(f))
        wcol = table.column(weights_column(f)).chunks if layout.weighted else None
        for ci, chunk in enumerate(col.chunks):
            offsets = chunk.offsets.to_numpy()
            lengths.append(np.diff(offsets))
            flat = chunk.flatten()
            if flat.null_count:
                raise DataFormatError(f"{where}: feature {f!r} has {flat.null_count} null ids")
            values.append(flat.to_numpy())
            if wcol is not None:
                w = wcol[ci] if len(wcol) == len(col.chunks) else None
                w_off = None if w is None else w.offsets.to_numpy()
                if w_off is None or not np.array_equal(w_off - w_off[0], offsets - offsets[0]):
                    raise DataFormatError(f"{where}: weights of feature {f!r} do not have the "
                                          "same bags as its ids")
                weights.append(w.flatten().to_numpy(zero_copy_only=False))

    def cat(parts, dtype_name):
        dt = _numpy_dtype(dtype_name)
        return torch.from_numpy(np.concatenate(parts).astype(dt, copy=False) if parts else
                                np.empty(0, dtype=dt))

    dense = np.empty((b, layout.num_dense), dtype=_numpy_dtype(layout.dense_dtype))
    for j in range(layout.num_dense):
        dense[:, j] = table.column(dense_column(j)).to_numpy()
    labels = _writable(table.column("label").to_numpy())
    request_ids = None
    if layout.request_ids:
        request_ids = torch.from_numpy(_writable(table.column("request_id").to_numpy()))
    sparse = KeyedJaggedTensor(
        keys=list(layout.features),
        values=cat(values, layout.values_dtype),
        lengths=cat(lengths, layout.lengths_dtype),
        weights=cat(weights, layout.weights_dtype) if layout.weighted else None,
        stride=b,
    )
    return Batch(sparse, torch.from_numpy(dense), torch.from_numpy(labels), request_ids)


class _GroupReader:
    """Reads row groups by their index in DatasetInfo.row_groups; files opened on first use,
    once per process (a forked worker opens its own)."""

    def __init__(self, info: DatasetInfo):
        self.info = info
        self._files: Dict[int, object] = {}
        self._pid = os.getpid()

    def read(self, group: int, use_threads: bool) -> pa.Table:
        fi, gi, rows = self.info.row_groups[group]
        path = self.info.files[fi].path
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        try:
            if fi not in self._files:
                self._files[fi] = open_file(path, OP)
            table = self._files[fi].read_row_group(gi, use_threads=use_threads)
        except (OSError, pa.ArrowException) as e:
            if isinstance(e, FileNotFoundError):
                raise FileNotFoundError(f"{OP}: {path}: no such file (removed while reading?)")
            raise DataFormatError(f"{OP}: {path}: row group {gi}: unreadable ({e})") from e
        if table.num_rows != rows:
            raise DataFormatError(f"{OP}: {path}: row group {gi} holds {table.num_rows} rows, "
                                  f"its footer says {rows}")
        return table


def read_run(reader: "_GroupReader", plan: EpochPlan, layout: Layout, window: int, lo: int,
             hi: int, use_threads: bool = True) -> Iterator[Tuple[int, object]]:
    """(k, Batch) pieces of stream rows [lo, hi) of `window` (a run of `plan.runs`), in order:
    piece k holds the rows of batch k that the window holds in [lo, hi) (all B of them, or the
    part of a batch that straddles windows). The window's groups are read once."""
    groups = plan.windows[window]
    start = int(plan.starts[window])
    table = pa.concat_tables([reader.read(g, use_threads) for g in groups])
    order = plan.order(window)
    if order is None:
        table = table.slice(lo - start, hi - lo)
    else:
        # One take over the whole window (a take per batch costs a call per column per batch;
        # a take over several chunks is slower than joining them first). Each step replaces
        # the table, so the window's rows are held at most twice.
        table = table.combine_chunks()
        table = table.take(order[lo - start:hi - start])
    files = sorted({reader.info.files[reader.info.row_groups[g][0]].path for g in groups})
    for k, a, b in plan.pieces(lo, hi):
        where = f"{OP}: {', '.join(files)} (epoch {plan.epoch}, batch {k})"
        yield k, table_to_batch(table.slice(a - lo, b - a), layout, where)


def concat_batches(parts: List) -> object:
    """Batches -> one Batch of their samples in order (same keys, dtypes and dense width)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recxla.data.synthetic import Batch

    if len(parts) == 1:
        return parts[0]
    keys = parts[0].sparse.keys()
    nk = len(keys)
    lengths = [p.sparse.lengths().view(nk, p.batch_size) for p in parts]
    per_key = [ln.sum(1, dtype=torch.int64).tolist() for ln in lengths]

    def by_key(tensors):  # key-major: key 0 of every part, then key 1, ...
        split = [t.split(n) for t, n in zip(tensors, per_key)]
        return torch.cat([s[f] for f in range(nk) for s in split])

    weighted = parts[0].sparse.weights_or_none() is not None
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=by_key([p.sparse.values() for p in parts]),
        lengths=torch.cat(lengths, dim=1).reshape(-1),
        weights=by_key([p.sparse.weights() for p in parts]) if weighted else None,
        stride=sum(p.batch_size for p in parts),
    )
    rid = None
    if parts[0].request_ids is not None:
        rid = torch.cat([p.request_ids for p in parts])
    return Batch(sparse, torch.cat([p.dense for p in parts]),
                 torch.cat([p.labels for p in parts]), rid)


def whole_batches(pieces: Iterable[Tuple[int, int, object]],
                  batch_size: int) -> Iterator[Tuple[int, int, object]]:
    """(epoch, k, piece) in stream order -> (epoch, k, Batch) once batch k's pieces hold
    `batch_size` samples. A batch is handed out only whole: a failure while reading its last
    piece raises before it."""
    key, parts, rows = None, [], 0
    try:
        for epoch, k, piece in pieces:
            if (epoch, k) != key:
                if parts:
                    raise RuntimeError(f"{OP}: batch {key} ended after {rows} of {batch_size} "
                                       "samples (pieces out of order)")
                key = (epoch, k)
            parts.append(piece)
            rows += piece.batch_size
            if rows == batch_size:
                yield epoch, k, concat_batches(parts)
                key, parts, rows = None, [], 0
    finally:
        # Closed early (the consumer stopped): the source's workers stop now, not at collection.
        close = getattr(pieces, "close", None)
        if close is not None:
            close()


def _check_int(value, name: str, lo: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{OP}: {name} must be an int >= {lo}, got {value!r}")
    return value
