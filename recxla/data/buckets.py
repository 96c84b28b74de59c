"""Bucketed feature tables: rows split by a hash of a key column, exactly as Apache Iceberg's
bucket partition transform splits them.

The trainer joins feature tables (user features, item features, keyed by a column) into
training rows at read time, one bucket at a time: both sides are split into the same number of
buckets by the same function of the key, so a key's feature row is always in the bucket of the
training rows that name it, and a join never needs more than one bucket of each side in memory.
The function is Iceberg's rather than one of recxla's own (recxla.data.id_mapping's FNV-1a,
splitmix64) so that the two kinds of table mix: a folder written here and an Iceberg table
partitioned by bucket(key, N) put every key in the same bucket, and join bucket for bucket.

    bucket_of(ids, N) -> int32 [n]     (murmur3_x86_32(bytes(id), seed 0) & 0x7FFFFFFF) % N

bytes(id), Iceberg's spec ("Bucket Transform Details"):
    integer ids   the value as an 8-byte little-endian long (an int32 -1 hashes as the long -1;
                  Iceberg has no unsigned types: a uint64 above 2**63 hashes as the int64 with
                  the same bits, a uint32 as its value)
    string ids    the UTF-8 bytes
    null          no hash: bucket 0. Iceberg keeps nulls in a null partition of their own; here
                  a row whose key is null never matches a feature row, so where it is stored
                  does not matter.
A self-check, the spec's reference values: the hash of the long 34 is 2017239379, of the
string "iceberg" 1210000089 (tests/test_data_buckets.py checks both, and every bucket against
pyiceberg's).

The folder that `write_buckets` writes (Iceberg's own data path naming, so a reader discovers
both with the same rules, `parse_bucket_folder`):
    out/<key>_bucket=0/part-00000.parquet
    out/<key>_bucket=1/part-00000.parquet
    ...
    out/<key>_bucket=<N-1>/part-00000.parquet
every one of the N folders present (an empty bucket holds a file of zero rows with the schema),
indexes without zero padding, the column name URL-encoded as Iceberg does (`quote_plus`: a
plain name such as user_id is unchanged). Each file holds the source's columns, its bucket's
rows in source order, zstd.
"""

import contextlib
import numbers
import os
import re
import shutil
from typing import Dict, Iterator, List, Optional, Tuple
from urllib.parse import quote_plus, unquote_plus

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recxla.data.convert_output import OutputError, install, is_within, temp_folder
from recxla.data.convert_source import format_of
from recxla.data.errors import DataFormatError
from recxla.data.id_mapping import string_bytes
from recxla.data.parquet_layout import default_rows_per_group

OP = "recxla.data.buckets.write_buckets"
MAX_BUCKETS = 2**31 - 1  # Iceberg's bucket count is a Java int
PART_FILE = "part-00000.parquet"
# Rows waiting for a full row group hold the blocks they were sliced from; past this many bytes
# of blocks every bucket's pending rows are written (smaller row groups, bounded memory).
BUFFER_BYTES = 256 << 20
_SPARE_FILES = 64  # descriptors left for everything but the N writers
_FOLDER = re.compile(r"(.+)_bucket=(0|[1-9][0-9]*)")

_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_M = np.uint32(5)
_N = np.uint32(0xE6546B64)
_F1 = np.uint32(0x85EBCA6B)
_F2 = np.uint32(0xC2B2AE35)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _scramble(k: np.ndarray) -> np.ndarray:
    k = k * _C1
    return _rotl(k, 15) * _C2


