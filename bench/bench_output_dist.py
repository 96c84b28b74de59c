"""pytest-benchmark: the receiver's two passes of the output dist (recxla/torchrec/output_dist.py)
on the message a rank gets in the trainer's default 4-rank job, no communication.

    .venv/bin/python -m pytest bench/bench_output_dist.py --benchmark-only

The message: rank 0 of 4, batch 1024, 26 one-feature tables of dim 64, table-wise; 24 of them
in row exchange (the trainer's plan on 4 ranks), each sending the unique rows that the batch's
bags read (ids drawn from 31% as many rows as bags), the other 2 their pooled bags. One call is
the forward pass (the module's output columns, every row group's bags pooled from the rows) and
the backward pass (the output's gradient back into the message's layout, reduced per unique
row). Providers:
- recxla: `PooledAssembly.assemble` and `split`: one multi-table lookup for all row groups that
  pools each feature straight into its output columns (its backward reads the gradient there),
  one `recxla::copy_runs` per direction for the owners' pooled column ranges (and one for the
  row gradients);
- per group: the same arithmetic as torch ops, how the output dist worked before: one lookup
  call per row group with its bags built per group, the column ranges moved by slicing and
  torch.cat (one cat forward, one per source block backward), the row gradients copied one
  group at a time;
- memcpy: a copy of the message and of the output, both directions (the bytes read and written
  at least once).
TorchRec has no counterpart to time: it pools every bag at the owner and sends B x F embeddings,
so its receiver only permutes columns (the training results compare the two whole steps).
extra_info as bench/common.py: bytes = the message and the output, read and written, both ways.
"""

import dataclasses
import random
from typing import List

import pytest
import torch

from bench.common import run_and_record
from recxla.ops.copy_runs import ColumnRange, JoinColumns, copy_runs, pack
from recxla.ops.dedup import segmented_unique
from recxla.ops.embedding_bag import (SGD, SUM, BagLookup, backward_update, pooled_forward,
                                      unique_grad)
from recxla.ops.row_ids import encode_row_ids
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.output_dist import OutputDist
from recxla.torchrec.row_exchange import RowBags
from recxla.torchrec.shard_layout import Shard, ShardLayout, TableInfo

WORLD, BATCH, TABLES, ROW_TABLES, DIM, ROWS, UNIQUE = 4, 1024, 26, 24, 64, 100_000, 0.31


def _dist() -> OutputDist:
    tables = [TableInfo(f"t{t}", ROWS, DIM, [f"f{t}"], SUM) for t in range(TABLES)]
    shards = [[Shard(t, 0, t % WORLD, 0, ROWS, 0, DIM)] for t in range(TABLES)]
    layout = ShardLayout.build(tables, shards, 0, WORLD, row_tables=range(ROW_TABLES))
    return OutputDist(layout, None, "e4m3", "e5m2", CommStats())


def _bags(groups: int, generator) -> RowBags:
    """This rank's bags: one id per bag (table g's feature is input slot g), drawn from
    UNIQUE x BATCH rows per group."""
    unique = int(UNIQUE * BATCH)
    long = dict(dtype=torch.int64)
    group = torch.arange(groups, **long).repeat_interleave(BATCH)
    sample = torch.arange(BATCH, **long).repeat(groups)
    ids = torch.randint(0, unique, (groups * BATCH,), generator=generator)
    encoded = encode_row_ids(group, group.clone(), sample, ids, None, [0] * groups,
                             [1] * groups, [BATCH])
    return RowBags.encoded(encoded, encoded.counts.flatten().tolist(), encoded.bounds.tolist(),
                           [BATCH], [1] * groups)


def _recxla(dist, bags, flat, grad_out, bag_lengths):
    message = dist.receive_layout(BATCH, dataclasses.replace(bags))  # its bags made anew
    out = dist.assembly.assemble(flat, message, bag_lengths)
    return out, dist.assembly.split(grad_out, flat, message, bag_lengths)


def _group_bags(bags: RowBags, g: int):
    """One group's bags as the lookup takes them: its rows as a table of their own."""
    first, last = bags.bounds[g], bags.bounds[g + 1]
    count = int(bags.counts[g, 0])
    unique = torch.arange(count, dtype=torch.int64)
    bounds = torch.zeros(2, dtype=torch.int64)
    bounds[1] = count
    offsets = torch.arange(BATCH + 1, dtype=torch.int64)  # one id per bag
    return unique, bounds, bags.inverse[first:last], offsets


