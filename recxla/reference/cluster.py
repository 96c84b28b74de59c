"""Reference of key-centric sample clustering (`recxla.cluster_samples`) in plain PyTorch.

The oracle that every path must match bit for bit (csrc/cpu/cluster*.cpp, csrc/cuda/cluster.cu,
csrc/cuda/cluster_fused.cu, triton_kernels/cluster.py and the "passes" GPU variant of
recxla.ops.cluster) and the baseline of bench/bench_clustering.py. It runs on CPU or CUDA
tensors.

It composes the same algorithm's steps, the torch ops of recxla.ops.cluster_steps (`key_hash`,
`feature_gains`, `bag_min_hash`, `bag_fingerprints`, `signature_sort_key`, `order_samples`,
...; the tests import them from here too), over the whole batch, as the C++ kernel composes its
own C++ steps, bit for bit, in one call. The kernels (C++, the fused CUDA op, the Triton and
CUDA key passes) are independent implementations checked against it; the "passes" GPU variant
shares its sorts and group moves with it. The algorithm is described step by step in
recxla.ops.cluster_steps; the argument checks are those of recxla.ops.cluster_checks, so that
both raise alike.
"""

from typing import Tuple

import torch

from recxla.ops.cluster_checks import (
    check_ids, check_kjt, check_num_micro_batches, key_bytes_tensor,
)
from recxla.ops.cluster_steps import (  # the algorithm's steps (csrc/include/recxla/cluster.h)
    REFINE_FEATURES, SORT_FEATURES, bag_fingerprints, bag_min_hash, balanced_offsets,
    feature_gains, feature_slices, integer_weights, key_hash, order_samples, rank_features,
    signature_sort_key,
)


def cluster_permutation_ref(
    values: torch.Tensor, lengths: torch.Tensor, batch: int, num_micro_batches: int,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The clustered order of a batch: int64 [B] on values' device.

    values: int32/int64 [>= N] (CPU or CUDA); lengths: int32/int64 [F * B], feature-major, >= 0,
    summing to N; weights: float64 [F] bytes per key, finite and >= 0; 1 <= M <= B.
    Same contract as the kernel `torch.ops.recxla.cluster_permutation`.
    """
    m = num_micro_batches
    perm = torch.arange(batch, dtype=torch.int64, device=values.device)
    if m == 1 or m == batch or lengths.numel() == 0:
        return perm  # every order costs the same
    slices = feature_slices(values, lengths, batch)
    hashes = [key_hash(v) for _, v in slices]
    ranked = rank_features(feature_gains(hashes, batch, m), weights)
    if not ranked:
        return perm
    refine = ranked[:REFINE_FEATURES]
    bag_lengths = torch.cat([slices[f][0] for f in ranked])
    ranked_hashes = torch.cat([hashes[f] for f in ranked])
    fingerprints = bag_fingerprints(bag_lengths, ranked_hashes).view(len(ranked), batch)
    sort_keys = [
        signature_sort_key(bag_min_hash(slices[f][0], hashes[f]), fingerprints[i])
        for i, f in enumerate(ranked[:SORT_FEATURES])
    ]
    int_weights = integer_weights(weights)
    bags = (bag_lengths, ranked_hashes, fingerprints[:len(refine)])
    return order_samples(sort_keys, bags, [int_weights[f] for f in refine], m)


def cluster_samples_ref(kjt, num_micro_batches: int, key_bytes=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract and result as `recxla.cluster_samples`, computed with this module."""
    op = "cluster_samples_ref"
    kjt = check_kjt(kjt, op)
    batch = kjt.stride()
    m = check_num_micro_batches(num_micro_batches, batch, op)
    weights = key_bytes_tensor(kjt, key_bytes, op)
    check_ids(kjt, op)
    perm = cluster_permutation_ref(kjt.values(), kjt.lengths(), batch, m, weights)
    return perm, balanced_offsets(batch, m, perm.device)
