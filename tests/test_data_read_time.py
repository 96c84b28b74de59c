"""recxla.data.read_time: raw tables read at train time with joins and transforms, against an
oracle that does the same work by hand (the transform applied to the whole table with pyarrow,
the joins as a pandas left merge), converts the result with recxla.data.convert and reads it
back; the same seed giving the same batches, resumed positions, ranks' shares and the
bucket-major order; Iceberg tables in a SQL catalog on SQLite (snapshots pinned, renamed and
added columns, catalog names); and the errors the modules' docstrings promise, with nothing
written."""

import importlib.util
import itertools
import json
import os
import pickle
import re
import shutil
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from data_pipeline_cases import assert_batches_equal, to_rows

from recxla.data import DataFormatError, ParquetDataset, convert, make_loader
from recxla.data.buckets import bucket_of, write_buckets
from recxla.data import joins
from recxla.data.epoch_plan import EpochPlan
from recxla.data.read_time import ReadTimeTable
from recxla.data.table_source import TableSource
from recxla.data.transforms import TransformError

COUNTRIES = ["us", "de", "fr", "jp", "br", "in"]
NUM_BUCKETS = 4
CATALOG = "t"  # any name: recxla's loader finds the one name the SQLite database holds

# The transforms under test, written into each test's folder and named "<file>.py:<function>".
TRANSFORMS = '''
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PRICE_EDGES = np.array([10.0, 25.0, 50.0, 100.0])


def _cross(users, countries):
    return pa.array([f"x{zlib.crc32(f'{u}/{c}'.encode()) % 997}"
                     for u, c in zip(users.to_pylist(), countries.to_pylist())], pa.string())


def engineer(batch):
    """Rows of users % 5 == 0 dropped; price bucketized into price_bin (int64); user_id x
    country hash-crossed into user_country (string); history cut to its first 3; country
    dropped."""
    users = batch.column("user_id").to_numpy(zero_copy_only=False)
    t = pa.Table.from_batches([batch]).filter(pa.array(users % 5 != 0))
    bins = np.searchsorted(PRICE_EDGES, t.column("price").to_numpy(), side="right")
    t = t.append_column("price_bin", pa.array(bins, pa.int64()))
    t = t.append_column("user_country", _cross(t.column("user_id"), t.column("country")))
    t = t.set_column(t.schema.get_field_index("history"), "history",
                     pc.list_slice(t.column("history"), 0, 3))
    return t.drop_columns(["country"])


def cross(batch):
    """engineer without the filter, returned as a RecordBatch (every row kept)."""
    t = pa.Table.from_batches([batch])
    t = t.append_column("user_country", _cross(t.column("user_id"), t.column("country")))
    t = t.set_column(t.schema.get_field_index("history"), "history",
                     pc.list_slice(t.column("history"), 0, 3))
    return t.drop_columns(["country"]).combine_chunks().to_batches()[0]


def history_length(batch):
    """history's length as a float column (after engineer: at most 3)."""
    t = pa.Table.from_batches([batch])
    lengths = pc.list_value_length(t.column("history")).cast(pa.float64())
    return t.append_column("history_len", pc.fill_null(lengths, 0.0))
'''

# A schema for the transformed columns: two features sharing a table, a hashed one, log1p.
SCHEMA = """
dense = ["price", "rid", "history_len"]
dense_log1p = ["price"]
[sparse.user_country]
mapping = "hash"
rows = 53
[sparse.item_id]
table = "items"
[sparse.history]
table = "items"
[tables.items]
mapping = "vocab"
min_count = 2
"""


# ---------------------------------------------------------------------------------------------
# Inputs and oracles.

def click_log(rng, n: int, num_users: int = 40, num_items: int = 60, first_rid: int = 0
              ) -> pa.Table:
    """A raw click log: int64 user_id, item_id; string country; float price; list<int64>
    history (empty bags included); int label 0/1; int64 timestamp; rid, the row's id as a float
    (a dense column, so that rows read in another order can be matched)."""
    lengths = rng.integers(0, 7, n)
    return pa.table({
        "user_id": pa.array(rng.integers(0, num_users, n), pa.int64()),
        "item_id": pa.array(rng.integers(0, num_items, n), pa.int64()),
        "country": pa.array(rng.choice(COUNTRIES, n).tolist(), pa.string()),
        "price": pa.array(rng.gamma(2.0, 20.0, n)),
        "history": pa.array([rng.integers(0, num_items, k).tolist() for k in lengths],
                            pa.list_(pa.int64())),
        "label": pa.array(rng.integers(0, 2, n), pa.int64()),
        "timestamp": pa.array(1_700_000_000 + np.cumsum(rng.integers(1, 100, n)), pa.int64()),
        "rid": pa.array(np.arange(first_rid, first_rid + n, dtype=np.float64)),
    })  # fmt: skip


