"""The trainer's data and initial weights: every rank its own shard, deterministic for a seed,
a held-out split disjoint from training, and tables seeded the same whatever the sharding."""

import torch

from recxla.train.parse import parse_config
from recxla.train.data import TrainData
from recxla.train.models import table_init


def _config(seed, *extra):
    return parse_config(["--profile", "small", "--batch-size", "64", "--seed", str(seed),
                         "--train-batches", "3", *extra])


def _same(a, b) -> bool:
    return (torch.equal(a.dense_features, b.dense_features)
            and torch.equal(a.labels, b.labels)
            and torch.equal(a.sparse_features.values(), b.sparse_features.values())
            and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths()))


def test_shards_are_deterministic_and_distinct(seed):
    config = _config(seed % 1000)
    r0, r1 = TrainData(config, 0, 2), TrainData(config, 1, 2)
    again = TrainData(config, 0, 2)
    b0, b1, b0_again = (list(d.train(0, 4)) for d in (r0, r1, again))
    assert all(_same(x, y) for x, y in zip(b0, b0_again))  # the same seed: the same batches
    assert not _same(b0[0], b1[0])  # each rank its own shard
    assert not _same(b0[0], b0[1])
    assert _same(b0[0], b0[3])  # step 3 starts the second epoch of 3 batches
    # resuming at step 2 sees the batch step 2 of an uninterrupted run sees
    assert _same(next(iter(r0.train(2, 3))), b0[2])
    other_seed = list(TrainData(_config(seed % 1000 + 1), 0, 2).train(0, 1))
    assert not _same(other_seed[0], b0[0])


def test_held_out_split_is_disjoint_from_training(seed):
    config = _config(seed % 1000, "--eval-batches", "2")
    data = TrainData(config, 0, 2)
    held_out = list(data.held_out())
    assert len(held_out) == 2
    train_requests = {int(r) for i in range(3) for r in data.dataset.batch(i).request_ids}
    for b in held_out:
        assert b.labels.numel() == 64
    from recxla.train.data import HELD_OUT_START

    eval_requests = {int(r) for i in range(2)
                     for r in data.dataset.batch(HELD_OUT_START + i).request_ids}
    assert not train_requests & eval_requests


def test_synthetic_held_out_split_has_a_size_of_its_own(seed):
    """Without --eval-batches the synthetic held-out split is SYNTHETIC_HELD_OUT examples of the
    job in whole batches per rank, whatever the batch size (at 2 ranks x 1024: the 8 batches
    --eval-batches used to default to); --eval-batches sets it."""
    from recxla.train.config import SYNTHETIC_HELD_OUT

    for batch, world, want in ((64, 2, 128), (1024, 2, 8), (1024, 1, 16), (3000, 4, 2)):
        config = parse_config(["--profile", "small", "--batch-size", str(batch), "--seed",
                               str(seed % 1000)])
        data = TrainData(config, world - 1, world)
        n = data.held_out_batches()  # what held_out() yields (generating them takes a while)
        assert n == want and n * batch * world >= SYNTHETIC_HELD_OUT, (batch, world, n)
    capped = TrainData(_config(0, "--eval-batches", "3"), 0, 2)
    assert capped.held_out_batches() == 3 and sum(1 for _ in capped.held_out()) == 3


def test_table_init_is_seeded_per_table(seed):
    tables = TrainData(_config(0), 0, 1).tables(8)
    a = table_init(tables[3], 3, seed)
    assert torch.equal(a, table_init(tables[3], 3, seed))
    assert not torch.equal(a[:8], table_init(tables[4], 4, seed)[:8])
    bound = (1.0 / tables[3].num_embeddings) ** 0.5
    assert a.shape == (tables[3].num_embeddings, 8)
    assert float(a.abs().max()) <= bound and float(a.std()) > bound / 3
