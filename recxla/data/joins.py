"""Feature backfill at read time: each training row gets the columns of feature tables (user
features, item features: one row per key) joined on a key column as the rows are read, so a
new feature needs no rewrite of the training data.

A join is named "KEY=TABLE" (`--join user_id=data/users`): KEY is a column of both tables,
TABLE a reference of recxla.data.table_source (a Parquet file or folder, bucketed or not, or an
Iceberg table). Bucket joins: both sides are split by Iceberg's bucket transform of KEY into
the same number of buckets (`python -m recxla.data bucket`, or an Iceberg table partitioned by
bucket(KEY, N)); the rows of a training unit all lie in one bucket, so the reader holds one
bucket of the feature table at a time, and the reader's order visits buckets one after another
(recxla.data.epoch_plan). A side that is not bucketed by KEY counts as one bucket: a small
feature table unbucketed joins an unbucketed training table whole.

What a row gets: the feature table's columns (all but KEY) of the row whose KEY equals its
own; with no such row (or a null KEY), nulls, which a conversion's missing-value rules turn
into defaults: no id (an empty bag) in a sparse column, 0 in a dense one, weight 1. Errors,
each naming both sides: KEY missing from a side, KEY an integer on one side and a string on the
other, bucket counts that differ, a feature column whose name the training table (or another
join) already has, a key that appears twice in a feature table, and (checked when the data is
planned) a row stored in another bucket than its key's.
"""

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recxla.data.buckets import bucket_of
from recxla.data.errors import DataFormatError
from recxla.data.id_mapping import string_keys
from recxla.data.table_source import TableSource, Unit, open_table

OP = "recxla.data.joins"


def parse_join(text: str) -> Tuple[str, str]:
    """(key column, table reference) of "KEY=TABLE"."""
    if not isinstance(text, str) or "=" not in text:
        raise ValueError(f"{OP}: a join is KEY=TABLE (e.g. user_id=data/users), got {text!r}")
    key, _, ref = text.partition("=")
    if not key or not ref:
        raise ValueError(f"{OP}: a join is KEY=TABLE (e.g. user_id=data/users), got {text!r}")
    return key, ref


def _key_kind(t: pa.DataType) -> Optional[str]:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return None


def _key_array(col, kind: str) -> pa.Array:
    """A key column as one array of one type per kind (int64, large_string)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    # uint64 keys above 2**63 keep their bits, as bucket_of and the id mapping take them.
    return col.cast(pa.int64(), safe=False) if kind == "int" else col.cast(pa.large_string())


class Join:
    """One feature table joined on `key`: its source (pinned), the columns it adds."""

    def __init__(self, key: str, ref: str, training: TableSource, snapshot: Optional[int]):
        self.key, self.ref = key, ref
        self.source = open_table(ref, snapshot, what=f"--join {key}")
        left = f"the training table {training.ref}"
        right = f"the feature table {self.source.ref}"
        for side, src in ((left, training), (right, self.source)):
            if src.schema.get_field_index(key) < 0:
                raise ValueError(f"{OP}: join of {left} with {right} on {key!r}: {side} has no "
                                 f"column {key!r} (its columns: {src.schema.names})")
        lk, rk = (_key_kind(s.schema.field(key).type) for s in (training, self.source))
        if lk is None or rk is None or lk != rk:
            raise ValueError(f"{OP}: join on {key!r}: the key is "
                             f"{training.schema.field(key).type} in {left} and "
                             f"{self.source.schema.field(key).type} in {right}: both must be "
                             "integers or both strings")
        self.kind = lk
        n_left, n_right = training.buckets.get(key, 1), self.source.buckets.get(key, 1)
        if n_left != n_right:
            raise ValueError(f"{OP}: join on {key!r}: {left} is in {n_left} bucket(s) of "
                             f"{key!r}, {right} in {n_right}: both sides need the same count "
                             "(`python -m recxla.data bucket ... --buckets N`, or an Iceberg "
                             f"partition bucket(N, {key}))")
        self.num_buckets = n_left
        self.columns = [c for c in self.source.schema.names if c != key]

    def bucket_of_unit(self, unit: Unit) -> int:
        """The unit's bucket of the key (NULL_BUCKET: an Iceberg file of null keys)."""
        return unit.bucket_of(self.key) if self.num_buckets > 1 else 0


