"""recxla-train on Parquet files (--data): TrainData yields exactly the loader's batches for
this rank, from any step (resume), with any loader; 2 gloo ranks train on a file and resume
from a checkpoint; files that do not fit the model, missing paths and a missing Ray are
rejected before any process group exists, naming the file."""

import json
import os
import random

import pytest
import torch
from test_train_cli import SMALL, _parse_error, launch_ranks

from recxla.data import ParquetDataset, write_parquet
from recxla.train import checkpoint
from recxla.train.parse import parse_config
from recxla.train.data import TrainData

WRITE_BATCH = 128  # rows per written batch and row group


def _write(tmp_path, seed: int, batches: int, name: str = "data", **profile) -> str:
    """`batches` synthetic batches of the small profile (the trainer's --profile small tables),
    written with write_parquet into the folder tmp_path/name."""
    argv = ["--profile", "small", "--batch-size", str(WRITE_BATCH), "--seed", str(seed)]
    for flag, value in profile.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    source = TrainData(parse_config(argv), 0, 1).dataset
    path = str(tmp_path / name)
    write_parquet([source.batch(i) for i in range(batches)], path, sort_by="cat_2")
    return path


def _same(got, want) -> bool:
    """A TorchRec batch equals a recxla.data.Batch, bit for bit."""
    return (torch.equal(got.dense_features, want.dense)
            and torch.equal(got.labels, want.labels)
            and got.sparse_features.keys() == want.sparse.keys()
            and torch.equal(got.sparse_features.values(), want.sparse.values())
            and torch.equal(got.sparse_features.lengths(), want.sparse.lengths()))


@pytest.fixture
def written(tmp_path, seed):
    return _write(tmp_path, seed % 1000, 6), seed % 1000


@pytest.mark.parametrize("workers", [0, 1])
def test_train_yields_this_ranks_loader_batches(written, workers):
    path, seed = written
    b, world = 64, 2
    config = parse_config(["--profile", "small", "--batch-size", str(b), "--seed", str(seed),
                           "--data", path, "--loader-workers", str(workers)])
    for rank in range(world):
        want = list(ParquetDataset(path, b, rank, world, seed, num_epochs=3))
        epoch = ParquetDataset(path, b, rank, world, seed).num_batches(0)
        assert epoch == 3 * WRITE_BATCH // b  # 3 of the 6 row groups a rank, whole batches
        data = TrainData(config, rank, world)
        got = list(data.train(0, len(want)))  # three epochs, each in a new order
        assert len(got) == len(want)
        assert all(_same(g, w) for g, w in zip(got, want))
        # Resuming at any step, in the first epoch or a later one, continues the sequence.
        start = random.randint(1, len(want) - 1)
        resumed = list(data.train(start, len(want)))
        assert all(_same(g, w) for g, w in zip(resumed, want[start:]))
        data.close()
        data.close()  # idempotent
    # Every rank judges row exchange on rank 0's first batch.
    first = next(iter(ParquetDataset(path, b, 0, world, seed)))
    assert all(_same(TrainData(config, r, world).sample(), first) for r in range(world))


def test_epochs_and_eval_data(tmp_path, written):
    path, seed = written
    held_out = _write(tmp_path, seed + 1, 2, "held_out")
    config = parse_config(["--profile", "small", "--batch-size", "64", "--seed", str(seed),
                           "--data", path, "--epochs", "2", "--eval-data", held_out,
                           "--eval-batches", "5"])
    assert config.steps == 2 * 6 * WRITE_BATCH // 64  # one rank (no WORLD_SIZE): all groups
    data = TrainData(config, 0, 1)
    got = list(data.held_out())
    want = list(ParquetDataset(held_out, 64, shuffle=False))
    assert len(got) == 4  # the files hold 4 batches of 64, fewer than --eval-batches
    assert all(_same(g, w) for g, w in zip(got, want))


