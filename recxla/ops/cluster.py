"""Key-centric sample clustering: order a batch's samples so that micro-batches share keys.

A training step looks up and communicates each embedding key once per micro-batch (dedup), so
the bytes on the wire follow the sum over micro-batches of their unique keys. A random split
copies every key that several samples share into up to M micro-batches; samples of one request
share all their user-side keys (user id, history, attributes), so keeping them together leaves
one copy. `cluster_samples` finds such groups from the keys alone, with no request ids.

The algorithm (scores features by a hash sample of their keys, sorts the samples by min-hash
and fingerprint signatures of the best features' bags, then moves whole groups to the
micro-batch that holds most of their keys) is described with its steps in torch ops,
`recxla.ops.cluster_steps`. Implementations, all with the same result bit for bit (the tests
check each against the plain-PyTorch oracle, recxla/reference/cluster.py, which composes those
steps as the C++ kernel does):
- CPU: one C++ call, `torch.ops.recxla.cluster_permutation` (csrc/cpu/cluster*.cpp);
- CUDA tensors, two GPU variants (family "cluster" of `recxla.ops.gpu_variants`: each
  architecture runs the one the GPU campaign measured fastest there, "passes" where nothing
  was measured):
  - "passes": the two passes over every key are CUDA kernels
    (`RECXLA_BACKEND=cuda`, csrc/cuda/cluster.cu) or Triton kernels (`triton`,
    triton_kernels/cluster.py), the sorts and group moves are the torch ops of
    `recxla.ops.cluster_steps` (`cluster_permutation_with_passes`);
  - "fused" (CUDA backend only): the whole order as one C++ op,
    `recxla::cluster_permutation_fused` (csrc/cuda/cluster_fused.cu): about 44 device
    operations behind one host sync, where "passes" pays about 400 launches and 66 syncs
    (docs/clustering.md). On CPU tensors the same op runs its steps serially on the host,
    which is how its tests run without a GPU;
- no compiled extension: a RuntimeError saying to reinstall (CPU tensors).
The per-key math (hashes, sampling, fingerprints) lives in csrc/include/recxla/cluster.h.
This module holds the public functions, the ops' fake kernels and the CUDA kernel of
`recxla::cluster_permutation` (registered here, in Python: it picks the GPU variant); the
argument checks are in recxla.ops.cluster_checks.
Cost: about 3 ms for a batch of 8192 (700,000 ids) on one CPU thread, against 11-15 ms for the
plain-PyTorch oracle (bench/results/clustering.md).
"""

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from recxla import _extension
from recxla.ops.cluster_checks import (
    check_id_dtypes, check_ids, check_kjt, check_lengths, check_num_micro_batches,
    check_permutation, key_bytes_tensor,
)
from recxla.ops.cluster_steps import (
    REFINE_FEATURES, SORT_FEATURES, KeyPasses, balanced_offsets, feature_slices,
    integer_weights, key_hash, order_samples, rank_features, signature_sort_key,
)

if TYPE_CHECKING:  # torchrec is imported on first use: `import recxla` stays light
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@_extension.register_fake("recxla::cluster_permutation")
def _cluster_permutation_fake(values, lengths, batch_size, num_micro_batches, key_bytes):
    return values.new_empty(batch_size, dtype=torch.int64)


@_extension.register_fake("recxla::cluster_permutation_fused")
def _cluster_permutation_fused_fake(values, lengths, batch_size, num_micro_batches, key_bytes):
    return values.new_empty(batch_size, dtype=torch.int64)


@_extension.register_fake("recxla::cluster_feature_gains")
def _cluster_feature_gains_fake(values, feature_offsets, batch_size, num_micro_batches):
    return values.new_empty(len(feature_offsets) - 1, dtype=torch.int64)


@_extension.register_fake("recxla::cluster_bag_signatures")
def _cluster_bag_signatures_fake(values, offsets):
    bags = offsets.shape[0] - 1
    return offsets.new_empty(bags), offsets.new_empty(bags)


