"""RowBags.message_bags: a receiver's bags of every row group of one micro-batch as one
multi-table lookup, against each bag pooled one by one from the rows it reads."""

import pytest
import torch

from recxla.ops.embedding_bag import MEAN, SUM, BagLookup, pooled_forward, unique_grad
from recxla.torchrec.row_exchange import RowBags


def _random_bags(generator, features, micro, weighted):
    """RowBags as encode_rows lays them out, and per (group, micro-batch, feature, sample) the
    bag's ids into that (group, micro-batch)'s unique rows (with their weights)."""
    groups, batch, max_features = len(features), sum(micro), max(features)
    lengths = torch.zeros(groups, max_features, batch, dtype=torch.int64)
    inverse, weights, bounds, counts, bags = [], [], [0], torch.zeros(groups, len(micro),
                                                                       dtype=torch.int64), {}
    for g, num_features in enumerate(features):
        for k, size in enumerate(micro):
            unique = int(torch.randint(0, 6, (), generator=generator))
            start = sum(micro[:k])
            run = 0
            for f in range(num_features):
                for b in range(size):
                    n = int(torch.randint(0, 4, (), generator=generator)) if unique else 0
                    ids = torch.randint(0, max(unique, 1), (n,), generator=generator)
                    w = torch.rand(n, generator=generator)
                    bags[g, k, f, b] = (ids, w)
                    lengths[g, f, start + b] = n
                    inverse.append(ids)
                    weights.append(w)
                    run += n
            counts[g, k] = unique
            bounds.append(bounds[-1] + run)
    row_bags = RowBags(counts, torch.cat(inverse), bounds, lengths,
                       torch.cat(weights) if weighted else None, list(micro))
    return row_bags, bags


@pytest.mark.parametrize("micro", [[5], [3, 4], [2, 0, 3]], ids=["m=1", "m=2", "m=3 empty"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_message_bags_pool_and_reduce_as_each_bag_alone(seed, micro, weighted):
    generator = torch.Generator().manual_seed(seed)
    features, cols = [2, 1, 3, 1], [4, 8, 4, 2]
    pooling = [SUM, MEAN, SUM, SUM] if not weighted else [SUM] * 4
    row_bags, bags = _random_bags(generator, features, micro, weighted)
    for k, size in enumerate(micro):
        rows = [torch.randn(int(row_bags.counts[g, k]), c, generator=generator)
                for g, c in enumerate(cols)]
        m = row_bags.message_bags(k, features)
        assert row_bags.message_bags(k, features) is m  # built once for forward and backward
        lookup = BagLookup(rows, m.unique_values, m.unique_offsets, m.inverse, m.offsets,
                           m.weights, m.feature_table, pooling, size)
        out = pooled_forward(lookup)
        grad = torch.randn(out.shape, generator=generator)
        row_grads = unique_grad(grad, lookup)
        expected = torch.zeros(size, sum(f * c for f, c in zip(features, cols)))
        expected_grads = [torch.zeros_like(r) for r in rows]
        column = 0
        for g, (num_features, c) in enumerate(zip(features, cols)):
            for f in range(num_features):
                for b in range(size):
                    ids, w = bags[g, k, f, b]
                    w = w if weighted else torch.ones(len(ids))
                    scale = 1.0 / len(ids) if pooling[g] == MEAN and len(ids) else 1.0
                    expected[b, column: column + c] = (rows[g][ids] * w[:, None]).sum(0) * scale
                    expected_grads[g].index_add_(
                        0, ids, w[:, None] * scale * grad[b, column: column + c])
                column += c
        torch.testing.assert_close(out, expected)
        for got, want in zip(row_grads, expected_grads):
            torch.testing.assert_close(got, want)
