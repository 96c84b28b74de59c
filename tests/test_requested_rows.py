"""The owner's requested rows as one lookup (recxla.torchrec.row_exchange.RequestedRows): the row
block's layout on fresh random group counts and widths (every row in one place, the padding
bounded), the lookup's rows against each table indexed by its ids, and its fused update against
a plain-PyTorch SGD step on the summed gradients of repeated rows."""

import random

import torch

from recxla.ops.embedding_bag import SGD, pooled_forward
from recxla.torchrec.row_exchange import (RowBlockLayout, apply_row_gradients, requested_rows,
                                          update_requested_rows)


def random_groups():
    groups = random.randint(1, 6)
    # Unequal counts, as Zipf tables ask: some groups empty, some large.
    counts = [random.choice([0, 1, random.randint(1, 9), random.randint(10, 200)])
              for _ in range(groups)]
    widths = [random.choice([1, 4, 8]) for _ in range(groups)]
    return counts, widths


def test_layout_places_every_row_once_and_bounds_the_padding():
    for _ in range(200):
        counts, widths = random_groups()
        layout = RowBlockLayout.of(counts, widths)
        seen = torch.zeros(layout.rows * layout.width, dtype=torch.int64)
        for g, (count, width) in enumerate(zip(counts, widths)):
            start = random.randint(0, count)
            # Any range of a group's rows, cut into pieces of whole rows inside the block.
            assert sum(n for _, n in layout.pieces(g, start, count - start)) == count - start
            for offset, n in layout.pieces(g, 0, count):
                for i in range(n):
                    seen[offset + i * layout.width: offset + i * layout.width + width] += 1
        assert int(seen.max()) <= 1 and int(seen.sum()) == sum(
            c * w for c, w in zip(counts, widths))
        held = layout.rows * (layout.first_slot[-1])
        assert held <= 1.5 * sum(counts) + layout.rows * len(counts) + len(counts), (counts,
                                                                                    layout)


def test_lookup_gives_each_group_its_rows():
    for _ in range(30):
        counts, widths = random_groups()
        weights = [torch.randn(50, w) for w in widths]
        ids = [torch.randint(0, 50, (c,)) for c in counts]
        layout = RowBlockLayout.of(counts, widths)
        requested = requested_rows(weights, torch.cat(ids), layout)
        block = pooled_forward(requested.lookup)
        assert block.shape == (layout.rows, layout.width)
        for g, (w, i) in enumerate(zip(weights, ids)):
            assert torch.equal(layout.group_rows(block, g), w[i])
        for g, unique in enumerate(requested.unique_rows()):
            assert torch.equal(unique, torch.unique(ids[g]))


def test_fused_update_sums_repeated_rows_once():
    lr = 0.5
    for _ in range(20):
        counts, widths = random_groups()
        weights = [torch.randn(20, w) for w in widths]
        ids = [torch.randint(0, 20, (c,)) for c in counts]  # 20 rows: repeats
        grads = [torch.randn(c, w) for c, w in zip(counts, widths)]
        want = [w.clone().index_add_(0, i, -lr * g) for w, i, g in zip(weights, ids, grads)]
        states = [torch.empty(0) for _ in weights]
        kinds, hparams = [SGD] * len(weights), [lr, 0.0, 0.0, 1.0] * len(weights)
        through_lists = [w.clone() for w in weights]
        apply_row_gradients(through_lists, states, ids, grads, kinds, hparams)
        layout = RowBlockLayout.of(counts, widths)
        requested = requested_rows(weights, torch.cat(ids), layout)
        block_grad = torch.full((layout.rows, layout.width), float("nan"))  # padding unread
        for g, grad in enumerate(grads):
            for (offset, n), first in zip(layout.pieces(g, 0, grad.shape[0]),
                                          range(0, grad.shape[0], layout.rows)):
                rows = block_grad.view(-1)[offset:].as_strided((n, grad.shape[1]),
                                                                (layout.width, 1))
                rows.copy_(grad[first: first + n])
        update_requested_rows(requested, states, block_grad, kinds, hparams)
        for got, other, expected in zip(weights, through_lists, want):
            torch.testing.assert_close(got, expected)
            assert torch.equal(got, other)
