"""Segmented key dedup: kernels against the per-segment torch.unique reference."""

import importlib
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recxla
from recxla import _extension
from recxla.ops.dedup import (
    bucketize_by_rank,
    row_wise_bounds,
    segmented_unique,
    table_wise_bounds,
)
from recxla.reference.dedup import bucketize_by_rank_ref, segmented_unique_ref

DTYPES = [torch.int32, torch.int64]
# The CPU kernel picks its method from the data; each kind reaches one of them:
# zipf: skewed traffic over a large table (hash table, then a radix sort of the uniques);
# hot: a few hundred keys spread wide (hash table, table sized from the first keys);
# uniform: nearly all keys distinct (radix sort of all keys); narrow: a small table (presence
# array); full: keys over the whole dtype, hashed ids (hash table, comparison sort of uniques).
KINDS = ["zipf", "hot", "uniform", "narrow", "full"]


def random_keys(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    info = torch.iinfo(dtype)
    if kind == "zipf":
        table = 50_000
        weights = torch.arange(1, table + 1, dtype=torch.float64).pow(-1.05)
        ranks = torch.multinomial(weights, n, replacement=True) if n else torch.zeros(0).long()
        # Hot keys scattered over the id space, negative ones included, as hashed ids are.
        ids = torch.randperm(40 * table)[:table] - 20 * table
        return ids[ranks].to(dtype)
    if kind == "hot":
        pool = torch.randint(-(2**40), 2**40, (int(torch.randint(260, 600, ())),))
        return pool[torch.randint(0, pool.numel(), (n,))].to(dtype)
    if kind == "uniform":
        return torch.randint(-(2**30), 2**30, (n,), dtype=torch.int64).to(dtype)
    if kind == "narrow":
        low = int(torch.randint(-1000, 1000, ()))
        return torch.randint(low, low + 97, (n,), dtype=torch.int64).to(dtype)
    return torch.randint(info.min, info.max, (n,), dtype=dtype)


def random_offsets(segments: int, max_len: int) -> torch.Tensor:
    lengths = torch.randint(0, max_len + 1, (segments,))
    lengths[torch.rand(segments) < 0.2] = 0  # empty segments
    offsets = torch.zeros(segments + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return offsets


def assert_same(got, want):
    names = ("unique_values", "unique_offsets", "inverse")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
        assert g.device == w.device, f"{name}: device {g.device} != {w.device}"
        assert torch.equal(g, w), f"{name} differs from the reference"


def check_properties(values, offsets, result):
    """What the contract promises, checked without the reference."""
    unique_values, unique_offsets, inverse = result
    assert torch.equal(unique_values[inverse], values)
    assert unique_offsets[0] == 0 and unique_offsets[-1] == unique_values.numel()
    for s in range(offsets.numel() - 1):
        lo, hi = int(unique_offsets[s]), int(unique_offsets[s + 1])
        seg = unique_values[lo:hi]
        assert bool((seg[1:] > seg[:-1]).all()), f"segment {s} not strictly ascending"
        seg_inverse = inverse[int(offsets[s]) : int(offsets[s + 1])]
        assert bool(((seg_inverse >= lo) & (seg_inverse < hi)).all())
        assert hi - lo == seg_inverse.unique().numel()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(kind, dtype):
    # Small totals run on one thread, larger ones on all; segments past 1024 keys are judged by
    # their first eighth (or 1024 keys) before the rest is hashed or sorted.
    cases = [(1, 500), (1, 20000), (26, 3000), (int(torch.randint(2, 60, ())), 300)]
    for segments, max_len in cases:
        offsets = random_offsets(segments, max_len)
        values = random_keys(kind, int(offsets[-1]), dtype)
        result = segmented_unique(values, offsets)
        assert_same(result, segmented_unique_ref(values, offsets))
        check_properties(values, offsets, result)


@pytest.mark.parametrize("kind", ["uniform", "zipf-wide", "hot"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_big_segment_matches_reference(kind, dtype):
    # Past 65536 keys the CPU kernel splits a segment in key-range buckets over all threads
    # (mostly distinct keys, or more distinct keys than a cached hash table holds) or keeps
    # hashing (few distinct keys). Small segments around it go to the thread pool.
    n = int(torch.randint(70_000, 140_000, ()))
    if kind == "zipf-wide":
        # Zipf(1.05) ranks of a 10M-row table, hot ranks scattered: ~30% distinct.
        u = torch.rand(n, dtype=torch.float64)
        top = (1e7 + 1.0) ** -0.05
        ranks = ((1.0 - u * (1.0 - top)) ** -20.0).floor().long()
        big = ((ranks * 2654435761) % 10_000_000 - 5_000_000).to(dtype)
    else:
        big = random_keys(kind, n, dtype)
    small = random_keys("zipf", 3000, dtype)
    values = torch.cat([small[:1000], big, small[1000:]])
    offsets = torch.tensor([0, 1000, 1000 + n, 1000 + n + 1000, values.numel()])
    result = segmented_unique(values, offsets)
    assert_same(result, segmented_unique_ref(values, offsets))
    assert torch.equal(result[0][result[2]], values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_and_repeated_keys(dtype):
    info = torch.iinfo(dtype)
    n = 3000
    pool = torch.tensor([info.min, info.min + 1, -1, 0, 1, info.max - 1, info.max], dtype=dtype)
    values = pool[torch.randint(0, pool.numel(), (n,))]
    offsets = torch.tensor([0, 1, 1, 700, n], dtype=torch.int64)
    assert_same(segmented_unique(values, offsets), segmented_unique_ref(values, offsets))
    same = torch.full((n,), int(pool[torch.randint(0, pool.numel(), ())]), dtype=dtype)
    assert_same(segmented_unique(same, offsets), segmented_unique_ref(same, offsets))


@pytest.mark.parametrize(
    "lengths",
    [[], [0], [0, 0, 0], [1], [0, 1, 0], [5000], [3] * 700, [0, 2, 0, 1] * 300],
    ids=["S0", "one-empty", "all-empty", "one-key", "key-among-empty", "one-big", "many", "mix"],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_shapes(lengths, dtype):
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    values = random_keys("narrow", int(offsets[-1]), dtype)
    result = segmented_unique(values, offsets)
    assert_same(result, segmented_unique_ref(values, offsets))
    assert result[1].shape == (len(lengths) + 1,)


def test_noncontiguous_and_int32_offsets():
    base = random_keys("zipf", 8000, torch.int64)
    values = base[::2]
    offsets = random_offsets(7, 1000)
    offsets[-1] = values.numel()
    offsets = torch.minimum(offsets, offsets[-1]).to(torch.int32)
    assert not values.is_contiguous()
    got = recxla.unique_keys(values, offsets)
    assert_same(got, segmented_unique_ref(values.contiguous(), offsets.to(torch.int64)))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    segments=st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), max_size=8),
    int32=st.booleans(),
)
def test_hypothesis_shapes(segments, int32):
    dtype = torch.int32 if int32 else torch.int64
    flat = [k for seg in segments for k in seg]
    if int32:
        flat = [(k % 2**32) - 2**31 for k in flat]
    values = torch.tensor(flat, dtype=dtype)
    offsets = torch.tensor([0] + [len(s) for s in segments], dtype=torch.int64).cumsum(0)
    assert_same(segmented_unique(values, offsets), segmented_unique_ref(values, offsets))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    offsets = random_offsets(5, 40)
    values = random_keys("narrow", int(offsets[-1]), dtype)
    torch.library.opcheck(torch.ops.recxla.segmented_unique.default, (values, offsets))


def test_triton_path_checks_and_fills_out(interpreted_triton, monkeypatch):
    """The Triton kernels trust their offsets: the public function checks them first, as the C++
    kernels do, and copies the result into out= (Triton interpreted, on CPU tensors)."""
    monkeypatch.setattr(_extension, "backend_for", lambda t, op: "triton")
    offsets = random_offsets(9, 100)
    values = random_keys("zipf", int(offsets[-1]), torch.int64)
    want = segmented_unique_ref(values, offsets)
    assert_same(segmented_unique(values, offsets), want)
    out = (torch.empty(1000, dtype=torch.int64), torch.empty(5, dtype=torch.int64),
           torch.empty(1000, dtype=torch.int64))
    got = segmented_unique(values, offsets, out=out)
    assert_same(got, want)
    assert all(g is o for g, o in zip(got, out))
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing, but offsets\[1\]"):
        segmented_unique(torch.arange(4), torch.tensor([0, 3, 2, 4]))


BAD_ARGS = [
    (torch.arange(4), torch.tensor([1, 2, 4]), ValueError, r"offsets\[0\] must be 0, got 1"),
    (
        torch.arange(6),
        torch.tensor([0, 4, 3, 6]),
        ValueError,
        r"offsets must be non-decreasing, but offsets\[1\]=4 > offsets\[2\]=3",
    ),
    (torch.arange(6), torch.tensor([0, 2, 5]), ValueError, r"offsets\[-1\] must equal .*=6, got 5"),
    (torch.arange(6), torch.tensor([0, 2, 7]), ValueError, r"offsets\[-1\] must equal .*=6, got 7"),
    (torch.arange(0), torch.tensor([], dtype=torch.int64), ValueError, r"offsets must have S \+ 1"),
    (torch.rand(4), torch.tensor([0, 4]), TypeError, r"values must be int32 or int64"),
    (torch.arange(4).view(2, 2), torch.tensor([0, 4]), ValueError, r"values must be 1-D"),
    (torch.arange(4), torch.tensor([0.0, 4.0]), TypeError, r"offsets must be int64"),
    (torch.arange(4), torch.tensor([[0, 4]]), ValueError, r"offsets must be 1-D"),
]


@pytest.mark.parametrize("values,offsets,exc,match", BAD_ARGS)
def test_errors_name_op_and_argument(values, offsets, exc, match):
    # Value checks of offsets come from the kernel (recxla::), argument checks from Python.
    with pytest.raises(exc, match=r"recxla(\.|::)segmented_unique: " + match):
        segmented_unique(values, offsets)


@pytest.mark.parametrize("values,offsets,exc,match", BAD_ARGS[:5] + BAD_ARGS[5:7])
def test_kernel_errors_name_op_and_argument(values, offsets, exc, match):
    # Called directly, the C++ op checks too (TORCH_CHECK_VALUE / TYPE map to these types).
    with pytest.raises(exc, match=r"recxla::segmented_unique: " + match):
        torch.ops.recxla.segmented_unique(values, offsets)


@pytest.fixture
def interpreted_triton():
    """recxla.triton_kernels.dedup with its kernels built for the Triton interpreter (CPU)."""
    pytest.importorskip("triton")
    module = importlib.import_module("recxla.triton_kernels.dedup")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: reload
    try:
        yield importlib.reload(module)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
        importlib.reload(module)


@pytest.mark.parametrize("kind", ["zipf", "full"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_interpreted_matches_reference(interpreted_triton, kind, dtype):
    for segments, max_len in [(0, 0), (3, 0), (int(torch.randint(1, 12, ())), 600)]:
        offsets = random_offsets(segments, max_len)
        values = random_keys(kind, int(offsets[-1]), dtype)
        got = interpreted_triton.segmented_unique_triton(values, offsets)
        assert_same(got, segmented_unique_ref(values, offsets))


# ---------------------------------------------------------------------------------------------
# The CUDA variant "packed_radix_sort" (csrc/cuda/dedup_packed.cuh): its plan, and its steps
# around the sort run on the host by its mirror (recxla::_dedup_packed_host: the same
# recxla/dedup.h functions, std::sort for CUB), so that all but the CUB call and the launch
# arithmetic is tested without a GPU. Both hooks are compiled with the CUDA kernels.
needs_packed_hooks = pytest.mark.skipif(
    not recxla.built_with_cuda(), reason="the packed variant's hooks are built with its kernels"
)


def packed_plan_formula(segments: int, key_min: int, key_max: int, dtype) -> list:
    """[key_bits, segment_bits, end_bit, word_bytes], from the definition: the keys' offsets from
    the least key, the segment id above them, a 32- or 64-bit word or none."""
    key_bits = (key_max - key_min).bit_length()
    segment_bits = (segments - 1).bit_length()
    end_bit = key_bits + segment_bits
    return [key_bits, segment_bits, end_bit, 4 if end_bit <= 32 else 8 if end_bit <= 64 else 0]


def packed_host_or_fallback(values, offsets):
    """The mirror's result, or None where the plan sends the CUDA op to the segmented sort (the
    mirror must then refuse, naming why)."""
    if values.numel():
        plan = packed_plan_formula(offsets.numel() - 1, int(values.min()), int(values.max()),
                                   values.dtype)
        if plan[3] == 0:
            with pytest.raises(ValueError, match=r"_dedup_packed_host: .* more than 64"):
                torch.ops.recxla._dedup_packed_host(values, offsets)
            return None
    return torch.ops.recxla._dedup_packed_host(values, offsets)


@needs_packed_hooks
def test_packed_plan_decides_the_word():
    plan = torch.ops.recxla._dedup_packed_plan
    i64, i32 = torch.iinfo(torch.int64), torch.iinfo(torch.int32)
    assert plan(26, 0, 10131226, torch.int64) == [24, 5, 29, 4]  # a Criteo batch: 4 passes
    assert plan(32, -7, 2**27 - 8, torch.int64) == [27, 5, 32, 4]  # every bit of 32
    assert plan(33, -7, 2**27 - 8, torch.int64) == [27, 6, 33, 8]
    assert plan(1, i64.min, i64.max, torch.int64) == [64, 0, 64, 8]  # no room for a segment
    assert plan(2, i64.min, i64.max, torch.int64) == [64, 1, 65, 0]  # the segmented sort
    assert plan(4, i32.min, i32.max, torch.int32) == [32, 2, 34, 8]  # int32 always packs
    assert plan(1, 5, 5, torch.int32) == [0, 0, 0, 4]  # one key: nothing to sort
    for _ in range(300):  # ranges of every width, segment counts of every width
        dtype = random.choice(DTYPES)
        info = torch.iinfo(dtype)
        low = random.randint(info.min, info.max)
        high = min(info.max, low + random.randint(0, 2 ** random.randint(0, info.bits) - 1))
        segments = random.randint(1, 2 ** random.randint(0, 31))
        assert plan(segments, low, high, dtype) == packed_plan_formula(segments, low, high, dtype)
    with pytest.raises(ValueError, match=r"_dedup_packed_plan: needs segments >= 1"):
        plan(0, 1, 2, torch.int64)
    with pytest.raises(ValueError, match=r"_dedup_packed_plan: needs .* key_min <= key_max"):
        plan(3, 2, 1, torch.int64)
    with pytest.raises(ValueError, match=r"_dedup_packed_plan: int32 keys must lie in"):
        plan(3, 0, 2**31, torch.int32)


@needs_packed_hooks
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_host_matches_reference(kind, dtype):
    for segments, max_len in [(1, 3000), (26, 800), (int(torch.randint(2, 300, ())), 40)]:
        offsets = random_offsets(segments, max_len)
        values = random_keys(kind, int(offsets[-1]), dtype)
        got = packed_host_or_fallback(values, offsets)
        if got is not None:
            assert_same(got, segmented_unique_ref(values, offsets))


@needs_packed_hooks
def test_packed_host_on_the_campaign_cases():
    # The GPU campaign's check set (bench/gpu_campaign/dedup.py): no segment, empty segments,
    # negative and int32 keys, one key, one distinct key (0 bits), a full 32-bit word, a 64-bit
    # key field, the fallback, thousands of tiny segments.
    from bench.gpu_campaign import dedup as campaign

    paths = set()
    for name, values, offsets in campaign.check_cases(dry_run=True):
        got = packed_host_or_fallback(values, offsets)
        paths.add("fallback" if got is None else "packed")
        if got is not None:
            want = segmented_unique_ref(values, offsets)
            for label, g, w in zip(("unique_values", "unique_offsets", "inverse"), got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {label} differs"
    assert paths == {"fallback", "packed"}


@needs_packed_hooks
@settings(max_examples=60, deadline=None)
@given(data=st.data(), int32=st.booleans())
def test_packed_host_hypothesis(data, int32):
    dtype = torch.int32 if int32 else torch.int64
    info = torch.iinfo(dtype)
    width = data.draw(st.integers(0, info.bits))
    low = data.draw(st.integers(info.min, info.max))
    keys = st.integers(low, min(info.max, low + 2**width - 1))
    segments = data.draw(st.lists(st.lists(keys, max_size=30), min_size=1, max_size=9))
    values = torch.tensor([k for seg in segments for k in seg], dtype=dtype)
    offsets = torch.tensor([0] + [len(s) for s in segments], dtype=torch.int64).cumsum(0)
    got = packed_host_or_fallback(values, offsets)
    if got is not None:
        assert_same(got, segmented_unique_ref(values, offsets))


@needs_packed_hooks
def test_packed_host_checks_offsets():
    with pytest.raises(ValueError, match=r"_dedup_packed_host: offsets must be non-decreasing"):
        torch.ops.recxla._dedup_packed_host(torch.arange(6), torch.tensor([0, 4, 3, 6]))


def test_campaign_check_catches_wrong_and_unwritten_outputs():
    from bench.gpu_campaign import dedup as campaign

    cases = [(name, v, o, segmented_unique_ref(v, o))
             for name, v, o in campaign.check_cases(dry_run=True)]
    assert campaign.check(segmented_unique, cases, "cpu") == "exact"

    def leaves_one_unwritten(values, offsets):
        unique_values, unique_offsets, inverse = segmented_unique(values, offsets)
        out = torch.empty_like(inverse)  # filled with int64's largest value during the check
        out[1:] = inverse[1:]
        return unique_values, unique_offsets, out

    def one_wrong(values, offsets):
        unique_values, unique_offsets, inverse = segmented_unique(values, offsets)
        return unique_values, unique_offsets, inverse.flip(0)

    assert campaign.check(leaves_one_unwritten, cases, "cpu").startswith(
        "FAILED: criteo zipf int64: inverse[0] = 9223372036854775807")
    assert campaign.check(one_wrong, cases, "cpu").startswith("FAILED: criteo zipf int64: inverse")
    assert not torch.are_deterministic_algorithms_enabled()  # the check restores the mode


def test_campaign_dry_run(interpreted_triton):
    # The campaign module's whole code path on CPU, small batches, Triton interpreted.
    from bench.gpu_campaign import dedup as campaign
    from recxla.ops import gpu_variants

    found = campaign.run("cpu", dry_run=True)
    groups = sorted({r["group"] for r in found["rows"]})
    assert [g.split(", ")[-1] for g in groups] == ["uniform int64", "zipf int32", "zipf int64"]
    providers = ["device copy"] + [f"cuda:{v}" for v in gpu_variants.variants("dedup")] + [
        "triton", "torch.unique"]
    for group in groups:
        rows = [r for r in found["rows"] if r["group"] == group]
        assert [r["provider"] for r in rows] == providers
        for r in rows:
            assert r["check"] == ("baseline" if r["provider"] == "device copy" else "exact"), r
            assert r["median_us"] > 0 and r["bytes"] > 0
            # keys in, unique keys and the int64 inverse out
            size = 4 if group.endswith("int32") else 8
            assert r["bytes"] == r["n_keys"] * (size + 8) + r["n_unique"] * size
    packed = [r for r in found["rows"] if r["provider"] == "cuda:packed_radix_sort"][0]
    assert "the segmented sort" in " ".join(packed["plans"].values())
    (choice,) = found["choices"]
    assert choice["family"] == "dedup" and choice["capability"] == 0
    assert choice["winner"] in gpu_variants.variants("dedup")
    assert choice["why"].startswith("dry run on CPU")


def _random_tables(tables: int, max_len: int, max_rows: int):
    offsets = random_offsets(tables, max_len)
    num_rows = torch.randint(1, max_rows, (tables,)).tolist()
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    values = torch.cat(
        [torch.randint(0, rows, (n,)) for rows, n in zip(num_rows, lengths)]
        + [torch.zeros(0, dtype=torch.int64)]
    )
    return values, offsets, num_rows


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_bucketize_by_rank_matches_reference(world_size):
    values, offsets, num_rows = _random_tables(5, 300, 5000)
    owners = torch.randint(0, world_size, (len(num_rows),)).tolist()
    row_wise = row_wise_bounds(num_rows, world_size)
    table_wise = table_wise_bounds(num_rows, owners, world_size)
    for bounds in (row_wise, table_wise):
        permutation, bucket_offsets = bucketize_by_rank(values, offsets, bounds)
        want = bucketize_by_rank_ref(values, offsets, bounds)
        assert torch.equal(permutation, want[0]) and torch.equal(bucket_offsets, want[1])
        # Every key lands with the rank whose block holds its row.
        tables = len(num_rows)
        for b in range(world_size * tables):
            r, t = divmod(b, tables)
            keys = values[permutation[bucket_offsets[b] : bucket_offsets[b + 1]]]
            assert bool(((keys >= bounds[t, r]) & (keys < bounds[t, r + 1])).all())
        # Dedup per (rank, table) bucket, then expand back to the original order.
        unique_values, _, inverse = segmented_unique(values[permutation], bucket_offsets)
        restored = torch.empty_like(values)
        restored[permutation] = unique_values[inverse]
        assert torch.equal(restored, values)


def test_bucketize_wide_keys_and_errors():
    # Keys spread over all of int64 take the per-table search instead of the banded one.
    values = random_keys("full", 900, torch.int64)
    offsets = torch.tensor([0, 300, 300, 900])
    interior = torch.sort(random_keys("full", 3 * 3, torch.int64).view(3, 3), dim=1).values
    bounds = torch.cat([interior[:, :1], interior, interior[:, -1:]], dim=1)
    got = bucketize_by_rank(values, offsets, bounds)
    want = bucketize_by_rank_ref(values, offsets, bounds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"recxla.bucketize_by_rank: block_bounds must be \[T, R"):
        bucketize_by_rank(values, offsets, bounds[:2])
    with pytest.raises(ValueError, match=r"recxla.bucketize_by_rank: each row of block_bounds"):
        bucketize_by_rank(values, offsets, bounds.flip(1))
    with pytest.raises(ValueError, match=r"recxla.table_wise_bounds: owners must lie in \[0, 2\)"):
        table_wise_bounds([10, 10], [0, 2], 2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_reference(monkeypatch, backend, kind, dtype):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    for segments, max_len in [(0, 0), (4, 0), (1, 5000), (26, 8000), (500, 40)]:
        offsets = random_offsets(segments, max_len)
        values = random_keys(kind, int(offsets[-1]), dtype)
        got = segmented_unique(values.cuda(), offsets.cuda())
        want = segmented_unique_ref(values, offsets)
        assert_same([t.cpu() for t in got], want)
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing"):
        segmented_unique(torch.arange(6).cuda(), torch.tensor([0, 4, 3, 6]).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["segmented_sort", "packed_radix_sort"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_variants_match_reference(variant, dtype):
    # Every CUDA kernel variant of the family, whichever this architecture runs by default; the
    # packed one on 32- and 64-bit words and on its fallback (keys over all of int64).
    from recxla.ops import gpu_variants

    if not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    assert variant in gpu_variants.variants("dedup")
    with gpu_variants.use_variant("dedup", variant):
        for kind in KINDS:
            for segments, max_len in [(0, 0), (3, 0), (1, 1), (1, 20000), (26, 9000), (700, 9)]:
                offsets = random_offsets(segments, max_len)
                values = random_keys(kind, int(offsets[-1]), dtype)
                got = torch.ops.recxla.segmented_unique(values.cuda(), offsets.cuda())
                assert_same([t.cpu() for t in got], segmented_unique_ref(values, offsets))
        with pytest.raises(ValueError, match=r"offsets must be non-decreasing"):
            torch.ops.recxla.segmented_unique(torch.arange(6).cuda(),
                                              torch.tensor([0, 4, 3, 6]).cuda())


@pytest.mark.gpu
def test_gpu_bucketize_matches_cpu():
    values, offsets, num_rows = _random_tables(6, 2000, 100_000)
    bounds = row_wise_bounds(num_rows, 4)
    want = bucketize_by_rank(values, offsets, bounds)
    got = bucketize_by_rank(values.cuda(), offsets.cuda(), bounds.cuda())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
