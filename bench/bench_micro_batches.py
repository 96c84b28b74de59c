"""pytest-benchmark: the cut of a batch's KeyedJaggedTensor into a micro-batch
(recxla.pipeline.micro_batches.slice_samples), which the pipeline runs once per micro-batch.

    .venv/bin/python -m pytest bench/bench_micro_batches.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds

Batches: the trainer's (1024 samples x 26 Criteo features, 20 one-hot and 6 with 1-3 ids, as
bench/bench_route_ids.py) and a multi-hot one (the same 26 features with 0-16 ids each, 8 on
average); the first half of the samples is cut (2 micro-batches). Providers, all returning the
same micro-batch:
- recxla: `slice_samples`, a copy of each feature's contiguous range of ids;
- gather: a gather of the ids by per-id indices built with torch ops (repeat_interleave of the
  range starts), what the pipeline ran before;
- memcpy: a copy of the micro-batch's ids, the bytes any cut must write;
on one thread (the cluster benchmark runs its ranks on one thread each).
"""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from bench.bench_dedup import MULTI_HOT
from bench.common import one_thread
from recxla.pipeline.micro_batches import slice_samples

BATCH = 1024
FEATURES = 26


def batch(kind: str) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(0)
    if kind == "trainer":
        lengths = torch.stack([torch.randint(1, 4, (BATCH,), generator=g) if f in MULTI_HOT else
                               torch.ones(BATCH, dtype=torch.int64) for f in range(FEATURES)])
    else:
        lengths = torch.randint(0, 17, (FEATURES, BATCH), generator=g)
    values = torch.randint(0, 100_000, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(FEATURES)], values=values,
                             lengths=lengths.flatten(), stride=BATCH)


def gather(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    keys, offsets = kjt.keys(), kjt.offsets()
    rows = torch.arange(len(keys)) * kjt.stride()
    first, last = offsets.index_select(0, rows + start), offsets.index_select(0, rows + stop)
    counts = last - first
    total = int(counts.sum())
    shift = torch.repeat_interleave(first - (torch.cumsum(counts, 0) - counts), counts,
                                    output_size=total)
    take = torch.arange(total) + shift
    return KeyedJaggedTensor(keys=keys, values=kjt.values().index_select(0, take),
                             lengths=kjt.lengths().view(len(keys), -1)[:, start:stop].flatten(),
                             stride=stop - start)


PROVIDERS = {"recxla": slice_samples, "gather": gather}


@pytest.mark.parametrize("kind", ["trainer", "multi-hot"])
@pytest.mark.parametrize("provider", ["recxla", "gather", "memcpy"])
def test_slice_samples(benchmark, provider, kind):
    with one_thread():
        kjt = batch(kind)
        kjt.offsets()  # computed once per batch, as in the pipeline
        start, stop = 0, BATCH // 2
        want = gather(kjt, start, stop)
        benchmark.extra_info.update(ids=kjt.values().numel(), cut_ids=want.values().numel())
        if provider == "memcpy":
            benchmark(want.values().clone)
            return
        got = PROVIDERS[provider](kjt, start, stop)
        assert torch.equal(got.values(), want.values())
        assert torch.equal(got.lengths(), want.lengths())
        benchmark(PROVIDERS[provider], kjt, start, stop)
