"""The MovieLens worked example (docs/your-data.md): its transforms against the same features
computed row by row, its table builder (Parquet and Iceberg) read back by the trainer's
reader, and the read-time benchmark's dry run, on random tables with MovieLens-100k's columns."""

import importlib.util
import os

import numpy as np
import pyarrow as pa
import pytest

from recxla.data import ParquetDataset, ReadTimeTable, load_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


transforms = _module("examples/movielens/transforms.py", "movielens_transforms")
prepare = _module("examples/movielens/prepare.py", "movielens_prepare")
bench = _module("bench/bench_read_time.py", "bench_read_time")


def _joined(rng, n: int) -> pa.Table:
    """A batch as the example's transforms get it: ratings joined with users and items (some
    rows without an item or a user: nulls)."""
    genres = {g: pa.array(rng.integers(0, 2, n), pa.int64(), mask=rng.random(n) < 0.1)
              for g in transforms.GENRES}
    return pa.table({
        "user_id": rng.integers(1, 50, n), "movie_id": rng.integers(1, 80, n),
        "rating": rng.integers(1, 6, n), "timestamp": rng.integers(0, 1 << 30, n),
        "age": pa.array(rng.integers(7, 74, n), pa.int64(), mask=rng.random(n) < 0.05),
        "gender": pa.array(np.where(rng.random(n) < 0.3, "F", "M")),
        "occupation": pa.array(np.array(["a", "b", "c"])[rng.integers(0, 3, n)]),
        "zip_code": pa.array([f"{z:05d}" for z in rng.integers(0, 99_999, n)]),
        "movie_title": pa.array(["t"] * n), "release_date": pa.array(["d"] * n),
        "video_release_date": pa.nulls(n, pa.float64()), "IMDb_URL": pa.array(["u"] * n),
        **genres})


def test_features_match_the_rows_computed_one_by_one(seed):
    rng = np.random.default_rng(seed)
    batch = _joined(rng, 300)
    out = transforms.features(batch.to_batches()[0])
    rows, got = batch.to_pylist(), out.to_pylist()
    assert len(got) == len(rows)
    assert set(out.column_names) == {"user_id", "movie_id", "timestamp", "gender",
                                     "occupation", "label", "age_group", "age_decades",
                                     "genres", "user_genre"}
    for r, g in zip(rows, got):
        age = r["age"] or 0
        group = sum(age >= edge for edge in transforms.AGE_EDGES)
        genres = [name for name in transforms.GENRES if r[name]]
        assert g["label"] == int(r["rating"] >= 4)
        assert g["age_group"] == group and g["age_decades"] == pytest.approx(age / 10)
        assert g["genres"] == genres
        assert g["user_genre"] == [f"{r['gender']}|{group}|{name}" for name in genres]


def test_prepared_tables_train_as_the_docs_say(tmp_path, seed):
    """prepare.py's Parquet and Iceberg tables, read with the example's joins and transform,
    give the same rows (the Iceberg files are other row groups: compared as multisets)."""
    pytest.importorskip("pyiceberg")
    tables = bench.synthetic_movielens(3000, 120, 90, seed=seed % 1000)
    out = str(tmp_path / "ml")
    rows_per_group = prepare.default_rows_per_group(tables)
    paths = prepare.write_parquet_tables(tables, out, 4, rows_per_group)
    refs = prepare.write_iceberg_tables(tables, out, 4, rows_per_group)
    fn = os.path.join(ROOT, "examples/movielens/transforms.py:features")

    def read(data, users, items):
        t = ReadTimeTable(data, transforms=[fn],
                          joins=[f"user_id={users}", f"movie_id={items}"])
        batches = list(ParquetDataset(t, 100, shuffle=False, num_epochs=1))
        keyed = []
        for b in batches:
            d = b.sparse.to_dict()
            for i in range(b.batch_size):
                keyed.append((float(b.labels[i]), tuple(float(x) for x in b.dense[i]),
                              tuple(tuple(d[f].values()[d[f].offsets()[i]:d[f].offsets()[i + 1]]
                                          .tolist()) for f in t.spec.sparse_features)))
        return t, sorted(keyed)

    parquet, rows_parquet = read(paths["ratings"], paths["users"], paths["items"])
    iceberg, rows_iceberg = read(refs["ratings"], refs["users"], refs["items"])
    assert parquet.spec == iceberg.spec
    assert len(rows_parquet) == 3000  # batches of 100 take every row of one stream
    assert rows_parquet == rows_iceberg


def test_histories_hold_each_users_earlier_movies_latest_first(seed):
    """prepare.py --history N: each rating's `watched` is its user's movies at strictly
    earlier timestamps (many ratings share a second), the latest first, at most N; the
    history schema reads it as a history of movie_id, and the printed commands name it."""
    rng = np.random.default_rng(seed)
    n, length = 400, 5
    ratings = pa.table({"user_id": rng.integers(1, 9, n), "movie_id": rng.integers(1, 60, n),
                        "rating": rng.integers(1, 6, n), "timestamp": rng.integers(0, 40, n)})
    out = prepare.with_histories(ratings, length)
    rows = out.to_pylist()
    without = sorted(str({k: v for k, v in r.items() if k != "watched"}) for r in rows)
    assert without == sorted(str(r) for r in ratings.to_pylist())  # the same ratings
    for i, r in enumerate(rows):
        earlier = [(q["timestamp"], j, q["movie_id"]) for j, q in enumerate(rows)
                   if q["user_id"] == r["user_id"] and q["timestamp"] < r["timestamp"]]
        assert r["watched"] == [m for _, _, m in sorted(earlier, reverse=True)][:length], i
    assert [len(r["watched"]) for r in rows].count(length) > 0
    schema = load_schema(prepare.HISTORY_SCHEMA)
    assert dict(schema.sparse)[prepare.HISTORY_COLUMN].history_of == "movie_id"
    assert "--model history --schema" in prepare.commands("r", "u", "i", history=True)
    assert "--model" not in prepare.commands("r", "u", "i")


def test_read_time_benchmark_dry_run(tmp_path):
    result = bench.main(["--dry-run", "--report", str(tmp_path / "report.md"), "--json",
                         str(tmp_path / "result.json")])
    readers = result["readers"]
    assert readers["read_time_1"]["rows"] == readers["converted_1"]["rows"] > 0
    assert readers["read_time_full"]["rows"] == readers["converted_full"]["rows"] > 0
    assert "## Read-time tables" in (tmp_path / "report.md").read_text()
