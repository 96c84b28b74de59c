"""Segmented key dedup with Triton kernels (the GPU path when RECXLA_BACKEND=triton).

Sort-based, like the CUDA kernel:
1. sort (segment, key) pairs, carrying each key's position: torch's stable sorts;
2. mark heads: sorted position i starts a new unique key when it starts a segment or differs
   from its left neighbour (csrc/include/recxla/dedup.h, `is_head`): Triton;
3. number the heads: an inclusive prefix sum of the head flags (torch.cumsum);
4. scatter: unique_values[number - 1] = key at each head, inverse[position] = number - 1: Triton.

Why steps 1 and 3 are not Triton: a sort or a prefix sum over the whole array needs every
program to see the others' results, and Triton has no grid-wide barrier inside a kernel;
`tl.sort` and `tl.cumsum` work within one block only. A multi-pass Triton radix sort would
rebuild what torch's sort (CUB on CUDA) already does at memory speed, so those steps stay torch
ops and the element-wise steps, which Triton fits, are kernels.

The kernels take plain pointers and run under TRITON_INTERPRET=1 on CPU tensors, which is how
they are tested on machines without a GPU.
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _mark_heads_kernel(keys_ptr, segments_ptr, heads_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    left_mask = mask & (i > 0)
    key = tl.load(keys_ptr + i, mask=mask, other=0)
    left = tl.load(keys_ptr + i - 1, mask=left_mask, other=0)
    segment = tl.load(segments_ptr + i, mask=mask, other=0)
    left_segment = tl.load(segments_ptr + i - 1, mask=left_mask, other=0)
    # Position 0 has no left neighbour and is always a head.
    head = (i == 0) | (segment != left_segment) | (key != left)
    tl.store(heads_ptr + i, head.to(tl.int64), mask=mask)


@triton.jit
def _scatter_kernel(
    keys_ptr,
    positions_ptr,
    heads_ptr,
    numbers_ptr,
    unique_ptr,
    inverse_ptr,
    n,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    key = tl.load(keys_ptr + i, mask=mask, other=0)
    position = tl.load(positions_ptr + i, mask=mask, other=0)
    head = tl.load(heads_ptr + i, mask=mask, other=0)
    # The inclusive sum counts this head too: the unique key's index is one less.
    index = tl.load(numbers_ptr + i, mask=mask, other=1) - 1
    tl.store(inverse_ptr + position, index, mask=mask)
    tl.store(unique_ptr + index, key, mask=mask & (head != 0))


def segment_sort(values: torch.Tensor, offsets: torch.Tensor):
    """Sorts keys within each segment, segments kept in place.

    values: int32/int64 [N]; offsets: int64 [S + 1]. Returns (sorted_keys [N] values' dtype,
    positions int64 [N] with sorted_keys == values[positions], segment_ids int64 [N] of the
    sorted positions, which are those of the original positions: segments do not move).
    """
    lengths = offsets[1:] - offsets[:-1]
    segment_ids = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=values.device), lengths, output_size=values.numel()
    )
    # Two stable sorts give the lexicographic (segment, key) order for any int64 keys, where
    # packing both into one sort key could overflow.
    by_key = torch.sort(values, stable=True).indices
    by_segment = torch.sort(segment_ids[by_key], stable=True).indices
    positions = by_key[by_segment]
    return values[positions], positions, segment_ids


def segmented_unique_triton(values: torch.Tensor, offsets: torch.Tensor):
    """values: int32/int64 [N] (contiguous); offsets: int64 [S + 1], already checked.

    Returns (unique_values [U] values' dtype, unique_offsets int64 [S + 1], inverse int64 [N]),
    equal to recxla.reference.dedup.segmented_unique_ref.
    """
    values = values.contiguous()
    offsets = offsets.contiguous()
    n = values.numel()
    inverse = torch.empty(n, dtype=torch.int64, device=values.device)
    if n == 0:
        return values.new_empty(0), torch.zeros_like(offsets), inverse
    keys, positions, segment_ids = segment_sort(values, offsets)
    heads = torch.empty(n, dtype=torch.int64, device=values.device)
    grid = (triton.cdiv(n, BLOCK),)
    _mark_heads_kernel[grid](keys, segment_ids, heads, n, BLOCK=BLOCK)
    numbers = torch.cumsum(heads, 0)
    # The output size is data-dependent: one read of the last number (a device sync on GPU).
    unique_count = int(numbers[-1])
    unique_values = values.new_empty(unique_count)
    _scatter_kernel[grid](keys, positions, heads, numbers, unique_values, inverse, n, BLOCK=BLOCK)
    # Segment s's uniques start after the heads before its first position.
    before = numbers[(offsets - 1).clamp(min=0)]
    unique_offsets = torch.where(offsets > 0, before, torch.zeros_like(before))
    return unique_values, unique_offsets, inverse
