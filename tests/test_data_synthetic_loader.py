"""recxla.data.synthetic_loader.synthetic_batches: the batches the synthetic logs give inline,
made by worker processes, in order, for any indices; closing stops the workers; a worker's
error is raised in the caller; bad arguments are named. And the trainer: --loader-workers
with the synthetic logs yields the same batches, from any step, and its default."""

import multiprocessing
import random

import pytest
import torch

from recxla.data.synthetic import SyntheticRankingDataset
from recxla.data.synthetic_loader import synthetic_batches
from recxla.train import parse
from recxla.train.data import TrainData
from recxla.train.parse import parse_config

SMALL = ["--profile", "small", "--batch-size", "32"]


def _same(got, want) -> bool:
    """Two recxla.data.Batch equal bit for bit."""
    return (torch.equal(got.dense, want.dense) and torch.equal(got.labels, want.labels)
            and torch.equal(got.request_ids, want.request_ids)
            and got.sparse.keys() == want.sparse.keys()
            and torch.equal(got.sparse.values(), want.sparse.values())
            and torch.equal(got.sparse.lengths(), want.sparse.lengths()))


def _dataset(seed) -> SyntheticRankingDataset:
    config = parse_config([*SMALL, "--seed", str(seed % 1000)])
    return TrainData(config, 1, 2).dataset  # rank 1 of 2: its own share of the logs


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_workers_yield_the_inline_batches_in_order(seed, num_workers):
    dataset = _dataset(seed)
    # Out of order, repeated, and more indices than the workers' prefetch holds.
    indices = [random.randrange(50) for _ in range(9)] + [7, 7, 0]
    got = list(synthetic_batches(dataset, indices, num_workers))
    assert len(got) == len(indices)
    for index, batch in zip(indices, got):
        assert _same(batch, dataset.batch(index)), index
    assert not _same(got[-1], dataset.batch(1))  # the comparison can fail


def test_closing_stops_the_workers(seed):
    batches = synthetic_batches(_dataset(seed), range(1000), 2)
    next(batches)
    assert len(multiprocessing.active_children()) >= 2
    batches.close()
    assert multiprocessing.active_children() == []


def test_a_workers_error_is_raised_here(seed):
    batches = synthetic_batches(_dataset(seed), [0, -1, 2], 1)
    assert _same(next(batches), _dataset(seed).batch(0))
    with pytest.raises(ValueError, match=r"^recxla.data: loader worker 0 \(pid \d+\) failed "
                       r"making synthetic batch -1: ValueError: SyntheticRankingDataset: index "
                       r"must be an int >= 0, got -1$") as raised:
        next(batches)
    # One line; the worker's traceback rides along for whoever wants it.
    assert raised.value.loader_worker.startswith("loader worker 0 (pid ")
    assert "in batch" in raised.value.worker_traceback
    assert raised.value.worker_traceback.rstrip().endswith("got -1")
    assert multiprocessing.active_children() == []


def test_bad_arguments_are_named(seed):
    with pytest.raises(ValueError, match="synthetic_batches: num_workers must be an int >= 0"):
        synthetic_batches(_dataset(seed), [0], -1)
    with pytest.raises(TypeError, match="synthetic_batches: dataset must be a "
                                        "SyntheticRankingDataset, got list"):
        synthetic_batches([], [0], 1)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_trainer_batches_from_any_step(seed, workers):
    argv = [*SMALL, "--seed", str(seed % 1000), "--train-batches", "5"]
    inline = TrainData(parse_config(argv), 0, 2)
    data = TrainData(parse_config([*argv, "--loader-workers", workers]), 0, 2)
    start, end = random.randrange(8), 12  # past one epoch of 5 batches
    got = list(data.train(start, end))
    data.close()
    want = list(inline.train(start, end))
    assert len(got) == len(want) == end - start
    for g, w in zip(got, want):
        assert torch.equal(g.dense_features, w.dense_features)
        assert torch.equal(g.sparse_features.values(), w.sparse_features.values())
        assert torch.equal(g.labels, w.labels)
    assert multiprocessing.active_children() == []


def test_loader_workers_default(monkeypatch, tmp_path):
    assert parse_config(SMALL).loader_workers == 0  # a CPU's cores train
    assert parse_config([*SMALL, "--loader-workers", "2"]).loader_workers == 2
    # On a GPU the host's thread launches the step: the batches are made beside it.
    monkeypatch.setattr(parse, "resolve_device", lambda requested: "cuda")
    assert parse_config([*SMALL, "--device", "cuda"]).loader_workers == 1