def _per_group(dist, bags, flat, grad_out, bag_lengths):
    message = dist.receive_layout(BATCH, bags)
    blocks = [flat[o: o + BATCH * d].view(BATCH, d) for o, d in message.pooled]
    rows: List[torch.Tensor] = [flat[o: o + n * c].view(n, c) for o, _, n, c in message.rows]
    group_bags = [_group_bags(bags, g) for _, g, _, _ in message.rows]
    pooled = [pooled_forward(BagLookup([r], u, b, i, o, None, [0], [SUM], BATCH))
              for r, (u, b, i, o) in zip(rows, group_bags)]
    blocks.append(torch.cat(pooled, dim=1))
    gather = sorted(dist.assembly.copies, key=lambda c: c.dst)  # no row-sharded sums here
    scatter = {}
    for c in sorted(dist.assembly.copies, key=lambda c: (c.block, c.src)):
        scatter.setdefault(c.block, []).append(c)
    out = torch.cat([blocks[c.block][:, c.src: c.src + c.width] for c in gather], dim=1)
    grad = torch.empty_like(flat)
    grad_blocks = [grad[o: o + BATCH * d].view(BATCH, d) for o, d in message.pooled]
    grad_blocks.append(grad_out.new_empty((BATCH, dist.assembly.row_block_width)))
    for block, copies in scatter.items():
        torch.cat([grad_out[:, c.dst: c.dst + c.width] for c in copies], dim=1,
                  out=grad_blocks[block])
    for (offset, _, n, c), r, (u, b, i, o), column in zip(
            message.rows, rows, group_bags, range(0, dist.assembly.row_block_width, DIM)):
        row_grad = unique_grad(grad_blocks[-1][:, column: column + DIM].contiguous(),
                               BagLookup([r], u, b, i, o, None, [0], [SUM], BATCH))[0]
        grad[offset: offset + n * c].view(n, c).copy_(row_grad)
    return out, grad


def _memcpy(flat, grad_out, into):
    into[0].copy_(flat)
    into[1].copy_(grad_out)
    into[2].copy_(grad_out)
    into[3].copy_(flat)
    return into


@pytest.mark.parametrize("provider", ["recxla", "per group", "memcpy"])
def test_output_dist_assemble_and_split(benchmark, provider):
    generator = torch.Generator().manual_seed(0)
    dist = _dist()
    groups = len(dist.group_cols)
    assert groups == ROW_TABLES
    bags = _bags(groups, generator)
    message = dist.receive_layout(BATCH, bags)
    flat = torch.randn(message.total, generator=generator)
    grad_out = torch.randn(BATCH, dist.assembly.out_dim, generator=generator)
    bag_lengths = torch.empty(BATCH, 0)
    benchmark.group = (f"output dist, rank 0 of {WORLD}: {TABLES} tables x dim {DIM}, "
                       f"{groups} in row exchange, batch {BATCH}, forward + backward")
    moved = 2 * 4 * (flat.numel() + grad_out.numel())  # read + written, fp32
    fn = {"recxla": lambda: _recxla(dist, bags, flat, grad_out, bag_lengths),
          "per group": lambda: _per_group(dist, bags, flat, grad_out, bag_lengths),
          "memcpy": lambda: _memcpy(flat, grad_out, (torch.empty_like(flat),
                                                     torch.empty_like(grad_out),
                                                     torch.empty_like(grad_out),
                                                     torch.empty_like(flat)))}[provider]
    out = run_and_record(benchmark, fn, nbytes=2 * moved, memcpy_nbytes=moved,
                         provider=provider, groups=groups)
    if provider != "memcpy":  # both ways compute the same numbers
        want = _per_group(dist, bags, flat, grad_out, bag_lengths)
        torch.testing.assert_close(out[0], want[0])
        torch.testing.assert_close(out[1], want[1])
        if provider == "recxla":
            assert not torch.equal(out[0], torch.zeros_like(out[0]))


# ------------------------------------------------------------ the data-parallel tables' merge
# The pooled module's output when TorchRec's planner makes some tables data-parallel
# (recxla/torchrec/data_parallel.py OutputMerge): the model-parallel columns and the
# data-parallel ones joined in the unsharded module's order, forward and backward. Providers:
# recxla (JoinColumns: one copy_runs each way), "cat + index_select" (how it was joined
# before: a cat, a column gather, and in the backward the gather's scatter into zeros), and
# memcpy (the output's bytes once each way).
MERGE_DP_FEATURES = 6  # of the TABLES features, spread over the output


