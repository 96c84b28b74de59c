"""RowBags.message_bags: a receiver's bags of every row group of one micro-batch as one
multi-table lookup, against each bag pooled one by one from the rows it reads."""

import pytest
import torch

from recxla.ops.embedding_bag import MEAN, SUM, BagLookup, pooled_forward, unique_grad
from recxla.ops.row_ids import encode_row_ids
from recxla.torchrec.row_exchange import RowBags


def _random_bags(generator, features, micro, weighted):
    """RowBags of random routed ids (encode_rows's op) and per (group, micro-batch, feature,
    sample) the bag's ids into that (group, micro-batch)'s unique rows (with their weights)."""
    groups, batch = len(features), sum(micro)
    slot_of = [(g, f) for g in range(groups) for f in range(features[g])]
    group, slot, sample, ids, weights = [], [], [], [], []
    for s, (g, _) in enumerate(slot_of):
        for b in range(batch):
            n = int(torch.randint(0, 4, (), generator=generator))
            group += [g] * n
            slot += [s] * n
            sample += [b] * n
            ids += torch.randint(0, 6, (n,), generator=generator).tolist()
            weights += torch.rand(n, generator=generator).tolist()
    long = dict(dtype=torch.int64)
    group, slot, sample, ids = (torch.tensor(v, **long) for v in (group, slot, sample, ids))
    weights = torch.tensor(weights) if weighted else None
    encoded = encode_row_ids(group, slot, sample, ids, weights, [f for _, f in slot_of],
                             features, micro)
    counts, bounds = encoded.counts.flatten().tolist(), encoded.bounds.tolist()
    row_bags = RowBags.encoded(encoded, counts, bounds, micro, features)
    unique = encoded.unique.split(counts)
    bags = {}
    for g in range(groups):
        for k, size in enumerate(micro):
            run = unique[g * len(micro) + k].tolist()
            for f in range(features[g]):
                for b in range(size):
                    first = sum(micro[:k]) + b
                    members = [i for i in range(ids.numel()) if group[i] == g and
                               slot_of[slot[i]][1] == f and sample[i] == first]
                    bags[g, k, f, b] = (
                        torch.tensor([run.index(int(ids[i])) for i in members], **long),
                        torch.tensor([1.0 if weights is None else float(weights[i])
                                      for i in members]))
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
        m = row_bags.message_bags(k)
        assert row_bags.message_bags(k) is m  # built once for forward and backward
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
