"""The per-key passes of key-centric sample clustering (csrc/cluster.cpp ops: feature gains and
bag signatures) on CPU, in Triton's interpreter and on CUDA, against the plain-PyTorch
reference; the "passes" GPU variant's orchestration (`cluster_permutation_with_passes`) and the
"fused" GPU variant (`cluster_permutation_fused`, its steps run serially on the host here, on
CUDA under the gpu marker) against the C++ kernel; `opcheck` and the ops' error messages."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.ops import cluster
from recxla.ops.cluster import KeyPasses, cluster_permutation_with_passes, gpu_passes
from recxla.data import SyntheticRankingDataset
from recxla.reference import cluster as reference
from recxla.triton_kernels import interpreted

HAS_CUDA = torch.cuda.is_available()
CPU_PASSES = KeyPasses(
    torch.ops.recxla.cluster_feature_gains, torch.ops.recxla.cluster_bag_signatures
)


def random_features(sizes, dtype=torch.int64):
    """values [sum(sizes)] with small and wide key ranges (repeats and one-off keys, negative
    ids), feature offsets [F + 1] as a list."""
    parts = []
    for n in sizes:
        high = int(torch.randint(1, 2**31, ()))
        keys = torch.randint(-high, high, (n,), dtype=torch.int64)
        repeat = torch.randint(-20, 20, (n,))
        parts.append(torch.where(torch.rand(n) < 0.5, repeat, keys).to(dtype))
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return torch.cat(parts + [torch.zeros(0, dtype=dtype)]), offsets


def random_bags(num_bags, max_len, dtype=torch.int64, lead=0):
    """values and int64 offsets [L + 1] of bags (empty ones included) starting at `lead`."""
    lengths = torch.randint(0, max_len + 1, (num_bags,))
    offsets = torch.zeros(num_bags + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    values, _ = random_features([lead + int(offsets[-1])], dtype)
    return values, offsets + lead


def gains_ref(values, feature_offsets, batch, m):
    hashes = [
        reference.key_hash(values[a:b].to(torch.int64))
        for a, b in zip(feature_offsets[:-1], feature_offsets[1:])
    ]
    return reference.feature_gains(hashes, batch, m)


def signatures_ref(values, offsets):
    lengths = offsets[1:] - offsets[:-1]
    hashes = reference.key_hash(values[int(offsets[0]):int(offsets[-1])].to(torch.int64))
    return reference.bag_min_hash(lengths, hashes), reference.bag_fingerprints(lengths, hashes)


# Feature sizes: empty, one value, below and above the sampling threshold (8192 values: larger
# features count a hash sample of 1 key in 2, 4, ...).
GAIN_SIZES = [[0], [1, 5], [300, 0, 8192], [8193, 20000, 70000]]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("sizes", GAIN_SIZES)
def test_feature_gains_cpu_matches_reference(dtype, sizes):
    values, offsets = random_features(sizes, dtype)
    for batch, m in ((1, 1), (500, 2), (500, 7), (8192, 4), (300, 300)):
        got = torch.ops.recxla.cluster_feature_gains(values, offsets, batch, m)
        assert torch.equal(got, gains_ref(values, offsets, batch, m))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_bag_signatures_cpu_matches_reference(dtype):
    for num_bags, max_len, lead in ((0, 0, 0), (1, 0, 3), (9000, 4, 5), (300, 120, 0)):
        values, offsets = random_bags(num_bags, max_len, dtype, lead)
        got = torch.ops.recxla.cluster_bag_signatures(values, offsets)
        want = signatures_ref(values, offsets)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    wide = torch.zeros(2 * values.numel(), dtype=dtype)
    wide[::2] = values  # strided ids give the same signatures
    got = torch.ops.recxla.cluster_bag_signatures(wide[::2], offsets)
    assert torch.equal(got[1], want[1])


def test_signatures_of_equal_bags_tie():
    """A bag's keys in another order give the same min-hash and fingerprint."""
    values, offsets = random_bags(200, 30)
    shuffled = values.clone()
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        shuffled[a:b] = values[a:b][torch.randperm(b - a)]
    want = torch.ops.recxla.cluster_bag_signatures(values, offsets)
    got = torch.ops.recxla.cluster_bag_signatures(shuffled, offsets)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture(scope="module")
