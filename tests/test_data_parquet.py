"""Parquet writer and ParquetDataset: exact round trips, sorting, order, sharding, resume."""

import json
import os
import random

import numpy as np
import pytest
import torch
from data_pipeline_cases import (
    FEATURES,
    assert_batches_equal,
    from_rows,
    random_batch,
    random_batches,
    to_rows,
    write,
)

from recxla import permute_samples
from recxla.data import (
    Batch,
    ParquetDataset,
    SyntheticRankingDataset,
    criteo_kaggle_profile,
    write_parquet,
)
from recxla.data.parquet_writer import sort_order


@pytest.mark.parametrize("target", ["file.parquet", "folder"])
def test_write_then_read_returns_the_written_batches(tmp_path, target):
    b = random.randint(20, 90)
    batches = random_batches(random.randint(3, 7), b)
    kwargs = {} if target.endswith(".parquet") else {"rows_per_file": 2 * b}
    path = write(batches, tmp_path / target, **kwargs)
    ds = ParquetDataset(path, b, shuffle=False)
    got = list(ds)
    assert len(got) == len(batches)
    for g, w in zip(got, batches):
        assert_batches_equal(g, w)
    if target == "folder":
        assert len(os.listdir(path)) == (len(batches) + 1) // 2
    assert ds.metadata["layout"]["features"] == list(FEATURES)
    assert ds.metadata["layout"]["num_dense"] == 3


def test_synthetic_dataset_round_trip(tmp_path, seed):
    data = SyntheticRankingDataset(criteo_kaggle_profile(max_rows=5000), batch_size=97,
                                   num_batches=2, seed=seed % 1000)
    path = write(data, tmp_path / "synthetic.parquet")
    for got, want in zip(ParquetDataset(path, 97, shuffle=False), data):
        assert_batches_equal(got, want)


def test_dtypes_and_weights_round_trip(tmp_path):
    batches = random_batches(3, 33, weighted=True, values_dtype=torch.int32,
                             lengths_dtype=torch.int64, dense_dtype=torch.float64,
                             request_ids=False)
    path = write(batches, tmp_path / "w.parquet", sort_by="user")
    for got, want in zip(ParquetDataset(path, 33, shuffle=False), batches):
        order = torch.from_numpy(sort_order(_table(want), "user"))
        assert_batches_equal(got, _permuted(want, order))


def _table(batch):
    from recxla.data.parquet_layout import Layout
    from recxla.data.parquet_writer import batch_to_table

    return batch_to_table(batch, Layout.of_batch(batch, "test"))


def _permuted(batch, order):
    rid = None if batch.request_ids is None else batch.request_ids[order]
    return Batch(permute_samples(batch.sparse, order), batch.dense[order], batch.labels[order],
                 rid)


def test_other_batch_size_reads_the_rows_in_order(tmp_path):
    written = random.randint(20, 60)
    batches = random_batches(5, written)
    path = write(batches, tmp_path / "f.parquet")
    b = random.randint(7, 3 * written)
    rows = [r for batch in batches for r in to_rows(batch)]
    got = list(ParquetDataset(path, b, shuffle=False))
    assert len(got) == len(rows) // b
    for k, batch in enumerate(got):
        assert_batches_equal(batch, from_rows(rows[k * b:(k + 1) * b], batches[0]))


@pytest.mark.parametrize("key", ["user", "history", "request_id", "auto"])
def test_sorted_rows_are_each_row_group_sorted_by_the_key(tmp_path, key):
    batches = random_batches(4, 50, id_range=40)
    path = write(batches, tmp_path / "s.parquet", sort_by=key, measure_unsorted=True)
    meta = ParquetDataset(path, 50).metadata
    if key == "auto":
        trial = meta["sort_trial"]["bytes"]
        assert trial[str(meta["sort_by"]).lower()] == min(trial.values())
        assert len(trial) == len(FEATURES) + 2  # every key, request_id and unsorted
    else:
        assert meta["sort_by"] == key
    assert meta["unsorted_bytes"] > 0
    for got, want in zip(ParquetDataset(path, 50, shuffle=False), batches):
        if meta["sort_by"] is None:
            assert_batches_equal(got, want)
            continue
        order = torch.from_numpy(sort_order(_table(want), meta["sort_by"]))
        assert_batches_equal(got, _permuted(want, order))
        if key == "user":  # the first id of every bag is non-decreasing (empty bags first)
            first = [bag[0] if bag else -1 for bag in (r[0][0] for r in to_rows(got))]
            assert first == sorted(first)


def test_sorting_by_user_shrinks_the_synthetic_log(tmp_path):
    data = list(SyntheticRankingDataset(criteo_kaggle_profile(max_rows=100_000),
                                        batch_size=2048, num_batches=1))
    path = write(data, tmp_path / "s.parquet", sort_by="cat_2", measure_unsorted=True)
    meta = ParquetDataset(path, 2048).metadata
    # Users repeat inside a request: their bags repeat row after row once sorted.
    assert meta["bytes"] < 0.85 * meta["unsorted_bytes"], meta


