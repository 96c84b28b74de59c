"""Key-centric sample clustering in torch ops: the algorithm's constants and steps
(recxla.ops.cluster composes them).

- The "passes" GPU variant runs the two passes over every key as kernels (CUDA:
  csrc/cuda/cluster.cu, Triton: triton_kernels/cluster.py) and the steps here around them:
  `rank_features`, `signature_sort_key`, `order_samples` (the sort and the group moves).
- `balanced_offsets` and `feature_slices` serve the public functions of recxla.ops.cluster.
- The tests' oracle, recxla/reference/cluster.py, composes every step here (the key passes
  too: `key_hash`, `feature_gains`, `bag_min_hash`, `bag_fingerprints`) into the whole order,
  as the C++ kernel (csrc/cpu/cluster*.cpp) computes it bit for bit.
The hash and the table sizes are the contract that csrc/include/recxla/cluster.h,
triton_kernels/cluster.py and the reference share: they live in the leaf recxla.cluster_hash.

Algorithm (hashes, scans and sorts: O(N log N) for N keys):
1. Score each feature by what clustering can save on it (`feature_gains`): a key held by c
   samples costs about min(c, M) micro-batch copies under a random split and ceil(c * M / B)
   when its samples are contiguous; the estimate sums the difference over a hash sample of
   the keys, counted in a table (no sort), times the feature's bytes per key.
2. Two signatures of every bag of the best `SORT_FEATURES` features, from a 64-bit hash of its
   keys: the min-hash (bags that overlap share it with probability equal to their Jaccard
   similarity) and the fingerprint (a sum of a nonlinear mix of the hashes: equal bags tie
   exactly, different ones with probability about 2**-64), packed into one int64 sort key.
3. Sort the samples by the key of the best feature, ties by the next, then by sample index.
   Runs of samples with equal best-feature key are groups (a user's requests).
4. `refine_bins`: the sorted order's M chunks give each group a bin; a few rounds move whole
   groups to the bin that already holds most of their keys of the best `REFINE_FEATURES`
   features, each bin kept within B / (M * BALANCE_SLACK) samples of ceil(B / M). The order
   is by bin, groups inside a bin in sorted order, cut into M chunks of floor(B / M) or
   ceil(B / M) samples.
"""

from typing import Callable, List, NamedTuple, Sequence

import torch

from recxla.cluster_hash import (
    HASH_MULTIPLIER, HASH_SALT, MIX_MULTIPLIER, sample_bits, table_bits,
)

# Features whose signatures form the sort key; later ones only order samples that tie on the
# earlier ones, so more cost time and gain little.
SORT_FEATURES = 2
# Rounds of moving whole groups between micro-batches (`refine_bins`), and how far above
# ceil(B / M) a micro-batch may grow meanwhile: B / (M * BALANCE_SLACK) samples.
REFINE_ROUNDS = 4
BALANCE_SLACK = 32
# Features whose keys the moves count: the ones with the largest clustering gain. Counting all
# 26 of the default profile saves 0.2 points more at 1.4x the cost; 4 lose 0.1 point.
REFINE_FEATURES = 6
# Bytes per key become integers with this largest value, so gains sum exactly.
WEIGHT_SCALE = 1 << 20
EMPTY_SIGNATURE = torch.iinfo(torch.int64).max
_LOW32 = (1 << 32) - 1


def key_hash(values: torch.Tensor) -> torch.Tensor:
    """A bijection of int64 keys that scatters them: (key ^ salt) * odd constant mod 2**64.

    Ids are often dense or sorted by popularity; hashed, the minimum over a bag is a min-hash
    and the top bits index a counting table. One function serves every feature: signatures
    and counts are only ever compared within a feature.
    """
    return (values ^ HASH_SALT).mul_(HASH_MULTIPLIER)