def _merge_case(generator):
    dp = sorted(random.Random(0).sample(range(TABLES), MERGE_DP_FEATURES))
    mp = [f for f in range(TABLES) if f not in dp]
    ranges, index, column = [], [], 0
    for f in range(TABLES):
        part, position = (1, dp.index(f)) if f in dp else (0, mp.index(f))
        ranges.append(ColumnRange(part, position * DIM, column, DIM))
        index.extend(range((len(mp) * DIM if part else 0) + position * DIM,
                           (len(mp) * DIM if part else 0) + (position + 1) * DIM))
        column += DIM
    parts = [torch.randn(BATCH, len(mp) * DIM, generator=generator).requires_grad_(),
             torch.randn(BATCH, len(dp) * DIM, generator=generator).requires_grad_()]
    return parts, ranges, torch.tensor(index, dtype=torch.int64)


def _merge_recxla(parts, ranges, grad):
    out = JoinColumns.apply(ranges, TABLES * DIM, *parts)
    return out.detach(), torch.autograd.grad(out, parts, grad)


def _merge_cat_index_select(parts, index, grad):
    out = torch.cat(parts, dim=1).index_select(1, index)
    return out.detach(), torch.autograd.grad(out, parts, grad)


@pytest.mark.parametrize("provider", ["recxla", "cat + index_select", "memcpy"])
def test_data_parallel_merge(benchmark, provider):
    generator = torch.Generator().manual_seed(0)
    parts, ranges, index = _merge_case(generator)
    grad = torch.randn(BATCH, TABLES * DIM, generator=generator)
    benchmark.group = (f"the data-parallel merge: {TABLES - MERGE_DP_FEATURES} model-parallel "
                       f"and {MERGE_DP_FEATURES} data-parallel features x dim {DIM}, batch "
                       f"{BATCH}, forward + backward")
    moved = 2 * 4 * grad.numel()  # the output read + written, fp32, each way
    forward, backward = torch.empty_like(grad), torch.empty_like(grad)
    fn = {"recxla": lambda: _merge_recxla(parts, ranges, grad),
          "cat + index_select": lambda: _merge_cat_index_select(parts, index, grad),
          "memcpy": lambda: (forward.copy_(grad), backward.copy_(grad))}[provider]
    out = run_and_record(benchmark, fn, nbytes=2 * moved, memcpy_nbytes=moved,
                         provider=provider)
    if provider != "memcpy":  # both ways give the same bits
        want = _merge_cat_index_select(parts, index, grad)
        assert torch.equal(out[0], want[0])
        assert all(torch.equal(g, w) for g, w in zip(out[1], want[1]))


# ------------------------------------------------------------ the owner's update
# Rank 0's side of the gradient coming back in the same job with one micro-batch (DBP's
# default): a message from each of the WORLD sources, its pooled rows [BATCH, D_owner] then the
# rows it asked of each of the owner's row groups, and the owner's fused update (SGD) of both
# lookups. Providers: recxla (OutputDist.owner_gradient_offsets, then each lookup's
# embedding_bag_backward_update reading its rows where the message holds them: the window's
# update_from_message), "unpack + update" (the message first unpacked into the [B, D_owner]
# gradient and the row block in one copy_runs, as several micro-batches still do), and memcpy
# (the message's bytes once).


def _owner_case(generator):
    """rank 0's RowInput, RequestedRows and pooled BagLookup, and a gradient message."""
    from recxla.torchrec.row_exchange import RowInput, requested_rows

    dist = _dist()
    groups = len(dist.local_group_cols)
    requested = int(UNIQUE * BATCH)  # of each group by each source
    values = torch.cat([torch.randperm(ROWS, generator=generator)[:requested]
                        for _ in range(groups * WORLD)])
    rows = RowInput(values, [[[requested] * WORLD] for _ in range(groups)])
    row_weights = [torch.randn(ROWS, DIM, generator=generator) for _ in range(groups)]
    row_lookup = requested_rows(row_weights, rows.values,
                                rows.block_layout(dist.local_group_cols))
    pooled_tables = dist.owner_dims[0] // DIM
    ids = torch.randint(0, ROWS, (pooled_tables * WORLD * BATCH,), generator=generator)
    unique, unique_offsets, inverse = segmented_unique(
        ids, torch.arange(pooled_tables + 1) * WORLD * BATCH)
    pooled = BagLookup([torch.randn(ROWS, DIM, generator=generator)
                        for _ in range(pooled_tables)], unique, unique_offsets, inverse,
                       torch.arange(ids.numel() + 1), None, list(range(pooled_tables)),
                       [SUM] * pooled_tables, WORLD * BATCH)
    sources = [BATCH] * WORLD
    flat = torch.randn(sum(dist.send_sizes(sources, rows)), generator=generator)
    return dist, sources, rows, row_lookup, pooled, flat


