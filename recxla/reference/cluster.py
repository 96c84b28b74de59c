"""Reference of key-centric sample clustering (`recxla.clustering`) in plain Python.

One loop per key and per sample, Python ints for the 64-bit hashes, dicts for the counting
table and sets for unique keys: slow, but each step reads as the algorithm's description, and
it shares no code with the vectorized version beyond constants, so the tests can demand the
same permutation bit for bit.
"""

from typing import List, Sequence, Tuple

import torch

from recxla import clustering as C

_MASK64 = (1 << 64) - 1


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def key_hash_ref(key: int) -> int:
    """(key ^ salt) * odd constant mod 2**64, as a signed int64 value."""
    return _signed(((key ^ C._HASH_SALT) * C._HASH_MULTIPLIER) & _MASK64)


def _mix_ref(h: int) -> int:
    """What a bag's fingerprint sums for a key hash h (see clustering.fingerprint_mix)."""
    x = _signed(((h ^ (h >> 29)) * C._MIX_MULTIPLIER) & _MASK64)
    return x ^ (x >> 32)


def _bags(kjt) -> List[List[List[int]]]:
    """bags[f][i]: the keys of sample i in feature f, as Python ints."""
    batch = kjt.stride()
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    bags, pos = [], 0
    for f in range(len(kjt.keys())):
        feature = []
        for i in range(batch):
            n = lengths[f * batch + i]
            feature.append(values[pos:pos + n])
            pos += n
        bags.append(feature)
    return bags


def _gain_ref(hashes: Sequence[int], batch: int, m: int) -> int:
    """Sampled, slot-counted clustering gain of one feature, in keys (see clustering_gains)."""
    r_bits = C.sample_bits(len(hashes))
    kept = [h & _MASK64 for h in hashes]
    if r_bits:
        kept = [u for u in kept if u >> (64 - r_bits) == 0]
    bits = C.table_bits(max(len(hashes) >> r_bits, 1))
    counts = {}
    for u in kept:
        slot = (u >> (64 - r_bits - bits)) & ((1 << bits) - 1)
        counts[slot] = counts.get(slot, 0) + 1
    gain = 0
    for c in counts.values():
        c = min(c, batch)
        gain += min(c, m) - (c * m + batch - 1) // batch
    return gain << r_bits


def cluster_samples_ref(
    kjt, num_micro_batches: int, key_bytes=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract and result as `recxla.cluster_samples`, computed with Python loops."""
    batch = kjt.stride()
    m = num_micro_batches
    offsets = [j * batch // m for j in range(m + 1)]
    weights = C.key_bytes_tensor(kjt, key_bytes, "cluster_samples_ref").tolist()
    order = list(range(batch))
    if m == 1 or m == batch or not kjt.keys():
        return torch.tensor(order, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)
    bags = _bags(kjt)
    hashed = [[[key_hash_ref(k) for k in bag] for bag in feature] for feature in bags]
    scores = []
    for f, feature in enumerate(hashed):
        flat = [h for bag in feature for h in bag]
        gain = float(_gain_ref(flat, batch, m)) * weights[f]
        if gain > 0:
            scores.append((-gain, f))
    ranked = [f for _, f in sorted(scores)]
    sort_keys = []
    for f in ranked[: C.SORT_FEATURES]:
        # The min-hash's top 32 bits, then the fingerprint's (see clustering.bag_sort_key).
        min_hash = [min(bag) if bag else C.EMPTY_SIGNATURE for bag in hashed[f]]
        fingerprint = [_signed(sum(_mix_ref(h) for h in bag) & _MASK64) for bag in hashed[f]]
        sort_keys.append(
            [(mh & ~C._LOW32) | ((fp >> 32) & C._LOW32) for mh, fp in zip(min_hash, fingerprint)]
        )
    order.sort(key=lambda i: tuple(key[i] for key in sort_keys))
    if sort_keys:
        refine = ranked[: C.REFINE_FEATURES]
        order = _refine_ref(order, sort_keys[0], hashed, weights, refine, batch, m, offsets)
    return torch.tensor(order, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


def _refine_ref(order, primary, hashed, weights, refine, batch, m, offsets) -> List[int]:
    """Groups (runs of equal primary key in `order`) moved between bins as in
    clustering.refine_bins, one group and one key (of the features in `refine`) at a time;
    returns the new order."""
    group_of = {}
    groups = []  # groups[g]: samples of group g in order
    for pos, i in enumerate(order):
        if pos == 0 or primary[i] != primary[order[pos - 1]]:
            groups.append([])
        groups[-1].append(i)
        group_of[i] = len(groups) - 1
    num_groups = len(groups)
    sizes = [len(g) for g in groups]
    bins, first = [], 0
    for size in sizes:
        middle = first + size // 2
        bins.append(min(sum(1 for o in offsets[1:] if o <= middle), m - 1))
        first += size
    top = max(weights) if weights else 0.0
    int_w = [int(round(w / top * C.WEIGHT_SCALE)) if top > 0 else 0 for w in weights]
    # A key: its feature and the hash bits above those that hold a group and a feature id.
    bits = max(1, num_groups.bit_length()) + (len(refine) - 1).bit_length()
    holders = {}  # (feature, key) -> groups holding it
    for f in refine:
        if int_w[f] == 0:
            continue
        for i, bag in enumerate(hashed[f]):
            for h in bag:
                holders.setdefault((f, h >> bits), set()).add(group_of[i])
    keys_of = [[] for _ in range(num_groups)]
    for key, gs in holders.items():
        for g in gs:
            keys_of[g].append(key)
    capacity = -(-batch // m) + batch // (m * C.BALANCE_SLACK)
    for _ in range(C.REFINE_ROUNDS):
        count = {key: [0] * m for key in holders}
        for key, gs in holders.items():
            for g in gs:
                count[key][bins[g]] += 1
        best = []
        for g in range(num_groups):
            gains = []
            for t in range(m):
                gain = 0
                if t != bins[g]:
                    for key in keys_of[g]:
                        w = int_w[key[0]]
                        gain += w * ((count[key][bins[g]] == 1) - (count[key][t] == 0))
                gains.append(gain)
            t_best = 0
            for t in range(1, m):
                if gains[t] > gains[t_best]:
                    t_best = t
            best.append((gains[t_best], t_best))
        movers = sorted((g for g in range(num_groups) if best[g][0] > 0), key=lambda g: -best[g][0])
        if not movers:
            break
        load = [0] * m
        for g in range(num_groups):
            load[bins[g]] += sizes[g]
        for g in movers:
            t = best[g][1]
            if load[t] + sizes[g] <= capacity:
                load[t] += sizes[g]
                load[bins[g]] -= sizes[g]
                bins[g] = t
    return sorted(order, key=lambda i: bins[group_of[i]])


def micro_batch_unique_keys_ref(kjt, permutation, offsets, key_bytes=None) -> torch.Tensor:
    """float64 [M]: per micro-batch, the sum over features of key_bytes[f] * |unique keys|."""
    weights = C.key_bytes_tensor(kjt, key_bytes, "micro_batch_unique_keys_ref").tolist()
    bags = _bags(kjt)
    perm = [int(p) for p in permutation]
    offsets = [int(o) for o in offsets]
    out = []
    for j in range(len(offsets) - 1):
        samples = perm[offsets[j]:offsets[j + 1]]
        total = 0.0
        for f, feature in enumerate(bags):
            unique = set()
            for i in samples:
                unique.update(feature[i])
            total += weights[f] * len(unique)
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)
