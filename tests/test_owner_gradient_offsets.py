"""OutputDist.owner_gradient_offsets (recxla/torchrec/output_dist.py): where the owner's fused
update reads each bag's gradient row in the gradient message of a batch sent as one exchange.
Against the message unpacked by the owner's runs (owner_message_runs, as unpack_gradient moves
it): every pooled bag and every requested row of the row block reads the same values, on each
rank of a layout with pooled and row-exchange tables, random batch sizes (some sources sending
nothing) and random request counts (some groups asked for nothing)."""

import random

import torch

from recxla.ops.copy_runs import copy_runs, pack
from recxla.ops.embedding_bag import SUM
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.output_dist import OutputDist
from recxla.torchrec.row_exchange import RowInput
from recxla.torchrec.shard_layout import Shard, ShardLayout, TableInfo

ROWS, WORLD = 40, 3


def _dist(rank: int) -> OutputDist:
    """Rank `rank` of 3: t0 (dim 16), t1 (dim 32) and t2 (dim 8) table-wise in row exchange,
    t3 (dim 24) column-wise over ranks 1 and 2 in row exchange, t4 (dim 8) and t5 (dim 16)
    pooled on ranks 2 and 0."""
    tables = [TableInfo("t0", ROWS, 16, ["a"], SUM), TableInfo("t1", ROWS, 32, ["b"], SUM),
              TableInfo("t2", ROWS, 8, ["c"], SUM), TableInfo("t3", ROWS, 24, ["d"], SUM),
              TableInfo("t4", ROWS, 8, ["e"], SUM), TableInfo("t5", ROWS, 16, ["f"], SUM)]
    shards = [[Shard(0, 0, 1, 0, ROWS, 0, 16)], [Shard(1, 1, 0, 0, ROWS, 0, 32)],
              [Shard(2, 2, 0, 0, ROWS, 0, 8)],
              [Shard(3, 3, 1, 0, ROWS, 0, 12), Shard(3, 4, 2, 0, ROWS, 12, 12)],
              [Shard(4, 5, 2, 0, ROWS, 0, 8)], [Shard(5, 6, 0, 0, ROWS, 0, 16)]]
    layout = ShardLayout.build(tables, shards, rank, WORLD, row_tables=range(4))
    return OutputDist(layout, None, "fp32", "fp32", CommStats())


def _unpacked(dist, sources, rows, flat):
    """The message unpacked as the window's buffers hold it: ([B, D_owner], the row block)."""
    block = rows.block_layout(dist.local_group_cols)
    gradient = torch.full((sum(sources), dist.owner_dims[dist.layout.rank]), float("nan"))
    row_block = torch.full((block.rows, block.width), float("nan"))
    runs = dist.owner_message_runs(sources, rows, 0, 0, True)
    copy_runs([flat], [gradient, row_block], pack(r.transposed() for r in runs))
    return gradient, row_block, block


def test_offsets_read_what_the_runs_unpack(seed):
    for rank in range(WORLD):
        dist = _dist(rank)
        for _ in range(5):
            sources = [random.choice([0, random.randint(1, 9)]) for _ in range(WORLD)]
            groups = len(dist.local_group_cols)
            counts = [[[random.choice([0, random.randint(1, 7)]) for _ in range(WORLD)]]
                      for _ in range(groups)]
            total = sum(c for group in counts for c in group[0])
            rows = RowInput(torch.randint(0, ROWS, (total,)), counts)
            flat = torch.randn(sum(dist.send_sizes(sources, rows)))
            gradient, row_block, block = _unpacked(dist, sources, rows, flat)
            # The pooled lookup's features: its columns cut at random into pieces.
            width = gradient.shape[1]
            cuts = sorted(random.sample(range(1, width), min(2, width - 1))) if width > 1 else []
            columns = [0, *cuts]
            dims = [b - a for a, b in zip(columns, [*cuts, width])] if width else []
            columns = columns[:len(dims)]
            pooled_at, rows_at = dist.owner_gradient_offsets(sources, rows, columns)
            batch = sum(sources)
            assert pooled_at.shape == (len(columns) * batch,)
            for f, (first, dim) in enumerate(zip(columns, dims)):
                for b in range(batch):
                    at = int(pooled_at[f * batch + b])
                    assert torch.equal(flat[at: at + dim], gradient[b, first: first + dim])
            assert rows_at.shape == (block.first_slot[-1] * block.rows,)
            for slot, (group, held) in enumerate(zip(block.slot_group, block.slot_rows())):
                first, last = block.columns[slot], block.columns[slot + 1]
                for b in range(held):
                    at = int(rows_at[slot * block.rows + b])
                    assert torch.equal(flat[at: at + last - first], row_block[b, first:last])
            # The unpacked buffers are whole: every requested row and pooled value arrived.
            assert not gradient.isnan().any()


def test_offsets_without_row_groups(seed):
    dist = _dist(2)
    sources = [random.randint(0, 9) for _ in range(WORLD)]
    pooled_at, rows_at = dist.owner_gradient_offsets(sources, None, [0])
    dim = dist.owner_dims[2]
    assert rows_at is None
    assert pooled_at.tolist() == [b * dim for b in range(sum(sources))]
