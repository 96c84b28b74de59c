"""Key-centric sample clustering: order a batch's samples so that micro-batches share keys.

A training step looks up and communicates each embedding key once per micro-batch (dedup), so
the bytes on the wire follow the sum over micro-batches of their unique keys. A random split
copies every key that several samples share into up to M micro-batches; samples of one request
share all their user-side keys (user id, history, attributes), so keeping them together leaves
one copy. `cluster_samples` finds such groups from the keys alone, with no request ids.

The algorithm (scores features by a hash sample of their keys, sorts the samples by min-hash
and fingerprint signatures of the best features' bags, then moves whole groups to the
micro-batch that holds most of their keys) is documented with its plain-PyTorch reference,
`recxla.reference.cluster`. Implementations, all with the same result bit for bit:
- CPU: one C++ call, `torch.ops.recxla.cluster_permutation` (csrc/cpu/cluster*.cpp);
- CUDA tensors, two GPU variants (family "cluster" of `recxla.ops.gpu_variants`: each
  architecture runs the one the GPU campaign measured fastest there, "passes" where nothing
  was measured):
  - "passes": the two passes over every key (scoring, bag signatures) are CUDA kernels
    (`RECXLA_BACKEND=cuda`, csrc/cuda/cluster.cu) or Triton kernels (`triton`,
    triton_kernels/cluster.py), the sorts and group moves are the reference's torch ops;
  - "fused" (CUDA backend only): the whole order as one C++ op,
    `recxla::cluster_permutation_fused` (csrc/cuda/cluster_fused.cu): about 44 device
    operations behind one host sync, where "passes" pays about 400 launches and 66 syncs
    (docs/clustering.md). On CPU tensors the same op runs its steps serially on the host,
    which is how its tests run without a GPU;
- no compiled extension: the reference.
The per-key math (hashes, sampling, fingerprints) lives in csrc/include/recxla/cluster.h.
Cost: about 3 ms for a batch of 8192 (700,000 ids) on one CPU thread, against 11-15 ms for the
reference (bench/results/clustering.md).
"""

from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional, Tuple

import torch

from recxla import _extension
from recxla.reference import cluster as reference
from recxla.reference.cluster import (  # noqa: F401  (the algorithm's constants, public here)
    BALANCE_SLACK, REFINE_FEATURES, REFINE_ROUNDS, SAMPLE_VALUES, SORT_FEATURES,
    balanced_offsets,
)

if TYPE_CHECKING:  # torchrec is imported on first use: `import recxla` stays light
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

_ID_DTYPES = (torch.int32, torch.int64)


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


def check_kjt(kjt, op: str) -> "KeyedJaggedTensor":
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(kjt, KeyedJaggedTensor):
        raise ValueError(
            f"{op}: kjt must be a torchrec KeyedJaggedTensor, got {type(kjt).__name__}"
        )
    if kjt.variable_stride_per_key():
        raise ValueError(f"{op}: kjt must have one batch size for every key (no variable stride)")
    return kjt


def check_num_micro_batches(num_micro_batches, batch_size: int, op: str) -> int:
    if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool):
        raise ValueError(
            f"{op}: num_micro_batches must be an int, got {type(num_micro_batches).__name__}"
        )
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(
            f"{op}: num_micro_batches must be in [1, batch size {batch_size}], "
            f"got {num_micro_batches}"
        )
    return num_micro_batches


def check_id_dtypes(kjt: "KeyedJaggedTensor", op: str) -> None:
    """Ids and lengths must be integers: a float id would be truncated into another key."""
    if kjt.values().dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: kjt.values() must be int32 or int64 ids, got {kjt.values().dtype}")
    if kjt.lengths().dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: kjt.lengths() must be int32 or int64, got {kjt.lengths().dtype}")


_INT64_MAX = 2**63 - 1


def _bag_name(kjt: "KeyedJaggedTensor", index: int) -> str:
    batch = kjt.stride()
    return f"at index {index} (feature {kjt.keys()[index // batch]!r}, sample {index % batch})"