def _sgd_updates(row_lookup, pooled, pooled_grad, row_grad, pooled_at=None, rows_at=None):
    """Both lookups' fused SGD update: of [B, D] and row-block gradients, or (with the offsets)
    of the message itself."""
    from recxla.torchrec.row_exchange import update_requested_rows

    def offsets(at):
        return None if at is None else torch.from_numpy(at)

    n = len(pooled.weights)
    backward_update(pooled_grad, pooled, [pooled_grad.new_empty(0)] * n, [SGD] * n,
                    [0.01, 0.0, 0.0, 1.0] * n, offsets(pooled_at))
    n = len(row_lookup.lookup.weights)
    update_requested_rows(row_lookup, [row_grad.new_empty(0)] * n, row_grad, [SGD] * n,
                          [0.01, 0.0, 0.0, 1.0] * n, offsets(rows_at))


def _owner_update_in_place(dist, sources, rows, row_lookup, pooled, flat):
    columns = [DIM * f for f in range(len(pooled.feature_table))]
    pooled_at, rows_at = dist.owner_gradient_offsets(sources, rows, columns)
    _sgd_updates(row_lookup, pooled, flat, flat, pooled_at, rows_at)


def _owner_update_unpacked(dist, sources, rows, row_lookup, pooled, flat):
    gradient = flat.new_empty((WORLD * BATCH, dist.owner_dims[0]))
    row_gradient = flat.new_empty((row_lookup.layout.rows, row_lookup.layout.width))
    runs = dist.owner_message_runs(sources, rows, 0, 0, True)
    copy_runs([flat], [gradient, row_gradient], pack(r.transposed() for r in runs))
    _sgd_updates(row_lookup, pooled, gradient, row_gradient)


@pytest.mark.parametrize("provider", ["recxla", "unpack + update", "memcpy"])
def test_owner_update_from_the_message(benchmark, provider):
    generator = torch.Generator().manual_seed(0)
    case = _owner_case(generator)
    dist, _, _, row_lookup, pooled, flat = case
    benchmark.group = (f"the owner's update, rank 0 of {WORLD}: {len(pooled.weights)} pooled "
                       f"and {len(row_lookup.lookup.weights)} row-exchange tables x dim {DIM}, "
                       f"{WORLD} sources x batch {BATCH}, one message, SGD")
    copy = torch.empty_like(flat)
    fn = {"recxla": lambda: _owner_update_in_place(*case),
          "unpack + update": lambda: _owner_update_unpacked(*case),
          "memcpy": lambda: copy.copy_(flat)}[provider]
    run_and_record(benchmark, fn, nbytes=2 * 4 * flat.numel(), memcpy_nbytes=4 * flat.numel(),
                   provider=provider, message_values=flat.numel())
    if provider != "memcpy":  # both read the same gradient: the same rows after one update
        before = [w.clone() for w in pooled.weights + row_lookup.lookup.weights]
        got = _copy_weights(case, before)
        _owner_update_in_place(*got)
        want = _copy_weights(case, before)
        _owner_update_unpacked(*want)
        for a, b in zip(got[4].weights + got[3].lookup.weights,
                        want[4].weights + want[3].lookup.weights):
            assert torch.equal(a, b)


def _copy_weights(case, weights):
    """`case` with fresh copies of `weights` (the pooled tables', then the row tables')."""
    dist, sources, rows, row_lookup, pooled, flat = case
    weights = [w.clone() for w in weights]
    pooled = pooled._replace(weights=weights[:len(pooled.weights)])
    lookup = row_lookup.lookup._replace(weights=weights[len(pooled.weights):])
    return dist, sources, rows, dataclasses.replace(row_lookup, lookup=lookup), pooled, flat
