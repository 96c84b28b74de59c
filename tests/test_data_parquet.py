"""Parquet writer and ParquetDataset: exact round trips, sorting, order (row groups shuffled,
rows shuffled within windows), sharding, resume."""

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


def test_shuffle_rows_zero_is_a_seeded_permutation_of_row_groups_per_epoch(tmp_path, seed):
    b = 16
    batches = random_batches(9, b)
    path = write(batches, tmp_path / "f.parquet")
    s = seed % 10_000

    def sequence(seed_, epochs=2):
        got = list(ParquetDataset(path, b, seed=seed_, num_epochs=epochs, shuffle_rows=0))
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


def _tagged(groups, rows, **kwargs):
    """Batches of `rows` samples whose dense column 0 numbers the rows 0, 1, ... (a row's tag)."""
    batches = random_batches(groups, rows, **kwargs)
    for i, batch in enumerate(batches):
        batch.dense[:, 0] = torch.arange(i * rows, (i + 1) * rows, dtype=torch.float32)
    return batches


def _tags(batches) -> list:
    return [int(t) for batch in batches for t in batch.dense[:, 0].tolist()]


@pytest.mark.parametrize("shuffle_rows", [None, 1, 50, 120])
def test_same_seed_same_batches_other_seed_other_batches(tmp_path, seed, shuffle_rows):
    rows, b = 40, 16  # 40-row groups: windows of 1 (shuffle_rows 1 and 50) or 3 groups (120)
    batches = _tagged(8, rows)
    path = write(batches, tmp_path / "f.parquet")
    kwargs = {} if shuffle_rows is None else {"shuffle_rows": shuffle_rows}
    s = seed % 10_000

    def read(seed_):
        return list(ParquetDataset(path, b, seed=seed_, num_epochs=2, **kwargs))

    first = read(s)
    again = read(s)
    assert len(first) == len(again) == 2 * 8 * rows // b
    for g, w in zip(again, first):
        assert_batches_equal(g, w)
    tags = _tags(first)
    epoch = 8 * rows
    for e in range(2):  # every row once per epoch, in an order that is not the stored one
        assert sorted(tags[e * epoch:(e + 1) * epoch]) == list(range(epoch))
        assert tags[e * epoch:(e + 1) * epoch] != list(range(epoch))
    assert tags[:epoch] != tags[epoch:]  # a new order every epoch
    assert _tags(read(s + 1)) != tags
    # A row's sample travels whole: its bags, weights, dense and label are the written ones.
    written = {r[2][0]: r for batch in batches for r in to_rows(batch)}
    for batch in first[:4]:
        for r in to_rows(batch):
            assert r == written[r[2][0]]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle_rows", [0, 30, 100, None])
def test_every_row_once_per_epoch_across_ranks(tmp_path, world_size, shuffle_rows):
    # Groups of 24 rows, 4 per rank, batches of 16: 6 batches a rank, straddling groups and
    # (with windows of 1 or 4 groups) windows.
    rows, b = 24, 16
    groups = 4 * world_size
    path = write(_tagged(groups, rows), tmp_path / "f.parquet")
    kwargs = {} if shuffle_rows is None else {"shuffle_rows": shuffle_rows}
    for epoch_seed in (1, 2):
        tags = []
        for r in range(world_size):
            ds = ParquetDataset(path, b, rank=r, world_size=world_size, seed=epoch_seed,
                                **kwargs)
            got = list(ds)
            assert len(got) == 4 * rows // b == ds.num_batches(0)
            tags += _tags(got)
        assert sorted(tags) == list(range(groups * rows))


