"""Key-centric sample clustering: the two passes over every key in Triton (the GPU path when
RECXLA_BACKEND=triton; contracts of the ops in csrc/cluster.cpp, the hash's constants in
recxla/cluster_hash.py, reference in recxla/reference/cluster.py).

- `feature_gains`: per feature, one kernel hashes every key and counts the sampled ones in the
  feature's table (atomics), a second turns each slot's count into keys saved; a torch sum per
  feature adds them up (integers: exact in any order).
- `bag_signatures`: one lane per bag walks its keys (a loop as long as the longest bag of the
  block) and keeps the smallest hash and the wrapping sum of the fingerprint mix.
The per-key math is that of csrc/include/recxla/cluster.h: 64-bit products wrap in uint64,
arithmetic shifts act on the int64 bit pattern. The sorts and group moves around these passes
are torch ops (recxla.ops.cluster.cluster_permutation_with_passes): a grid-wide sort has no place
inside one Triton kernel. The kernels take plain pointers and run under TRITON_INTERPRET=1 on
CPU tensors, which is how they are tested without a GPU.
"""

from typing import Sequence

import torch
import triton
import triton.language as tl

from recxla.cluster_hash import (
    HASH_MULTIPLIER,
    HASH_SALT,
    MIX_MULTIPLIER,
    sample_bits,
    table_bits,
)

BLOCK = 1024
BAG_BLOCK = 128
_SALT = tl.constexpr(HASH_SALT)
_MULTIPLIER = tl.constexpr(HASH_MULTIPLIER)
_MIX = tl.constexpr(MIX_MULTIPLIER % (1 << 64))  # as an unsigned 64-bit constant
_EMPTY = tl.constexpr((1 << 63) - 1)


@triton.jit
def _key_hash(values):
    """(key ^ salt) * odd constant mod 2**64, as uint64."""
    return (values.to(tl.int64).to(tl.uint64, bitcast=True) ^ _SALT) * _MULTIPLIER


@triton.jit
def _fingerprint_mix(h):
    """x = (h ^ (h >> 29)) * odd constant, then x ^ (x >> 32), arithmetic shifts; as uint64."""
    s = h.to(tl.int64, bitcast=True)
    x = ((s ^ (s >> 29)).to(tl.uint64, bitcast=True) * _MIX).to(tl.int64, bitcast=True)
    return (x ^ (x >> 32)).to(tl.uint64, bitcast=True)


@triton.jit
def _count_kernel(values_ptr, counts_ptr, start, n, shift, slots, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    h = _key_hash(tl.load(values_ptr + start + i, mask=mask, other=0))
    slot = h >> shift  # logical: a key is sampled iff its slot is below the table's size
    sampled = mask & (slot < slots)
    slot = tl.where(sampled, slot, 0).to(tl.int64)
    tl.atomic_add(counts_ptr + slot, tl.full([BLOCK], 1, tl.int32), mask=sampled)


@triton.jit
def _slot_gain_kernel(counts_ptr, out_ptr, slots, batch, m, r_bits, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < slots
    c = tl.minimum(tl.load(counts_ptr + i, mask=mask, other=0).to(tl.int64), batch)
    gain = tl.minimum(c, m) - (c * m + batch - 1) // batch  # all >= 0: floor division
    tl.store(out_ptr + i, gain << r_bits, mask=mask)


@triton.jit
def _signature_kernel(values_ptr, offsets_ptr, min_ptr, fp_ptr, num_bags, max_len,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = b < num_bags
    first = tl.load(offsets_ptr + b, mask=mask, other=0)
    last = tl.load(offsets_ptr + b + 1, mask=mask, other=0)
    smallest = tl.full([BLOCK], _EMPTY, tl.int64)
    total = tl.full([BLOCK], 0, tl.uint64)
    for j in range(0, max_len):
        inside = mask & (first + j < last)
        h = _key_hash(tl.load(values_ptr + first + j, mask=inside, other=0))
        smallest = tl.where(inside, tl.minimum(smallest, h.to(tl.int64, bitcast=True)), smallest)
        total += tl.where(inside, _fingerprint_mix(h), 0)
    tl.store(min_ptr + b, smallest, mask=mask)
    tl.store(fp_ptr + b, total.to(tl.int64, bitcast=True), mask=mask)


def feature_gains(
    values: torch.Tensor, feature_offsets: Sequence[int], batch_size: int, num_micro_batches: int
) -> torch.Tensor:
    """Keys clustering is estimated to save on each feature, int64 [F] on values' device.

    values: int32/int64 [>= N]; feature f is values[feature_offsets[f]:feature_offsets[f + 1]]
    (F + 1 ints, checked by the caller). Equals the reference's `feature_gains` of the hashes.
    """
    values = values.contiguous()
    out = torch.zeros(len(feature_offsets) - 1, dtype=torch.int64, device=values.device)
    for f in range(len(feature_offsets) - 1):
        start, n = feature_offsets[f], feature_offsets[f + 1] - feature_offsets[f]
        if n == 0:
            continue
        r_bits = sample_bits(n)
        bits = table_bits(max(n >> r_bits, 1))
        counts = torch.zeros(1 << bits, dtype=torch.int32, device=values.device)
        _count_kernel[(triton.cdiv(n, BLOCK),)](
            values, counts, start, n, 64 - r_bits - bits, 1 << bits, BLOCK=BLOCK
        )
        saved = torch.empty(1 << bits, dtype=torch.int64, device=values.device)
        _slot_gain_kernel[(triton.cdiv(1 << bits, BLOCK),)](
            counts, saved, 1 << bits, batch_size, num_micro_batches, r_bits, BLOCK=BLOCK
        )
        out[f] = saved.sum()
    return out


def bag_signatures(values: torch.Tensor, offsets: torch.Tensor):
    """(min_hash int64 [L], fingerprint int64 [L]) of bags values[offsets[i]:offsets[i + 1]].

    values: int32/int64 [>= N]; offsets: int64 [L + 1], non-decreasing, within values (checked
    by the caller). Equals the reference's `bag_min_hash` and `bag_fingerprints`.
    """
    values, offsets = values.contiguous(), offsets.contiguous()
    bags = offsets.numel() - 1
    min_hash = torch.empty(bags, dtype=torch.int64, device=values.device)
    fingerprint = torch.empty(bags, dtype=torch.int64, device=values.device)
    if bags == 0:
        return min_hash, fingerprint
    max_len = int((offsets[1:] - offsets[:-1]).max())  # the loop bound: one read (a sync)
    _signature_kernel[(triton.cdiv(bags, BAG_BLOCK),)](
        values, offsets, min_hash, fingerprint, bags, max_len, BLOCK=BAG_BLOCK
    )
    return min_hash, fingerprint
