"""pytest-benchmark: two parts of the trainer's step on CPU, each against the code it replaced
and a memcpy of the same bytes, on the trainer's batch (1024 samples a rank, 26 Criteo
features, 4 ranks), one thread.

    .venv/bin/python -m pytest bench/bench_step_parts.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds

- The owner's reorder of the ids it received (recxla/torchrec/id_decoder.py): the sources'
  blocks arrive (source, slot) and the lookup takes them (slot, source). Rank 0 owns 7 of the
  26 tables (two multi-hot), 4 sources; ids int64, with and without per-id weights.
  Providers: `recxla` (recxla::decode_id_blocks over the sources' raw blocks: the reorder,
  and the bags' bounds besides), `fbgemm` (FBGEMM's permute_2D_sparse_data: the path before
  the op), `gather` (a gather index over every id, then index_select: the path before that),
  `memcpy` (a copy of the ids and weights).
- The padded sparse arch of `--embedding-dims auto` (recxla/train/models.py): the pooled values
  of 22 features at dim 32 and 4 at 16 (the trainer's proposal on 4 ranks, in TorchRec's
  output order) to DLRM's [1024, 26, 64], forward and backward. Providers: `runs`
  (`PadFeatures`: one `recxla::copy_runs` a pass, the padding's zeros included), `pad_cat` (a
  pad per feature and a cat: the arch before), `memcpy` (a copy of the output and of the
  values' gradient).
"""

import pytest
import torch

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

from bench.bench_dedup import MULTI_HOT, TABLE_ROWS
from bench.common import one_thread
from recxla.ops.id_blocks import decode_id_blocks
from recxla.reference.id_blocks import encode_id_blocks_ref
from recxla.train.models import PadFeatures, feature_runs

BATCH = 1024
SOURCES = 4
OWNED_TABLES = [0, 2, 4, 8, 11, 16, 24]  # rank 0's tables, two multi-hot (2, 11)


def received_ids(weighted: bool):
    """(sizes int64 [sources, slots, 1], ids, weights or None, bag lengths int64 [sources,
    slots, BATCH]) as rank 0 receives them."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.stack([torch.stack([torch.randint(1, 4, (BATCH,), generator=g)
                                        if t in MULTI_HOT else
                                        torch.ones(BATCH, dtype=torch.int64)
                                        for t in OWNED_TABLES]) for _ in range(SOURCES)])
    sizes = lengths.sum(2, keepdim=True)
    total = int(sizes.sum())
    ids = torch.randint(0, min(TABLE_ROWS), (total,), generator=g)
    weights = torch.rand(total, generator=g) if weighted else None
    return sizes, ids, weights, lengths


def segment_gather(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """The gather index that puts segments laid out in the row-major order of `sizes` (int64
    [world, groups, micro-batches]) in (group, micro-batch, world) order."""
    flat = sizes.flatten()
    start = (torch.cumsum(flat, 0) - flat).view(sizes.shape)
    target_sizes = sizes.permute(1, 2, 0).flatten()
    target_start = torch.cumsum(target_sizes, 0) - target_sizes
    shift = torch.repeat_interleave(start.permute(1, 2, 0).flatten() - target_start,
                                    target_sizes, output_size=total)
    return torch.arange(total, device=sizes.device) + shift


def reorder_by_fbgemm(sizes, ids, weights):
    """FBGEMM's permute_2D_sparse_data: each segment copied whole."""
    world, groups, micro = sizes.shape
    order = torch.arange(world * groups * micro, dtype=torch.int32)
    order = order.view(world, groups, micro).permute(1, 2, 0).flatten()
    _, ids, weights = torch.ops.fbgemm.permute_2D_sparse_data(
        order, sizes.reshape(-1, 1), ids, weights, ids.numel())
    return ids, weights


def reorder_by_gather(sizes, ids, weights):
    gather = segment_gather(sizes, ids.numel())
    return ids.index_select(0, gather), None if weights is None else weights.index_select(0, gather)


def reorder_memcpy(sizes, ids, weights):
    return ids.clone(), None if weights is None else weights.clone()