def feature_table(rng, log: pa.Table, key: str, columns: dict, extra_keys=(1000, 1001, 1002)):
    """One row per key, in a random order: about 3/4 of the log's keys (at least one of them
    missing) and a few keys the log never names; `columns` name -> "float" or "string", each
    with a null or two."""
    keys = np.unique(log.column(key).to_numpy(zero_copy_only=False))
    missing = rng.choice(keys, max(1, len(keys) // 4), replace=False)
    ids = rng.permutation(np.concatenate([np.setdiff1d(keys, missing), np.array(extra_keys)]))
    out = {key: pa.array(ids.tolist(), log.schema.field(key).type)}
    for name, kind in columns.items():
        nulls = rng.random(len(ids)) < 0.05
        if kind == "float":
            out[name] = pa.array(rng.uniform(1.0, 80.0, len(ids)), mask=nulls)
        else:
            out[name] = pa.array([f"{name[0]}{k}" for k in rng.integers(0, 6, len(ids))],
                                 pa.string(), mask=nulls)
    return pa.table(out)


def user_features(rng, log):
    return feature_table(rng, log, "user_id", {"age": "float", "segment": "string"})


def item_features(rng, log):
    return feature_table(rng, log, "item_id", {"popularity": "float", "category": "string"})


def country_features(rng, log):
    return feature_table(rng, log, "country", {"gdp": "float", "region": "string"},
                         extra_keys=("nz", "ca"))


def joined_by_pandas(log: pa.Table, joins) -> pa.Table:
    """The log left-merged (pandas) with each (key, feature table) in turn, the log's order
    kept; a feature row with a null key joins nothing (recxla.data.joins)."""
    df = log.to_pandas()
    fields = list(log.schema)
    for key, table in joins:
        right = table.filter(pc.is_valid(table.column(key))).to_pandas()
        df = df.merge(right, on=key, how="left", sort=False, validate="many_to_one")
        fields += [f for f in table.schema if f.name != key]
    return pa.Table.from_pandas(df, schema=pa.schema(fields), preserve_index=False)


def write_transforms(folder) -> str:
    path = os.path.join(folder, "feature_fns.py")
    with open(path, "w") as f:
        f.write(TRANSFORMS)
    return path


def load_function(path: str, name: str):
    """The function `name` of the module file `path`, loaded by the test (the oracle's copy)."""
    spec = importlib.util.spec_from_file_location(f"oracle_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def converted(table: pa.Table, folder, name: str, rows_per_group: int, schema=None):
    """`table` written as Parquet and converted (source order kept): (dataset folder, spec)."""
    src = os.path.join(folder, f"{name}.parquet")
    pq.write_table(table, src)
    out = os.path.join(folder, f"{name}_converted")
    spec = convert(src, out, schema, rows_per_group=rows_per_group, sort_by=None,
                   progress=False, workers=1)
    return out, spec


def rows_by_id(batches, spec) -> list:
    """Every sample of `batches` as a row (data_pipeline_cases.to_rows), sorted by rid."""
    j = spec.dense_features.index("rid")
    return sorted((r for b in batches for r in to_rows(b)), key=lambda r: r[2][j])


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert_batches_equal(g, w)


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def divisor(rng, n: int, lo: int = 5, hi: int = 40) -> int:
    return int(rng.choice([b for b in range(lo, hi + 1) if n % b == 0]))


def write_raw(tmp_path, rng, n: int, rows_per_group: int, bucketed: bool):
    """log and users written to tmp_path (the log in row groups of `rows_per_group`, or both
    bucketed by user_id into NUM_BUCKETS): (log, users, log reference, users reference)."""
    log = click_log(rng, n)
    users = user_features(rng, log)
    pq.write_table(log, tmp_path / "log.parquet", row_group_size=rows_per_group)
    pq.write_table(users, tmp_path / "users.parquet")
    if not bucketed:
        return log, users, str(tmp_path / "log.parquet"), str(tmp_path / "users.parquet")
    write_buckets(tmp_path / "log.parquet", "user_id", NUM_BUCKETS, tmp_path / "log_b",
                  rows_per_group=rows_per_group)
    write_buckets(tmp_path / "users.parquet", "user_id", NUM_BUCKETS, tmp_path / "users_b",
                  rows_per_group=int(rng.integers(4, 12)))
    return log, users, str(tmp_path / "log_b"), str(tmp_path / "users_b")


# ---------------------------------------------------------------------------------------------
# 1. Transforms.

@pytest.mark.parametrize("with_schema", [False, True], ids=["inferred", "schema"])
def test_transforms_match_the_function_applied_by_hand(tmp_path, seed, with_schema):
    """The oracle applies the transform to the whole table at once (it is a function of each
    row), converts the result and reads it with shuffle=False; the read-time table applies it
    per row group. On one rank without a shuffle both streams are every row in file order
    (row groups one after another), so the batches compare exactly whatever the group
    boundaries after the filter. schema: a schema file for both, and a second transform that
    reads the first one's output (history cut to 3 ids)."""
    rng = np.random.default_rng(seed)
    n, rpg = int(rng.integers(250, 400)), int(rng.integers(20, 50))
    log = click_log(rng, n)
    raw = str(tmp_path / "log.parquet")
    pq.write_table(log, raw, row_group_size=rpg)
    fns = write_transforms(tmp_path)
    names = ["engineer"] + (["history_length"] if with_schema else [])
    schema = None
    if with_schema:
        schema = str(tmp_path / "schema.toml")
        with open(schema, "w") as f:
            f.write(SCHEMA)
    table = ReadTimeTable(raw, schema, transforms=[f"{fns}:{name}" for name in names])

    want = log.combine_chunks()
    for name in names:
        want = load_function(fns, name)(want.combine_chunks().to_batches()[0])
    assert 0 < want.num_rows < n
    out, spec = converted(want, tmp_path, "oracle", rpg, schema)
    assert table.spec == spec
    assert "country" not in spec.sparse_features
    assert {"price_bin", "user_country", "history"} <= set(spec.sparse_features)
    tables = {t.name: t for t in table.spec.tables}
    assert (tables["t_price_bin"].id_type, tables["t_price_bin"].mapping) == ("int", "vocab")
    assert tables["t_user_country"].id_type == "string"
    if with_schema:
        assert (tables["t_user_country"].mapping, tables["t_user_country"].num_rows) == (
            "hash", 53)
        assert tables["items"].features == ("item_id", "history")
        assert max(want.column("history_len").to_pylist()) <= 3

    # Per unit: the raw row group's rows the filter keeps, and their largest timestamp.
    keep = log.column("user_id").to_numpy() % 5 != 0
    stamps = log.column("timestamp").to_numpy()
    starts = range(0, n, rpg)
    assert [r for _, _, r in table.info.row_groups] == [int(keep[s:s + rpg].sum())
                                                         for s in starts]
    assert [table.info.largest_timestamp(i) for i in range(len(starts))] == [
        int(stamps[s:s + rpg][keep[s:s + rpg]].max(initial=0)) for s in starts]
    assert table.info.num_rows == want.num_rows

    b = int(rng.integers(5, 40))
    got = list(ParquetDataset(table, b, shuffle=False))
    assert len(got) == want.num_rows // b
    assert_same_batches(got, list(ParquetDataset(out, b, shuffle=False)))


def test_a_transform_may_empty_a_row_group(tmp_path, seed):
    """A filter that removes every row of one raw row group: that unit holds no rows and the
    stream is the others' rows (oracle as above)."""
    rng = np.random.default_rng(seed)
    n, rpg = 200, int(rng.integers(20, 40))
    log = click_log(rng, n)
    raw = str(tmp_path / "log.parquet")
    pq.write_table(log, raw, row_group_size=rpg)
    emptied = int(rng.integers(0, n // rpg))
    path = tmp_path / "drop_group.py"
    path.write_text(textwrap.dedent(f"""
        import pyarrow as pa
        import pyarrow.compute as pc


        def drop(batch):
            rid = batch.column("rid")
            inside = pc.and_(pc.greater_equal(rid, {emptied * rpg}.0),
                             pc.less(rid, {(emptied + 1) * rpg}.0))
            return pa.Table.from_batches([batch]).filter(pc.invert(inside))
    """))
    table = ReadTimeTable(raw, transforms=[f"{path}:drop"])
    assert table.info.row_groups[emptied][2] == 0
    assert table.info.num_rows == n - rpg
    rid = log.column("rid").to_numpy()
    want = log.filter(pa.array((rid < emptied * rpg) | (rid >= (emptied + 1) * rpg)))
    out, _ = converted(want, tmp_path, "oracle", rpg)
    b = int(rng.integers(5, 40))
    assert_same_batches(list(ParquetDataset(table, b, shuffle=False)),
                        list(ParquetDataset(out, b, shuffle=False)))
    # Shuffled (windows that hold the empty unit among others): each kept row at most once.
    ds = ParquetDataset(table, b, seed=int(rng.integers(0, 99)), shuffle_rows=2 * rpg)
    j = table.spec.dense_features.index("rid")
    rows = [r[2][j] for batch in ds for r in to_rows(batch)]
    assert len(rows) == len(set(rows)) == ds.num_batches(0) * b
    assert set(rows) <= set(want.column("rid").to_pylist())


# ---------------------------------------------------------------------------------------------
# 2. Joins.

@pytest.mark.parametrize("variant", ["unbucketed", "bucketed", "bucketed_and_items",
                                     "bucketed_by_country"])
def test_joins_match_a_pandas_merge(tmp_path, seed, variant):
    """The oracle: pandas left merges in the log's order, converted and read with
    shuffle=False. Unbucketed, the read-time table reads the log's rows in the same order:
    batches compare exactly. Bucketed, it reads bucket after bucket: every row of both (the
    batch size divides the rows) compared after sorting by rid. bucketed_and_items: a second
    join on item_id with an unbucketed items table (the log is not bucketed by item_id: one
    bucket on both sides). bucketed_by_country: a string key, log and countries bucketed by
    it (buckets of 6 countries, some maybe empty), then users joined unbucketed."""
    rng = np.random.default_rng(seed)
    n, rpg = 240, int(rng.integers(15, 40))
    bucketed = variant in ("bucketed", "bucketed_and_items")
    log, users, log_ref, users_ref = write_raw(tmp_path, rng, n, rpg, bucketed)
    joins, merges = [f"user_id={users_ref}"], [("user_id", users)]
    if variant == "bucketed_and_items":
        items = item_features(rng, log)
        pq.write_table(items, tmp_path / "items.parquet")
        joins.append(f"item_id={tmp_path / 'items.parquet'}")
        merges.append(("item_id", items))
    if variant == "bucketed_by_country":
        countries = country_features(rng, log)
        pq.write_table(countries, tmp_path / "countries.parquet")
        log_ref = str(tmp_path / "log_c")
        write_buckets(tmp_path / "log.parquet", "country", NUM_BUCKETS, log_ref,
                      rows_per_group=rpg)
        write_buckets(tmp_path / "countries.parquet", "country", NUM_BUCKETS,
                      tmp_path / "countries_b")
        joins.insert(0, f"country={tmp_path / 'countries_b'}")
        merges.insert(0, ("country", countries))
    table = ReadTimeTable(log_ref, joins=joins)
    if variant != "unbucketed":
        key = "country" if variant == "bucketed_by_country" else "user_id"
        assert table.source.buckets == {key: NUM_BUCKETS}
        assert [j.num_buckets for j in table.joiner.joins] == [NUM_BUCKETS, 1][:len(joins)]

    out, spec = converted(joined_by_pandas(log, merges), tmp_path, "oracle", rpg)
    assert table.spec == spec
    b = divisor(rng, n)
    got = list(ParquetDataset(table, b, shuffle=False))
    want = list(ParquetDataset(out, b, shuffle=False))
    assert len(got) == len(want) == n // b
    if variant == "unbucketed":
        assert_same_batches(got, want)
    rows = rows_by_id(got, spec)
    assert rows == rows_by_id(want, spec)
    assert [r[2][spec.dense_features.index("rid")] for r in rows] == list(range(n))

    # A user missing from the users table: no segment id (an empty bag), age 0.
    missing = set(log.column("user_id").to_pylist()) - set(users.column("user_id").to_pylist())
    seg, age = spec.sparse_features.index("segment"), spec.dense_features.index("age")
    user = log.column("user_id").to_pylist()
    assert missing
    for i, r in enumerate(rows):
        if user[i] in missing:
            assert r[0][seg] == [] and r[2][age] == 0.0


def test_a_null_key_joins_nothing(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = 60
    log = click_log(rng, n, num_users=6)
    null_rows = rng.random(n) < 0.3
    null_rows[0] = True
    log = log.set_column(0, "user_id", pa.array(log.column("user_id").to_numpy(), pa.int64(),
                                                mask=null_rows))
    users = pa.table({"user_id": pa.array(list(range(6)) + [None], pa.int64()),
                      "age": pa.array(rng.uniform(1.0, 80.0, 7)),
                      "segment": pa.array([f"s{i}" for i in range(7)])})
    pq.write_table(log, tmp_path / "log.parquet", row_group_size=15)
    pq.write_table(users, tmp_path / "users.parquet")
    table = ReadTimeTable(str(tmp_path / "log.parquet"),
                          joins=[f"user_id={tmp_path / 'users.parquet'}"])
    rows = rows_by_id(ParquetDataset(table, 10, shuffle=False), table.spec)
    seg, age = table.spec.sparse_features.index("segment"), table.spec.dense_features.index("age")
    got = [(r[0][seg], r[2][age]) for r, null in zip(rows, null_rows) if null]
    assert got == [([], 0.0)] * int(null_rows.sum())


def test_uint64_keys_beyond_int64_join(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = 60
    ids = np.concatenate([rng.integers(2**63, 2**64 - 1, 4, dtype=np.uint64, endpoint=True),
                          rng.integers(0, 1000, 4).astype(np.uint64)])
    log = pa.table({"user_id": pa.array(ids[rng.integers(0, len(ids), n)]),
                    "label": pa.array(rng.integers(0, 2, n)),
                    "rid": pa.array(np.arange(n, dtype=np.float64))})
    age = dict(zip(ids[:6].tolist(), rng.uniform(1.0, 80.0, 6).tolist()))  # 2 users missing
    users = pa.table({"user_id": pa.array(list(age), pa.uint64()),
                      "age": pa.array(list(age.values()))})
    pq.write_table(log, tmp_path / "log.parquet", row_group_size=20)
    pq.write_table(users, tmp_path / "users.parquet")
    table = ReadTimeTable(str(tmp_path / "log.parquet"),
                          joins=[f"user_id={tmp_path / 'users.parquet'}"])
    rows = rows_by_id(ParquetDataset(table, 10, shuffle=False), table.spec)
    j = table.spec.dense_features.index("age")
    assert [r[2][j] for r in rows] == [float(np.float32(age.get(u, 0.0)))
                                       for u in log.column("user_id").to_pylist()]


# ---------------------------------------------------------------------------------------------
# 3. Determinism, resume, ranks, bucket-major order.

def test_same_seed_same_batches_and_positions_resume(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n, rpg = 240, int(rng.integers(12, 30))
    _, _, log_ref, users_ref = write_raw(tmp_path, rng, n, rpg, bucketed=True)
    fns = write_transforms(tmp_path)
    args = dict(joins=[f"user_id={users_ref}"], transforms=[f"{fns}:engineer"])
    table = ReadTimeTable(log_ref, **args)
    b, s = int(rng.integers(5, 20)), int(rng.integers(0, 1000))
    kw = dict(shuffle=True, shuffle_rows=int(rng.integers(10, 60)), num_epochs=2)
    first = list(ParquetDataset(table, b, seed=s, **kw))
    # The table opened again (its own planning pass): the same batches.
    assert_same_batches(list(ParquetDataset(ReadTimeTable(log_ref, **args), b, seed=s, **kw)),
                        first)
    other = list(ParquetDataset(table, b, seed=s + 1, **kw))
    assert any(not torch_equal(g.dense, w.dense) for g, w in zip(other, first))

    def loader(position=None):
        return make_loader(table, b, 0, 1, s, loader="local", num_workers=1,
                           position=position, **kw)

    want = list(loader())
    assert_same_batches(want, first)  # the worker process reads what this process reads
    k = int(rng.integers(1, len(want)))
    it = iter(loader())
    for _ in range(k):
        next(it)
    position = json.loads(json.dumps(it.state_dict()))
    it.close()
    assert_same_batches(list(loader(position)), want[k:])


def test_a_position_resumes_only_the_same_table(tmp_path, seed):
    rng = np.random.default_rng(seed)
    log, _, log_ref, users_ref = write_raw(tmp_path, rng, 200, 25, bucketed=False)
    fns = write_transforms(tmp_path)

    def dataset(transform, position=None):
        table = ReadTimeTable(log_ref, joins=[f"user_id={users_ref}"],
                              transforms=[f"{fns}:{transform}"])
        return ParquetDataset(table, 8, seed=3, position=position)

    it = iter(dataset("engineer"))
    next(it)
    position = it.state_dict()
    it.close()
    assert dataset("engineer", position).start == (0, 1)  # the same table, opened again
    with pytest.raises(ValueError, match="position was saved with dataset="):
        dataset("cross", position)
    pq.write_table(user_features(rng, log), users_ref)  # other user features
    with pytest.raises(ValueError, match="position was saved with dataset="):
        dataset("engineer", position)


def test_a_module_transform_loads_from_the_working_folder(tmp_path, monkeypatch):
    """"module:function" imports the module from the working folder; a worker process in
    another folder that cannot import it loads it from the file it came from."""
    log = click_log(np.random.default_rng(0), 50)
    pq.write_table(log, tmp_path / "log.parquet", row_group_size=20)
    with open(tmp_path / "rt_module_fns.py", "w") as f:
        f.write(TRANSFORMS)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader may add the working folder
    monkeypatch.chdir(tmp_path)
    try:
        table = ReadTimeTable(str(tmp_path / "log.parquet"), transforms=["rt_module_fns:cross"])
        by_file = ReadTimeTable(str(tmp_path / "log.parquet"),
                                transforms=[f"{tmp_path / 'rt_module_fns.py'}:cross"])
        blob = pickle.dumps(table)
    finally:
        sys.modules.pop("rt_module_fns", None)
    assert_same_batches(list(ParquetDataset(table, 10, shuffle=False)),
                        list(ParquetDataset(by_file, 10, shuffle=False)))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        moved = pickle.loads(blob)
    finally:
        sys.modules.pop("rt_module_fns", None)
    assert_same_batches(list(ParquetDataset(moved, 10, shuffle=False)),
                        list(ParquetDataset(by_file, 10, shuffle=False)))


def test_a_relative_file_transform_loads_in_another_folder(tmp_path, monkeypatch):
    log = click_log(np.random.default_rng(0), 50)
    pq.write_table(log, tmp_path / "log.parquet", row_group_size=20)
    write_transforms(tmp_path)
    monkeypatch.chdir(tmp_path)
    table = ReadTimeTable(str(tmp_path / "log.parquet"), transforms=["feature_fns.py:cross"])
    blob = pickle.dumps(table)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    moved = pickle.loads(blob)  # what a Ray task started in another folder does
    assert_same_batches(list(ParquetDataset(moved, 10, shuffle=False)),
                        list(ParquetDataset(table, 10, shuffle=False)))


@pytest.mark.parametrize("bucketed", [False, True], ids=["unbucketed", "bucketed"])
def test_two_ranks_read_disjoint_rows(tmp_path, seed, bucketed):
    """Unbucketed: 8 row groups of 30 rows, each rank's 120 rows fill whole batches, so the
    two ranks' rows are the epoch's every row. Bucketed (groups of other sizes): disjoint,
    each rank num_batches * B rows."""
    rng = np.random.default_rng(seed)
    n = 240
    _, _, log_ref, users_ref = write_raw(tmp_path, rng, n, 30, bucketed)
    fns = write_transforms(tmp_path)
    table = ReadTimeTable(log_ref, joins=[f"user_id={users_ref}"], transforms=[f"{fns}:cross"])
    assert len(table.info.row_groups) == 8 or bucketed
    b, s = divisor(rng, n // 2, 4, 30), int(rng.integers(0, 1000))
    j = table.spec.dense_features.index("rid")
    per_epoch = []
    for rank in range(2):
        ds = ParquetDataset(table, b, rank, 2, s, shuffle_rows=int(rng.integers(0, 70)),
                            num_epochs=2)
        rows = [r[2][j] for batch in ds for r in to_rows(batch)]
        cut = ds.num_batches(0) * b
        per_epoch.append((rows[:cut], rows[cut:]))
        assert len(rows) == cut + ds.num_batches(1) * b
    for epoch in range(2):
        a, c = (per_epoch[r][epoch] for r in range(2))
        assert len(set(a)) == len(a) and len(set(c)) == len(c)
        assert not set(a) & set(c)
        assert set(a) | set(c) <= set(range(n))
        if not bucketed:
            assert set(a) | set(c) == set(range(n))


def test_bucket_joins_keep_each_bucket_together(tmp_path, seed, monkeypatch):
    rng = np.random.default_rng(seed)
    _, _, log_ref, users_ref = write_raw(tmp_path, rng, 300, int(rng.integers(8, 16)), True)
    table = ReadTimeTable(log_ref, joins=[f"user_id={users_ref}"])
    info = table.info
    n = len(info.row_groups)
    assert n > 2 * NUM_BUCKETS
    s = int(rng.integers(0, 1000))
    orders = set()
    for world_size, epoch in itertools.product((1, 2), range(4)):
        groups = []
        for rank in range(world_size):
            plan = EpochPlan(info, 4, rank, world_size, s, True, epoch, 40)
            buckets = [info.bucket_of_group(g) for g in plan.groups]
            runs = [k for k, _ in itertools.groupby(buckets)]
            assert len(runs) == len(set(buckets)), runs  # no bucket comes back
            groups += plan.groups
            if world_size == 1:
                orders.add(tuple(runs))
        assert sorted(groups) == list(range(n))
    assert len(orders) > 1  # the buckets' order is drawn anew every epoch

    # The reader loads each bucket of the users table once per epoch, not once per group.
    loads = []
    real = TableSource.read_bucket
    monkeypatch.setattr(TableSource, "read_bucket",
                        lambda *a, **k: loads.append(a[1:]) or real(*a, **k))
    assert len(list(ParquetDataset(table, 4, seed=s, shuffle_rows=40, prefetch=0))) > 0
    assert 0 < len(loads) <= NUM_BUCKETS < n


# ---------------------------------------------------------------------------------------------
# 4. Iceberg.

def iceberg_catalog(tmp_path, name: str = CATALOG):
    """A SQL catalog on SQLite at tmp_path/cat.db, warehouse tmp_path/warehouse (where
    recxla's loader looks), namespace "db": (catalog, reference prefix "iceberg:...#db.")."""
    pytest.importorskip("pyiceberg")
    from pyiceberg.catalog.sql import SqlCatalog

    db = tmp_path / "cat.db"
    catalog = SqlCatalog(name, uri=f"sqlite:///{db}", warehouse=f"file://{tmp_path}/warehouse")
    catalog.create_namespace("db")
    return catalog, f"iceberg:sqlite:///{db}#db."


def iceberg_table(catalog, name: str, data: pa.Table, buckets=None, rows_per_group=None):
    """`data` as the table db.<name>, partitioned by bucket(user_id, buckets) if given."""
    from pyiceberg.transforms import BucketTransform

    props = {} if rows_per_group is None else {
        "write.parquet.row-group-limit": str(rows_per_group)}
    table = catalog.create_table(f"db.{name}", schema=data.schema, properties=props)
    if buckets is not None:
        with table.update_spec() as spec:
            spec.add_field("user_id", BucketTransform(buckets), "user_id_bucket")
    table.append(data)
    return table


def folder_rows(tmp_path, log: pa.Table, users: pa.Table, b: int):
    """The rows (sorted by rid) and spec of the same tables as bucketed Parquet folders."""
    folder = tmp_path / "folders"
    folder.mkdir(exist_ok=True)
    pq.write_table(log, folder / "log.parquet")
    pq.write_table(users, folder / "users.parquet")
    write_buckets(folder / "log.parquet", "user_id", NUM_BUCKETS, folder / "log_b",
                  rows_per_group=25)
    write_buckets(folder / "users.parquet", "user_id", NUM_BUCKETS, folder / "users_b")
    table = ReadTimeTable(str(folder / "log_b"), joins=[f"user_id={folder / 'users_b'}"])
    return rows_by_id(ParquetDataset(table, b, shuffle=False), table.spec), table.spec


def test_iceberg_tables_read_as_the_parquet_folders(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = 200
    log = click_log(rng, n)
    users = user_features(rng, log)
    catalog, ref = iceberg_catalog(tmp_path)
    iceberg_table(catalog, "log", log, NUM_BUCKETS, rows_per_group=int(rng.integers(10, 30)))
    iceberg_table(catalog, "users", users, NUM_BUCKETS)
    table = ReadTimeTable(ref + "log", joins=[f"user_id={ref}users"])
    assert table.source.kind == "iceberg" and table.source.buckets == {"user_id": NUM_BUCKETS}
    assert table.joiner.joins[0].num_buckets == NUM_BUCKETS
    b = divisor(rng, n)
    want, spec = folder_rows(tmp_path, log, users, b)
    assert table.spec == spec
    assert rows_by_id(ParquetDataset(table, b, shuffle=False), spec) == want


def test_iceberg_snapshots_pin_the_rows(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n, m = 200, 40
    log = click_log(rng, n)
    users = user_features(rng, log)
    catalog, ref = iceberg_catalog(tmp_path)
    log_table = iceberg_table(catalog, "log", log, NUM_BUCKETS)
    iceberg_table(catalog, "users", users, NUM_BUCKETS)
    joins = [f"user_id={ref}users"]
    b = int(rng.choice([8, 10, 20, 40]))  # divides n and n + m
    first = ReadTimeTable(ref + "log", joins=joins)
    rows = rows_by_id(ParquetDataset(first, b, shuffle=False), first.spec)
    assert len(rows) == n and all(isinstance(s, int) for s in first.snapshots)

    log_table.append(click_log(rng, m, first_rid=n))
    pinned = ReadTimeTable(ref + "log", joins=joins, snapshots=first.snapshots)
    assert pinned.snapshots == first.snapshots
    assert pinned.info.fingerprint == first.info.fingerprint
    assert rows_by_id(ParquetDataset(pinned, b, shuffle=False), pinned.spec) == rows
    by_ref = ReadTimeTable(f"{ref}log@{first.snapshots[0]}", joins=joins)
    assert by_ref.info.fingerprint == first.info.fingerprint
    current = ReadTimeTable(ref + "log", joins=joins)
    assert current.info.num_rows == n + m
    assert current.snapshots[0] != first.snapshots[0]
    assert current.info.fingerprint != first.info.fingerprint

    bad = max(first.snapshots[0], current.snapshots[0]) + 12345
    before = files_under(tmp_path)
    with pytest.raises(ValueError, match=rf"snapshot {bad} no longer exists"):
        ReadTimeTable(ref + "log", joins=joins, snapshots=[bad, None])
    with pytest.raises(ValueError, match=rf"snapshot {bad} no longer exists"):
        ReadTimeTable(f"{ref}log@{bad}", joins=joins)
    with pytest.raises(ValueError,
                       match=rf"--join user_id {re.escape(ref)}users: snapshot {bad} no "):
        ReadTimeTable(ref + "log", joins=joins, snapshots=[None, bad])
    assert files_under(tmp_path) == before


def test_iceberg_renamed_and_added_columns(tmp_path, seed):
    """price renamed cost and a column coupon added, then rows appended under the new schema:
    the files written before are read by field id, their price under the name cost, coupon
    as nulls (no id)."""
    pytest.importorskip("pyiceberg")
    from pyiceberg.types import StringType

    rng = np.random.default_rng(seed)
    n, m = 160, 40
    log = click_log(rng, n)
    users = user_features(rng, log)
    catalog, ref = iceberg_catalog(tmp_path)
    log_table = iceberg_table(catalog, "log", log, NUM_BUCKETS)
    iceberg_table(catalog, "users", users, NUM_BUCKETS)
    with log_table.update_schema() as update:
        update.rename_column("price", "cost")
        update.add_column("coupon", StringType())
    more = click_log(rng, m, first_rid=n).rename_columns(
        ["cost" if c == "price" else c for c in log.column_names])
    more = more.append_column("coupon", pa.array(rng.choice(["c1", "c2"], m).tolist()))
    log_table.append(more)
    table = ReadTimeTable(ref + "log", joins=[f"user_id={ref}users"])
    assert "cost" in table.spec.dense_features and "price" not in table.spec.dense_features
    assert "coupon" in table.spec.sparse_features
    b = int(rng.choice([8, 10, 20, 40]))
    old = log.rename_columns(more.column_names[:-1]).append_column(
        "coupon", pa.nulls(n, pa.string()))
    want, spec = folder_rows(tmp_path, pa.concat_tables([old, more]), users, b)
    assert table.spec == spec
    assert rows_by_id(ParquetDataset(table, b, shuffle=False), spec) == want


def test_iceberg_rename_is_seen_from_the_next_snapshot(tmp_path, seed):
    """A snapshot is read with its own schema (what it reads never changes): a rename shows
    once a write makes a snapshot after it."""
    rng = np.random.default_rng(seed)
    log = click_log(rng, 60)
    catalog, ref = iceberg_catalog(tmp_path)
    log_table = iceberg_table(catalog, "log", log, NUM_BUCKETS)
    with log_table.update_schema() as update:
        update.rename_column("price", "cost")
    assert "price" in ReadTimeTable(ref + "log").spec.dense_features
    log_table = catalog.load_table(log_table.name())
    log_table.append(click_log(rng, 20).rename_columns(
        ["cost" if c == "price" else c for c in log.column_names]).cast(
            log_table.schema().as_arrow()))
    assert "cost" in ReadTimeTable(ref + "log").spec.dense_features


def test_iceberg_null_keys_read_shuffled(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = 80
    log = click_log(rng, n, num_users=8)
    nulls = rng.random(n) < 0.2
    nulls[0] = True
    log = log.set_column(0, "user_id", pa.array(log.column("user_id").to_numpy(), pa.int64(),
                                                mask=nulls))
    users = user_features(rng, log.filter(pc.is_valid(log.column("user_id"))))
    catalog, ref = iceberg_catalog(tmp_path)
    iceberg_table(catalog, "log", log, NUM_BUCKETS)
    iceberg_table(catalog, "users", users, NUM_BUCKETS)
    table = ReadTimeTable(ref + "log", joins=[f"user_id={ref}users"])
    rows = rows_by_id(ParquetDataset(table, 8, seed=int(rng.integers(0, 99))), table.spec)
    assert len(rows) == n
    seg = table.spec.sparse_features.index("segment")
    assert all(r[0][seg] == [] for r, null in zip(rows, nulls) if null)


def test_iceberg_bucket_counts_that_differ_name_both_sides(tmp_path, seed):
    rng = np.random.default_rng(seed)
    log = click_log(rng, 60)
    catalog, ref = iceberg_catalog(tmp_path)
    iceberg_table(catalog, "log", log, NUM_BUCKETS)
    iceberg_table(catalog, "users", user_features(rng, log), 2)
    before = files_under(tmp_path)
    at = re.escape(ref)
    with pytest.raises(ValueError, match=rf"training table {at}log is in {NUM_BUCKETS} "
                       rf"bucket\(s\) of 'user_id', the feature table {at}users in 2"):
        ReadTimeTable(ref + "log", joins=[f"user_id={ref}users"])
    assert files_under(tmp_path) == before


def test_iceberg_catalog_names(tmp_path, seed):
    """A database of one catalog name opens under that name; one of two names is an error
    naming both, and "?catalog=NAME" picks one."""
    rng = np.random.default_rng(seed)
    catalog, ref = iceberg_catalog(tmp_path, name="first")
    iceberg_table(catalog, "log", click_log(rng, 40))
    assert ReadTimeTable(ref + "log").info.num_rows == 40
    other, _ = iceberg_catalog(tmp_path, name="second")
    iceberg_table(other, "log", click_log(rng, 30))
    with pytest.raises(ValueError, match=r"holds the catalogs \['first', 'second'\]: name one"):
        ReadTimeTable(ref + "log")
    db = ref[:-len("#db.")]
    assert ReadTimeTable(f"{db}?catalog=second#db.log").info.num_rows == 30
    assert ReadTimeTable(f"{db}?catalog=first#db.log").info.num_rows == 40


# ---------------------------------------------------------------------------------------------
# 5. Errors: each names what the docstrings say, and nothing is written.

def files_under(folder) -> dict:
    """relative path -> (size, mtime) of every file under `folder` (Python's own bytecode
    caches of the transforms' modules aside)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            st = os.stat(os.path.join(root, f))
            out[os.path.relpath(os.path.join(root, f), folder)] = (st.st_size, st.st_mtime_ns)
    return out


BAD_TRANSFORMS = '''
import numpy as np
import pyarrow as pa


def _first_rid(batch):
    return int(batch.column("rid")[0].as_py())


def boom(batch):
    if _first_rid(batch) == {bad_group} * {rpg}:
        raise KeyError("no such price")
    return batch


def as_dict(batch):
    return batch.to_pydict()


def columns_vary(batch):
    t = pa.Table.from_batches([batch])
    if _first_rid(batch) >= {rpg}:
        t = t.append_column("extra", pa.array(np.ones(t.num_rows)))
    return t


def random_rows(batch):
    return pa.Table.from_batches([batch]).slice(0, batch.num_rows - np.random.randint(0, 10))
'''


@pytest.fixture
def raw(tmp_path, seed):
    """tmp_path/data: log.parquet (row groups of rpg rows), users.parquet, both bucketed by
    user_id into NUM_BUCKETS (log_b, users_b) and users into 2 (users_b2); tmp_path/fns:
    the failing transforms."""
    rng = np.random.default_rng(seed)
    rpg = int(rng.integers(15, 30))
    data = tmp_path / "data"
    data.mkdir()
    log, users, _, _ = write_raw(data, rng, 150, rpg, bucketed=True)
    write_buckets(data / "users.parquet", "user_id", 2, data / "users_b2")
    (tmp_path / "fns").mkdir()
    bad_group = int(rng.integers(1, 150 // rpg))
    fns = tmp_path / "fns" / "bad_fns.py"
    fns.write_text(BAD_TRANSFORMS.format(bad_group=bad_group, rpg=rpg))
    return dict(data=data, log=log, users=users, rng=rng, rpg=rpg, bad_group=bad_group,
                fns=str(fns))


def _with_users(raw, name: str, users: pa.Table) -> str:
    path = raw["data"] / f"{name}.parquet"
    pq.write_table(users, path)
    return str(path)


def _swap_bucket_files(folder, a: int, b: int) -> None:
    pa_, pb = (os.path.join(folder, f"user_id_bucket={i}", "part-00000.parquet") for i in (a, b))
    os.rename(pa_, pa_ + ".tmp")
    os.rename(pb, pa_)
    os.rename(pa_ + ".tmp", pb)


def case_key_missing_in_training(raw):
    return dict(joins=[f"segment={raw['data'] / 'users.parquet'}"]), ValueError, (
        r"join of the training table \S+log\.parquet with the feature table \S+users\.parquet "
        r"on 'segment': the training table \S+log\.parquet has no column 'segment'")


def case_key_missing_in_features(raw):
    return dict(joins=[f"country={raw['data'] / 'users.parquet'}"]), ValueError, (
        r"join of the training table \S+log\.parquet with the feature table \S+users\.parquet "
        r"on 'country': the feature table \S+users\.parquet has no column 'country'")


def case_key_types_differ(raw):
    users = raw["users"].set_column(0, "user_id", raw["users"].column("user_id").cast(pa.string()))
    path = _with_users(raw, "users_str", users)
    return dict(joins=[f"user_id={path}"]), ValueError, (
        r"the key is int64 in the training table \S+log\.parquet and string in the feature "
        r"table \S+users_str\.parquet: both must be integers or both strings")


def case_bucket_counts_differ(raw):
    return dict(ref=str(raw["data"] / "log_b"), joins=[f"user_id={raw['data'] / 'users_b2'}"]
                ), ValueError, (r"the training table \S+log_b is in 4 bucket\(s\) of "
                                r"'user_id', the feature table \S+users_b2 in 2")


def case_bucketed_log_unbucketed_users(raw):
    users = raw["data"] / "users.parquet"
    return dict(ref=str(raw["data"] / "log_b"), joins=[f"user_id={users}"]), ValueError, (
        r"log_b is in 4 bucket\(s\) of 'user_id', the feature table \S+users\.parquet in 1")


def case_column_clash(raw):
    users = raw["users"].append_column("price", pa.array(np.ones(raw["users"].num_rows)))
    path = _with_users(raw, "users_price", users)
    return dict(joins=[f"user_id={path}"]), ValueError, (
        r"column 'price' of the feature table \S+users_price\.parquet is also a column of the "
        r"training table \S+log\.parquet")


def case_duplicate_key(raw):
    users = raw["users"]
    i = int(raw["rng"].integers(0, users.num_rows))
    twice = users.column("user_id")[i].as_py()
    path = _with_users(raw, "users_dup", pa.concat_tables([users, users.slice(i, 1)]))
    return dict(joins=[f"user_id={path}"]), DataFormatError, (
        rf"key {twice} appears more than once in the feature table \S+users_dup\.parquet")


def case_feature_row_in_another_bucket(raw):
    folder = raw["data"] / "users_b"
    _swap_bucket_files(folder, 1, 2)
    return dict(ref=str(raw["data"] / "log_b"), joins=[f"user_id={folder}"]), DataFormatError, (
        r"the feature table \S+users_b holds key \d+ in bucket [12], but Iceberg's bucket "
        r"transform puts it in bucket [12]")


def case_training_row_in_another_bucket(raw):
    folder = raw["data"] / "log_b"
    _swap_bucket_files(folder, 0, 3)
    return dict(ref=str(folder), joins=[f"user_id={raw['data'] / 'users_b'}"]), \
        DataFormatError, r"user_id_bucket=[03]\S* row group \d+ lies in bucket [03] but holds key"


def case_bucket_folder_missing(raw):
    shutil.rmtree(raw["data"] / "users_b" / "user_id_bucket=2")
    return dict(ref=str(raw["data"] / "log_b"), joins=[f"user_id={raw['data'] / 'users_b'}"]
                ), DataFormatError, r"--join user_id \S+users_b: bucket folder\(s\) " \
        r"user_id_bucket=2 missing of 4"


def case_transform_raises(raw):
    name = f"{raw['fns']}:boom"
    return dict(transforms=[name]), TransformError, (
        rf"transform {name} raised on \S+log\.parquet: \S+log\.parquet row group "
        rf"{raw['bad_group']}: KeyError: 'no such price'")


def case_transform_returns_a_dict(raw):
    return dict(transforms=[f"{raw['fns']}:as_dict"]), TransformError, (
        r"transform \S+bad_fns\.py:as_dict returned dict on \S+: \S+log\.parquet row group 0")


def case_transform_columns_vary(raw):
    return dict(transforms=[f"{raw['fns']}:columns_vary"]), DataFormatError, (
        r"log\.parquet row group 1: after the joins and transforms the columns are \[.*, "
        r"extra: double\], in \S+log\.parquet row group 0 \[.*rid: double\]: a transform must "
        r"return the same columns")


def case_missing_module(raw):
    return dict(transforms=["recxla_no_such_module_for_tests:fn"]), ValueError, (
        r"transform 'recxla_no_such_module_for_tests:fn': no module "
        r"'recxla_no_such_module_for_tests'")


def case_missing_function_in_module(raw):
    return dict(transforms=["json:no_such_function"]), ValueError, (
        r"transform 'json:no_such_function': json has no function 'no_such_function'")


def case_missing_function_in_file(raw):
    return dict(transforms=[f"{raw['fns']}:nope"]), ValueError, (
        r"bad_fns\.py has no function 'nope'")


def case_missing_file(raw):
    return dict(transforms=[f"{raw['data']}/absent.py:fn"]), FileNotFoundError, (
        r"absent\.py: no such file")


def case_malformed_transform_name(raw):
    return dict(transforms=["no_colon"]), ValueError, r"module:function or file\.py:function"


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items()
         if name.startswith("case_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_errors_name_the_fault_and_write_nothing(tmp_path, raw, case):
    args, error, match = CASES[case](raw)
    ref = args.pop("ref", str(raw["data"] / "log.parquet"))
    before = files_under(tmp_path)
    with pytest.raises(error, match=match):
        ReadTimeTable(ref, **args)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("text", ["=users.parquet", "user_id=", "user_id users.parquet"])
def test_malformed_joins(tmp_path, raw, text):
    with pytest.raises(ValueError, match="a join is KEY=TABLE"):
        ReadTimeTable(str(raw["data"] / "log.parquet"), joins=[text])


def test_a_transform_that_is_not_a_function_of_its_batch(tmp_path, raw):
    """Planned with one random drop per row group, read with others: the read of a row
    group whose row count differs from the plan's fails, naming both counts and the unit."""
    table = ReadTimeTable(str(raw["data"] / "log.parquet"),
                          transforms=[f"{raw['fns']}:random_rows"])
    before = files_under(tmp_path)
    with pytest.raises(DataFormatError, match=r"log\.parquet row group \d+: the transforms gave "
                       r"\d+ rows, \d+ when the table was planned"):
        for _ in ParquetDataset(table, 2, shuffle=False, num_epochs=3):
            pass
    assert files_under(tmp_path) == before


def test_a_missing_key_names_both_tables(raw):
    users = str(raw["data"] / "users.parquet")
    with pytest.raises(ValueError, match=r"training table \S+log\.parquet.*feature table "
                       r"\S+users\.parquet"):
        ReadTimeTable(str(raw["data"] / "log.parquet"), joins=[f"segment={users}"])


def test_bucket_of_agrees_with_the_folders_the_reader_reads(raw):
    """The units of a bucketed folder hold the rows whose bucket_of is their folder's."""
    table = ReadTimeTable(str(raw["data"] / "log_b"),
                          joins=[f"user_id={raw['data'] / 'users_b'}"])
    for i, unit in enumerate(table.source.units):
        rows = table.source.read(i).column("user_id")
        assert (bucket_of(rows, NUM_BUCKETS) == unit.bucket_of("user_id")).all()


@pytest.mark.parametrize("kind", ["int", "string", "colliding strings"])
def test_key_index_finds_what_index_in_finds(kind, seed, monkeypatch):
    """KeyIndex (a bucket's keys sorted once, binary searched per unit) against pyarrow's
    index_in: random keys with nulls, keys missing from the bucket, and for strings a hash that
    collides for most keys (every string's length), which must fall back to exact matching."""
    rng = np.random.default_rng(seed)
    right = rng.choice(1 << 40, 300, replace=False).astype(np.int64)
    left = np.concatenate([rng.choice(right, 500), rng.integers(0, 1 << 40, 200)])
    rng.shuffle(left)
    if kind == "int":
        r, lf = pa.array(right, pa.int64()), pa.array(left, pa.int64())
    else:
        r = pa.array([f"k{v}" for v in right], pa.large_string())
        lf = pa.array([f"k{v}" for v in left], pa.large_string())
    if kind == "colliding strings":
        monkeypatch.setattr(joins, "string_keys",
                            lambda a: pc.utf8_length(a).to_numpy().astype(np.int64))
    r = pa.array(r.to_pylist() + [None])  # a feature row without a key matches nothing
    r = r.cast(pa.int64() if kind == "int" else pa.large_string())
    nulls = rng.random(len(lf)) < 0.1
    lf = pa.array(lf.to_pylist(), lf.type, mask=nulls)
    index = joins.KeyIndex(r, "user_id", "the feature table t")
    got = index.lookup(lf)
    want = pc.index_in(lf, value_set=r, skip_nulls=True)
    assert got.to_pylist() == want.to_pylist()
    assert got.null_count > nulls.sum()  # some keys are missing, beyond the null ones


def test_transforms_see_plain_string_and_list_types():
    """Iceberg's readers give large_string / large_list columns, Parquet's string / list: a
    transform is given string and list either way (nested lists too), the values unchanged."""
    from recxla.data.transforms import as_batch

    large = pa.table({"zip": pa.array(["02139", None], pa.large_string()),
                      "items": pa.array([[1, 2], []], pa.large_list(pa.int64())),
                      "tags": pa.array([[["a"]], [[]]], pa.large_list(pa.large_list(
                          pa.large_string())))})
    batch = as_batch(large)
    assert batch.schema.field("zip").type == pa.string()
    assert batch.schema.field("items").type == pa.list_(pa.int64())
    assert batch.schema.field("tags").type == pa.list_(pa.list_(pa.string()))
    assert batch.to_pydict() == large.to_pydict()
    plain = pa.table({"zip": pa.array(["02139"], pa.string())})
    assert as_batch(plain).schema == plain.schema


def test_a_transforms_digest_covers_the_helper_modules_it_uses(tmp_path, monkeypatch):
    """Editing a module that the transform's file imports (directly or through another of the
    job's modules) changes the transform's digest, so a resume on other features is refused;
    installed packages (pyarrow) are not the job's and are left out."""
    from recxla.data.transforms import Transform

    (tmp_path / "rt_helper_inner.py").write_text("SHIFT = 1\n")
    (tmp_path / "rt_helper.py").write_text(
        "import rt_helper_inner\n\ndef level(x):\n    return x + rt_helper_inner.SHIFT\n")
    (tmp_path / "rt_uses_helper.py").write_text(
        "import pyarrow as pa\nfrom rt_helper import level\n\n"
        "def derive(batch):\n    return batch\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    names = ("rt_helper_inner", "rt_helper", "rt_uses_helper")

    def digest() -> str:
        for name in names:
            sys.modules.pop(name, None)
        try:
            return Transform("rt_uses_helper:derive").digest
        finally:
            for name in names:
                sys.modules.pop(name, None)

    first = digest()
    assert digest() == first  # nothing edited, the same digest
    (tmp_path / "rt_helper_inner.py").write_text("SHIFT = 2\n")
    edited_inner = digest()
    (tmp_path / "rt_helper.py").write_text(
        "import rt_helper_inner\n\ndef level(x):\n    return x - rt_helper_inner.SHIFT\n")
    assert len({first, edited_inner, digest()}) == 3


@pytest.mark.parametrize("where", ["at import", "on a batch"])
def test_a_transform_calling_sys_exit_is_an_error_naming_it(tmp_path, where):
    """sys.exit in a transform never ends the job quietly: it is a TransformError naming it."""
    from recxla.data.transforms import Transform, TransformError

    body = "import sys\nsys.exit(0)\n" if where == "at import" else ""
    (tmp_path / "exits.py").write_text(body + "import sys\n\ndef derive(batch):\n"
                                       "    sys.exit(0)\n")
    name = f"{tmp_path / 'exits.py'}:derive"
    with pytest.raises(TransformError, match=r"exits.py.*raised SystemExit|raised on unit 3: "
                       r"SystemExit"):
        Transform(name)(pa.record_batch({"a": [1]}), "unit 3")


def test_an_iceberg_table_naming_code_is_refused_and_nothing_runs(tmp_path, seed, monkeypatch):
    """A table whose metadata names a FileIO class (pyiceberg's py-io-impl) is refused, naming
    the property, and the module it names is never imported; damaged metadata is one error
    naming the table, not pyiceberg's traceback."""
    from recxla.data.table_source import open_table

    catalog, prefix = iceberg_catalog(tmp_path)
    table = iceberg_table(catalog, "log", click_log(np.random.default_rng(seed), 40))
    marker = tmp_path / "ran"
    (tmp_path / "rt_table_code.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\nclass IO:\n    def __init__(self, p):\n"
        "        pass\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    # Written into the metadata file as another writer would (pyiceberg's own commit would
    # load the class itself).
    path = table.metadata_location.removeprefix("file://")
    with open(path) as f:
        metadata = json.load(f)
    metadata["properties"]["py-io-impl"] = "rt_table_code.IO"
    with open(path, "w") as f:
        json.dump(metadata, f)
    with pytest.raises(DataFormatError, match=r"its metadata names a Python class to load "
                       r"\(py-io-impl = 'rt_table_code.IO'\); recxla runs no code"):
        open_table(prefix + "log")
    assert not marker.exists() and "rt_table_code" not in sys.modules

    damaged = iceberg_table(catalog, "damaged", click_log(np.random.default_rng(seed), 40))
    path = damaged.metadata_location.removeprefix("file://")
    with open(path, "w") as f:
        f.write('{"format-version": 2, "table-uuid": ')
    with pytest.raises(DataFormatError, match=r"db.damaged: unreadable table metadata") as e:
        open_table(prefix + "damaged")
    assert "\n" not in str(e.value)