def interpreted_cluster():
    """triton_kernels/cluster.py with kernels built for Triton's interpreter (CPU tensors)."""
    pytest.importorskip("triton")
    return interpreted("cluster")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_triton_interpreted_matches_reference(interpreted_cluster, dtype):
    values, offsets = random_features([0, 700, 9000], dtype)  # the last one is sampled
    for batch, m in ((400, 3), (9000, 8)):
        got = interpreted_cluster.feature_gains(values, offsets, batch, m)
        assert torch.equal(got, gains_ref(values, offsets, batch, m))
    for num_bags, max_len, lead in ((0, 0, 0), (300, 6, 2), (40, 90, 0)):
        values, offsets = random_bags(num_bags, max_len, dtype, lead)
        got = interpreted_cluster.bag_signatures(values, offsets)
        want = signatures_ref(values, offsets)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def ranking_batch(seed, batch):
    return SyntheticRankingDataset(batch_size=batch, seed=seed).batch(0).sparse


@pytest.mark.parametrize("m", [2, 5])
def test_gpu_orchestration_matches_the_cpu_kernel(interpreted_cluster, seed, m):
    """The GPU path (kernel passes + the reference's sorts and moves), run on CPU tensors with
    the CPU ops and with the interpreted Triton kernels as its passes."""
    kjt = ranking_batch(seed % 1000, 160)
    weights = torch.randint(0, 4, (26,)).double()
    args = (kjt.values(), kjt.lengths(), 160, m, weights)
    want = torch.ops.recxla.cluster_permutation(*args[:4], weights.tolist())
    triton_passes = KeyPasses(interpreted_cluster.feature_gains, interpreted_cluster.bag_signatures)
    for passes in (CPU_PASSES, triton_passes):
        assert torch.equal(cluster_permutation_with_passes(*args, passes), want)
    assert torch.equal(reference.cluster_permutation_ref(*args), want)


def test_opcheck():
    values, offsets = random_features([40, 3])
    torch.library.opcheck(torch.ops.recxla.cluster_feature_gains, (values, offsets, 10, 3))
    bag_values, bag_offsets = random_bags(30, 4)
    torch.library.opcheck(torch.ops.recxla.cluster_bag_signatures, (bag_values, bag_offsets))
    kjt = ranking_batch(0, 64)
    for op in (torch.ops.recxla.cluster_permutation, FUSED):
        torch.library.opcheck(op, (kjt.values(), kjt.lengths(), 64, 4, [1.0] * 26))


# ---------------------------------------------------------------------------- the fused variant

FUSED = torch.ops.recxla.cluster_permutation_fused


def assert_fused_matches_cpu(values, lengths, batch, m, key_bytes):
    """The fused op on values' device (CPU: the host run) against the C++ CPU kernel."""
    want = torch.ops.recxla.cluster_permutation(values.cpu(), lengths.cpu(), batch, m, key_bytes)
    got = FUSED(values, lengths, batch, m, key_bytes)
    assert got.dtype == torch.int64 and got.device == values.device
    assert torch.equal(got.cpu(), want), f"B={batch} M={m}"


@pytest.mark.parametrize("m", [2, 3, 8, 9, 32, 33, 150])
def test_fused_matches_cpu_kernel_on_ranking_batches(seed, m):
    """The fused variant's steps run serially on the host, on ranking batches with int64 and
    int32 ids and lengths, some features costing nothing. M covers the gains' three paths (per
    lane registers up to 8 and 32 bins, per-bin lanes beyond) and both move walks (loads in
    registers up to 8 bins, else in memory)."""
    batch = 600
    kjt = ranking_batch(seed % 1000, batch)
    key_bytes = (torch.randint(0, 4, (26,)).double() * 68).tolist()
    values, lengths = kjt.values(), kjt.lengths()
    for v, n in ((values, lengths), (values.int(), lengths.int()), (values.int(), lengths.long())):
        assert_fused_matches_cpu(v, n, batch, m, key_bytes)