def test_uneven_row_groups_read_no_row_twice(tmp_path, seed):
    batches = []
    sizes = [random.randint(10, 60) for _ in range(random.randint(6, 12))]  # >= a batch a rank
    start = 0
    for n in sizes:
        batch = random_batch(n)
        batch.dense[:, 0] = torch.arange(start, start + n, dtype=torch.float32)
        batches.append(batch)
        start += n
    path = write(batches, tmp_path / "f.parquet")
    b, world = random.randint(3, 20), 2
    for shuffle_rows in (0, 40, 200):
        tags = []
        for r in range(world):
            ds = ParquetDataset(path, b, rank=r, world_size=world, seed=seed % 1000,
                                shuffle_rows=shuffle_rows)
            tags += _tags(ds)
        assert len(set(tags)) == len(tags) and set(tags) <= set(range(start))
        # Left out: what the smallest rank's share does not fill, and its last partial batch.
        plan = ds.plan(0)
        shares = [sum(sizes[g] for g in plan_r.groups) for plan_r in
                  (ParquetDataset(path, b, rank=r, world_size=world, seed=seed % 1000,
                                  shuffle_rows=shuffle_rows).plan(0) for r in range(world))]
        assert len(tags) == world * plan.num_batches * b == world * (min(shares) // b) * b


def test_windows_hold_at_most_shuffle_rows_and_are_read_once(tmp_path, monkeypatch):
    from recxla.data import parquet_reader

    rows, b = 30, 7
    path = write(random_batches(10, rows), tmp_path / "f.parquet")
    ds = ParquetDataset(path, b, shuffle_rows=70, prefetch=0)
    plan = ds.plan(0)
    assert all(len(w) == 2 for w in plan.windows[:-1])  # 2 groups of 30 <= 70 < 3 groups
    assert sum(plan.windows, []) == plan.groups
    reads = []
    read = parquet_reader._GroupReader.read
    monkeypatch.setattr(parquet_reader._GroupReader, "read",
                        lambda self, g, t: reads.append(g) or read(self, g, t))
    assert len(list(ds)) == 10 * rows // b
    assert sorted(reads) == list(range(10))  # each row group read once, straddling or not
    # A group larger than the window is a window of its own.
    assert [len(w) for w in ParquetDataset(path, b, shuffle_rows=10).plan(0).windows] == [1] * 10


def _user_log(groups: int, rows: int, users: int):
    """A log with a one-id "user" feature (uniform over `users`) and an item bag."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for _ in range(groups):
        user = torch.randint(0, users, (rows,))
        item_lengths = torch.randint(0, 4, (rows,))
        items = torch.randint(0, 10_000, (int(item_lengths.sum()),))
        kjt = KeyedJaggedTensor(
            keys=["user", "item"], values=torch.cat([user, items]),
            lengths=torch.cat([torch.ones(rows, dtype=torch.int64), item_lengths]).int(),
            stride=rows)
        out.append(Batch(kjt, torch.randn(rows, 2), torch.randint(0, 2, (rows,)).float()))
    return out


def _users_per_batch(batches) -> float:
    return float(np.mean([batch.sparse["user"].values().unique().numel() for batch in batches]))


def test_a_batch_holds_as_many_users_as_a_random_sample(tmp_path, seed):
    # Row groups sorted by user, as `convert --sort-by auto` writes them: 512 rows of 64 users
    # hold 8 rows a user side by side, and a batch of 64 read in stored order about 9 users.
    # Shuffled within windows, a batch holds as many as 64 rows drawn at random from the whole
    # log (64 * (1 - (63/64)**64), about 41).
    groups, rows, users, b = 8, 512, 64, 64
    path = write(_user_log(groups, rows, users), tmp_path / "u.parquet", sort_by="user")
    assert ParquetDataset(path, b).metadata["sort_by"] == "user"
    every = np.concatenate([batch.sparse["user"].values().numpy()
                            for batch in ParquetDataset(path, b, shuffle=False)])
    rng = np.random.default_rng(seed)
    sample = np.mean([np.unique(rng.choice(every, b, replace=False)).size for _ in range(400)])
    stored = _users_per_batch(ParquetDataset(path, b, shuffle=False))
    assert stored < 0.4 * sample  # the sorted layout, read as stored: few users a batch
    for kwargs in ({}, {"shuffle_rows": rows}, {"rank": 1, "world_size": 2}):
        got = _users_per_batch(ParquetDataset(path, b, seed=seed % 1000, **kwargs))
        assert got > 0.9 * sample, (kwargs, got, sample, stored)


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


@pytest.mark.parametrize("shuffle_rows", [0, 45, 70, None])
def test_resume_continues_exactly(tmp_path, shuffle_rows):
    # 30-row groups: windows of 1 or 2 groups (45, 70) or all of a rank's (default), so a cut
    # lands mid-window and, for some batch sizes, mid-way through a batch straddling windows.
    batches = random_batches(7, 30)
    path = write(batches, tmp_path / "f.parquet")
    b = random.randint(11, 40)
    kwargs = dict(rank=1, world_size=2, seed=3, num_epochs=3)
    if shuffle_rows is not None:
        kwargs["shuffle_rows"] = shuffle_rows
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
    with pytest.raises(ValueError, match="shuffle_rows=131072.*shuffle_rows=5"):
        ParquetDataset(path, 10, position=position, shuffle_rows=5)
    # File order: the window plays no part, any shuffle_rows resumes.
    it = iter(ParquetDataset(path, 10, shuffle=False, shuffle_rows=7))
    next(it)
    assert len(list(ParquetDataset(path, 10, shuffle=False, position=it.state_dict()))) == 7
    it.close()
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
    with pytest.raises(ValueError, match="shuffle_rows must be an int >= 0, got -1"):
        ParquetDataset(path, 4, shuffle_rows=-1)


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


def test_overwrite_replaces_only_files_recxla_wrote(tmp_path):
    """A tool never deletes what it did not write: a Parquet file of the user's in the folder
    (or at the file path) stops an overwrite, named, and nothing is touched."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [random_batch(16) for _ in range(2)]
    folder = tmp_path / "ds"
    write(good, folder, rows_per_file=16)
    mine = folder / "notes.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), mine)
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    with pytest.raises(FileExistsError, match="notes.parquet is not recxla's"):
        write(good[:1], folder, overwrite=True)
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before
    os.remove(mine)
    write(good[:1], folder, overwrite=True)  # recxla's own files are replaced
    assert sorted(os.listdir(folder)) == ["part-00000.parquet"]
    single = tmp_path / "user.parquet"
    pq.write_table(pa.table({"x": [1]}), single)
    with pytest.raises(FileExistsError, match="not recxla's"):
        write(good, single, overwrite=True)
    assert pq.read_table(single).column_names == ["x"]


def test_id_order_is_stable_within_ties(tmp_path):
    batch = random_batch(64, id_range=3)
    order = sort_order(_table(batch), "user")
    first = np.array([bag[0] if bag else -(2**63) for bag in (r[0][0] for r in to_rows(batch))])
    assert np.array_equal(order, np.argsort(first, kind="stable"))
