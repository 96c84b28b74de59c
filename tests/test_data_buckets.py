"""recxla.data.buckets: Iceberg's bucket transform (pyiceberg as the oracle), the bucket folder
names, `write_buckets` (round trip, streaming order, errors leaving nothing behind), the
`bucket` command, and an Iceberg table bucketed by the same key agreeing file for file."""

import errno
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recxla.data import buckets
from recxla.data.__main__ import main as data_main
from recxla.data.buckets import (
    PART_FILE,
    _murmur3_long,
    _murmur3_utf8,
    bucket_folder_name,
    bucket_of,
    parse_bucket_folder,
    write_buckets,
)
from recxla.data.convert_output import OutputError

NUM_BUCKETS = (1, 2, 7, 16, 1000)
# Every UTF-8 length (1 to 4 bytes) and every tail length (len % 4) of murmur3.
_ALPHABET = list("abcXYZ09 _-/") + ["é", "ß", "Ж", "中", "文", "€", "😀", "𝄞", "\u0000"]


def iceberg_buckets(values, num_buckets: int, string: bool) -> np.ndarray:
    """pyiceberg's bucket of every value (None: bucket 0, recxla's place for null keys)."""
    from pyiceberg.transforms import BucketTransform
    from pyiceberg.types import LongType, StringType

    f = BucketTransform(num_buckets).transform(StringType() if string else LongType())
    return np.array([0 if v is None else f(v) for v in values], dtype=np.int32)


def random_longs(rng, n: int) -> np.ndarray:
    edges = np.array([0, -1, 1, 2**63 - 1, -2**63, 2**31 - 1, -2**31, 34], dtype=np.int64)
    return rng.permutation(np.concatenate([
        edges, rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True),
        rng.integers(-1000, 1000, n // 4, dtype=np.int64)]))


def random_strings(rng, n: int) -> list:
    strings = ["", "iceberg"] + ["".join(rng.choice(_ALPHABET, rng.integers(0, 14)))
                                 for _ in range(n)]
    return [strings[i] for i in rng.permutation(len(strings))]


def test_spec_reference_hashes():
    # Iceberg's spec, "Bucket Transform Details": hash(34L) and hash("iceberg").
    assert _murmur3_long(np.array([34], dtype=np.int64)).tolist() == [2017239379]
    assert _murmur3_utf8(pa.array(["iceberg"])).tolist() == [1210000089]
    assert _murmur3_utf8(pa.array(["iceberg"], pa.large_string())).tolist() == [1210000089]


@pytest.mark.parametrize("num_buckets", NUM_BUCKETS)
def test_int64_matches_iceberg(seed, num_buckets):
    pytest.importorskip("pyiceberg")
    values = random_longs(np.random.default_rng(seed), 2000)
    got = bucket_of(pa.array(values), num_buckets)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, iceberg_buckets(values.tolist(), num_buckets, False))


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "uint8", "uint16", "uint32",
                                   "uint64"])
def test_other_integer_types_hash_as_the_long(seed, dtype):
    pytest.importorskip("pyiceberg")
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    values = np.concatenate([np.array([info.min, info.max, 0], dtype=dtype),
                             rng.integers(info.min, info.max, 500, dtype=dtype, endpoint=True)])
    # uint64 above 2**63: the int64 with the same bits (Iceberg has no unsigned longs).
    as_long = values.view(np.int64) if dtype == "uint64" else values.astype(np.int64)
    for n in (7, 1000):
        np.testing.assert_array_equal(bucket_of(pa.array(values), n),
                                      iceberg_buckets(as_long.tolist(), n, False))


@pytest.mark.parametrize("num_buckets", NUM_BUCKETS)
@pytest.mark.parametrize("string_type", [pa.string(), pa.large_string()])
def test_strings_match_iceberg(seed, num_buckets, string_type):
    pytest.importorskip("pyiceberg")
    strings = random_strings(np.random.default_rng(seed), 1500)
    got = bucket_of(pa.array(strings, string_type), num_buckets)
    np.testing.assert_array_equal(got, iceberg_buckets(strings, num_buckets, True))