class KeyIndex:
    """The keys of one bucket of a feature table, sorted once when the bucket is loaded, so that
    each unit's lookup is a binary search (a hash set built per unit, as pyarrow's index_in
    does, cost a copy of the bucket's keys and its time on every read).

    Integer keys are searched as they are; string keys by their 64-bit FNV-1a hash
    (recxla.data.id_mapping.string_keys), every match checked against the string itself.
    A key that appears twice is a DataFormatError naming it and `table`; null keys are never
    matched (a row without a key gets no feature row, not one without a key)."""

    def __init__(self, keys: pa.Array, column: str, table: str):
        self.strings = not pa.types.is_integer(keys.type)
        # Integer keys need only the sorted copy; strings keep theirs to check each match.
        self.keys = keys if self.strings else None
        valid = keys.is_valid().to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(valid)
        hashed = self._hash(keys.filter(keys.is_valid()))
        order = np.argsort(hashed, kind="stable")
        self.sorted = hashed[order]
        self.rows = rows[order].astype(np.int32 if len(keys) < 2**31 else np.int64)
        del hashed, order
        self.num_keys = rows.size
        self._exact = True
        same = np.flatnonzero(self.sorted[1:] == self.sorted[:-1])
        for k in same:  # equal hashes: the same key twice, or (strings) two keys colliding
            a, b = (keys[int(self.rows[k])], keys[int(self.rows[k + 1])])
            if a.as_py() == b.as_py():
                raise DataFormatError(f"{OP}: join on {column!r}: key {a.as_py()!r} appears "
                                      f"more than once in {table}; a feature table holds one "
                                      "row per key")
            self._exact = False
        self._exact_keys = None if self._exact else keys
        if not self._exact:  # colliding hashes may hide a duplicate between them
            present = keys.filter(keys.is_valid())
            if pc.count_distinct(present).as_py() != len(present):
                counts = pc.value_counts(present)
                twice = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"]
                raise DataFormatError(f"{OP}: join on {column!r}: key {twice.as_py()!r} "
                                      f"appears more than once in {table}; a feature table "
                                      "holds one row per key")

    def _hash(self, keys: pa.Array) -> np.ndarray:
        if not self.strings:
            return keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return string_keys(keys)

    def lookup(self, left: pa.Array) -> pa.Array:
        """int64 rows of the bucket's table for each key of `left` (null: no match)."""
        if not self._exact:  # two strings of the bucket share a hash: pyarrow's own set
            return pc.index_in(left, value_set=self._exact_keys, skip_nulls=True)
        n = len(left)
        valid = left.is_valid().to_numpy(zero_copy_only=False)
        hashed = np.zeros(n, np.int64)
        if valid.any():
            hashed[valid] = self._hash(left.filter(left.is_valid()))
        found = valid.copy()
        if self.sorted.size:
            pos = np.minimum(np.searchsorted(self.sorted, hashed), self.sorted.size - 1)
            found &= self.sorted[pos] == hashed
            rows = self.rows[pos].astype(np.int64)
        else:
            found[:] = False
            rows = np.zeros(n, np.int64)
        if self.strings and found.any():  # a hash match of another string is no match
            at = np.flatnonzero(found)
            same = pc.equal(left.take(pa.array(at)), self.keys.take(pa.array(rows[at])))
            found[at] = pc.fill_null(same, False).to_numpy(zero_copy_only=False)
        return pa.array(rows, pa.int64(), mask=~found)


