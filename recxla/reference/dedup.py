"""Reference segmented key dedup in plain PyTorch (see recxla.ops.dedup for the contract).

Deliberately the obvious algorithm: one `torch.unique` per segment. The kernels must match it
exactly: unique keys ascending within each segment, segments in order, and the inverse index.
"""

import torch


def segmented_unique_ref(values: torch.Tensor, offsets: torch.Tensor):
    """values: int32/int64 [N]; offsets: int64 [S + 1] (0, non-decreasing, ends at N).

    Returns (unique_values [U] values' dtype, unique_offsets int64 [S + 1], inverse int64 [N]).
    """
    bounds = offsets.tolist()
    uniques, counts, inverses = [], [], []
    base = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        unique, inverse = torch.unique(values[start:end], sorted=True, return_inverse=True)
        uniques.append(unique)
        inverses.append(inverse.to(torch.int64) + base)
        counts.append(unique.numel())
        base += unique.numel()
    unique_offsets = torch.zeros(len(bounds), dtype=torch.int64, device=values.device)
    if counts:
        unique_offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    if not uniques:
        return values.new_empty(0), unique_offsets, values.new_empty(0, dtype=torch.int64)
    return torch.cat(uniques), unique_offsets, torch.cat(inverses)


def bucketize_by_rank_ref(values: torch.Tensor, offsets: torch.Tensor, block_bounds: torch.Tensor):
    """The rank-major (rank, table) grouping of `recxla.ops.dedup.bucketize_by_rank`, one key at a
    time: values [N], offsets int64 [T + 1], block_bounds int64 [T, R + 1].

    Returns (permutation int64 [N], bucket_offsets int64 [R * T + 1]).
    """
    tables, ranks = block_bounds.shape[0], block_bounds.shape[1] - 1
    bounds = offsets.tolist()
    buckets = [[] for _ in range(ranks * tables)]
    for t in range(tables):
        interior = block_bounds[t, 1:ranks].tolist()
        for i in range(bounds[t], bounds[t + 1]):
            key = int(values[i])
            rank = sum(1 for b in interior if key >= b)
            buckets[rank * tables + t].append(i)
    permutation = torch.tensor([i for b in buckets for i in b], dtype=torch.int64)
    sizes = torch.tensor([0] + [len(b) for b in buckets], dtype=torch.int64)
    return permutation.to(values.device), sizes.cumsum(0).to(values.device)
