"""Raw ids -> table rows: the three mappings of a converted dataset, and `IdMapper`, which maps
raw ids the way the conversion did (for evaluation and serving).

Every raw id first becomes a 64-bit key:
    integer ids   the id itself as int64 (uint64 ids: the same 64 bits)
    string ids    FNV-1a 64 of the id's UTF-8 bytes (offset basis 0xcbf29ce484222325, prime
                  0x100000001b3), as int64 bits
A table whose features all hold integer ids uses integer keys; if any of its features holds
strings, the integer ids of its other features are first written as decimal strings, so the
same id is the same key whichever feature holds it.

Keys -> rows, per table (the table's `mapping` in its TableSpec):
    hash     row = (splitmix64(key) & (2**63 - 1)) % rows      splitmix64 as in
             recxla.data.hashing (SplitMix64's finalizer, unsigned 64-bit arithmetic)
    modulo   row = key % rows, for integer ids >= 0 (what TorchRec's Criteo utilities do)
    vocab    row = 1 + the key's position in the vocabulary, or 0 (the out-of-vocabulary row)
             for a key not in it. The vocabulary holds the ids seen at least min_count times
             in the converted files, most frequent first (ties: smaller raw id first), at most
             rows - 1 of them; it is stored in the dataset folder as vocab/<table>.parquet
             (columns id, key, count; row i + 1 is line i), a file name of its own per table
             (`vocab_files`); the spec records each table's file.
Two different strings with the same 64-bit key are one id (probability about n**2 / 2**65 for n
distinct strings: 3e-8 for a million).
"""

import hashlib
import os
import re
from typing import Dict, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recxla.data.errors import DataFormatError
from recxla.data.hashing import splitmix64_numpy

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
OOV_ROW = 0
ID_TYPES = ("int", "string")
_INT63 = (1 << 63) - 1


def string_bytes(strings: pa.Array):
    """(bytes uint8, starts int64 [n], lengths int64 [n]) of a (large_)string array without
    nulls, views of its buffers: what the vectorized string hashes walk."""
    strings = strings.cast(pa.large_string())
    n = len(strings)
    bufs = strings.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64)[strings.offset:strings.offset + n + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    return data, offsets[:-1], np.diff(offsets)


def _fnv1a64_unique(strings: pa.Array) -> np.ndarray:
    """FNV-1a 64 of each string of a (large_)string array without nulls: uint64 [len]."""
    data, starts, lens = string_bytes(strings)
    n = len(starts)
    h = np.full(n, FNV_OFFSET, dtype=np.uint64)
    active = np.arange(n)
    prime = np.uint64(FNV_PRIME)
    j = 0
    while active.size:
        active = active[lens[active] > j]
        if not active.size:
            break
        h[active] = (h[active] ^ data[starts[active] + j].astype(np.uint64)) * prime
        j += 1
    return h


def string_keys(strings: pa.Array) -> np.ndarray:
    """int64 keys [len] of a string array without nulls: FNV-1a 64 bits, each distinct string
    hashed once."""
    if len(strings) == 0:
        return np.empty(0, dtype=np.int64)
    enc = pc.dictionary_encode(strings)
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks()
    hashed = _fnv1a64_unique(enc.dictionary).view(np.int64)
    return hashed[enc.indices.to_numpy(zero_copy_only=False)]


def int_keys(ints: pa.Array) -> np.ndarray:
    """int64 keys of an integer array without nulls (uint64: the same bits)."""
    a = ints.to_numpy(zero_copy_only=False)
    return a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64, copy=False)


def keys_of(ids: pa.Array, id_type: str) -> np.ndarray:
    """Raw ids (an Arrow array without nulls) -> int64 keys, for a table of `id_type`."""
    t = ids.type
    if id_type == "string":
        if pa.types.is_integer(t):
            ids = pc.cast(ids, pa.large_string())
        return string_keys(ids)
    return int_keys(ids)


def hash_rows(keys: np.ndarray, rows: int) -> np.ndarray:
    """(splitmix64(key) & (2**63 - 1)) % rows: int64 [n] in [0, rows)."""
    h = splitmix64_numpy(keys)
    h &= np.uint64(_INT63)
    h %= np.uint64(rows)
    return h.view(np.int64)


