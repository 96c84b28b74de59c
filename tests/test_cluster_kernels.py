"""The per-key passes of key-centric sample clustering (csrc/cluster.cpp ops: feature gains and
bag signatures) on CPU, in Triton's interpreter and on CUDA, against the plain-PyTorch
reference; the GPU path's orchestration (`cluster_permutation_with_passes`) against the C++
kernel; `opcheck` and the ops' error messages."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.clustering import KeyPasses, cluster_permutation_with_passes, gpu_passes
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
    torch.library.opcheck(
        torch.ops.recxla.cluster_permutation, (kjt.values(), kjt.lengths(), 64, 4, [1.0] * 26)
    )


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
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_cluster_samples_matches_cpu(monkeypatch, seed, backend):
    import recxla

    monkeypatch.setenv("RECXLA_BACKEND", backend)
    kjt = ranking_batch(seed % 1000, 4096)
    on_gpu = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values().cuda(), lengths=kjt.lengths().cuda(), stride=4096
    )
    for m in (2, 4, 8):
        perm, offsets = recxla.cluster_samples(on_gpu, m)
        assert perm.is_cuda and offsets.is_cuda
        want = recxla.cluster_samples(kjt, m)
        assert torch.equal(perm.cpu(), want[0]) and torch.equal(offsets.cpu(), want[1])
