"""Key-centric sample clustering: order a batch's samples so that micro-batches share keys.

A training step looks up and communicates each embedding key once per micro-batch (dedup), so
the bytes on the wire follow the sum over micro-batches of their unique keys. A random split
copies every key that several samples share into up to M micro-batches; samples of one request
share all their user-side keys (user id, history, attributes), so keeping them together leaves
one copy. `cluster_samples` finds such groups from the keys alone, with no request ids.

Algorithm (hashes, scans and sorts: O(N log N) for N keys, plain torch, CPU or GPU):
1. Score each feature by what clustering can save on it: a key held by c samples costs about
   min(c, M) micro-batch copies under a random split and ceil(c * M / B) when its samples are
   contiguous; the score is key_bytes[f] times the sum of the difference over its keys,
   estimated on a hash sample of the keys with a counting table (no sort of the keys). Features
   with few values (every micro-batch holds all of them anyway) or only one-off keys score ~0;
   those whose keys repeat over a few samples (a user's history) score highest.
2. Two signatures of every bag of the best `SORT_FEATURES` features, from a 64-bit hash of its
   keys: the min-hash (the smallest hash; bags that overlap share it with probability equal to
   their Jaccard similarity, so users with similar histories come close) and the fingerprint
   (the sum of a nonlinear mix of the hashes: equal bags, e.g. the samples of one request,
   tie exactly, different ones but with probability about 2**-64), packed into one int64
   sort key.
3. Sort the samples by the key of the best feature, ties by the next (stable sorts; ties keep
   batch order). Runs of samples with equal best-feature key are groups (a user's requests).
4. Re-pack the groups (`refine_bins`): the sorted order's M chunks give each group a bin;
   then a few rounds move whole groups to the bin that already holds most of their keys of
   the best `REFINE_FEATURES` features (gain: bytes of keys only they hold in their bin,
   minus bytes of keys new to the target),
   best gains first, each bin kept within 1/32 of B / M. The order is by bin, groups inside a
   bin in sorted order, cut into M chunks of floor(B / M) or ceil(B / M) (a cut splits at
   most one group).
Why step 4: sorting alone keeps users whole (within 1% of grouping by the true user id, an
oracle the keys do not reveal), but stops at 40% fewer keys than a random split at M = 4;
what remains is item-side keys (items, their attributes and categories, popular history
items) that several requests share. Moving groups puts requests that share them in one
micro-batch: 41% fewer (every batch above 40%). Cost: a sort of the distinct (key, group)
pairs of the best features, with a bag equal to the one before it in its group read once
(a user-side bag once per group) and keys only one group holds dropped (they never change a
gain), then per round a few linear passes over those pairs plus a loop over the groups that
gain (a few hundred): O(N log N). About 23 ms for batch 8192 (700,000 ids) on one CPU
thread, most of it linear passes over all ids (hash, gain table, fingerprints, min-hash).
"""

from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:  # torchrec is imported on first use: `import recxla` stays light
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# Features whose signatures form the sort key; later ones only order samples that tie on
# the earlier ones, so more passes cost time and gain little.
SORT_FEATURES = 2
_HASH_SALT = 0x5EED_C1A5_D1CE_F00D
_LOW32 = (1 << 32) - 1
# Features are scored on a hash sample of their keys of about this many values.
SAMPLE_VALUES = 8192
_HASH_MULTIPLIER = 0x2545F4914F6CDD1D  # odd: multiplication by it is a bijection mod 2**64
_MIX_MULTIPLIER = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as an int64, odd
EMPTY_SIGNATURE = torch.iinfo(torch.int64).max
# Rounds of moving whole groups between micro-batches (see refine_bins), and how far above
# ceil(B / M) a micro-batch may grow: B / (M * BALANCE_SLACK) samples.
REFINE_ROUNDS = 4
# Features whose keys the moves count: the ones with the largest clustering gain. Counting all
# 26 of the default profile adds 0.2 points to the 41% and makes the whole call 1.4x slower;
# 4 lose 0.1 point, and some batches fall to 40.3%.
REFINE_FEATURES = 6
BALANCE_SLACK = 32
WEIGHT_SCALE = 1 << 20