def test_chunked_dictionary_and_null_ids(seed):
    pytest.importorskip("pyiceberg")
    rng = np.random.default_rng(seed)
    longs = [None if rng.random() < 0.1 else int(v) for v in random_longs(rng, 600)]
    strings = [None if rng.random() < 0.1 else s for s in random_strings(rng, 600)]
    for values, string in ((longs, False), (strings, True)):
        want = iceberg_buckets(values, 16, string)
        plain = pa.array(values)
        cut = sorted(rng.integers(0, len(values), 3).tolist())
        chunked = pa.chunked_array([plain[a:b] for a, b in zip([0] + cut, cut + [len(values)])])
        encoded = plain.dictionary_encode()
        sliced = plain.slice(5)
        for ids, expect in ((plain, want), (chunked, want), (encoded, want),
                            (pa.chunked_array([encoded[:100], encoded[100:]]), want),
                            (sliced, want[5:])):
            got = bucket_of(ids, 16)
            assert got.dtype == np.int32 and got.shape == (len(ids),)
            np.testing.assert_array_equal(got, expect)
        assert (bucket_of(plain, 16)[np.array([v is None for v in values])] == 0).all()
    # A dictionary holding a null, and one that is empty (every index null).
    dictionary = pa.DictionaryArray.from_arrays(pa.array([1, 0, None, 1], pa.int8()),
                                                pa.array(["a", None]))
    assert bucket_of(dictionary, 7).tolist() == [0, iceberg_buckets(["a"], 7, True)[0], 0, 0]
    empty_dict = pa.DictionaryArray.from_arrays(pa.array([None, None], pa.int32()),
                                                pa.array([], pa.string()))
    assert bucket_of(empty_dict, 7).tolist() == [0, 0]
    assert bucket_of(pa.array([], pa.int64()), 7).shape == (0,)
    assert bucket_of(pa.chunked_array([], pa.string()), 7).shape == (0,)
    # numpy arrays and lists go through pa.array.
    assert bucket_of(np.array([34, -1]), 16).tolist() == bucket_of(pa.array([34, -1]), 16).tolist()


@pytest.mark.parametrize("ids", [pa.array([1.5]), pa.array([b"x"]), pa.array([[1]]),
                                 pa.array([True])], ids=["float", "binary", "list", "bool"])
def test_bucket_of_rejects_other_types(ids):
    with pytest.raises(ValueError, match=r"recxla\.data\.buckets\.bucket_of: ids must be "
                       "integers or strings"):
        bucket_of(ids, 4)


@pytest.mark.parametrize("num_buckets", [0, -3, 2**31, True, 2.0, "4", None])
def test_bucket_of_rejects_num_buckets_out_of_range(num_buckets):
    with pytest.raises(ValueError, match=r"bucket_of: num_buckets must be an int in "
                       r"\[1, 2\*\*31 - 1\]"):
        bucket_of(pa.array([1, 2]), num_buckets)
    assert bucket_of(pa.array([1, 2]), np.int64(2**31 - 1)).dtype == np.int32


def test_bucket_folder_names():
    assert bucket_folder_name("user_id", 0) == "user_id_bucket=0"
    assert bucket_folder_name("user_id", 12) == "user_id_bucket=12"
    assert bucket_folder_name("user id/x", 3) == "user+id%2Fx_bucket=3"  # as Iceberg's paths
    for column in ("user_id", "user id/x", "é=1_bucket=2", "a+b%20", "_x"):
        for i in (0, 9, 2**31 - 2):
            assert parse_bucket_folder(bucket_folder_name(column, i)) == (column, i)
    for name in ("user_id", "user_id_bucket=", "user_id_bucket=07", "user_id_bucket=-1",
                 "user_id_bucket=1x", "_bucket=1", "user id_bucket=1", "a=b_bucket=1",
                 f"user_id_bucket={2**31 - 1}", "part-00000.parquet"):
        assert parse_bucket_folder(name) is None, name
    with pytest.raises(ValueError, match="bucket_folder_name: column must be a non-empty str"):
        bucket_folder_name("", 0)
    with pytest.raises(ValueError, match=r"bucket_folder_name: i must be an int in "):
        bucket_folder_name("user_id", -1)