def _block(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    """murmur3_x86_32's step for one 4-byte block k of every value (uint32 arithmetic wraps
    modulo 2**32, as the C code's does)."""
    return _rotl(h ^ _scramble(k), 13) * _M + _N


def _finish(h: np.ndarray, length) -> np.ndarray:
    h = h ^ np.asarray(length, dtype=np.uint32)
    h ^= h >> np.uint32(16)
    h *= _F1
    h ^= h >> np.uint32(13)
    h *= _F2
    h ^= h >> np.uint32(16)
    return h


def _murmur3_long(values) -> np.ndarray:
    """murmur3_x86_32, seed 0, of each value as an 8-byte little-endian long: int32 [n] (the
    signed int that Iceberg's Java code returns). values: int64 (or uint64: the same bits)."""
    v = np.asarray(values).reshape(-1)
    v = v.view(np.uint64) if v.dtype == np.uint64 else v.astype(np.int64).view(np.uint64)
    low = (v & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    high = (v >> np.uint64(32)).astype(np.uint32)
    h = _block(_block(np.zeros(v.shape, np.uint32), low), high)
    return _finish(h, 8).view(np.int32)


def _murmur3_utf8(strings: pa.Array) -> np.ndarray:
    """murmur3_x86_32, seed 0, of the UTF-8 bytes of each string of a (large_)string array
    without nulls: int32 [len].

    Position by position over whole arrays, as recxla.data.id_mapping's FNV-1a: block j of
    every string that has one, then the tails. The strings are ordered longest first, so the
    strings still hashing at block j are a prefix of the arrays (no index array per step)."""
    data, starts, lens = string_bytes(strings)
    n = len(starts)
    blocks = lens >> 2
    order = np.argsort(-blocks, kind="stable")
    sorted_starts, descending = starts[order], -blocks[order]  # descending: ascending -blocks
    h = np.zeros(n, np.uint32)
    for j in range(int(-descending[0]) if n else 0):
        m = int(np.searchsorted(descending, -j, side="left"))  # strings with > j blocks
        at = sorted_starts[:m] + 4 * j
        k = (data[at].astype(np.uint32) | data[at + 1].astype(np.uint32) << np.uint32(8)
             | data[at + 2].astype(np.uint32) << np.uint32(16)
             | data[at + 3].astype(np.uint32) << np.uint32(24))
        h[:m] = _block(h[:m], k)
    hashed = np.empty(n, np.uint32)
    hashed[order] = h
    # The tail (len % 4 bytes): a zero tail scrambles to 0, a no-op on h.
    tail_at, tail = starts + 4 * blocks, lens & 3
    k = np.zeros(n, np.uint32)
    for b in range(3):
        has = np.flatnonzero(tail > b)
        k[has] |= data[tail_at[has] + b].astype(np.uint32) << np.uint32(8 * b)
    return _finish(hashed ^ _scramble(k), lens).view(np.int32)


def _check_num_buckets(num_buckets, op: str) -> int:
    if not isinstance(num_buckets, numbers.Integral) or isinstance(num_buckets, bool) or not (
            1 <= num_buckets <= MAX_BUCKETS):
        raise ValueError(f"{op}: num_buckets must be an int in [1, 2**31 - 1] (Iceberg's "
                         f"bucket count is a Java int), got {num_buckets!r}")
    return int(num_buckets)


def _hashable(t: pa.DataType) -> bool:
    """Whether `bucket_of` hashes a column of type t: integers, strings, and dictionaries of
    them."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def bucket_of(ids, num_buckets: int) -> np.ndarray:
    """Iceberg's bucket transform of every id: int32 [len(ids)] in [0, num_buckets).

    Args:
        ids: a pa.Array or pa.ChunkedArray (or anything pa.array takes: a numpy array, a list)
            of int8..int64 / uint8..uint64 or string / large_string ids, plain or
            dictionary-encoded; nulls allowed (bucket 0).
        num_buckets: an int in [1, 2**31 - 1].
    Raises ValueError naming the argument for another type (float, binary, list...) or a
    num_buckets out of range.
    """
    op = "recxla.data.buckets.bucket_of"
    num_buckets = _check_num_buckets(num_buckets, op)
    if not isinstance(ids, (pa.Array, pa.ChunkedArray)):
        ids = pa.array(ids)
    if not _hashable(ids.type):
        raise ValueError(f"{op}: ids must be integers or strings (Iceberg's bucket transform "
                         f"of a long or a string; dictionaries of them), got {ids.type}")
    if isinstance(ids, pa.ChunkedArray):
        parts = [_buckets(c, num_buckets) for c in ids.chunks]
        return np.concatenate(parts) if parts else np.empty(0, np.int32)
    return _buckets(ids, num_buckets)


def _buckets(ids: pa.Array, num_buckets: int) -> np.ndarray:
    """bucket_of of one array of a hashable type."""
    if pa.types.is_dictionary(ids.type):
        values = _buckets(ids.dictionary, num_buckets)
        if len(values) == 0:  # every index is null
            return np.zeros(len(ids), np.int32)
        indices = pc.fill_null(ids.indices, 0).to_numpy(zero_copy_only=False)
        out = values[indices]
    else:
        plain = pc.fill_null(ids, "" if not pa.types.is_integer(ids.type) else 0) \
            if ids.null_count else ids
        if pa.types.is_integer(ids.type):
            hashes = _murmur3_long(plain.to_numpy(zero_copy_only=False))
        elif len(plain) == 0:
            hashes = np.empty(0, np.int32)
        else:  # each distinct string hashed once
            enc = pc.dictionary_encode(plain)
            hashes = _murmur3_utf8(enc.dictionary)[enc.indices.to_numpy(zero_copy_only=False)]
        out = ((hashes.view(np.uint32) & np.uint32(0x7FFFFFFF)) % np.uint32(num_buckets)).view(
            np.int32)
    if ids.null_count:
        out = np.where(ids.is_null().to_numpy(zero_copy_only=False), np.int32(0), out)
    return out.astype(np.int32, copy=False)


def bucket_folder_name(column: str, i: int) -> str:
    """The folder of bucket i of a table bucketed by `column`: "<column>_bucket=<i>", the
    column URL-encoded as Iceberg writes partition paths (quote_plus)."""
    if not isinstance(column, str) or not column:
        raise ValueError(f"recxla.data.buckets.bucket_folder_name: column must be a non-empty "
                         f"str, got {column!r}")
    if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < MAX_BUCKETS:
        raise ValueError(f"recxla.data.buckets.bucket_folder_name: i must be an int in "
                         f"[0, 2**31 - 2], got {i!r}")
    return f"{quote_plus(column, safe='')}_bucket={int(i)}"


def parse_bucket_folder(name: str) -> Optional[Tuple[str, int]]:
    """(column, i) of a folder named by `bucket_folder_name`, else None (another name, an index
    with leading zeros, a column name not in the encoded form bucket_folder_name writes)."""
    m = _FOLDER.fullmatch(name)
    if m is None:
        return None
    column, i = unquote_plus(m.group(1)), int(m.group(2))
    if i >= MAX_BUCKETS or quote_plus(column, safe="") != m.group(1):
        return None
    return column, i


@contextlib.contextmanager
def _writing(out: str) -> Iterator[None]:
    """OSErrors raised inside become OutputErrors naming `out` (convert_output.writing's,
    naming this op rather than convert)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        raise OutputError(e.errno, f"{OP}: writing {out}: {e.strerror or e} (errno {e.errno}); "
                          f"nothing was written at {out}: the partial output was removed") from e


def _sources(src) -> List[str]:
    """The Parquet files of SRC (a file, or a folder's .parquet files in name order, as
    convert lists them)."""
    src = os.fspath(src)
    if os.path.isfile(src):
        return [src]
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{OP}: {src}: no such file or folder")
    names = sorted(n for n in os.listdir(src) if not n.startswith((".", "_")))
    files = [os.path.join(src, n) for n in names
             if format_of(n) == "parquet" and os.path.isfile(os.path.join(src, n))]
    if not files:
        raise DataFormatError(f"{OP}: {src}: the folder holds no Parquet files")
    return files


def _read_schema(path: str) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise DataFormatError(f"{OP}: {path}: not a readable Parquet file: {e}") from None


def _schema(files: List[str], key: str) -> pa.Schema:
    """The first file's schema, once the key column is found hashable in it and every other
    file holds the same columns with the same types."""
    first = _read_schema(files[0])
    found = first.get_all_field_indices(key)
    if len(found) != 1:
        what = "no column" if not found else f"{len(found)} columns named"
        raise ValueError(f"{OP}: {files[0]}: {what} {key!r} (the key); its columns: "
                         f"{first.names}")
    if not _hashable(first.field(key).type):
        raise ValueError(f"{OP}: key column {key!r} holds {first.field(key).type}: bucket_of "
                         "hashes integers and strings (Iceberg's bucket transform of a long or "
                         "a string)")
    for path in files[1:]:
        types = {f.name: f.type for f in _read_schema(path)}
        for f in first:
            if f.name not in types:
                raise ValueError(f"{OP}: {path}: column {f.name!r} is not in the file (the "
                                 f"first file, {files[0]}, has it)")
            if not types[f.name].equals(f.type):
                raise ValueError(f"{OP}: {path}: column {f.name!r} holds {types[f.name]}, the "
                                 f"first file's ({files[0]}) holds {f.type}")
        extra = [c for c in types if c not in first.names]
        if extra:
            raise ValueError(f"{OP}: {path}: column {extra[0]!r} is not in the first file "
                             f"({files[0]}); every file must hold the same columns")
    return first


def _check_out(out: str, src, files: List[str]) -> None:
    real = os.path.realpath(out)
    src = os.fspath(src)
    if os.path.isdir(src) and is_within(real, os.path.realpath(src)):
        raise ValueError(f"{OP}: out {out} is inside the source folder {src}: the buckets would "
                         "be mixed with the input; choose another out")
    if any(os.path.realpath(f) == real for f in files):
        raise ValueError(f"{OP}: out {out} is the source file; choose another out")
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.path.islink(out)
                                     and not os.listdir(out)):
        raise FileExistsError(f"{OP}: {out} exists and is not an empty folder; write_buckets "
                              "writes only to an absent or empty folder")


def _allow_open_files(n: int) -> None:
    """One writer per bucket stays open: raise the soft limit on open files (up to the hard
    one) when n writers need it; ValueError naming the limit when the hard one is too low."""
    try:
        import resource
    except ImportError:  # not a POSIX system: no limit to read
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + _SPARE_FILES
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(f"{OP}: num_buckets {n} keeps {n} files open at once (one per bucket), "
                         f"but this process may open at most {hard} (ulimit -Hn); use at most "
                         f"{hard - _SPARE_FILES} buckets or raise the limit")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (OSError, ValueError) as e:
        raise ValueError(f"{OP}: num_buckets {n} keeps {n} files open at once (one per "
                         f"bucket), but the limit on open files ({soft}) could not be raised: "
                         f"{e}") from None


class _BucketWriters:
    """The N open ParquetWriters of a split and each bucket's rows waiting for a full row group
    (slices of the blocks they came from, in source order)."""

    def __init__(self, folder: str, key: str, schema: pa.Schema, n: int, rows_per_group: int):
        self.schema, self.rows_per_group = schema, rows_per_group
        self.writers: List[pq.ParquetWriter] = []
        self.pending: List[List[pa.Table]] = [[] for _ in range(n)]
        self.pending_rows = np.zeros(n, np.int64)
        self.written = np.zeros(n, np.int64)
        self.held = 0
        try:
            for i in range(n):
                sub = os.path.join(folder, bucket_folder_name(key, i))
                os.mkdir(sub)
                self.writers.append(pq.ParquetWriter(os.path.join(sub, PART_FILE), schema,
                                                     compression="zstd"))
        except BaseException:  # no descriptor left open in a folder about to be removed
            self.abort()
            raise

    def add(self, block: pa.Table, buckets: np.ndarray) -> None:
        counts = np.bincount(buckets, minlength=len(self.writers))
        ends = np.cumsum(counts)
        ordered = block.take(pa.array(np.argsort(buckets, kind="stable")))  # stable: source order
        self.held += ordered.nbytes
        for i in np.flatnonzero(counts):
            self.pending[i].append(ordered.slice(ends[i] - counts[i], counts[i]))
            self.pending_rows[i] += counts[i]
            if self.pending_rows[i] >= self.rows_per_group:
                self._flush(i, whole_groups=True)
        if self.held > BUFFER_BYTES:
            self.flush()

    def _flush(self, i: int, whole_groups: bool) -> None:
        rows = pa.concat_tables(self.pending[i])
        n = rows.num_rows - rows.num_rows % self.rows_per_group if whole_groups else rows.num_rows
        self.writers[i].write_table(rows.slice(0, n), row_group_size=self.rows_per_group)
        self.written[i] += n
        rest = rows.slice(n)
        self.pending[i] = [rest] if rest.num_rows else []
        self.pending_rows[i] = rest.num_rows

    def flush(self) -> None:
        """Write every bucket's pending rows, releasing every block held."""
        for i in np.flatnonzero(self.pending_rows):
            self._flush(i, whole_groups=False)
        self.held = 0

    def close(self) -> None:
        self.flush()
        for w in self.writers:
            w.close()

    def abort(self) -> None:
        for w in self.writers:
            try:
                w.close()
            except Exception:  # the folder is removed next; the first error is the one to see
                pass


def _blocks(path: str, schema: pa.Schema, rows_per_group: int):
    """The rows of one source file as tables of at most rows_per_group rows, with the columns
    of `schema` in its order."""
    try:
        # pre_buffer (pyarrow's default) reads every row group's column chunks ahead, memory
        # that grows with the file: without it, a row group's pages at a time.
        f = pq.ParquetFile(path, pre_buffer=False)
        for batch in f.iter_batches(batch_size=rows_per_group, columns=schema.names):
            t = pa.Table.from_batches([batch]).select(schema.names)
            yield t if t.schema.equals(schema) else t.cast(schema)
    except (OSError, pa.ArrowException) as e:
        raise DataFormatError(f"{OP}: {path}: unreadable Parquet: {e}") from None


def write_buckets(src, key: str, num_buckets: int, out, *, rows_per_group: Optional[int] = None,
                  progress: bool = False) -> Dict:
    """Split a Parquet file, or a folder of them, into `num_buckets` buckets by
    `bucket_of(key column)`: out/<key>_bucket=<i>/part-00000.parquet for i in 0..N-1.

    Args:
        src: a Parquet file, or a folder of them (its .parquet files in name order, every one
            with the same columns and types); any columns.
        key: the column to bucket by: integers or strings (plain or dictionary-encoded).
        num_buckets: an int in [1, 2**31 - 1] (in practice at most what the process may keep
            open: one file per bucket; the soft limit is raised to the hard one if needed).
        out: the folder to create: absent or an empty folder, not inside the source folder.
        rows_per_group: rows read per block and rows per output row group (a bucket's rows are
            held until it has a full group, or until BUFFER_BYTES of blocks are held). None:
            a conversion's default for the source's rows (default_rows_per_group: about 64
            groups in all, at most 65,536 rows), so that the trainer's held-out split
            (whole row groups, the latest by time) can hold out a tenth of the rows, not
            whole buckets.
        progress: show a progress bar (tqdm) of rows on stderr.
    Returns {"rows": total rows, "buckets": N, "rows_per_bucket": [rows of bucket i]}.
    Streaming: memory is a block, the rows pending a row group (at most about BUFFER_BYTES of
    blocks) and the N open writers' buffers, whatever the source's size. pyarrow's writer keeps
    its encoders' buffers between row groups, about a row group's bytes (several times that
    for dictionary-encoded strings) per bucket: with hundreds of buckets, a smaller
    rows_per_group keeps that down. Every bucket keeps its rows in source order.
    Raises FileNotFoundError for a missing src; FileExistsError naming `out` when it exists and
    is not an empty folder; ValueError (DataFormatError for an unreadable file) naming the
    file and column for a missing or unhashable key column, files whose columns differ, `out`
    inside the source; OutputError (an OSError) naming `out` when writing fails. Nothing is
    left at `out`, or next to it, on failure: the buckets are written to a hidden temporary
    folder next to `out`, renamed to `out` once complete.
    """
    out = os.fspath(out)
    num_buckets = _check_num_buckets(num_buckets, OP)
    if rows_per_group is not None and (not isinstance(rows_per_group, numbers.Integral) or
                                       isinstance(rows_per_group, bool) or rows_per_group < 1):
        raise ValueError(f"{OP}: rows_per_group must be an int >= 1, got {rows_per_group!r}")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{OP}: key must be a column name (a non-empty str), got {key!r}")
    files = _sources(src)
    schema = _schema(files, key)  # every footer readable
    if rows_per_group is None:
        rows_per_group = default_rows_per_group(sum(pq.read_metadata(f).num_rows for f in files))
    _check_out(out, src, files)
    _allow_open_files(num_buckets)
    tmp = temp_folder(out)
    writers, bar = None, None
    try:
        if progress:
            from tqdm import tqdm

            total = sum(pq.read_metadata(f).num_rows for f in files)
            bar = tqdm(total=total, unit="rows", unit_scale=True, desc="bucketing",
                       dynamic_ncols=True)
        with _writing(out):
            os.makedirs(tmp)
            writers = _BucketWriters(tmp, key, schema, num_buckets, int(rows_per_group))
        for path in files:
            for block in _blocks(path, schema, int(rows_per_group)):
                buckets = bucket_of(block.column(key), num_buckets)
                with _writing(out):
                    writers.add(block, buckets)
                if bar is not None:
                    bar.update(block.num_rows)
        with _writing(out):
            writers.close()
            install(tmp, out)
    except BaseException:
        if writers is not None:
            writers.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    per_bucket = [int(r) for r in writers.written]
    return {"rows": sum(per_bucket), "buckets": num_buckets, "rows_per_bucket": per_bucket}
