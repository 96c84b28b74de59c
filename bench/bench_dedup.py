"""pytest-benchmark: segmented key dedup on a Criteo-like batch.

    .venv/bin/python -m pytest bench/bench_dedup.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds

Batch: 8192 samples x 26 sparse features with Criteo Kaggle's table sizes; 20 features one-hot,
6 multi-hot with 1-3 ids per sample (N about 8192 x 32), keys drawn Zipf(1.05) (skewed traffic)
or uniform over each table, hot keys scattered over the id space. One segment per table.

Providers, all producing the same (unique_values, unique_offsets, inverse):
- recxla: the C++ CPU kernel (torch.ops.recxla.segmented_unique), fresh outputs every call;
- recxla-out: the same into out= buffers made once (torch.ops.recxla.segmented_unique_out), as
  recxla.nn.EmbeddingBagCollection calls it every step: no new memory per call;
- reference: torch.unique per segment (recxla.reference.dedup, the tests' oracle);
- torch-unique-combined: one torch.unique over (segment, key) packed into one int64, then the
  offsets from the segments of the uniques;
- memcpy: a copy of the bytes the op must read and write at least (values in; uniques and
  inverse out), the speed of light on this machine;
each on 1 thread and on all threads (the test id ends in the thread count: torch's own sort is
parallel too, and on a busy machine its threads can lose more than they gain).
FBGEMM's jagged_unique_indices has no CPU kernel (fbgemm-gpu-cpu 1.9.0 registers none), so
there is no upstream provider on CPU. On a GPU, `python -m pytest bench -m gpu --benchmark-only`
times the CUDA and Triton kernels against the combined torch.unique with the `gpu` cases.

extra_info: threads, allocator (bench/conftest.py keeps freed memory in the process unless
RECXLA_BENCH_MALLOC=default), n_keys, n_unique, unique_ratio, bytes (the memcpy bytes) and gbps
(bytes per second at the median, so providers compare as fractions of memcpy).
"""

import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from recxla.ops.dedup import segmented_unique  # noqa: E402
from recxla.reference.dedup import segmented_unique_ref  # noqa: E402

BATCH = 8192
# Criteo Kaggle (Display Advertising Challenge) categorical feature cardinalities.
TABLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
MULTI_HOT = {2, 3, 11, 15, 20, 23}  # the big tables get 1-3 ids per sample
ZIPF_S = 1.05
SEED = 0