def test_fused_matches_cpu_kernel_on_a_full_batch(seed):
    """The bench's batch: 8192 samples, 700,000 ids (groups, pairs and movers at full scale)."""
    kjt = ranking_batch(seed % 1000, 8192)
    for m in (2, 8):
        assert_fused_matches_cpu(kjt.values(), kjt.lengths(), 8192, m, [1.0] * 26)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.integers(1, 48),
    num_features=st.integers(0, 8),
    m_frac=st.floats(0.0, 1.0),
    max_len=st.sampled_from([0, 1, 3, 8]),
    key_range=st.sampled_from([2, 12, 60, 2**40]),
    int32=st.booleans(),
    torch_seed=st.integers(0, 2**31 - 1),
)
def test_fused_matches_cpu_kernel_on_random_bags(
    batch, num_features, m_frac, max_len, key_range, int32, torch_seed
):
    """Small odd batches: no feature, empty bags, more features than are ranked (6), one
    sample per micro-batch, keys that no group shares, spare values past the last bag, key
    bytes of 0 and of different sizes."""
    torch.manual_seed(torch_seed)
    lengths = torch.randint(0, max_len + 1, (num_features * batch,))
    values = torch.randint(-key_range, key_range, (int(lengths.sum()) + 2,))
    if int32:
        values, lengths = values.int() % 1000, lengths.int()
    m = 1 + int(m_frac * (batch - 1))
    key_bytes = torch.tensor([0.0, 1.0, 2.5, 68.0])[torch.randint(0, 4, (num_features,))]
    assert_fused_matches_cpu(values, lengths, batch, m, key_bytes.tolist())


def test_fused_sizes_the_count_table_exactly_for_many_micro_batches():
    """Past 256 MiB, the [keys, M] count table is sized from the keys' count read back
    (U / 2 * M * 4 bytes = 300 MB here): the same order."""
    batch, m = 1000, 500
    lengths = torch.randint(250, 350, (batch,))
    users = torch.randint(0, 100, (batch,))  # samples of a user draw from its 20 keys
    values = users.repeat_interleave(lengths) * 20 + torch.randint(0, 20, (int(lengths.sum()),))
    assert_fused_matches_cpu(values, lengths, batch, m, [1.0])


def test_fused_reads_strided_ids():
    kjt = ranking_batch(1, 200)
    wide = torch.zeros(2 * kjt.values().numel(), dtype=torch.int64)
    wide[::2] = kjt.values()
    want = FUSED(kjt.values(), kjt.lengths(), 200, 4, [1.0] * 26)
    assert torch.equal(FUSED(wide[::2], kjt.lengths(), 200, 4, [1.0] * 26), want)


def test_gpu_variant_follows_the_variant_table(monkeypatch):
    """cluster_samples picks the variant by architecture (nothing measured: "passes", the
    fallback), an override picks "fused", and the Triton backend always runs "passes"."""
    from recxla.ops import gpu_variants

    assert gpu_variants.variants("cluster")[0] == "passes"
    monkeypatch.setattr(gpu_variants, "capability", lambda device=None: 90)
    device = torch.device("cpu")
    assert cluster.gpu_variant(device, "cuda") == gpu_variants.chosen("cluster", 90)
    with gpu_variants.use_variant("cluster", "fused"):
        assert cluster.gpu_variant(device, "cuda") == "fused"
        assert cluster.gpu_variant(device, "triton") == "passes"
    with gpu_variants.use_variant("cluster", "passes"):
        assert cluster.gpu_variant(device, "cuda") == "passes"


