"""pytest-benchmark: the input dist's id routing (recxla.ops.route_ids) on the trainer's batch.

    .venv/bin/python -m pytest bench/bench_route_ids.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds

Batch: 1024 samples x 26 features with Criteo Kaggle's table sizes (capped at 100k rows, as the
cluster benchmark trains), 20 one-hot, 6 with 1-3 ids, int64 ids; tables dealt over 4 owners
table-wise (one route per id), and the same with every table column-wise over 2 owners (two
routes per id). Providers, all returning the RoutedIds of the tests' oracle
(recxla.reference.route_ids, a per-id loop, checked once and not timed):
- recxla: the C++ kernel, two passes over the ids;
- torch: the plain-PyTorch chain (repeat_interleave, gathers, stable sort, bincounts) that
  the sharded module ran before the kernel, and that ids on a GPU still run
  (recxla.ops.route_ids.route_ids_torch);
- memcpy: a copy of the bytes the op must read and write at least (ids in, routed ids out);
on one thread (the kernel is serial; the cluster benchmark runs its ranks on one thread each).
"""

import pytest
import torch

from bench.bench_dedup import MULTI_HOT, TABLE_ROWS
from bench.common import one_thread
from recxla.ops.route_ids import route_ids, route_ids_torch
from recxla.reference.route_ids import route_ids_ref

BATCH = 1024
OWNERS = 4


def trainer_batch(columns: int):
    """(values, lengths, routing tables, send slots): tables dealt round-robin over OWNERS,
    each split over `columns` owners' send slots."""
    g = torch.Generator().manual_seed(0)
    rows = [min(r, 100_000) for r in TABLE_ROWS]
    lengths = torch.stack([torch.randint(1, 4, (BATCH,), generator=g) if t in MULTI_HOT else
                           torch.ones(BATCH, dtype=torch.int64) for t in range(len(rows))])
    values = torch.cat([torch.randint(0, r, (int(n),), generator=g)
                        for r, n in zip(rows, lengths.sum(1))])
    send_slot = [(t + c) % OWNERS * len(rows) + t for t in range(len(rows))
                 for c in range(columns)]
    long = dict(dtype=torch.int64)
    tables = (torch.tensor(rows, **long), torch.arange(len(rows) + 1), torch.zeros(len(rows), **long),
              torch.arange(0, len(rows) * columns + 1, columns), torch.tensor(send_slot, **long),
              torch.full((len(send_slot),), -1, **long), torch.zeros(len(send_slot), **long))
    return values, lengths.flatten(), tables, OWNERS * len(rows)


def memcpy(values, *_):
    return values.clone()


PROVIDERS = {"recxla": route_ids, "torch": route_ids_torch, "memcpy": memcpy}


@pytest.mark.parametrize("columns", [1, 2], ids=["table-wise", "column-wise-2"])
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_route_ids(benchmark, provider, columns):
    with one_thread():
        values, lengths, tables, slots = trainer_batch(columns)
        fn = PROVIDERS[provider]
        args = (values, lengths, None, BATCH, *tables, slots)
        if provider != "memcpy":
            want = route_ids_ref(*args)
            got = fn(*args)
            assert all(torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
                       for a, b in zip(got, want))
        benchmark.extra_info.update(ids=values.numel(), routes_per_id=columns)
        benchmark(fn, *args)
