"""The receiver's side of the output dist (recxla/torchrec/output_dist.py, PooledAssembly): the
row groups' bags pooled straight into the output's columns and their gradient read where the
model leaves it (a column range of a wider gradient), against the path through a row block and
the runs, bit for bit; the cases that must take that path (a row group's column that is a
later part of a row-sharded sum); and the pipeline window's gradient tap, which hands that
gradient over as the model leaves it."""

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recxla.ops.embedding_bag import MEAN, SUM
from recxla.pipeline.window import _GradientTap
from recxla.ops.row_ids import encode_row_ids
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.output_dist import OutputDist
from recxla.torchrec.row_exchange import RowBags
from recxla.torchrec.shard_layout import Shard, ShardLayout, TableInfo

ROWS = 40


def _layout(row_sharded: bool) -> ShardLayout:
    """Rank 0 of 3: t0 (2 features, dim 16), t1 (dim 32) and t2 (dim 8, MEAN) table-wise, t3
    (dim 24) column-wise over ranks 1 and 2, t4 (dim 8) pooled; every table but t4 in row
    exchange. row_sharded: t1 split by rows over ranks 0 and 1 instead (its parts summed)."""
    tables = [TableInfo("t0", ROWS, 16, ["a", "b"], SUM), TableInfo("t1", ROWS, 32, ["c"], SUM),
              TableInfo("t2", ROWS, 8, ["d"], MEAN), TableInfo("t3", ROWS, 24, ["e"], SUM),
              TableInfo("t4", ROWS, 8, ["f"], SUM)]
    t1 = [Shard(1, 1, 0, 0, ROWS // 2, 0, 32), Shard(1, 2, 1, ROWS // 2, ROWS // 2, 0, 32)] \
        if row_sharded else [Shard(1, 1, 2, 0, ROWS, 0, 32)]
    shards = [[Shard(0, 0, 1, 0, ROWS, 0, 16)], t1, [Shard(2, 3, 0, 0, ROWS, 0, 8)],
              [Shard(3, 4, 1, 0, ROWS, 0, 12), Shard(3, 5, 2, 0, ROWS, 12, 12)],
              [Shard(4, 6, 2, 0, ROWS, 0, 8)]]
    return ShardLayout.build(tables, shards, 0, 3, row_tables=range(4))


def _bags(dist: OutputDist, batch: int, generator: torch.Generator) -> RowBags:
    """Random bags (0-3 ids each) of every row group's features, for `batch` samples."""
    layout = dist.layout
    groups = [g for r in range(layout.world_size) for g in layout.row_groups(r)]
    features = [len(layout.tables[g.table].feature_names) for g in groups]
    group, slot, sample, ids = [], [], [], []
    slot_position = []
    for g, local in enumerate(groups):
        for j in range(features[g]):
            lengths = torch.randint(0, 4, (batch,), generator=generator)
            n = int(lengths.sum())
            group.append(torch.full((n,), g))
            slot.append(torch.full((n,), len(slot_position)))
            sample.append(torch.repeat_interleave(torch.arange(batch), lengths))
            ids.append(torch.randint(0, local.shard.rows, (n,), generator=generator))
            slot_position.append(j)
    encoded = encode_row_ids(*(torch.cat(x) for x in (group, slot, sample, ids)), None,
                             slot_position, features, [batch])
    return RowBags.encoded(encoded, encoded.counts.flatten().tolist(), encoded.bounds.tolist(),
                           [batch], features)


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_row_groups_pooled_in_place_as_through_the_row_block(seed):
    generator = torch.Generator().manual_seed(seed)
    dist = OutputDist(_layout(row_sharded=False), None, "e4m3", "e5m2", CommStats())
    placed = dist.assembly
    assert placed.row_feature_columns is not None
    through_block = copy.copy(placed)
    through_block.row_feature_columns = None
    batch = 1 + int(torch.randint(0, 20, (), generator=generator))
    message = dist.receive_layout(batch, _bags(dist, batch, generator))
    flat = torch.randn(message.total, generator=generator)
    lengths = flat.new_empty((batch, 0))

    calls = _Calls()
    with calls:
        out = placed.assemble(flat, message, lengths)
    assert "recxla.embedding_bag_forward.default" not in calls.names  # no row block
    assert torch.equal(out, through_block.assemble(flat, message, lengths))

    # The model's gradient: a column range of a wider one, read where it lies.
    wide = torch.randn(batch, placed.out_dim + 7, generator=generator)
    grad_out = wide[:, 3: 3 + placed.out_dim]
    calls = _Calls()
    with calls:
        got = placed.split(grad_out, flat, message, lengths)
    copies = [n for n in calls.names if n.split(".")[1] in ("clone", "copy_", "cat", "_to_copy")]
    assert copies == []
    assert torch.equal(got, through_block.split(grad_out.contiguous(), flat, message, lengths))
    # A gradient broadcast over the samples (rows 0 apart, as (values * w).sum() gives) and one
    # whose columns are apart are read from a contiguous copy.
    for odd in (wide[0, :placed.out_dim].expand(batch, placed.out_dim),
                torch.randn(placed.out_dim, batch, generator=generator).t()):
        assert torch.equal(placed.split(odd, flat, message, lengths),
                           through_block.split(odd.contiguous(), flat, message, lengths))


def test_a_row_sharded_sum_goes_through_the_row_block(seed):
    """t1's parts come from two owners' row groups and are added in order: the row groups'
    columns then go through the row block, and the output is the same as pooling each part."""
    generator = torch.Generator().manual_seed(seed)
    dist = OutputDist(_layout(row_sharded=True), None, "e4m3", "e5m2", CommStats())
    assert dist.assembly.row_feature_columns is None
    batch = 9
    message = dist.receive_layout(batch, _bags(dist, batch, generator))
    flat = torch.randn(message.total, generator=generator)
    wide = torch.randn(batch, dist.assembly.out_dim + 2, generator=generator)
    grad_out = wide[:, 1: 1 + dist.assembly.out_dim]
    lengths = flat.new_empty((batch, 0))
    assert torch.equal(dist.assembly.split(grad_out, flat, message, lengths),
                       dist.assembly.split(grad_out.contiguous(), flat, message, lengths))
    assert dist.assembly.assemble(flat, message, lengths).shape == (batch, 16 * 2 + 32 + 8 +
                                                                    24 + 8)


def test_gradient_tap_hands_over_the_models_gradient_uncopied(seed):
    """The tap's output requires grad although its values do not; the backward hands its
    gradient to the callback as the model's cat leaves it (a view of the incoming gradient, not
    a copy a leaf's .grad would make), and the anchor gets none."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 6, generator=generator)
    dense = torch.randn(5, 2, generator=generator, requires_grad=True)
    anchor = torch.empty(0, requires_grad=True)
    arrived = []
    tapped = _GradientTap.apply(anchor, values, arrived.append)
    assert tapped.requires_grad and torch.equal(tapped, values)
    grad = torch.randn(5, 8, generator=generator)
    torch.cat([dense, tapped], dim=1).backward(grad)
    (got,) = arrived
    assert torch.equal(got, grad[:, 2:])
    assert got.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    assert anchor.grad is None and torch.equal(dense.grad, grad[:, :2])