def _check_kjt(kjt, op: str) -> "KeyedJaggedTensor":
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(kjt, KeyedJaggedTensor):
        raise ValueError(
            f"{op}: kjt must be a torchrec KeyedJaggedTensor, got {type(kjt).__name__}"
        )
    if kjt.variable_stride_per_key():
        raise ValueError(f"{op}: kjt must have one batch size for every key (no variable stride)")
    return kjt


def _check_num_micro_batches(num_micro_batches, batch_size: int, op: str) -> int:
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


def _feature_slices(kjt: "KeyedJaggedTensor", hashed: bool = False):
    """(lengths [B] int64, values [N_f] int64) of every feature, as views; with hashed=True the
    values are replaced by their `key_hash` (one pass over all features)."""
    lengths = kjt.lengths().to(torch.int64)
    batch = kjt.stride()
    starts = [0]
    for n in kjt.length_per_key():
        starts.append(starts[-1] + n)
    values = kjt.values()[: starts[-1]].to(torch.int64)
    if hashed:
        values = key_hash(values)
    return [
        (lengths[f * batch:(f + 1) * batch], values[starts[f]:starts[f + 1]])
        for f in range(len(starts) - 1)
    ]


def key_hash(values: torch.Tensor) -> torch.Tensor:
    """A bijection of int64 keys that scatters them: (key ^ salt) * odd constant mod 2**64.

    Two operations. Ids are often dense or sorted by popularity; hashed, the minimum over a
    bag is a min-hash and the top bits index a counting table. One function serves every
    feature: signatures and counts are only ever compared within a feature.
    """
    return (values ^ _HASH_SALT).mul_(_HASH_MULTIPLIER)