def fingerprint_mix(hashes: torch.Tensor) -> torch.Tensor:
    """What a fingerprint sums for each key hash h: x = (h ^ (h >> 29)) * odd constant mod
    2**64, then x ^ (x >> 32) (arithmetic shifts).

    `key_hash` is nearly linear in small keys, so a plain sum of hashes ties bags like {0, 3}
    and {1, 2}; with the two folds none of 300,000 random small-key bags tie.
    """
    mixed = hashes >> 29
    mixed.bitwise_xor_(hashes).mul_(MIX_MULTIPLIER)
    return mixed.bitwise_xor_(mixed >> 32)


def feature_slices(values: torch.Tensor, lengths: torch.Tensor, batch: int):
    """(lengths int64 [B], values int64 [N_f]) of each of the F = lengths.numel() / B features.

    values: int32/int64 [>= N]; lengths: int32/int64 [F * B], feature-major, checked by the
    caller (>= 0, sum N <= values.numel()).
    """
    lengths = lengths.to(torch.int64)
    num_features = lengths.numel() // batch if batch else 0
    counts = lengths.view(num_features, batch).sum(1).tolist() if num_features else []
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    flat = values[: starts[-1]].to(torch.int64)
    return [
        (lengths[f * batch:(f + 1) * batch], flat[starts[f]:starts[f + 1]])
        for f in range(num_features)
    ]


def feature_gains(hashes: Sequence[torch.Tensor], batch: int, m: int) -> torch.Tensor:
    """Estimated keys that clustering saves on each feature: int64 [F] on CPU.

    hashes: `key_hash` of each feature's values (int64 [N_f] each).
    A key seen c times costs about min(c, M) micro-batch copies under a random split and
    ceil(c * M / B) when its samples are contiguous. Linear time, no sort: a feature keeps the
    keys whose hash has its top log2(R) bits zero (about 1/R of its keys, with all their
    occurrences, R from `sample_bits`), counts them in a table indexed by the next bits
    (`table_bits` of N / R), sums min(c, M) - ceil(c * M / B) over the slots (c capped at B)
    and scales the sum by R. Keys sharing a slot count as one: the score only ranks features.
    """
    num_features = len(hashes)
    if m == 1 or num_features == 0:
        return torch.zeros(num_features, dtype=torch.int64)
    # Every value's slot, written in place into one buffer: feature f owns 2**bits + 2 slots
    # from bounds[f], the first and last for the values of unsampled keys (dropped below).
    total = sum(h.numel() for h in hashes)
    slots = torch.empty(total, dtype=torch.int64, device=hashes[0].device)
    bounds, rate_bits, pos = [0], [], 0
    for h in hashes:
        r_bits = sample_bits(h.numel())
        bits = table_bits(max(h.numel() >> r_bits, 1))  # ~N / R values are sampled
        slot = slots[pos:pos + h.numel()]
        pos += h.numel()
        # Arithmetic shift: the top r_bits and the sign stay above the table's bits.
        torch.bitwise_right_shift(h, 64 - r_bits - bits, out=slot)
        if r_bits:  # a key is sampled iff its slot is in [0, 2**bits): clamp the rest out
            slot.clamp_(-1, 1 << bits).add_(bounds[-1] + 1)
        else:  # every key: the top `bits` bits, signed, moved to [0, 2**bits)
            slot.add_(bounds[-1] + 1 + (1 << (bits - 1)))
        bounds.append(bounds[-1] + (1 << bits) + 2)
        rate_bits.append(r_bits)
    counts = torch.bincount(slots, minlength=bounds[-1])
    c = torch.arange(batch + 1, device=counts.device)
    gain_of_count = c.clamp(max=m) - (c * m + batch - 1) // batch
    saved = gain_of_count.index_select(0, counts.clamp(max=batch))
    ends = torch.tensor(bounds[1:], device=saved.device) - 1  # each feature's last slot
    dropped = torch.tensor(bounds[:-1], device=saved.device)  # and its first
    saved = saved.index_fill_(0, torch.cat([dropped, ends]), 0).cumsum(0)
    per_feature = saved.index_select(0, ends).cpu()
    per_feature = per_feature.diff(prepend=torch.zeros(1, dtype=per_feature.dtype))
    return per_feature << torch.tensor(rate_bits, dtype=torch.int64)