@pytest.mark.parametrize("call,exc,match", [
    (lambda: torch.ops.recxla.cluster_feature_gains(torch.rand(5), [0, 5], 4, 2), TypeError,
     r"cluster_feature_gains: values must be int32 or int64 ids, got Float"),
    (lambda: torch.ops.recxla.cluster_feature_gains(torch.arange(5), [0, 6], 4, 2), ValueError,
     r"feature_offsets\[-1\]=6 overruns values, which holds 5"),
    (lambda: torch.ops.recxla.cluster_feature_gains(torch.arange(5), [0, 3, 2], 4, 2), ValueError,
     r"feature_offsets must be non-decreasing, but feature_offsets\[1\]=3 > feature_offsets\[2\]=2"),
    (lambda: torch.ops.recxla.cluster_feature_gains(torch.arange(5), [0, 5], 4, 5), ValueError,
     r"num_micro_batches must be in \[1, batch_size 4\], got 5"),
    (lambda: torch.ops.recxla.cluster_bag_signatures(torch.arange(5), torch.tensor([0, 3, 1])),
     ValueError, r"cluster_bag_signatures: offsets must be non-decreasing, but offsets\[1\]=3"),
    (lambda: torch.ops.recxla.cluster_bag_signatures(torch.arange(5), torch.tensor([0, 6])),
     ValueError, r"offsets\[-1\]=6 overruns values, which holds 5"),
    (lambda: torch.ops.recxla.cluster_bag_signatures(torch.arange(5), torch.tensor([-1, 2])),
     ValueError, r"offsets\[0\] must be >= 0, got -1"),
    (lambda: torch.ops.recxla.cluster_bag_signatures(torch.arange(5), torch.tensor([0, 2.0])),
     TypeError, r"offsets must be int64"),
    (lambda: torch.ops.recxla.cluster_permutation(
        torch.arange(6), torch.tensor([1, 2, -1, 2]), 2, 2, [1.0, 1.0]),
     ValueError, r"cluster_permutation: lengths must be >= 0, got -1 at index 2 \(feature 1, sample 0\)"),
    (lambda: torch.ops.recxla.cluster_permutation(
        torch.arange(4), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, 1.0]),
     ValueError, r"cluster_permutation: lengths overrun values"),
    (lambda: torch.ops.recxla.cluster_permutation(
        torch.arange(6), torch.tensor([1, 2, 1]), 2, 2, [1.0, 1.0]),
     ValueError, r"lengths must hold F \* batch_size entries, got 3 for batch_size 2"),
    (lambda: torch.ops.recxla.cluster_permutation(
        torch.arange(6), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0]),
     ValueError, r"key_bytes must hold one number per feature \(2\), got 1"),
    (lambda: torch.ops.recxla.cluster_permutation(
        torch.arange(6), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, float("inf")]),
     ValueError, r"key_bytes must be finite and >= 0, got inf for feature 1"),
    (lambda: torch.ops.recxla.cluster_permutation(
        torch.arange(6).double(), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, 1.0]),
     TypeError, r"values must be int32 or int64 ids, got Double"),
])  # fmt: skip
def test_op_errors_name_op_and_argument(call, exc, match):
    with pytest.raises(exc, match=match) as info:
        call()
    assert str(info.value).startswith("recxla::cluster_")


BAD_PERMUTATION_ARGS = [
    (torch.arange(6), torch.tensor([1, 2, -1, 2]), 2, 2, [1.0, 1.0]),
    (torch.arange(6), torch.tensor([1, 2, 1, -3], dtype=torch.int32), 2, 2, [1.0, 1.0]),
    (torch.arange(4), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, 1.0]),
    (torch.arange(4), torch.tensor([1, 9, 0, 0]), 2, 1, [1.0, 1.0]),
    (torch.arange(4), torch.tensor([3, 3, -1, 0]), 2, 2, [1.0, 1.0]),  # the first feature's first
    (torch.arange(4), torch.tensor([2**40, 1]), 2, 2, [1.0]),
    (torch.arange(6), torch.tensor([1, 2, 1]), 2, 2, [1.0, 1.0]),
    (torch.arange(6), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0]),
    (torch.arange(6), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, float("inf")]),
    (torch.arange(6), torch.tensor([1, 2, 1, 2]), 2, 2, [-1.0, 1.0]),
    (torch.arange(6), torch.tensor([1, 2, 1, 2]), 2, 3, [1.0, 1.0]),
    (torch.arange(6), torch.tensor([1, 2, 1, 2]), 0, 1, [1.0, 1.0]),
    (torch.arange(6).double(), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, 1.0]),
    (torch.arange(6), torch.tensor([1.0, 2, 1, 2]), 2, 2, [1.0, 1.0]),
    (torch.arange(6).view(2, 3), torch.tensor([1, 2, 1, 2]), 2, 2, [1.0, 1.0]),
]


