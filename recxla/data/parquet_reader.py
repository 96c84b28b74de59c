"""`ParquetDataset`: Parquet files -> `recxla.data.Batch`es, straight from Arrow buffers.

What a rank reads in an epoch (`EpochPlan`): the row groups of all files, in file order or in a
seeded random order that changes every epoch, dealt round-robin to the ranks (rank r takes
groups r, r + W, ...). A rank's groups, in that order, form one stream of rows cut into batches
of B; every rank yields the same number of batches (the smallest any rank can fill), so no
rank waits in a collective for a batch that never comes. The rest of the rows (less than a
group plus a batch per rank) is left out of that epoch.

Reading a batch: the row groups it spans are read with pyarrow (decompression and decoding in
C++), and every feature becomes part of the KeyedJaggedTensor by whole-array operations on the
list column's offsets and values buffers (lengths = diff(offsets)); no Python code runs per row.
"""

import os
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import torch

from recxla.data import hashing
from recxla.data.batch_iterator import BatchIterator, check_position
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
_TAG_EPOCH_ORDER = 0x0E90C4


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


class EpochPlan:
    """The row groups one rank reads in one epoch, and how its rows cut into batches.

    groups: indices into DatasetInfo.row_groups, in reading order; starts: the first row of
    each group in the rank's stream (and the total at the end); num_batches: batches of
    batch_size every rank yields this epoch.
    """

    def __init__(self, info: DatasetInfo, batch_size, rank, world_size, seed, shuffle, epoch):
        n = len(info.row_groups)
        if shuffle:
            g = torch.Generator().manual_seed(hashing.mix_scalar(seed, epoch, _TAG_EPOCH_ORDER))
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        rows = [[info.row_groups[i][2] for i in order[r::world_size]] for r in range(world_size)]
        self.epoch = epoch
        self.batch_size = batch_size
        self.groups: List[int] = order[rank::world_size]
        self.starts = np.concatenate([[0], np.cumsum(rows[rank], dtype=np.int64)])
        self.num_batches = min(sum(r) for r in rows) // batch_size

    def group_at(self, row: int) -> int:
        """Position (in self.groups) of the group holding row `row` of the rank's stream."""
        return int(np.searchsorted(self.starts, row, side="right")) - 1

    def chunks(self, first: int = 0) -> List[Tuple[int, int]]:
        """Batches [first, num_batches) as (first, stop) runs whose first rows lie in the same
        group: a worker that reads a run reads each of its groups once."""
        out: List[Tuple[int, int]] = []
        for k in range(first, self.num_batches):
            g = self.group_at(k * self.batch_size)
            if out and self.group_at(out[-1][0] * self.batch_size) == g:
                out[-1] = (out[-1][0], k + 1)
            else:
                out.append((k, k + 1))
        return out


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


def read_batches(reader: _GroupReader, plan: EpochPlan, layout: Layout, first: int, stop: int,
                 use_threads: bool = True) -> Iterator[Tuple[int, object]]:
    """(k, Batch) for batches first <= k < stop of `plan`, reading each needed group once."""
    b = plan.batch_size
    g = plan.group_at(first * b)
    skip = first * b - int(plan.starts[g])
    pending: List[pa.Table] = []
    pending_rows = 0
    for k in range(first, stop):
        while pending_rows < b:
            t = reader.read(plan.groups[g], use_threads)
            if skip:
                t, skip = t.slice(skip), 0
            pending.append(t)
            pending_rows += t.num_rows
            g += 1
        parts, need = [], b
        while need:
            t = pending[0]
            if t.num_rows <= need:
                parts.append(pending.pop(0))
                need -= t.num_rows
            else:
                parts.append(t.slice(0, need))
                pending[0] = t.slice(need)
                need = 0
        pending_rows -= b
        fi, gi, _ = reader.info.row_groups[plan.groups[g - 1]]
        where = f"{OP}: {reader.info.files[fi].path} (epoch {plan.epoch}, batch {k})"
        yield k, table_to_batch(pa.concat_tables(parts), layout, where)


def _check_int(value, name: str, lo: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{OP}: {name} must be an int >= {lo}, got {value!r}")
    return value