def zipf_ranks(n: int, rows: int, s: float, generator: torch.Generator) -> torch.Tensor:
    """Ranks 0..rows-1 with P(rank k) ~ (k + 1)^-s: inverse CDF of the continuous power law on
    [1, rows + 1), floored (exact enough for skew, and fast for 10M-row tables)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    a = s - 1.0
    top = (rows + 1.0) ** (-a)
    x = (1.0 - u * (1.0 - top)) ** (-1.0 / a)
    return (x.floor().long() - 1).clamp(0, rows - 1)


def criteo_batch(distribution: str, dtype=torch.int64, seed: int = SEED):
    """(values [N] dtype, offsets int64 [27]): one segment per table."""
    g = torch.Generator().manual_seed(seed)
    chunks, lengths = [], []
    for t, rows in enumerate(TABLE_ROWS):
        n = BATCH
        if t in MULTI_HOT:
            n = int(torch.randint(1, 4, (BATCH,), generator=g).sum())
        if distribution == "zipf":
            # Scatter the hot ranks over the table (an odd multiplier mod rows): ids of hot
            # items are not small consecutive numbers in real data.
            keys = (zipf_ranks(n, rows, ZIPF_S, g) * 2654435761) % rows
        else:
            keys = torch.randint(0, rows, (n,), generator=g)
        chunks.append(keys)
        lengths.append(n)
    offsets = torch.zeros(len(TABLE_ROWS) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    return torch.cat(chunks).to(dtype), offsets


def torch_unique_combined(values: torch.Tensor, offsets: torch.Tensor):
    """One torch.unique over (segment, key): segment ids packed above the keys, which here
    span less than 2^40, then every output rebuilt from the packed uniques."""
    segments = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    segment_ids = torch.repeat_interleave(torch.arange(segments, device=values.device), lengths)
    lo = values.min()
    packed = (segment_ids << 40) | (values.long() - lo)
    unique_packed, inverse = torch.unique(packed, sorted=True, return_inverse=True)
    unique_values = ((unique_packed & ((1 << 40) - 1)) + lo).to(values.dtype)
    counts = torch.bincount(unique_packed >> 40, minlength=segments)
    unique_offsets = torch.zeros_like(offsets)
    unique_offsets[1:] = counts.cumsum(0)
    return unique_values, unique_offsets, inverse


ALL_THREADS = torch.get_num_threads()
ALLOCATOR = "default" if os.environ.get("RECXLA_BENCH_MALLOC") == "default" else "tuned"


def with_out_buffers(values: torch.Tensor, offsets: torch.Tensor):
    """segmented_unique into out= buffers made once for this batch (kept by the closure)."""
    n = values.numel()
    out = (values.new_empty(n), torch.empty(offsets.numel(), dtype=torch.int64),
           torch.empty(n, dtype=torch.int64))
    return lambda v, o: segmented_unique(v, o, out=out)


PROVIDERS = {
    "recxla": segmented_unique,
    "recxla-out": None,  # with_out_buffers, made per batch
    "reference": segmented_unique_ref,
    "torch-unique-combined": torch_unique_combined,
}


def _bytes_moved(values, result) -> int:
    unique_values, unique_offsets, inverse = result
    return (
        values.numel() * values.element_size()
        + unique_values.numel() * unique_values.element_size()
        + inverse.numel() * inverse.element_size()
    )


@pytest.fixture
def threads(request):
    """Every provider runs on 1 thread and on all of them (torch's sort is parallel too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", sorted({1, ALL_THREADS}), indirect=True)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("distribution", ["zipf", "uniform"])
@pytest.mark.parametrize("provider", list(PROVIDERS) + ["memcpy"])
def test_dedup_cpu(benchmark, provider, distribution, dtype, threads):
    values, offsets = criteo_batch(distribution, dtype)
    want = segmented_unique_ref(values, offsets)
    moved = _bytes_moved(values, want)
    if provider == "memcpy":
        src = torch.empty(moved, dtype=torch.uint8).random_(0, 256)
        dst = torch.empty_like(src)
        benchmark(dst.copy_, src)
    else:
        fn = PROVIDERS[provider] or with_out_buffers(values, offsets)
        got = benchmark(fn, values, offsets)
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"{provider} differs from the reference"
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        threads=threads,
        allocator=ALLOCATOR,
        n_keys=values.numel(),
        n_unique=want[0].numel(),
        unique_ratio=round(want[0].numel() / values.numel(), 4),
        bytes=moved,
        gbps=round(moved / median / 1e9, 3),
    )


@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("distribution", ["zipf", "uniform"])
@pytest.mark.parametrize("provider", ["recxla", "reference"])
def test_dedup_one_big_segment(benchmark, provider, distribution, threads):
    """One segment of 2^20 keys from a 10M-row table (a long multi-hot feature): the kernel has
    no segments to spread over threads here, so this is its single-thread worst shape."""
    g = torch.Generator().manual_seed(SEED)
    n, rows = 1 << 20, 10_000_000
    if distribution == "zipf":
        values = (zipf_ranks(n, rows, ZIPF_S, g) * 2654435761) % rows
    else:
        values = torch.randint(0, rows, (n,), generator=g)
    offsets = torch.tensor([0, n])
    got = benchmark(PROVIDERS[provider], values, offsets)
    want = segmented_unique_ref(values, offsets)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    benchmark.extra_info.update(threads=threads, n_keys=n, n_unique=want[0].numel())


@pytest.mark.gpu
@pytest.mark.parametrize("distribution", ["zipf", "uniform"])
@pytest.mark.parametrize("provider", ["cuda", "triton", "torch-unique-combined"])
def test_dedup_gpu(benchmark, monkeypatch, provider, distribution):
    values, offsets = criteo_batch(distribution)
    values, offsets = values.cuda(), offsets.cuda()
    if provider == "torch-unique-combined":
        fn = torch_unique_combined
    else:
        monkeypatch.setenv("RECXLA_BACKEND", provider)
        fn = segmented_unique

    def run():
        out = fn(values, offsets)
        torch.cuda.synchronize()
        return out

    run()  # the first call compiles (Triton) or loads the kernels: not timed
    got = benchmark(run)
    want = segmented_unique_ref(values.cpu(), offsets.cpu())
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w), f"{provider} differs from the reference"
    benchmark.extra_info.update(n_keys=values.numel(), n_unique=want[0].numel())