def test_shuffle_is_a_seeded_permutation_of_row_groups_per_epoch(tmp_path, seed):
    b = 16
    batches = random_batches(9, b)
    path = write(batches, tmp_path / "f.parquet")
    s = seed % 10_000

    def sequence(seed_, epochs=2):
        got = list(ParquetDataset(path, b, seed=seed_, num_epochs=epochs))
        which = []
        for g in got:
            match = [i for i, w in enumerate(batches) if torch.equal(g.labels, w.labels)
                     and torch.equal(g.sparse.values(), w.sparse.values())]
            assert len(match) == 1
            which.append(match[0])
        return which

    first = sequence(s)
    assert sorted(first[:9]) == list(range(9)) and sorted(first[9:]) == list(range(9))
    assert first[:9] != first[9:]  # a new order every epoch (1 in 9! to tie by chance)
    assert sequence(s) == first
    assert sequence(s + 1) != first


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_read_disjoint_row_groups_and_as_many_batches(tmp_path, world_size):
    b = 12
    groups = random.randint(2 * world_size, 4 * world_size)
    batches = random_batches(groups, b)
    path = write(batches, tmp_path / "f.parquet")
    per_rank = [list(ParquetDataset(path, b, rank=r, world_size=world_size, seed=5))
                for r in range(world_size)]
    assert len({len(x) for x in per_rank}) == 1
    assert len(per_rank[0]) == groups // world_size
    seen = [tuple(g.sparse.values().tolist()) + tuple(g.labels.tolist())
            for x in per_rank for g in x]
    assert len(set(seen)) == len(seen)


def test_resume_continues_exactly(tmp_path):
    batches = random_batches(7, 30)
    path = write(batches, tmp_path / "f.parquet")
    b = random.randint(11, 40)
    kwargs = dict(rank=1, world_size=2, seed=3, num_epochs=3)
    full = list(ParquetDataset(path, b, **kwargs))
    cut = random.randint(0, len(full))
    it = iter(ParquetDataset(path, b, **kwargs))
    for _ in range(cut):
        next(it)
    position = json.loads(json.dumps(it.state_dict()))
    it.close()
    rest = list(ParquetDataset(path, b, position=position, **kwargs))
    assert len(rest) == len(full) - cut
    for g, w in zip(rest, full[cut:]):
        assert_batches_equal(g, w)


def test_resume_refuses_other_settings(tmp_path):
    path = write(random_batches(4, 20), tmp_path / "f.parquet")
    it = iter(ParquetDataset(path, 10))
    next(it)
    position = it.state_dict()
    with pytest.raises(ValueError, match="batch_size=10.*batch_size=20"):
        ParquetDataset(path, 20, position=position)
    with pytest.raises(ValueError, match="past the"):
        ParquetDataset(path, 10, position={**position, "batch": 10**6})
    with pytest.raises(ValueError, match="not a recxla.data position"):
        ParquetDataset(path, 10, position={"epoch": 0})


def test_too_small_dataset_is_an_error(tmp_path):
    path = write(random_batches(2, 8), tmp_path / "f.parquet")
    with pytest.raises(ValueError, match="fill no batch of 100"):
        ParquetDataset(path, 100)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        ParquetDataset(path, 4, rank=2, world_size=2)


def test_writer_rejects_bad_input_and_leaves_nothing(tmp_path):
    good = random_batches(2, 10)
    with pytest.raises(ValueError, match="batch 1: features"):
        write([good[0], random_batch(10, features=("x",))], tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="batch 1: num_dense"):
        write([good[0], random_batch(10, num_dense=5)], tmp_path / "a.parquet")
    with pytest.raises(TypeError, match="expected a recxla.data.Batch"):
        write([good[0].sparse], tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="sort_by must be"):
        write(good, tmp_path / "a.parquet", sort_by="nope")
    with pytest.raises(ValueError, match="no batches"):
        write([], tmp_path / "a.parquet")

    def failing():
        yield from good
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        write(failing(), tmp_path / "folder", rows_per_file=10)
    assert os.listdir(tmp_path) == ["folder"] and os.listdir(tmp_path / "folder") == []
    write(good, tmp_path / "b.parquet")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write(good, tmp_path / "b.parquet")
    write(good[:1], tmp_path / "b.parquet", overwrite=True)
    assert len(list(ParquetDataset(str(tmp_path / "b.parquet"), 10))) == 1


def test_id_order_is_stable_within_ties(tmp_path):
    batch = random_batch(64, id_range=3)
    order = sort_order(_table(batch), "user")
    first = np.array([bag[0] if bag else -(2**63) for bag in (r[0][0] for r in to_rows(batch))])
    assert np.array_equal(order, np.argsort(first, kind="stable"))