def cluster_samples(
    kjt: "KeyedJaggedTensor", num_micro_batches: int, key_bytes=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Order a batch's samples into micro-batches that share embedding keys.

    Args:
        kjt: the batch's sparse features, F keys of B samples each (CPU or CUDA), int32 or
            int64 ids and lengths; lengths >= 0 and within kjt.values().
        num_micro_batches: M, 1 <= M <= B.
        key_bytes: bytes a key of each feature costs on the wire (e.g. its embedding row's
            bytes): None (1 per key), F numbers in key order, or a dict {feature: bytes}.
    Returns:
        permutation: int64 [B] on kjt's device; micro-batch j holds samples
            permutation[offsets[j]:offsets[j + 1]].
        offsets: int64 [M + 1], offsets[j] = j * B // M: every micro-batch holds floor(B / M)
            or ceil(B / M) samples, whatever the clustering (sizes differ by at most one).
    Raises:
        TypeError for float ids or lengths; ValueError for a wrong kjt, M or key_bytes, and for
        negative lengths or lengths that sum past kjt.values().
    The same permutation on every backend (see the module docstring); `micro_batch_unique_keys`
    measures the result.
    """
    op = "recxla.cluster_samples"
    kjt = check_kjt(kjt, op)
    batch = kjt.stride()
    num_micro_batches = check_num_micro_batches(num_micro_batches, batch, op)
    weights = key_bytes_tensor(kjt, key_bytes, op)
    values, lengths = kjt.values(), kjt.lengths()
    offsets = balanced_offsets(batch, num_micro_batches, values.device)
    backend = _extension.backend_for(values, op)
    if backend == "cpu":
        check_id_dtypes(kjt, op)  # the kernel checks the lengths in its first pass
        perm = torch.ops.recxla.cluster_permutation(
            values, lengths, batch, num_micro_batches, weights.tolist()
        )
    elif gpu_variant(values.device, backend) == "fused":
        check_id_dtypes(kjt, op)  # the op checks the lengths (its one host sync)
        perm = torch.ops.recxla.cluster_permutation_fused(
            values, lengths, batch, num_micro_batches, weights.tolist()
        )
    else:
        check_ids(kjt, op)
        perm = cluster_permutation_with_passes(
            values, lengths, batch, num_micro_batches, weights, gpu_passes(backend)
        )
    return perm, offsets


def gpu_variant(device: torch.device, backend: str) -> str:
    """The cluster family's GPU variant that runs on `device` with GPU backend `backend`
    ("cuda" or "triton"): "fused" is CUDA C++, so the Triton backend always runs "passes"."""
    if backend != "cuda":
        return "passes"
    from recxla.ops import gpu_variants

    return gpu_variants.chosen("cluster", gpu_variants.capability(device))


def gpu_passes(backend: str) -> KeyPasses:
    """The CUDA ops or the Triton kernels (backend "cuda" or "triton")."""
    if backend == "cuda":
        return KeyPasses(
            torch.ops.recxla.cluster_feature_gains, torch.ops.recxla.cluster_bag_signatures
        )
    from recxla.triton_kernels import cluster as triton_cluster

    return KeyPasses(triton_cluster.feature_gains, triton_cluster.bag_signatures)


def cluster_permutation_with_passes(
    values: torch.Tensor, lengths: torch.Tensor, batch: int, num_micro_batches: int,
    weights: torch.Tensor, passes: KeyPasses,
) -> torch.Tensor:
    """The clustered order (int64 [B]) with the key passes of `passes` and the torch ops of
    recxla.ops.cluster_steps for the rest: the "passes" GPU variant.

    values: int32/int64 [>= N] (CPU or CUDA); lengths: int32/int64 [F * B], feature-major, >= 0,
    summing to N; weights: float64 [F] bytes per key, finite and >= 0; 1 <= M <= B (checked by
    the caller). Same contract as the op `torch.ops.recxla.cluster_permutation`."""
    m = num_micro_batches
    device = values.device
    perm = torch.arange(batch, dtype=torch.int64, device=device)
    if m == 1 or m == batch or lengths.numel() == 0:
        return perm
    lengths = lengths.to(torch.int64)
    num_features = lengths.numel() // batch
    counts = lengths.view(num_features, batch).sum(1).cumsum(0).tolist()
    feature_offsets = [0] + counts
    ranked = rank_features(passes.feature_gains(values, feature_offsets, batch, m), weights)
    if not ranked:
        return perm
    refine = ranked[:REFINE_FEATURES]
    bag_lengths, fingerprints, sort_keys = [], [], []
    for i, f in enumerate(ranked):
        feature_lengths = lengths[f * batch:(f + 1) * batch]
        offsets = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        torch.cumsum(feature_lengths, 0, out=offsets[1:])
        min_hash, fingerprint = passes.bag_signatures(values, offsets.add_(feature_offsets[f]))
        if i < SORT_FEATURES:
            sort_keys.append(signature_sort_key(min_hash, fingerprint))
        bag_lengths.append(feature_lengths)
        fingerprints.append(fingerprint)
    ranked_values = torch.cat([values[feature_offsets[f]:feature_offsets[f + 1]] for f in ranked])
    bags = (
        torch.cat(bag_lengths),
        key_hash(ranked_values.to(torch.int64)),
        torch.stack(fingerprints[:len(refine)]),
    )
    int_weights = integer_weights(weights)
    return order_samples(sort_keys, bags, [int_weights[f] for f in refine], m)


if _extension.HAVE_EXTENSION:
    # The op's CUDA kernel is the chosen GPU variant: "fused" is the C++ op of the same contract;
    # "passes" composes the two passes over every key (kernels) with recxla.ops.cluster_steps.
    @torch.library.impl("recxla::cluster_permutation", "CUDA")
    def _cluster_permutation_cuda(values, lengths, batch_size, num_micro_batches, key_bytes):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        backend = _extension.gpu_backend()
        if gpu_variant(values.device, backend) == "fused":
            return torch.ops.recxla.cluster_permutation_fused(
                values, lengths, batch_size, num_micro_batches, key_bytes
            )
        op = "recxla::cluster_permutation"
        if values.dim() != 1 or lengths.dim() != 1:
            raise ValueError(f"{op}: values and lengths must be 1-D")
        if batch_size < 1 or lengths.numel() % batch_size:
            raise ValueError(
                f"{op}: lengths must hold F * batch_size entries, got {lengths.numel()} for "
                f"batch_size {batch_size}"
            )
        features = [f"feature {f}" for f in range(lengths.numel() // batch_size)]
        kjt = KeyedJaggedTensor(features, values, lengths=lengths, stride=batch_size)
        num_micro_batches = check_num_micro_batches(num_micro_batches, batch_size, op)
        weights = key_bytes_tensor(kjt, list(key_bytes), op)
        check_ids(kjt, op)
        return cluster_permutation_with_passes(
            values, lengths, batch_size, num_micro_batches, weights, gpu_passes(backend)
        )


def permute_samples(kjt: "KeyedJaggedTensor", permutation: torch.Tensor) -> "KeyedJaggedTensor":
    """The batch with its samples in `permutation` order: sample j of the result is sample
    permutation[j] of kjt, in every feature (lengths, values and weights move together).

    kjt: F keys of B samples each, lengths >= 0 and within kjt.values(); permutation: int64
    [B], a permutation of range(B) (checked: every entry in range, each once). Returns a
    KeyedJaggedTensor with the same keys, lengths' dtype and values' dtype.
    Dense features and labels are plain [B, ...] tensors: index them with `permutation`.
    One gather of the values (a jagged index_select per feature, all features at once): O(N).
    """
    op = "recxla.permute_samples"
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = check_kjt(kjt, op)
    batch = kjt.stride()
    device = kjt.values().device
    permutation = check_permutation(permutation, batch, device, op)
    check_lengths(kjt, op)
    num_features = len(kjt.keys())
    lengths = kjt.lengths().view(num_features, batch)
    starts = torch.zeros(num_features * batch, dtype=torch.int64, device=device)
    starts[1:] = lengths.reshape(-1)[:-1].to(torch.int64).cumsum(0)
    rows = (torch.arange(num_features, device=device)[:, None] * batch + permutation).reshape(-1)
    new_lengths = lengths.reshape(-1).index_select(0, rows)
    total = int(new_lengths.sum()) if new_lengths.numel() else 0
    # Index of every output value: its bag's start in the input plus its rank in the bag.
    counts = new_lengths.to(torch.int64)
    bag_start = torch.repeat_interleave(starts.index_select(0, rows), counts, output_size=total)
    out_start = torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)
    index = bag_start + torch.arange(total, device=device) - out_start
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().index_select(0, index),
        weights=None if weights is None else weights.index_select(0, index),
        lengths=new_lengths,
        stride=batch,
    )


def even_sizes(batch_size: int, num_micro_batches: int) -> List[int]:
    """The contiguous split: M sizes summing to batch_size, the first batch_size % M one
    larger (recxla.pipeline's split="contiguous", and what `choose_row_tables` assumes)."""
    base, extra = divmod(batch_size, num_micro_batches)
    return [base + (1 if k < extra else 0) for k in range(num_micro_batches)]


def random_split(
    batch_size: int, num_micro_batches: int, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The baseline: a random permutation cut into balanced micro-batches (CPU tensors)."""
    op = "recxla.ops.cluster.random_split"
    num_micro_batches = check_num_micro_batches(num_micro_batches, batch_size, op)
    perm = torch.randperm(batch_size, generator=generator)
    return perm, balanced_offsets(batch_size, num_micro_batches)


def micro_batch_unique_keys(
    kjt: "KeyedJaggedTensor", permutation: torch.Tensor, offsets: torch.Tensor, key_bytes=None
) -> torch.Tensor:
    """Wire cost of a split: float64 [M], micro-batch j's unique keys summed over features,
    each weighted by its feature's key_bytes (default 1: a count of unique keys).

    permutation: int64 [B], a permutation of the samples; offsets: int64 [M + 1] bounds into it.
    The whole batch as one micro-batch (offsets [0, B]) gives the floor of any split.
    """
    op = "recxla.ops.cluster.micro_batch_unique_keys"
    kjt = check_kjt(kjt, op)
    batch = kjt.stride()
    weights = key_bytes_tensor(kjt, key_bytes, op)
    check_ids(kjt, op)
    device = kjt.values().device
    permutation = check_permutation(
        torch.as_tensor(permutation, device=device).to(torch.int64), batch, device, op
    )
    offsets = torch.as_tensor(offsets, device=device).to(torch.int64)
    num_mb = offsets.numel() - 1
    bad = num_mb < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != batch
    if bad or bool((offsets.diff() < 0).any()):
        raise ValueError(f"{op}: offsets must rise from 0 to {batch}, got {offsets.tolist()}")
    # Micro-batch of every sample: position in the permutation -> chunk.
    position = torch.empty_like(permutation)
    position[permutation] = torch.arange(batch, device=device)
    sample_mb = torch.searchsorted(offsets[1:], position, right=True)
    total = torch.zeros(num_mb, dtype=torch.float64, device=device)
    for f, (lengths, values) in enumerate(feature_slices(kjt.values(), kjt.lengths(), batch)):
        if values.numel() == 0:
            continue
        owner = torch.repeat_interleave(
            torch.arange(batch, device=device), lengths, output_size=values.numel()
        )
        _, key_id = torch.unique(values, return_inverse=True)
        pairs = torch.unique(sample_mb.index_select(0, owner) * values.numel() + key_id)
        counts = torch.bincount(pairs // values.numel(), minlength=num_mb)
        total += float(weights[f]) * counts.to(torch.float64)
    return total
