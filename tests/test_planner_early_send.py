"""recxla.planner.early_send against a by-hand count in plain Python on fresh random batches."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def _batch(generator, keys, batch, rows):
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=generator)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def _by_hand(config, steps):
    bags = bags_late = rows = rows_late = 0
    for before, after in zip(steps[:-1], steps[1:]):
        read = set()
        for b in before:
            for f in config.feature_names:
                read |= set(b[f].values().tolist())
        for b in after:
            unique = set()
            for f in config.feature_names:
                jt = b[f]
                for bag in jt.to_dense():
                    ids = bag.tolist()
                    bags += 1
                    bags_late += any(i in read for i in ids)
                    unique |= set(ids)
            rows += len(unique)
            rows_late += sum(i in read for i in unique)
    return bags, bags_late / bags, rows, rows_late / rows


def test_early_send_shares_match_a_count_by_hand(seed):
    from recxla.planner.early_send import early_send_shares

    g = torch.Generator().manual_seed(seed)
    configs = [EmbeddingBagConfig(name="wide", embedding_dim=8, num_embeddings=500,
                                  feature_names=["a", "b"]),
               EmbeddingBagConfig(name="narrow", embedding_dim=8, num_embeddings=40,
                                  feature_names=["c"])]
    keys = ["a", "b", "c"]
    steps = [[_batch(g, keys, 5, 40) for _ in range(3)] for _ in range(4)]
    got = early_send_shares(configs, steps)
    for config, share in zip(configs, got):
        bags, bags_late, rows, rows_late = _by_hand(config, steps)
        assert share.table == config.name
        assert share.bags == bags and share.rows == rows
        assert share.bags_late == pytest.approx(bags_late)
        assert share.rows_late == pytest.approx(rows_late)
        assert share.unique_per_bag == pytest.approx(rows / bags)


def test_early_send_shares_rejects_too_few_steps():
    from recxla.planner.early_send import early_send_shares

    with pytest.raises(ValueError, match="early_send_shares needs 2 steps or more"):
        early_send_shares([], [[]])
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="the same number of ranks"):
        early_send_shares([], [[_batch(g, ["a"], 2, 5)], [_batch(g, ["a"], 2, 5)] * 2])