def first_line(error) -> str:
    return str(error).splitlines()[0]


def as_fused(message: str) -> str:
    return message.replace("cluster_permutation", "cluster_permutation_fused")


@pytest.mark.parametrize("args", BAD_PERMUTATION_ARGS)
def test_fused_raises_the_cpu_kernels_errors(args):
    """Every bad argument raises what the CPU kernel raises, message for message (bad lengths
    before any id is read: negative, past the values, in the first feature or a later one)."""
    with pytest.raises((TypeError, ValueError)) as want:
        torch.ops.recxla.cluster_permutation(*args)
    with pytest.raises(want.type) as got:
        FUSED(*args)
    assert first_line(got.value) == as_fused(first_line(want.value))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cuda_passes_match_cpu(dtype):
    values, offsets = random_features([0, 300, 20000], dtype)
    cuda = values.cuda()
    for backend in ("cuda", "triton"):
        passes = gpu_passes(backend)
        got = passes.feature_gains(cuda, offsets, 4000, 4)
        assert torch.equal(got.cpu(), torch.ops.recxla.cluster_feature_gains(values, offsets, 4000, 4))
        bag_values, bag_offsets = random_bags(5000, 40, dtype, 3)
        got = passes.bag_signatures(bag_values.cuda(), bag_offsets.cuda())
        want = torch.ops.recxla.cluster_bag_signatures(bag_values, bag_offsets)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,variant", [("cuda", "passes"), ("cuda", "fused"), ("triton", "passes")]
)
def test_cuda_cluster_samples_matches_cpu(monkeypatch, seed, backend, variant):
    import recxla
    from recxla.ops import gpu_variants

    monkeypatch.setenv("RECXLA_BACKEND", backend)
    kjt = ranking_batch(seed % 1000, 4096)
    on_gpu = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values().cuda(), lengths=kjt.lengths().cuda(), stride=4096
    )
    with gpu_variants.use_variant("cluster", variant):
        for m in (2, 4, 8):
            perm, offsets = recxla.cluster_samples(on_gpu, m)
            assert perm.is_cuda and offsets.is_cuda
            want = recxla.cluster_samples(kjt, m)
            assert torch.equal(perm.cpu(), want[0]) and torch.equal(offsets.cpu(), want[1])
            direct = torch.ops.recxla.cluster_permutation(
                on_gpu.values(), on_gpu.lengths(), 4096, m, [1.0] * 26
            )
            assert torch.equal(direct.cpu(), want[0])


@pytest.mark.gpu
def test_cuda_fused_matches_cpu_on_odd_batches(seed):
    """The fused CUDA kernels on what the host run is tested with: every gains path and move
    walk, int32 ids and lengths, random small batches, the exact count table, and a batch
    whose move block needs global scratch (more groups than shared memory holds)."""
    kjt = ranking_batch(seed % 1000, 600)
    key_bytes = (torch.randint(0, 4, (26,)).double() * 68).tolist()
    for m in (2, 3, 8, 9, 32, 33, 150):
        for v, n in ((kjt.values(), kjt.lengths()), (kjt.values().int(), kjt.lengths().int())):
            assert_fused_matches_cpu(v.cuda(), n.cuda(), 600, m, key_bytes)
    for _ in range(40):
        batch, features = int(torch.randint(1, 48, ())), int(torch.randint(0, 9, ()))
        lengths = torch.randint(0, 6, (features * batch,))
        values = torch.randint(-12, 12, (int(lengths.sum()),))
        m = int(torch.randint(1, batch + 1, ()))
        assert_fused_matches_cpu(values.cuda(), lengths.cuda(), batch, m, [1.0] * features)
    batch, m = 1000, 500
    lengths = torch.randint(250, 350, (batch,))
    users = torch.randint(0, 100, (batch,))
    values = users.repeat_interleave(lengths) * 20 + torch.randint(0, 20, (int(lengths.sum()),))
    assert_fused_matches_cpu(values.cuda(), lengths.cuda(), batch, m, [1.0])
    big = 40000  # 2**16 move slots of 16 bytes: past any GPU's shared memory
    lengths = torch.randint(1, 4, (2 * big,))
    values = torch.randint(0, 5000, (int(lengths.sum()),))
    assert_fused_matches_cpu(values.cuda(), lengths.cuda(), big, 4, [1.0, 1.0])