def rank_features(saved_keys: torch.Tensor, weights: torch.Tensor) -> List[int]:
    """The features that clustering saves most bytes on, best first (ties: lower index), at
    most max(SORT_FEATURES, REFINE_FEATURES) of them, and only those with a gain above 0.

    saved_keys: int64 [F] from `feature_gains`; weights: float64 [F] bytes per key.
    """
    gains = (saved_keys.cpu().to(torch.float64) * weights).tolist()
    ranked = [f for _, f in sorted((-g, f) for f, g in enumerate(gains) if g > 0)]
    return ranked[:max(SORT_FEATURES, REFINE_FEATURES)]


def bag_fingerprints(lengths: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of `fingerprint_mix` over each bag's hashes, int64 [L] for lengths
    int64 [L] and hashes int64 [N] (N = lengths.sum()): equal exactly for equal bags (as
    multisets). Differences of a running sum, which wraps mod 2**64 like the sum itself."""
    ends = lengths.cumsum(0)
    running = torch.empty(hashes.numel() + 1, dtype=torch.int64, device=hashes.device)
    running[0] = 0
    torch.cumsum(fingerprint_mix(hashes), 0, out=running[1:])
    return running.index_select(0, ends) - running.index_select(0, ends - lengths)


def bag_min_hash(lengths: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The smallest hash of each bag, int64 [L] (EMPTY_SIGNATURE for an empty bag)."""
    batch = lengths.numel()
    owner = torch.repeat_interleave(
        torch.arange(batch, device=hashes.device), lengths, output_size=hashes.numel()
    )
    min_hash = torch.full((batch,), EMPTY_SIGNATURE, dtype=torch.int64, device=hashes.device)
    return min_hash.scatter_reduce_(0, owner, hashes, reduce="amin", include_self=True)


def signature_sort_key(min_hash: torch.Tensor, fingerprint: torch.Tensor) -> torch.Tensor:
    """One int64 key per bag: the top 32 bits of the min-hash above the top 32 bits of the
    fingerprint. It differs from the exact pair order only where two bags agree on 32 bits of
    a hash and not on all 64 (about 2**-32 per pair), which moves a sample, not a group."""
    return (min_hash & ~_LOW32) | ((fingerprint >> 32) & _LOW32)


def balanced_offsets(batch_size: int, num_micro_batches: int, device=None) -> torch.Tensor:
    """Micro-batch bounds: int64 [M + 1], j * B // M, sizes floor(B / M) or ceil(B / M)."""
    m = torch.arange(num_micro_batches + 1, dtype=torch.int64, device=device)
    return m * batch_size // num_micro_batches


def integer_weights(weights: torch.Tensor) -> list:
    """Bytes per key as ints (the largest is WEIGHT_SCALE, round half to even), so that gains
    sum exactly and the order of summation cannot change a decision."""
    top = float(weights.max()) if weights.numel() else 0.0
    if top <= 0:
        return [0] * weights.numel()
    return torch.round(weights / top * WEIGHT_SCALE).to(torch.int64).tolist()


def order_samples(
    sort_keys: Sequence[torch.Tensor], bags, weights: list, num_micro_batches: int
) -> torch.Tensor:
    """Steps 3 and 4: the clustered permutation, int64 [B].

    sort_keys: int64 [B] each, most significant first (`signature_sort_key` of the best
    features); bags: (lengths int64 [R * B], hashes int64 [N_R], fingerprints int64 [R, B]) of
    the R features whose keys the moves count, feature-major; weights: their integer bytes per
    key (`integer_weights`), R ints.
    """
    batch = sort_keys[0].numel()
    device = sort_keys[0].device
    perm = torch.arange(batch, dtype=torch.int64, device=device)
    # Lexicographic order: stable sorts, least significant key first.
    for key in reversed(sort_keys):
        primary, order = torch.sort(key.index_select(0, perm), stable=True)
        perm = perm.index_select(0, order)
    # Groups: runs of samples that tie on the best feature's key (a user's requests).
    start = torch.ones(batch, dtype=torch.bool, device=device)
    start[1:] = primary[1:] != primary[:-1]
    group_in_order = start.cumsum(0) - 1
    group = torch.empty_like(group_in_order).index_copy_(0, perm, group_in_order)
    bins = refine_bins(bags, perm, start, group, group_in_order, weights, num_micro_batches)
    order = torch.sort(bins.index_select(0, group_in_order), stable=True).indices
    return perm.index_select(0, order)


def group_key_pairs(bags, perm, start, group, weights: list, group_bits: int):
    """The distinct (key, group) pairs of every weighted feature whose key more than one group
    holds: (key ids int64 [P], groups int64 [P], bytes per pair int64 [P], number of key ids).

    bags: as in `order_samples`; perm: the sorted order, int64 [B]; start: bool [B], True where
    a group starts in it; group: int64 [B], each sample's group (< 2**group_bits).
    A key is (feature, top 64 - group_bits - feature_bits bits of its hash): the three fit one
    int64, so one sort of all features finds the distinct pairs (a hash collision merges two
    keys: a cost estimate changes, not a result).
    A bag whose fingerprint equals that of the bag before it in its group adds no pair (a
    user-side bag is read once per group). A key only one group holds adds the same bytes to
    the gain of leaving its bin as it costs in any target: it never changes a gain, so its
    pair is dropped.
    """
    lengths, hashes, fingerprints = bags
    num_features, batch = fingerprints.shape
    device = hashes.device
    feature_bits = (num_features - 1).bit_length()
    in_order = fingerprints.index_select(1, perm)
    new_bag = start.expand(num_features, batch).clone()
    new_bag[:, 1:] |= in_order[:, 1:] != in_order[:, :-1]
    new_bag &= torch.tensor(weights, device=device)[:, None] > 0
    kept_feature, kept_pos = new_bag.nonzero(as_tuple=True)  # feature-major, sorted order
    kept_sample = perm.index_select(0, kept_pos)
    rows = kept_feature * batch + kept_sample
    kept_lengths = lengths.index_select(0, rows)
    ends = kept_lengths.cumsum(0)
    total = int(ends[-1]) if ends.numel() else 0
    if total == 0:
        return None
    # Index of every gathered value: its bag's start in `hashes` plus its rank in the bag.
    shift = (lengths.cumsum(0) - lengths).index_select(0, rows) - (ends - kept_lengths)
    index = torch.repeat_interleave(shift, kept_lengths, output_size=total)
    index += torch.arange(total, device=device)
    tag = (kept_feature << group_bits) | group.index_select(0, kept_sample)
    owner = torch.repeat_interleave(tag, kept_lengths, output_size=total)
    low = (1 << (group_bits + feature_bits)) - 1
    pairs = torch.unique((hashes.index_select(0, index) & ~low) | owner)
    feature_key = pairs >> group_bits
    new_key = torch.ones_like(pairs, dtype=torch.bool)
    new_key[1:] = feature_key[1:] != feature_key[:-1]
    key = new_key.cumsum(0) - 1
    num_keys = int(key[-1]) + 1
    # Keep the keys of two groups or more, renumbered 0..K-1 (smaller count tables).
    shared_key = torch.bincount(key, minlength=num_keys) > 1
    shared = shared_key.index_select(0, key)
    pairs, key = pairs[shared], (shared_key.cumsum(0) - 1).index_select(0, key[shared])
    num_keys = int(key[-1]) + 1 if key.numel() else 0
    feature = (pairs >> group_bits) & ((1 << feature_bits) - 1)
    pair_bytes = torch.tensor(weights, dtype=torch.int64, device=device).index_select(0, feature)
    return key, pairs & ((1 << group_bits) - 1), pair_bytes, num_keys


def refine_bins(
    bags, perm, start, group, group_in_order, weights: list, num_micro_batches: int
) -> torch.Tensor:
    """Micro-batch (bin) of every group, int64 [G]: the sorted order's chunks, then
    REFINE_ROUNDS rounds of moving groups to the bin where they add the fewest new keys.

    A group's first bin is the chunk [j * B // M, (j + 1) * B // M) that holds its middle
    sample (first position + size // 2). A group in bin b moving to bin t saves the bytes of
    its keys that no other group of b holds and costs those of its keys that no group of t
    holds. Each round computes that gain for every group and bin at once (the best target:
    the largest gain, ties to the lowest bin), then moves the groups whose best gain is above 0
    in order of falling gain (ties: lower group id) while the target stays within
    ceil(B / M) + B // (M * BALANCE_SLACK) samples; later moves use the gains of the round's
    start. The final cut at balanced offsets splits at most one group per cut.
    bags, weights: as in `order_samples`; perm, start, group: the sorted order, its group
    starts (bool [B]) and each sample's group (int64 [B]); group_in_order: int64 [B], the
    group at each position of the sorted order.
    """
    batch = group.numel()
    m = num_micro_batches
    num_groups = int(group_in_order[-1]) + 1
    size = torch.bincount(group, minlength=num_groups)
    first = torch.cumsum(size, 0) - size  # position of each group's first sample
    bins = torch.searchsorted(
        balanced_offsets(batch, m, group.device)[1:], first + size // 2, right=True
    ).clamp_(max=m - 1)
    found = group_key_pairs(bags, perm, start, group, weights, max(1, num_groups.bit_length()))
    if found is None:
        return bins
    key, pair_group, pair_bytes, num_keys = found
    capacity = -(-batch // m) + batch // (m * BALANCE_SLACK)
    size_list = size.tolist()
    # Bytes of each key (one feature each), and each pair's slot in a [K, M] count table.
    key_bytes = torch.zeros(num_keys, dtype=torch.int64, device=key.device)
    key_bytes.index_copy_(0, key, pair_bytes)
    key_slot = key * m
    for _ in range(REFINE_ROUNDS):
        slot = key_slot + bins.index_select(0, pair_group)
        count = torch.bincount(slot, minlength=num_keys * m)
        # Leaving: the bytes of the group's keys no other group of its bin holds (all targets).
        alone = (count.index_select(0, slot) == 1).to(torch.int64) * pair_bytes
        leave = torch.zeros(num_groups, dtype=torch.int64, device=group.device)
        leave.index_add_(0, pair_group, alone)
        # Joining t: the bytes of its keys no group of t holds.
        new_bytes = (count.view(num_keys, m) == 0).to(torch.int64) * key_bytes[:, None]
        join = torch.zeros(num_groups, m, dtype=torch.int64, device=group.device)
        join.index_add_(0, pair_group, new_bytes.index_select(0, key))
        gain = leave[:, None] - join
        gain.scatter_(1, bins[:, None], 0)  # staying gains nothing
        best_gain, target = gain.max(1)  # ties: the lowest bin
        order = torch.sort(-best_gain, stable=True).indices
        movers = order[: int((best_gain > 0).sum())].tolist()
        if not movers:
            break
        load = torch.bincount(bins, weights=size, minlength=m).to(torch.int64).tolist()
        bin_list, target_list = bins.tolist(), target.tolist()
        for g in movers:
            t = target_list[g]
            if load[t] + size_list[g] <= capacity:
                load[t] += size_list[g]
                load[bin_list[g]] -= size_list[g]
                bin_list[g] = t
        bins = torch.tensor(bin_list, dtype=torch.int64, device=group.device)
    return bins


class KeyPasses(NamedTuple):
    """The two passes over every key, as kernels with the contracts of the ops
    `recxla::cluster_feature_gains` and `recxla::cluster_bag_signatures` (csrc/cluster.cpp)."""

    feature_gains: Callable  # (values, feature_offsets list, B, M) -> int64 [F]
    bag_signatures: Callable  # (values, offsets int64 [L + 1]) -> (min_hash, fingerprint)