def random_table(rng, rows: int, key: str, string_key: bool, null_keys: bool = True):
    """Random rows with a unique `row` column (the source order) and a few column types."""
    if string_key:
        pool = random_strings(rng, max(1, rows // 3))
        keys = [pool[i] for i in rng.integers(0, len(pool), rows)]
    else:
        keys = random_longs(rng, rows)[:rows].tolist()
    if null_keys:
        keys = [None if rng.random() < 0.05 else k for k in keys]
    lengths = rng.integers(0, 4, rows)
    return pa.table({
        "row": pa.array(np.arange(rows, dtype=np.int64)),
        key: pa.array(keys, pa.string() if string_key else pa.int64()),
        "score": pa.array(rng.standard_normal(rows).astype(np.float32)),
        "history": pa.array([rng.integers(0, 100, k).tolist() for k in lengths],
                            pa.list_(pa.int64())),
        "name": pa.array([f"n{v}" for v in rng.integers(0, 50, rows)]),
    })


def read_buckets(out, key: str, num_buckets: int):
    """Bucket i's rows, after checking that the folder holds exactly the N bucket folders."""
    names = sorted(os.listdir(out))
    assert names == sorted(bucket_folder_name(key, i) for i in range(num_buckets))
    tables = []
    for i in range(num_buckets):
        folder = os.path.join(out, bucket_folder_name(key, i))
        assert parse_bucket_folder(os.path.basename(folder)) == (key, i)
        assert os.listdir(folder) == [PART_FILE]
        tables.append(pq.read_table(os.path.join(folder, PART_FILE)))
    return tables


def check_round_trip(source: pa.Table, out, key: str, num_buckets: int, result: dict):
    tables = read_buckets(out, key, num_buckets)
    assert result == {"rows": source.num_rows, "buckets": num_buckets,
                      "rows_per_bucket": [t.num_rows for t in tables]}
    for i, t in enumerate(tables):
        assert t.schema.equals(source.schema, check_metadata=False)
        assert (bucket_of(t.column(key), num_buckets) == i).all()
        rows = t.column("row").to_numpy()
        assert (np.diff(rows) > 0).all(), f"bucket {i} is not in source order"
    # The same rows, each once: `row` is unique, so sorting by it gives back the source.
    together = pa.concat_tables(tables)
    assert together.sort_by("row").equals(source)


@pytest.mark.parametrize("string_key", [False, True], ids=["int64-key", "string-key"])
@pytest.mark.parametrize("buffer_bytes", [None, 20_000], ids=["buffered", "small-buffer"])
def test_write_buckets_round_trip(tmp_path, seed, monkeypatch, string_key, buffer_bytes):
    rng = np.random.default_rng(seed)
    if buffer_bytes is not None:  # every few blocks, every bucket's pending rows are written
        monkeypatch.setattr(buckets, "BUFFER_BYTES", buffer_bytes)
    source = random_table(rng, int(rng.integers(2500, 4000)), "user_id", string_key)
    pq.write_table(source, tmp_path / "users.parquet")
    num_buckets, rows_per_group = int(rng.choice([1, 7, 16])), 200
    out = tmp_path / "out"
    result = write_buckets(tmp_path / "users.parquet", "user_id", num_buckets, out,
                           rows_per_group=rows_per_group)
    check_round_trip(source, out, "user_id", num_buckets, result)
    for i in range(num_buckets):
        meta = pq.read_metadata(out / bucket_folder_name("user_id", i) / PART_FILE)
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        assert all(s <= rows_per_group for s in sizes)
        if buffer_bytes is None:  # held until full: only the last group is short
            assert all(s == rows_per_group for s in sizes[:-1])
    assert sorted(os.listdir(tmp_path)) == ["out", "users.parquet"]


def test_write_buckets_folder_of_files_and_empty_buckets(tmp_path, seed):
    rng = np.random.default_rng(seed)
    source = random_table(rng, 900, "item", string_key=False)
    src = tmp_path / "items"
    src.mkdir()
    cuts = [0, 250, 251, 900]  # name order is source order; one file of a single row
    for part, (a, b) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(source.slice(a, b - a), src / f"part-{part}.parquet")
    (src / "notes.txt").write_text("not Parquet: not read")
    (src / ".hidden.parquet").write_text("hidden: not read")
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is allowed
    result = write_buckets(src, "item", 16, out, rows_per_group=64)
    check_round_trip(source, out, "item", 16, result)
    # 1000 buckets for 3 rows: every bucket folder exists, most with a file of zero rows.
    tiny = source.slice(0, 3)
    pq.write_table(tiny, tmp_path / "tiny.parquet")
    result = write_buckets(tmp_path / "tiny.parquet", "item", 1000, tmp_path / "many")
    check_round_trip(tiny, tmp_path / "many", "item", 1000, result)
    assert sum(r == 0 for r in result["rows_per_bucket"]) >= 997


def test_default_row_groups_let_a_tenth_be_held_out(tmp_path, seed):
    """Without rows_per_group, a bucket's row groups are a conversion's size for the source
    (about 64 in all): the trainer's split by row group can hold out a tenth of the rows, not
    a whole bucket."""
    from recxla.data.parquet_layout import default_rows_per_group

    rng = np.random.default_rng(seed)
    n = int(rng.integers(4000, 9000))
    source = random_table(rng, n, "user", string_key=False)
    pq.write_table(source, tmp_path / "s.parquet")
    result = write_buckets(tmp_path / "s.parquet", "user", 4, tmp_path / "out")
    check_round_trip(source, tmp_path / "out", "user", 4, result)
    groups = [md.row_group(g).num_rows for f in sorted((tmp_path / "out").rglob("*.parquet"))
              for md in [pq.read_metadata(f)] for g in range(md.num_row_groups)]
    assert max(groups) <= default_rows_per_group(n) < n // 10
    assert len(groups) >= 16


def test_dictionary_key_column(tmp_path, seed):
    rng = np.random.default_rng(seed)
    source = random_table(rng, 1200, "user", string_key=True)
    source = source.set_column(1, "user", source.column("user").dictionary_encode())
    pq.write_table(source, tmp_path / "s.parquet")
    result = write_buckets(tmp_path / "s.parquet", "user", 7, tmp_path / "out",
                           rows_per_group=100)
    check_round_trip(source, tmp_path / "out", "user", 7, result)


def _nothing_left(folder, before):
    assert sorted(os.listdir(folder)) == before, "write_buckets left something behind"


def test_write_buckets_errors_leave_nothing(tmp_path, seed):
    rng = np.random.default_rng(seed)
    source = random_table(rng, 300, "user", string_key=False)
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(source, src / "a.parquet")
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    before = sorted(os.listdir(work))

    with pytest.raises(ValueError, match=r"write_buckets: .*a\.parquet: no column 'nope' \(the "
                       r"key\); its columns: \['row', 'user', 'score', 'history', 'name'\]"):
        write_buckets(src, "nope", 4, out)
    _nothing_left(work, before)
    with pytest.raises(ValueError, match=r"write_buckets: key column 'score' holds float: "
                       "bucket_of hashes integers and strings"):
        write_buckets(src, "score", 4, out)
    _nothing_left(work, before)
    with pytest.raises(ValueError, match=r"write_buckets: num_buckets must be an int in "
                       r"\[1, 2\*\*31 - 1\].*got 0"):
        write_buckets(src, "user", 0, out)
    _nothing_left(work, before)
    with pytest.raises(ValueError, match="rows_per_group must be an int >= 1"):
        write_buckets(src, "user", 4, out, rows_per_group=0)
    _nothing_left(work, before)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        write_buckets(tmp_path / "missing", "user", 4, out)
    _nothing_left(work, before)

    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match=r"write_buckets: .*out exists and is not an "
                       "empty folder"):
        write_buckets(src, "user", 4, out)
    assert sorted(os.listdir(work)) == ["out"] and os.listdir(out) == ["mine.txt"]
    (out / "mine.txt").unlink()
    out.rmdir()

    inside_before = sorted(os.listdir(src))
    for inside in (src / "buckets", src):
        with pytest.raises(ValueError, match="is inside the source folder"):
            write_buckets(src, "user", 4, inside)
        _nothing_left(src, inside_before)
    with pytest.raises(ValueError, match="is the source file"):
        write_buckets(src / "a.parquet", "user", 4, src / "a.parquet")
    _nothing_left(src, inside_before)

    other = source.rename_columns(["row", "user", "score", "history", "label"])
    pq.write_table(other, src / "b.parquet")
    with pytest.raises(ValueError, match=r"write_buckets: .*b\.parquet: column 'name' is not in "
                       "the file"):
        write_buckets(src, "user", 4, out)
    _nothing_left(work, before)
    pq.write_table(source.set_column(2, "score", source.column("score").cast(pa.float64())),
                   src / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet: column 'score' holds double, the first "
                       "file's .* holds float"):
        write_buckets(src, "user", 4, out)
    _nothing_left(work, before)
    (src / "b.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(ValueError, match=r"b\.parquet: not a readable Parquet file"):
        write_buckets(src, "user", 4, out)
    _nothing_left(work, before)


def test_failures_while_writing_remove_the_partial_output(tmp_path, seed, monkeypatch):
    rng = np.random.default_rng(seed)
    pq.write_table(random_table(rng, 1000, "user", string_key=True), tmp_path / "s.parquet")
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    add = buckets._BucketWriters.add
    calls = []

    def failing_add(self, block, ids, error):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return add(self, block, ids)

    monkeypatch.setattr(buckets._BucketWriters, "add",
                        lambda s, b, i: failing_add(s, b, i, OSError(errno.ENOSPC, "No space")))
    with pytest.raises(OutputError, match=r"write_buckets: writing .*out: No space .*nothing "
                       "was written") as e:
        write_buckets(tmp_path / "s.parquet", "user", 8, out, rows_per_group=100)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(work) == []
    calls.clear()
    monkeypatch.setattr(buckets._BucketWriters, "add",
                        lambda s, b, i: failing_add(s, b, i, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_buckets(tmp_path / "s.parquet", "user", 8, out, rows_per_group=100)
    assert os.listdir(work) == []


def test_open_file_limit(monkeypatch):
    class Resource:  # a process allowed 100 open files, up to 1,000
        RLIMIT_NOFILE, RLIM_INFINITY = 7, -1
        limits = (100, 1000)

        def getrlimit(self, which):
            return self.limits

        def setrlimit(self, which, limits):
            self.limits = limits

    fake = Resource()
    monkeypatch.setitem(sys.modules, "resource", fake)
    buckets._allow_open_files(30)
    assert fake.limits == (100, 1000)
    buckets._allow_open_files(500)  # one writer per bucket: the soft limit is raised
    assert fake.limits[1] == 1000 and 500 < fake.limits[0] <= 1000
    with pytest.raises(ValueError, match=r"write_buckets: num_buckets 5000 keeps 5000 files "
                       r"open at once \(one per bucket\), but this process may open at most "
                       r"1000 \(ulimit -Hn\)"):
        buckets._allow_open_files(5000)


def test_bucket_command(tmp_path, seed, capsys, monkeypatch):
    rng = np.random.default_rng(seed)
    source = random_table(rng, 700, "user id", string_key=True)
    pq.write_table(source, tmp_path / "users.parquet")
    out = tmp_path / "out"
    assert data_main(["bucket", str(tmp_path / "users.parquet"), "--key", "user id",
                      "--buckets", "5", "--out", str(out), "--rows-per-group", "128",
                      "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    tables = read_buckets(out, "user id", 5)
    assert lines[:5] == [f"user+id_bucket={i}: {t.num_rows:,} rows" for i, t in enumerate(tables)]
    assert lines[5].startswith("wrote 700 rows in 5 buckets (bucket(user id, 5), ")

    missing = tmp_path / "out2"
    assert data_main(["bucket", str(tmp_path / "users.parquet"), "--key", "user_id",
                      "--buckets", "5", "--out", str(missing), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: recxla.data.buckets.write_buckets: ")
    assert "no column 'user_id'" in err and "'user id'" in err
    assert data_main(["bucket", str(tmp_path / "users.parquet"), "--key", "user id",
                      "--buckets", "0", "--out", str(missing), "--no-progress"]) == 2
    assert "num_buckets must be an int in [1, 2**31 - 1]" in capsys.readouterr().err
    assert not missing.exists()

    def full_disk(self, block, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(buckets._BucketWriters, "add", full_disk)
    assert data_main(["bucket", str(tmp_path / "users.parquet"), "--key", "user id",
                      "--buckets", "5", "--out", str(missing), "--no-progress"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.parametrize("string_key", [False, True], ids=["int64-key", "string-key"])
def test_iceberg_table_agrees_bucket_for_bucket(tmp_path, seed, string_key):
    pytest.importorskip("pyiceberg")
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import BucketTransform
    from pyiceberg.types import DoubleType, LongType, NestedField, StringType

    rng = np.random.default_rng(seed)
    key, num_buckets = "user id", 11
    n = 2000
    keys = random_strings(rng, n)[:n] if string_key else random_longs(rng, n)[:n].tolist()
    data = pa.table({key: pa.array(keys, pa.string() if string_key else pa.int64()),
                     "score": pa.array(rng.standard_normal(n))})
    catalog = SqlCatalog("t", uri=f"sqlite:///{tmp_path}/cat.db", warehouse=f"file://{tmp_path}/wh")
    catalog.create_namespace("ns")
    schema = Schema(NestedField(1, key, StringType() if string_key else LongType(),
                                required=False),
                    NestedField(2, "score", DoubleType(), required=False))
    spec = PartitionSpec(PartitionField(source_id=1, field_id=1000,
                                        transform=BucketTransform(num_buckets),
                                        name=f"{key}_bucket"))
    table = catalog.create_table("ns.features", schema=schema, partition_spec=spec)
    table.append(data)

    pq.write_table(data, tmp_path / "features.parquet")
    ours = read_buckets_by_index(write_buckets(tmp_path / "features.parquet", key, num_buckets,
                                               tmp_path / "out"), tmp_path / "out", key)
    theirs = {i: [] for i in range(num_buckets)}
    rows = 0
    for task in table.scan().plan_files():
        bucket, path = task.file.partition[0], task.file.file_path
        assert path.startswith("file://")
        path = path[len("file://"):]
        # The same folder name as Iceberg's data path ("user+id_bucket=<i>").
        assert os.path.basename(os.path.dirname(path)) == bucket_folder_name(key, bucket)
        # Column 0: pyiceberg writes "user id" as "user_x20id" (Avro-safe names).
        keys_in_file = pq.read_table(path).column(0)
        assert (bucket_of(keys_in_file, num_buckets) == bucket).all()
        theirs[bucket].extend(keys_in_file.to_pylist())
        rows += len(keys_in_file)
    assert rows == n
    for i in range(num_buckets):  # every key in the same bucket on both sides
        assert sorted(theirs[i]) == sorted(ours[i]), f"bucket {i}"


def read_buckets_by_index(result, out, key):
    tables = read_buckets(out, key, result["buckets"])
    return {i: t.column(key).to_pylist() for i, t in enumerate(tables)}