def check_lengths(kjt: "KeyedJaggedTensor", op: str) -> None:
    """Lengths that are integers >= 0 and stay within kjt.values(): the checks the C++ kernel
    makes in its first pass, for the paths that run torch ops (which would raise bare errors
    or read the wrong keys). O(F * B), two host syncs (the bounds, the sum).

    The sum is exact: an int64 sum of lengths near 2**62 wraps to a negative total that passes
    a plain `sum > numel` test (torch then fails on negative repeats, or reads the wrong keys).
    So each length is first bounded by the values' count, and the sum is then taken over chunks
    short enough that no chunk's int64 sum can wrap, adding the chunks in Python ints."""
    lengths, num_values = kjt.lengths(), kjt.values().numel()
    if lengths.dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: kjt.lengths() must be int32 or int64, got {lengths.dtype}")
    if lengths.numel() == 0:
        return
    flat = lengths.reshape(-1)
    low, high = torch.stack(torch.aminmax(flat)).tolist()
    if low < 0:
        index = int(torch.nonzero(flat < 0)[0])
        raise ValueError(
            f"{op}: kjt.lengths() must be >= 0, got {int(flat[index])} {_bag_name(kjt, index)}"
        )
    if high > num_values:
        index = int(torch.nonzero(flat > num_values)[0])
        raise ValueError(
            f"{op}: kjt.lengths() overrun kjt.values(): length {int(flat[index])} "
            f"{_bag_name(kjt, index)} exceeds the {num_values} values kjt.values() holds"
        )
    # 0 <= length <= high, so a chunk of _INT64_MAX // high lengths sums without wrapping (one
    # chunk unless the lengths' count times the values' count passes 2**63).
    chunk = _INT64_MAX // max(high, 1)
    parts = flat.split(chunk)
    total = 0
    for i, part in enumerate(parts):
        total += int(part.sum(dtype=torch.int64))
        if total > num_values:
            exact = "" if i == len(parts) - 1 else "at least "
            raise ValueError(
                f"{op}: kjt.lengths() overrun kjt.values(): they sum to {exact}{total}, "
                f"kjt.values() holds {num_values}"
            )


def check_ids(kjt: "KeyedJaggedTensor", op: str) -> None:
    """`check_id_dtypes` and `check_lengths`."""
    check_id_dtypes(kjt, op)
    check_lengths(kjt, op)