def modulo_rows(keys: np.ndarray, rows: int, where: str) -> np.ndarray:
    """key % rows for non-negative integer keys; ValueError naming `where` for a negative id."""
    if keys.size and keys.min() < 0:
        bad = int(np.argmax(keys < 0))
        raise ValueError(f"{where}: id {int(keys[bad])} at position {bad} is negative; the "
                         "modulo mapping needs ids >= 0 (use mapping = \"hash\")")
    return keys % rows


VOCAB_DIR = "vocab"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def vocab_files(tables: Iterable[str]) -> Dict[str, str]:
    """table name -> its vocabulary file, "vocab/<file>.parquet", one per table.

    <file> is the name itself when it is 1 to 100 letters, digits, "_", "-" and "." (not
    first); else (a "/" in the name, say: tables "a/b" and "a_b" once shared vocab/a_b.parquet),
    or when two names differ only in case (one file on a case-insensitive file system), the
    name with "_" for a leading "." and every other character, cut at 100, then "-" and 8 hex
    digits of the name's SHA-256. ValueError if two tables would still share a file.
    """
    names = list(dict.fromkeys(tables))
    folded: Dict[str, int] = {}
    for n in names:
        folded[n.lower()] = folded.get(n.lower(), 0) + 1

    def file(n: str) -> str:
        if _PLAIN_NAME.fullmatch(n) and folded[n.lower()] == 1:
            return n
        digest = hashlib.sha256(n.encode()).hexdigest()[:8]
        # A leading "." would make a hidden file, which no reader of the folder lists.
        safe = re.sub(r'[^A-Za-z0-9_.-]', '_', re.sub(r'^\.', '_', n))[:100]
        return f"{safe}-{digest}"

    files = {n: f"{VOCAB_DIR}/{file(n)}.parquet" for n in names}
    seen: Dict[str, str] = {}
    for n, f in files.items():
        if f.lower() in seen:
            raise ValueError(f"recxla.data.convert: tables {seen[f.lower()]!r} and {n!r} would "
                             f"share the vocabulary file {f}: rename one")
        seen[f.lower()] = n
    return files


def _vocab_path(folder: str, table) -> str:
    """The vocabulary file of a TableSpec read from a dataset's footer: DataFormatError unless
    it names a file directly in the dataset's vocab/ folder (a spec is data, not a path to
    follow anywhere)."""
    v = table.vocabulary
    head, name = os.path.split(v) if isinstance(v, str) else (None, "")
    if head != VOCAB_DIR or not name.endswith(".parquet") or name.startswith(".") or \
            "\\" in name:
        raise DataFormatError(f"recxla.data.IdMapper: {folder}: table {table.name}: vocabulary "
                              f"{v!r} is not a file in the dataset's {VOCAB_DIR}/ folder")
    return os.path.join(folder, VOCAB_DIR, name)


class Vocabulary:
    """A table's vocabulary: raw ids in row order (row i + 1 holds ids[i]) with their keys and
    counts; `rows(keys)` maps keys to rows (0 for keys not in it)."""

    def __init__(self, table: pa.Table):
        self.table = table  # columns: id (int64 or string), key int64, count int64
        keys = table.column("key").to_numpy()
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]

    def __len__(self) -> int:
        return self.table.num_rows

    @staticmethod
    def build(counts: pa.Table, min_count: int, max_ids: Optional[int]) -> "Vocabulary":
        """From a (key, id, count) table of distinct keys: the ids counted at least
        `min_count` times, most frequent first, ties by raw id, at most `max_ids`."""
        kept = counts.filter(pc.greater_equal(counts.column("count"), min_count))
        order = pc.sort_indices(kept, sort_keys=[("count", "descending"), ("id", "ascending")])
        if max_ids is not None:
            order = order[:max_ids]
        kept = kept.take(order)
        return Vocabulary(pa.table({"id": kept.column("id"), "key": kept.column("key"),
                                    "count": kept.column("count")}))

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """int64 rows [n]: 1 + position in the vocabulary, or OOV_ROW (0)."""
        n = self._sorted.size
        if n == 0:
            return np.zeros(keys.shape, dtype=np.int64)
        pos = np.searchsorted(self._sorted, keys)
        clipped = np.minimum(pos, n - 1)
        found = (pos < n) & (self._sorted[clipped] == keys)
        return np.where(found, self._order[clipped] + 1, OOV_ROW).astype(np.int64)

    def save(self, path: str) -> None:
        pq.write_table(self.table, path, compression="zstd")

    @staticmethod
    def load(path: str) -> "Vocabulary":
        return Vocabulary(pq.read_table(path))