def sample_bits(num_values: int) -> int:
    """log2 of the key sampling rate R of a feature with N values: R >= N / SAMPLE_VALUES."""
    return (max(num_values - 1, 0) // SAMPLE_VALUES).bit_length()


def table_bits(num_values: int) -> int:
    """log2 of a counting table for N values: the power of two in [N, 2N) (at least 2 slots)."""
    return max(1, (num_values - 1).bit_length())


def clustering_gains(
    hashes, weights: torch.Tensor, batch_size: int, num_micro_batches: int
) -> torch.Tensor:
    """What clustering can save on each feature: float64 [F] on CPU, in bytes.

    hashes: `key_hash` of the values of every feature (int64 [N_f] each); weights: bytes per
    key of each feature, float64 [F].
    A key seen c times costs about min(c, M) micro-batch copies when samples are split at
    random and ceil(c * M / B) when its samples are contiguous; the gain of a feature is the
    sum of the difference over its keys, times its bytes per key.
    Estimated in linear time, with no sort: a feature keeps the keys whose hash has its top
    log2(R) bits zero (about 1/R of its keys, with all their occurrences, R chosen so that
    about SAMPLE_VALUES values remain) and counts them in a table indexed by the next bits;
    the sum is scaled by R. Keys sharing a slot count as one. The score only ranks features,
    so an estimate within a few percent does.
    """
    num_features = len(hashes)
    m, b = num_micro_batches, batch_size
    gains = torch.zeros(num_features, dtype=torch.float64)
    if m == 1:
        return gains
    # Every value's slot, written in place into one buffer: feature f owns 2**bits + 2 slots
    # from bounds[f], the first and last for the values of unsampled keys (dropped below).
    total = sum(h.numel() for h in hashes)
    slots = torch.empty(total, dtype=torch.int64, device=hashes[0].device)
    bounds, rates, pos = [0], [], 0
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
        rates.append(float(1 << r_bits))
    counts = torch.bincount(slots, minlength=bounds[-1])
    c = torch.arange(b + 1, device=counts.device)
    gain_of_count = c.clamp(max=m) - (c * m + b - 1) // b
    saved = gain_of_count.index_select(0, counts.clamp(max=b))
    ends = torch.tensor(bounds[1:], device=saved.device) - 1  # each feature's last slot
    dropped = torch.tensor(bounds[:-1], device=saved.device)  # and its first
    saved = saved.index_fill_(0, torch.cat([dropped, ends]), 0).cumsum(0)
    per_feature = saved.index_select(0, ends).cpu()
    per_feature = per_feature.diff(prepend=torch.zeros(1, dtype=per_feature.dtype))
    return per_feature.to(torch.float64) * torch.tensor(rates, dtype=torch.float64) * weights


def fingerprint_mix(hashes: torch.Tensor) -> torch.Tensor:
    """What a fingerprint sums for each key hash h, int64 like `hashes`:
    x = (h ^ (h >> 29)) * odd constant mod 2**64, then x ^ (x >> 32).

    `key_hash` is nearly linear in small keys (key ^ salt only flips low bits), so a plain sum
    of hashes ties bags like {0, 3} and {1, 2}; one fold and multiplication still tied some
    bags of four small keys; with the second fold none of 300,000 random small-key bags tie.
    """
    mixed = hashes >> 29
    mixed.bitwise_xor_(hashes).mul_(_MIX_MULTIPLIER)
    return mixed.bitwise_xor_(mixed >> 32)


def bag_fingerprints(lengths: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of `fingerprint_mix` over each bag's hashes, int64 [L] for lengths
    int64 [L] and hashes int64 [N] (N = lengths.sum()): equal exactly for equal bags (as
    multisets), different otherwise but with probability about 2**-64. Differences of a
    running sum (wrapping mod 2**64, like the sum itself): one scan, no scatter, so every
    feature of a batch costs one call."""
    ends = lengths.cumsum(0)
    running = torch.empty(hashes.numel() + 1, dtype=torch.int64, device=hashes.device)
    running[0] = 0
    torch.cumsum(fingerprint_mix(hashes), 0, out=running[1:])
    return running.index_select(0, ends) - running.index_select(0, ends - lengths)


def bag_signatures(lengths: torch.Tensor, hashes: torch.Tensor):
    """Two signatures of every bag, int64 [B] each, from the `key_hash` of its keys.

    min_hash: the smallest hash (EMPTY_SIGNATURE for an empty bag). Bags that overlap share
        it with probability equal to their Jaccard similarity.
    fingerprint: `bag_fingerprints`.
    lengths: int64 [B] bag lengths; hashes: int64 [N].
    """
    return bag_min_hash(lengths, hashes), bag_fingerprints(lengths, hashes)


def bag_min_hash(lengths: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The min_hash of `bag_signatures`: int64 [B]."""
    batch = lengths.numel()
    owner = torch.repeat_interleave(
        torch.arange(batch, device=hashes.device), lengths, output_size=hashes.numel()
    )
    min_hash = torch.full((batch,), EMPTY_SIGNATURE, dtype=torch.int64, device=hashes.device)
    return min_hash.scatter_reduce_(0, owner, hashes, reduce="amin", include_self=True)


def bag_sort_key(lengths: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """One int64 [B] key that orders bags by min-hash, then by fingerprint.

    The top 32 bits of the min-hash above the top 32 bits of the fingerprint: one sort instead
    of two. It differs from the exact pair order only where two bags agree on 32 bits of a
    hash and not on all 64 (about 2**-32 per pair of bags), which moves a sample, not a group.
    """
    return signature_sort_key(*bag_signatures(lengths, hashes))


def signature_sort_key(min_hash: torch.Tensor, fingerprint: torch.Tensor) -> torch.Tensor:
    """`bag_sort_key` from the two signatures of `bag_signatures`."""
    return (min_hash & ~_LOW32) | ((fingerprint >> 32) & _LOW32)


def balanced_offsets(batch_size: int, num_micro_batches: int, device=None) -> torch.Tensor:
    """Micro-batch bounds: int64 [M + 1], sizes floor(B / M) or ceil(B / M)."""
    m = torch.arange(num_micro_batches + 1, dtype=torch.int64, device=device)
    return m * batch_size // num_micro_batches


def cluster_samples(
    kjt: "KeyedJaggedTensor", num_micro_batches: int, key_bytes=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Order a batch's samples into micro-batches that share embedding keys.

    Args:
        kjt: the batch's sparse features, F keys of B samples each (CPU or CUDA).
        num_micro_batches: M, 1 <= M <= B.
        key_bytes: bytes a key of each feature costs on the wire (e.g. its embedding row's
            bytes): None (1 per key), F numbers in key order, or a dict {feature: bytes}.
    Returns:
        permutation: int64 [B] on kjt's device; micro-batch j holds samples
            permutation[offsets[j]:offsets[j + 1]].
        offsets: int64 [M + 1], offsets[0] = 0, offsets[M] = B; sizes differ by at most one.
    The algorithm is in this module's docstring; `micro_batch_unique_keys` measures the result.
    """
    op = "recxla.cluster_samples"
    kjt = _check_kjt(kjt, op)
    batch = kjt.stride()
    num_micro_batches = _check_num_micro_batches(num_micro_batches, batch, op)
    weights = key_bytes_tensor(kjt, key_bytes, op)
    device = kjt.values().device
    offsets = balanced_offsets(batch, num_micro_batches, device)
    perm = torch.arange(batch, dtype=torch.int64, device=device)
    if num_micro_batches == 1 or num_micro_batches == batch or not kjt.keys():
        return perm, offsets  # every order costs the same
    slices = _feature_slices(kjt, hashed=True)
    hashes = [h for _, h in slices]
    gains = clustering_gains(hashes, weights, batch, num_micro_batches).tolist()
    # The features that clustering can save most on, best first: the first SORT_FEATURES
    # order the samples, the first REFINE_FEATURES guide the group moves.
    ranked = [f for _, f in sorted((-g, f) for f, g in enumerate(gains) if g > 0)]
    ranked = ranked[:max(SORT_FEATURES, REFINE_FEATURES)]
    if not ranked:
        return perm, offsets
    # Fingerprints of every bag of those features in one scan: [R, B].
    lengths = torch.cat([slices[f][0] for f in ranked])
    ranked_hashes = torch.cat([hashes[f] for f in ranked])
    fingerprints = bag_fingerprints(lengths, ranked_hashes).view(len(ranked), batch)
    # Lexicographic order over the best features: stable sorts, least significant key first.
    primary = None
    for i in reversed(range(min(SORT_FEATURES, len(ranked)))):
        min_hash = bag_min_hash(*slices[ranked[i]])
        sort_key = signature_sort_key(min_hash, fingerprints[i])
        primary, order = torch.sort(sort_key.index_select(0, perm), stable=True)
        perm = perm.index_select(0, order)
    # Groups: runs of samples that tie on the best feature's signature (a user's requests).
    start = torch.ones(batch, dtype=torch.bool, device=device)
    start[1:] = primary[1:] != primary[:-1]
    group_in_order = start.cumsum(0) - 1
    group = torch.empty_like(group_in_order).index_copy_(0, perm, group_in_order)
    int_weights = integer_weights(weights)
    refine = ranked[:REFINE_FEATURES]
    bins = refine_bins(
        (lengths, ranked_hashes, fingerprints[:len(refine)]), perm, start, group, group_in_order,
        [int_weights[f] for f in refine], num_micro_batches,
    )
    perm = perm.index_select(0, torch.sort(bins.index_select(0, group_in_order), stable=True).indices)
    return perm, offsets


def integer_weights(weights: torch.Tensor) -> list:
    """Bytes per key as ints (the largest is WEIGHT_SCALE), so that gains sum exactly and the
    order of summation cannot change a decision."""
    top = float(weights.max()) if weights.numel() else 0.0
    if top <= 0:
        return [0] * weights.numel()
    return torch.round(weights / top * WEIGHT_SCALE).to(torch.int64).tolist()


def group_key_pairs(bags, perm, start, group, weights: list, group_bits: int):
    """The distinct (key, group) pairs of every weighted feature whose key more than one group
    holds: (key ids int64 [P], groups int64 [P], bytes per pair int64 [P], number of key ids).

    bags: (lengths int64 [F * B], key hashes int64 [N], fingerprints int64 [F, B]) of all
    features, feature-major; perm: the sorted order, int64 [B]; start: bool [B], True where a
    group starts in it; group: int64 [B], each sample's group (< 2**group_bits).
    A key is (feature, top 64 - group_bits - feature_bits bits of its hash): the three fit one
    int64, so one sort of all features finds the distinct pairs (a hash collision merges two
    keys: a cost estimate, not a result, changes).
    A bag equal (same fingerprint) to the bag of the sample before it in its group adds no
    pair: only the other bags' values are gathered (one bag per group of a user-side feature,
    a tenth of the ids). A key only one group holds adds the same bytes to the gain of leaving
    its bin as it costs in any target (it is new there): it never changes a gain, so its pair
    is dropped, which leaves the move rounds a third of the pairs.
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

    A group in bin b moving to bin t saves the bytes of its keys that no other group of b holds
    and costs those of its keys that no group of t holds. Each round computes that gain for
    every group and bin at once, then moves groups in order of falling gain (ties: lower group
    id) while the target bin stays within ceil(B / M) + B / (M * BALANCE_SLACK) samples; later
    moves use gains of the round's start. The final cut at balanced offsets splits at most one
    group per cut.
    bags: (lengths, hashes, fingerprints) of the features counted, as in `group_key_pairs`;
    weights: their integer bytes per key; perm, start, group: the sorted order, its group
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


def permute_samples(kjt: "KeyedJaggedTensor", permutation: torch.Tensor) -> "KeyedJaggedTensor":
    """The batch with its samples in `permutation` order: sample j of the result is sample
    permutation[j] of kjt, in every feature (lengths, values and weights move together).

    kjt: F keys of B samples each; permutation: int64 [B], a permutation of range(B), on kjt's
    device. Returns a KeyedJaggedTensor with the same keys, lengths' dtype and values' dtype.
    Dense features and labels are plain [B, ...] tensors: index them with `permutation`.
    One gather of the values (a jagged index_select per feature, all features at once): O(N).
    """
    op = "recxla.clustering.permute_samples"
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = _check_kjt(kjt, op)
    batch = kjt.stride()
    device = kjt.values().device
    if not isinstance(permutation, torch.Tensor) or permutation.dtype != torch.int64:
        raise TypeError(f"{op}: permutation must be an int64 tensor")
    if permutation.shape != (batch,):
        raise ValueError(
            f"{op}: permutation must have shape ({batch},), got {tuple(permutation.shape)}"
        )
    permutation = permutation.to(device)
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


def random_split(
    batch_size: int, num_micro_batches: int, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The baseline: a random permutation cut into balanced micro-batches (CPU tensors)."""
    op = "recxla.clustering.random_split"
    num_micro_batches = _check_num_micro_batches(num_micro_batches, batch_size, op)
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
    kjt = _check_kjt(kjt, op)
    batch = kjt.stride()
    weights = key_bytes_tensor(kjt, key_bytes, op)
    device = kjt.values().device
    permutation = torch.as_tensor(permutation, device=device).to(torch.int64)
    offsets = torch.as_tensor(offsets, device=device).to(torch.int64)
    if permutation.shape != (batch,):
        raise ValueError(
            f"{op}: permutation must have shape ({batch},), got {tuple(permutation.shape)}"
        )
    num_mb = offsets.numel() - 1
    bad = num_mb < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != batch
    if bad or bool((offsets.diff() < 0).any()):
        raise ValueError(f"{op}: offsets must rise from 0 to {batch}, got {offsets.tolist()}")
    # Micro-batch of every sample: position in the permutation -> chunk.
    position = torch.empty_like(permutation)
    position[permutation] = torch.arange(batch, device=device)
    sample_mb = torch.searchsorted(offsets[1:], position, right=True)
    total = torch.zeros(num_mb, dtype=torch.float64, device=device)
    for f, (lengths, values) in enumerate(_feature_slices(kjt)):
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