@pytest.mark.gpu
def test_cuda_fused_raises_the_cpu_kernels_errors():
    for args in BAD_PERMUTATION_ARGS:
        with pytest.raises((TypeError, ValueError)) as want:
            torch.ops.recxla.cluster_permutation(*args)
        with pytest.raises(want.type) as got:
            FUSED(args[0].cuda(), args[1].cuda(), *args[2:])
        assert first_line(got.value) == as_fused(first_line(want.value))


# ---------------------------------------------------------------------------- the GPU campaign


def test_gpu_campaign_module_dry_run(monkeypatch):
    """bench/gpu_campaign/cluster.py on CPU, as CI runs it before a GPU comes: every provider
    checked then timed at M = 2, 4, 8, a winner among the variants; a provider whose order is
    wrong and one that raises are recorded FAILED, never timed and never chosen."""
    from bench.gpu_campaign import cluster as campaign
    from recxla.ops import gpu_variants

    real = campaign.providers

    def with_broken(device):
        out = real(device)
        fn, context, where = out["cuda:fused"]

        def raises(kjt, m, key_bytes):
            raise RuntimeError("boom")

        out["wrong order"] = (lambda kjt, m, kb: fn(kjt, m, kb).flip(0), context, where)
        out["raises"] = (raises, context, where)
        return out

    monkeypatch.setattr(campaign, "providers", with_broken)
    result = campaign.run("cpu", dry_run=True)
    rows = {(r["group"], r["provider"]): r for r in result["rows"]}
    groups = [f"cluster criteo batch 96, M={m}" for m in (2, 4, 8)]
    providers = ["cuda:passes", "cuda:fused", "triton", campaign.CPU_KERNEL, campaign.REFERENCE]
    for group in groups:
        for name in providers:
            r = rows[(group, name)]
            assert r["check"] == "exact" and r["median_us"] > 0, r
        assert rows[(group, "cuda:passes")]["census"]["syncs"] > 0
        wrong = rows[(group, "wrong order")]["check"]
        assert wrong.startswith("FAILED: criteo B=96 M=2: permutation[")
        assert rows[(group, "raises")]["check"] == "FAILED: RuntimeError: boom"
        assert rows[(group, "raises")]["median_us"] is None
    assert len(result["rows"]) == 3 * (len(providers) + 2)
    (choice,) = result["choices"]
    assert choice["family"] == "cluster" and choice["capability"] == 0
    assert choice["winner"] in gpu_variants.variants("cluster")
    assert choice["why"].startswith("dry run on CPU")


def test_lengths_whose_sum_wraps_int64_are_an_error():
    """Each length within the values' count (a stride-0 view of 2**62 ids), their sum past
    int64: the C++ kernel's own check once let the wrapped sum through and read past the
    values."""
    values = torch.zeros(1, dtype=torch.int64).expand(2**62)
    lengths = torch.tensor([2**62, 2**62], dtype=torch.int64)
    with pytest.raises(ValueError, match="need more values than an int64 counts"):
        torch.ops.recxla.cluster_permutation(values, lengths, 2, 2, [1.0])
