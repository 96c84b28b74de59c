"""pytest-benchmark: the sender's row-exchange encoding (recxla.ops.row_ids) on the trainer's batch.

    .venv/bin/python -m pytest bench/bench_row_ids.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds

Batch: 1024 samples x 26 features with Criteo Kaggle's table sizes (capped at 100k rows, as the
cluster benchmark trains), 20 one-hot, 6 with 1-3 ids, skewed ids (a few rows take most of the
reads, as in click logs); 24 of the tables in row exchange (the trainer's plan), each one row
group; one micro-batch, and two. Providers, all returning the EncodedRows of the tests' oracle
(recxla.reference.row_ids, a per-id loop, checked once and not timed):
- recxla: the C++ kernel (a counting sort over the bags, a sorted dedup per run, the plan);
- torch: the plain-PyTorch chain (a stable sort, bincounts, segmented_unique, then per
  micro-batch the plan's gathers and cumsums) that the sharded module ran before the kernel,
  and that ids on a GPU still run (recxla.ops.row_ids.encode_row_ids_torch);
- memcpy: a copy of the bytes the op must read and write at least (four int64 per id in, an
  order, an inverse and the plan's inverse out);
on one thread (the kernel is serial; the cluster benchmark runs its ranks on one thread each).

The sequence module's expansion (`recxla::expand_row_plan`, test_expand_row_plan) on the
history model's batch: 1024 samples' histories of 20-200 ids (mean 110, skewed), one table, whole
rows (one row group) or cut into two column shards (two routes an id); one micro-batch and two.
Providers: recxla, the C++ kernel; torch, `expand_row_plan_torch` (the positions and per
micro-batch gather plan in torch ops that the module ran before, and that GPU ids still run);
memcpy, a copy of four int64 per route in and the plan out.
"""

import pytest
import torch

from bench.bench_dedup import MULTI_HOT, TABLE_ROWS
from bench.common import one_thread
from recxla.ops.row_ids import (encode_row_ids, encode_row_ids_torch, expand_row_plan,
                                expand_row_plan_torch)
from recxla.reference.row_ids import encode_row_ids_ref, expand_row_plan_ref

BATCH = 1024
ROW_TABLES = 24


def trainer_rows(num_micro: int):
    """encode_row_ids' arguments for the trainer's batch: tables 0 .. ROW_TABLES - 1 in row
    exchange, table t's feature being input slot t."""
    g = torch.Generator().manual_seed(0)
    rows = [min(r, 100_000) for r in TABLE_ROWS[:ROW_TABLES]]
    lengths = [torch.randint(1, 4, (BATCH,), generator=g) if t in MULTI_HOT else
               torch.ones(BATCH, dtype=torch.int64) for t in range(ROW_TABLES)]
    long = dict(dtype=torch.int64)
    group = torch.cat([torch.full((int(n.sum()),), t, **long) for t, n in enumerate(lengths)])
    sample = torch.cat([torch.repeat_interleave(torch.arange(BATCH), n) for n in lengths])
    # Skewed: the cube of a uniform draw puts most reads on the first rows.
    ids = torch.cat([(torch.rand(int(n.sum()), generator=g) ** 3 * r).long()
                     for r, n in zip(rows, lengths)])
    micro = [BATCH // num_micro] * num_micro
    return (group, group.clone(), sample, ids, None, [0] * ROW_TABLES, [1] * ROW_TABLES, micro)


def memcpy(group, slot, sample, ids, *_):
    return torch.cat([group, slot, sample, ids, group, slot, sample])


PROVIDERS = {"recxla": encode_row_ids, "torch": encode_row_ids_torch, "memcpy": memcpy}


@pytest.mark.parametrize("num_micro", [1, 2], ids=["m=1", "m=2"])
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_encode_row_ids(benchmark, provider, num_micro):
    with one_thread():
        args = trainer_rows(num_micro)
        fn = PROVIDERS[provider]
        if provider != "memcpy":
            want = encode_row_ids_ref(*args)
            got = fn(*args)
            assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(got, want))
        benchmark.extra_info.update(ids=args[0].numel(), micro_batches=num_micro)
        benchmark(fn, *args)


def history_rows(num_micro: int, shards: int):
    """expand_row_plan's arguments for the history model's batch: one input slot, its table
    in `shards` column shards (row groups 0 .. shards - 1), 64 columns in wire rows of 64 /
    shards."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 201, (1, BATCH), generator=g)
    n = int(lengths.sum())
    ids = (torch.rand(n, generator=g) ** 3 * 100_000).long()
    long = dict(dtype=torch.int64)
    sample = torch.repeat_interleave(torch.arange(BATCH), lengths[0]).repeat_interleave(shards)
    group = torch.arange(shards).repeat(n)
    micro = [BATCH // num_micro] * num_micro
    encoded = encode_row_ids(group, torch.zeros(n * shards, **long), sample,
                             ids.repeat_interleave(shards), None, [0], [1] * shards, micro)
    return (encoded.order, encoded.inverse, encoded.counts, encoded.bounds,
            torch.zeros(n * shards, **long), sample, lengths, [shards], micro,
            [1] * shards, list(range(shards)), shards)


def expand_memcpy(order, inverse, counts, bounds, slot, sample, *_):
    return torch.cat([order, inverse, slot, sample, order, inverse, slot])


EXPAND_PROVIDERS = {"recxla": expand_row_plan, "torch": expand_row_plan_torch,
                    "memcpy": expand_memcpy}


@pytest.mark.parametrize("shards", [1, 2], ids=["whole rows", "2 column shards"])
@pytest.mark.parametrize("num_micro", [1, 2], ids=["m=1", "m=2"])
@pytest.mark.parametrize("provider", list(EXPAND_PROVIDERS))
def test_expand_row_plan(benchmark, provider, num_micro, shards):
    with one_thread():
        args = history_rows(num_micro, shards)
        fn = EXPAND_PROVIDERS[provider]
        if provider != "memcpy" and shards == 1 and num_micro == 1:
            assert torch.equal(fn(*args), expand_row_plan_ref(*args))
        benchmark.extra_info.update(routes=args[0].numel(), micro_batches=num_micro)
        benchmark(fn, *args)