def key_bytes_tensor(kjt: "KeyedJaggedTensor", key_bytes, op: str) -> torch.Tensor:
    """Per-feature bytes per key as float64 [F] on CPU.

    key_bytes: None (1 per key), a sequence or 1-D tensor of F numbers in KJT key order, or a
    dict from feature name to bytes covering every key.
    """
    keys = kjt.keys()
    if key_bytes is None:
        return torch.ones(len(keys), dtype=torch.float64)
    if isinstance(key_bytes, dict):
        missing = [k for k in keys if k not in key_bytes]
        if missing:
            raise ValueError(f"{op}: key_bytes has no entry for features {missing}")
        key_bytes = [key_bytes[k] for k in keys]
    try:
        out = torch.as_tensor(key_bytes, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{op}: key_bytes must be numbers, one per feature, got {key_bytes!r}")
    if out.shape != (len(keys),):
        raise ValueError(
            f"{op}: key_bytes must hold one number per feature ({len(keys)}), "
            f"got shape {tuple(out.shape)}"
        )
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise ValueError(f"{op}: key_bytes must be finite and >= 0, got {out.tolist()}")
    return out


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
    backend = _extension.backend_for(values)
    if backend == "cpu":
        check_id_dtypes(kjt, op)  # the kernel checks the lengths in its first pass
        perm = torch.ops.recxla.cluster_permutation(
            values, lengths, batch, num_micro_batches, weights.tolist()
        )
    elif backend == "reference":
        check_ids(kjt, op)
        perm = reference.cluster_permutation_ref(values, lengths, batch, num_micro_batches, weights)
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


class KeyPasses(NamedTuple):
    """The two passes over every key, as kernels with the contracts of the ops
    `recxla::cluster_feature_gains` and `recxla::cluster_bag_signatures` (csrc/cluster.cpp)."""

    feature_gains: Callable  # (values, feature_offsets list, B, M) -> int64 [F]
    bag_signatures: Callable  # (values, offsets int64 [L + 1]) -> (min_hash, fingerprint)


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
    """The clustered order (int64 [B]) with the key passes of `passes` and the reference's torch
    ops for the rest: the GPU path. Arguments as for `reference.cluster_permutation_ref`
    (checked by the caller)."""
    m = num_micro_batches
    device = values.device
    perm = torch.arange(batch, dtype=torch.int64, device=device)
    if m == 1 or m == batch or lengths.numel() == 0:
        return perm
    lengths = lengths.to(torch.int64)
    num_features = lengths.numel() // batch
    counts = lengths.view(num_features, batch).sum(1).cumsum(0).tolist()
    feature_offsets = [0] + counts
    ranked = reference.rank_features(passes.feature_gains(values, feature_offsets, batch, m), weights)
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
            sort_keys.append(reference.signature_sort_key(min_hash, fingerprint))
        bag_lengths.append(feature_lengths)
        fingerprints.append(fingerprint)
    ranked_values = torch.cat([values[feature_offsets[f]:feature_offsets[f + 1]] for f in ranked])
    bags = (
        torch.cat(bag_lengths),
        reference.key_hash(ranked_values.to(torch.int64)),
        torch.stack(fingerprints[:len(refine)]),
    )
    int_weights = reference.integer_weights(weights)
    return reference.order_samples(sort_keys, bags, [int_weights[f] for f in refine], m)


if _extension.HAVE_EXTENSION:
    # The op's CUDA kernel is the chosen GPU variant: "fused" is the C++ op of the same contract;
    # "passes" composes the two passes over every key (kernels) with the reference's torch ops.
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


def check_permutation(permutation, batch: int, device, op: str) -> torch.Tensor:
    """permutation as an int64 [B] tensor on `device` holding each of range(B) once: O(B) (a
    range check and a presence count, no sort)."""
    if not isinstance(permutation, torch.Tensor) or permutation.dtype != torch.int64:
        got = permutation.dtype if isinstance(permutation, torch.Tensor) else type(permutation).__name__
        raise TypeError(f"{op}: permutation must be an int64 tensor, got {got}")
    if permutation.shape != (batch,):
        raise ValueError(
            f"{op}: permutation must have shape ({batch},), got {tuple(permutation.shape)}"
        )
    permutation = permutation.to(device)
    if batch == 0:
        return permutation
    lo, hi = int(permutation.min()), int(permutation.max())
    if lo < 0 or hi >= batch:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{op}: permutation entries must lie in [0, {batch}), got {bad}"
        )
    seen = torch.bincount(permutation, minlength=batch)
    if not bool((seen == 1).all()):
        twice = int(torch.nonzero(seen > 1)[0])
        missing = int(torch.nonzero(seen == 0)[0])
        raise ValueError(
            f"{op}: permutation must hold each of range({batch}) once, but {twice} appears "
            f"{int(seen[twice])} times and {missing} is missing"
        )
    return permutation


def permute_samples(kjt: "KeyedJaggedTensor", permutation: torch.Tensor) -> "KeyedJaggedTensor":
    """The batch with its samples in `permutation` order: sample j of the result is sample
    permutation[j] of kjt, in every feature (lengths, values and weights move together).

    kjt: F keys of B samples each, lengths >= 0 and within kjt.values(); permutation: int64
    [B], a permutation of range(B) (checked: every entry in range, each once). Returns a
    KeyedJaggedTensor with the same keys, lengths' dtype and values' dtype.
    Dense features and labels are plain [B, ...] tensors: index them with `permutation`.
    One gather of the values (a jagged index_select per feature, all features at once): O(N).
    """
    op = "recxla.clustering.permute_samples"
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
    op = "recxla.clustering.random_split"
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
    op = "recxla.clustering.micro_batch_unique_keys"
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
    for f, (lengths, values) in enumerate(reference.feature_slices(kjt.values(), kjt.lengths(), batch)):
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