def decoder(sizes, ids, weights, lengths):
    """The owner's decode op over the same ids as the sources' raw blocks (int64 on the wire)
    -> a function of (sizes, ids, weights) that decodes them (it also makes the bag bounds)."""
    starts = torch.cumsum(sizes.flatten(), 0) - sizes.flatten()
    sources = []
    for s in range(SOURCES):
        first, count = int(starts[s * len(OWNED_TABLES)]), int(sizes[s].sum())
        sources.append({"lengths": lengths[s], "ids": ids[first: first + count],
                        "micro": [BATCH], "encoding": 0,
                        "weights": weights[first: first + count] if weights is not None
                        else None})
    weighted = weights is not None
    received, blocks = encode_id_blocks_ref(sources, len(OWNED_TABLES), 1, 0, 8, weighted)

    def decode(*_):
        out = decode_id_blocks(received, blocks, len(OWNED_TABLES), 1, 0, 8, weighted)
        return out.values, out.weights if weighted else None

    return decode


REORDER = {"recxla": decoder, "fbgemm": lambda *_: reorder_by_fbgemm,
           "gather": lambda *_: reorder_by_gather, "memcpy": lambda *_: reorder_memcpy}


@pytest.mark.parametrize("weighted", [False, True], ids=["ids", "ids+weights"])
@pytest.mark.parametrize("provider", list(REORDER))
def test_owner_reorder(benchmark, provider, weighted):
    with one_thread():
        sizes, ids, weights, lengths = received_ids(weighted)
        args = (sizes, ids, weights)
        fn = REORDER[provider](sizes, ids, weights, lengths)
        if provider != "memcpy":
            want = reorder_by_gather(*args)
            got = fn(*args)
            assert torch.equal(got[0], want[0])
            assert (got[1] is None) == (want[1] is None)
            assert got[1] is None or torch.equal(got[1], want[1])
        benchmark.extra_info.update(ids=ids.numel())
        benchmark(fn, *args)


DIM = 64
# The trainer's proposal on 4 ranks (22 tables at 32, 4 at 16), features in the order TorchRec's
# sharded collection gives them (grouped by sharding type, not the configs' order).
KEYS = [f"cat_{i}" for i in (0, 1, 2, 6, 10, 12, 15, 18, 23, 3, 4, 7, 9, 11, 14, 17, 20, 25, 5,
                             8, 13, 16, 19, 21, 22, 24)]
SMALL = {"cat_2", "cat_3", "cat_11", "cat_20"}
DIMS = [16 if k in SMALL else 32 for k in KEYS]
FEATURES = [f"cat_{i}" for i in range(26)]


def pad_cat(values, grad):
    out = torch.cat([torch.nn.functional.pad(v, (0, DIM - v.shape[1]))
                     for v in torch.split(values, DIMS, dim=1)], dim=1)
    out = out.view(BATCH, len(FEATURES), DIM)  # in KEYS' order: the cost, not the order, counts
    out.backward(grad)
    return out


def pad_runs(values, grad, runs):
    out = PadFeatures.apply(values, runs, len(FEATURES), DIM)
    out.backward(grad)
    return out


def pad_memcpy(values, grad):
    return grad.clone(), values.detach().clone()


@pytest.mark.parametrize("provider", ["runs", "pad_cat", "memcpy"])
def test_padded_sparse_arch(benchmark, provider):
    with one_thread():
        g = torch.Generator().manual_seed(0)
        values = torch.randn(BATCH, sum(DIMS), generator=g).requires_grad_()
        grad = torch.randn(BATCH, len(FEATURES), DIM, generator=g)
        runs = feature_runs(KEYS, DIMS, {f: i for i, f in enumerate(FEATURES)})
        if provider == "runs":
            fn, args = pad_runs, (values, grad, runs)
            expect = torch.zeros(BATCH, len(FEATURES), DIM)
            for column, (key, dim) in zip(torch.tensor([0] + DIMS).cumsum(0).tolist(),
                                          zip(KEYS, DIMS)):
                expect[:, FEATURES.index(key), :dim] = values.detach()[:, column: column + dim]
            assert torch.equal(fn(*args), expect)
        else:
            fn, args = (pad_cat if provider == "pad_cat" else pad_memcpy), (values, grad)
        benchmark.extra_info.update(runs=len(runs))

        def call(*a):
            values.grad = None
            return fn(*a)

        benchmark(call, *args)