class BucketJoiner:
    """The joins of a training table, applied to its units as they are read.

    Args:
        joins: "KEY=TABLE" strings, applied in order.
        training: the training table.
        snapshots: the Iceberg snapshot of each feature table (from a checkpoint), or None.
    Holds one bucket of each feature table at a time (the last one read).
    """

    def __init__(self, joins: Sequence[str], training: TableSource,
                 snapshots: Optional[Sequence[Optional[int]]] = None):
        parsed = [parse_join(j) for j in joins]
        snaps = list(snapshots) if snapshots is not None else [None] * len(parsed)
        if len(snaps) != len(parsed):
            raise ValueError(f"{OP}: {len(snaps)} snapshots for {len(parsed)} joins")
        self.training = training
        self.joins = [Join(k, r, training, s) for (k, r), s in zip(parsed, snaps)]
        owner: Dict[str, str] = {c: f"the training table {training.ref}"
                                 for c in training.schema.names}
        for j in self.joins:
            for c in j.columns:
                if c in owner:
                    raise ValueError(f"{OP}: join on {j.key!r}: column {c!r} of the feature "
                                     f"table {j.source.ref} is also a column of {owner[c]}: "
                                     "rename one (a transform cannot: joins come first)")
                owner[c] = f"the feature table {j.source.ref}"
        self._held: Dict[int, Tuple[int, pa.Table, pa.Array]] = {}

    @property
    def snapshots(self) -> List[Optional[int]]:
        return [j.source.snapshot for j in self.joins]

    def identity(self) -> List[str]:
        """What the data's fingerprint holds of the joins."""
        return [f"{j.key}={j.source.ref}#{j.source.fingerprint}" for j in self.joins]

    def _bucket(self, i: int, bucket: int, check: bool) -> Tuple[pa.Table, "KeyIndex"]:
        held = self._held.get(i)
        if held is not None and held[0] == bucket:
            return held[1], held[2]
        if self._held.pop(i, None) is not None:  # the last bucket goes before the next is read
            # mimalloc (pyarrow's pool) keeps freed pages for reuse: handing them back keeps the
            # reader's resident memory at about one bucket, not the largest few it held.
            pa.default_memory_pool().release_unused()
        j = self.joins[i]
        t = j.source.read_bucket(j.key, bucket)
        keys = _key_array(t.column(j.key), j.kind)
        index = KeyIndex(keys, j.key, f"the feature table {j.source.ref} (bucket {bucket})")
        if check and j.num_buckets > 1 and index.num_keys:
            present = keys.filter(keys.is_valid())
            got = bucket_of(present, j.num_buckets)
            if (got != bucket).any():
                k = present[int(np.argmax(got != bucket))].as_py()
                raise DataFormatError(f"{OP}: join on {j.key!r}: the feature table "
                                      f"{j.source.ref} holds key {k!r} in bucket {bucket}, but "
                                      f"Iceberg's bucket transform puts it in bucket "
                                      f"{int(got[int(np.argmax(got != bucket))])}: the table "
                                      "was bucketed by another function")
        table = t.select(j.columns)
        del t, keys
        self._held[i] = (bucket, table, index)
        return table, index

    def release(self) -> None:
        """Let go of the held buckets (the planning pass's joiner, once the table is planned:
        each reader holds its own)."""
        self._held = {}
        pa.default_memory_pool().release_unused()

    def join(self, table: pa.Table, unit: Unit, where: str, check: bool = False) -> pa.Table:
        """`table` (rows of `unit` of the training table) with every join's columns appended.
        check: also verify that every key lies in the unit's bucket (the planning pass)."""
        for i, j in enumerate(self.joins):
            bucket = j.bucket_of_unit(unit)
            features, keys = self._bucket(i, bucket, check)
            left = _key_array(table.column(j.key), j.kind)
            if check and j.num_buckets > 1:
                valid = left.filter(left.is_valid())
                got = bucket_of(valid, j.num_buckets) if len(valid) else np.zeros(0, np.int32)
                if (got != bucket).any():
                    k = valid[int(np.argmax(got != bucket))].as_py()
                    raise DataFormatError(f"{OP}: join on {j.key!r}: {where} lies in bucket "
                                          f"{bucket} but holds key {k!r}, whose bucket is "
                                          f"{int(got[int(np.argmax(got != bucket))])}: the "
                                          "training table was bucketed by another function")
            taken = features.take(keys.lookup(left))
            for c in j.columns:
                table = table.append_column(features.schema.field(c), taken.column(c))
        return table

    def clone(self) -> "BucketJoiner":
        """The same joins with files and held buckets of its own (one per reader thread)."""
        other = copy.copy(self)
        other.joins = [copy.copy(j) for j in self.joins]
        for j in other.joins:
            j.source = j.source.clone()
        other._held = {}
        return other

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_held"] = {}
        return state