def count_ids(keys: np.ndarray, ids: pa.Array) -> pa.Table:
    """The distinct keys of one batch with a raw id each and their counts: (key, id, count)."""
    t = pa.table({"key": pa.array(keys, pa.int64()), "id": ids})
    return merge_counts([t.append_column("count", pa.array(np.ones(len(keys), np.int64)))])


def merge_counts(tables: Sequence[pa.Table]) -> pa.Table:
    """(key, id, count) tables -> one with distinct keys, counts summed."""
    t = pa.concat_tables(tables)
    g = t.group_by("key", use_threads=False).aggregate([("id", "first"), ("count", "sum")])
    return pa.table({"key": g.column("key"), "id": g.column("id_first"),
                     "count": g.column("count_sum")})


class IdMapper:
    """Maps raw ids to table rows exactly as the conversion of a dataset did.

    `IdMapper.from_dataset(path)` reads the dataset's spec (and vocabularies); then
    `mapper.map(feature, raw_ids)` -> int64 numpy rows [n], in [0, table rows). raw_ids: a
    sequence, numpy array or Arrow array of the feature's raw ids (ints or strings; no None).
    """

    def __init__(self, spec, folder: str):
        self.spec = spec
        self._vocab: Dict[str, Vocabulary] = {}
        for t in spec.tables:
            if t.mapping == "vocab":
                self._vocab[t.name] = Vocabulary.load(_vocab_path(folder, t))

    @staticmethod
    def from_dataset(path) -> "IdMapper":
        from recxla.data.schema import read_dataset_spec

        path = os.fspath(path)
        spec = read_dataset_spec(path)
        return IdMapper(spec, path if os.path.isdir(path) else os.path.dirname(path))

    def map(self, feature: str, raw_ids) -> np.ndarray:
        table = self.spec.table_of(feature)
        ids = raw_ids if isinstance(raw_ids, (pa.Array, pa.ChunkedArray)) else pa.array(
            list(raw_ids) if not isinstance(raw_ids, np.ndarray) else raw_ids)
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        if ids.null_count:
            raise ValueError(f"recxla.data.IdMapper.map: feature {feature!r}: raw_ids holds "
                             f"{ids.null_count} None")
        if len(ids) and not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type)
                             or pa.types.is_large_string(ids.type)):
            raise TypeError(f"recxla.data.IdMapper.map: feature {feature!r}: raw ids must be "
                            f"ints or strings, got {ids.type}")
        if table.id_type == "int" and not pa.types.is_integer(ids.type) and len(ids):
            raise TypeError(f"recxla.data.IdMapper.map: feature {feature!r} has integer ids, "
                            f"got {ids.type}")
        return map_keys(table, keys_of(ids, table.id_type), self._vocab.get(table.name),
                        f"recxla.data.IdMapper.map: feature {feature!r}")


def map_keys(table, keys: np.ndarray, vocab: Optional[Vocabulary], where: str) -> np.ndarray:
    """Keys -> rows by the table's mapping (TableSpec or anything with mapping, num_rows)."""
    if table.mapping == "hash":
        return hash_rows(keys, table.num_rows)
    if table.mapping == "modulo":
        return modulo_rows(keys, table.num_rows, where)
    if table.mapping == "vocab":
        return vocab.rows(keys)
    raise ValueError(f"{where}: table {table.name} has mapping {table.mapping!r}: its ids are "
                     "rows already, not raw ids")