def test_files_that_do_not_fit_are_rejected(capsys, tmp_path, seed):
    # Written with tables of 5000 rows: ids past the 2000 rows of --profile small's tables.
    big = _write(tmp_path, seed % 1000, 1, "big", max_rows=5000)
    err = _parse_error(capsys, ["--profile", "small", "--batch-size", "64", "--data", big])
    assert f"--data: recxla.data: {big}: feature 'cat_" in err
    assert "has 2000 rows" in err and "--max-rows 2000" in err
    # The same files fit tables of 5000 rows.
    parse_config(["--profile", "small", "--max-rows", "5000", "--batch-size", "64", "--data",
                  big])
    err = _parse_error(capsys, ["--profile", "small", "--batch-size", "64", "--eval-data", big])
    assert f"--eval-data: recxla.data: {big}: feature 'cat_" in err
    missing = str(tmp_path / "nowhere")
    err = _parse_error(capsys, ["--data", missing])
    assert err.count(f"--data: recxla.data.read_dataset_spec: {missing}: no such file or "
                     "folder") == 1
    err = _parse_error(capsys, ["--profile", "small", "--data", big])  # 128 rows, batch 1024
    assert "fill no batch of 1024" in err


def test_loader_options_are_checked(capsys, monkeypatch, written):
    path, _ = written
    assert "--loader applies to --data" in _parse_error(capsys, ["--loader", "ray"])
    base = ["--profile", "small", "--batch-size", "64", "--data", path, "--loader", "ray"]
    assert "--loader-workers 0 applies to --loader local" in _parse_error(
        capsys, [*base, "--loader-workers", "0"])
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else find_spec(name, *a))
    err = _parse_error(capsys, base)
    assert "--loader ray needs Ray Data, which is not installed: pip install 'recxla[ray]'" in err


def test_resume_on_other_data_is_refused(written, tmp_path):
    path, seed = written
    other = _write(tmp_path, seed, 4, "other")
    config = parse_config(["--profile", "small", "--batch-size", "64", "--data", path])
    fingerprint = TrainData(config, 0, 1).fingerprint
    state = {"world_size": 1, "path": "recxla", "steps_done": 2, "config": config.asdict(),
             "data_fingerprint": fingerprint}
    checkpoint.check_compatible(config, 1, state)
    moved = parse_config(["--profile", "small", "--batch-size", "64", "--data", other])
    with pytest.raises(ValueError, match=r"--data .* other files\)"):
        checkpoint.check_compatible(moved, 1, state)
    synthetic = parse_config(["--profile", "small", "--batch-size", "64"])
    with pytest.raises(ValueError, match=r"--data .*\(now None, other data\)"):
        checkpoint.check_compatible(synthetic, 1, state)


@pytest.mark.distributed
def test_two_ranks_train_on_files_and_resume(tmp_path, seed):
    # 8 batches of 128: 4 row groups a rank, 4 steps an epoch at --batch-size 128.
    path = _write(tmp_path, seed % 1000, 8)
    run = [*SMALL, "--data", path, "--seed", str(seed % 1000), "--warmup-steps", "1",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--sharding", "table_wise"]
    launch_ranks([*run, "--steps", "3", "--metrics", str(tmp_path / "a.json")], tmp_path)
    os.makedirs(tmp_path / "resumed")
    ranks = launch_ranks([*run, "--steps", "6", "--resume", "--metrics",
                          str(tmp_path / "b.json")], tmp_path / "resumed")
    assert "steps 3..6" in ranks[0].output()
    for name, steps in (("a.json", 3), ("b.json", 6)):
        with open(tmp_path / name) as f:
            m = json.load(f)
        assert m["config"]["data"] == path and m["config"]["steps"] == steps
        assert m["examples_per_s"] > 0 and 0.3 < m["final_loss"] < 1.5
        assert m["eval_examples"] == 2 * 2 * 128  # the synthetic held-out split
    assert m["resumed_from_step"] == 3
    with open(os.path.join(checkpoint.latest_checkpoint(str(tmp_path / "ckpt"))[1],
                           checkpoint.STATE_FILE)) as f:
        assert json.load(f)["data_fingerprint"] == ParquetDataset(path, 128).identity["dataset"]
