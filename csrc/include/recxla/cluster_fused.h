// Key-centric sample clustering, "fused" GPU variant: the per-thread steps of the whole order of
// one batch, written once for the CUDA kernels (csrc/cuda/cluster_fused.cu) and for their host
// run (csrc/cpu/cluster_fused.cpp), which executes every step serially over the same index
// space so that CPU tests check these bodies bit for bit against the CPU kernel. The result is
// the reference's (recxla/reference/cluster.py) and the CPU kernel's (csrc/cpu/cluster_order.cpp,
// cluster_refine.cpp); this file reuses their names.
//
// Why this shape: on a GPU the old path was bound by ~400 launches and ~60 host syncs, not by
// work (docs/clustering.md). Here every step is one launch over a flat index space, sizes that
// only the device knows (groups, pairs, keys, movers) stay on the device, and bounds known to
// the host size the buffers, so the only sync is the one that checks the lengths.
// Steps that cooperate across threads (scans, sorts, the per-group warp sums, the single-block
// move loop) are backend primitives. The pair steps are in cluster_fused_pairs.h, the rounds'
// pieces in cluster_fused_rounds.h, the host code of a call in cluster_fused_run.h.
// Atomics: on the host run they are plain read-modify-writes (it is serial). Every sum is an
// integer sum, so the order in which threads add cannot change a decision.
#pragma once

#include <cstdint>

#include "recxla/cluster.h"

namespace recxla {
namespace cluster {
namespace fused {

static_assert(kSortFeatures == 2, "SortRecord holds the keys of exactly two sort features");
constexpr int kMaxRanked = kSortFeatures > kRefineFeatures ? kSortFeatures : kRefineFeatures;
// Every feature's counting table of the scoring pass fits 2**13 slots (cluster.h, table_bits),
// so feature f owns slots [f * kTableSlots, (f + 1) * kTableSlots): no offsets to compute.
constexpr int64_t kTableSlots = int64_t{1} << 13;
constexpr uint64_t kEmptyWord = ~uint64_t{0};  // no pair or key word has all bits set
// Threads per bag in the steps that read bags: a bag's values are split over 32 lanes (one
// warp), which add their parts into the bag's outputs with atomics. One thread walking a bag
// of 100 ids would wait on 100 dependent loads or atomics (tens of microseconds).
constexpr int64_t kLanes = 32;

// A signed min-hash as an unsigned word of the same order (the sign bit flipped), so that
// atomicMin on unsigned words takes it and an all-ones fill is the empty bag's INT64_MAX.
RECXLA_CLUSTER_HD uint64_t ordered(int64_t h) {
  return static_cast<uint64_t>(h) ^ (uint64_t{1} << 63);
}
RECXLA_CLUSTER_HD int64_t from_ordered(uint64_t x) {
  return static_cast<int64_t>(x ^ (uint64_t{1} << 63));
}

// ---------------------------------------------------------------------------------- atomics

RECXLA_CLUSTER_HD uint32_t atomic_add(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(reinterpret_cast<unsigned int*>(p), v);
#else
  const uint32_t old = *p;
  *p = old + v;
  return old;
#endif
}

RECXLA_CLUSTER_HD int32_t atomic_add(int32_t* p, int32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(reinterpret_cast<int*>(p), v);
#else
  const int32_t old = *p;
  *p = old + v;
  return old;
#endif
}

// Two's complement: an unsigned 64-bit add is the signed add, wrapping like the CPU's sums.
RECXLA_CLUSTER_HD void atomic_add(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#else
  *p += v;
#endif
}

RECXLA_CLUSTER_HD void atomic_add(int64_t* p, int64_t v) {
  atomic_add(reinterpret_cast<uint64_t*>(p), static_cast<uint64_t>(v));
}

RECXLA_CLUSTER_HD int64_t atomic_fetch_add(int64_t* p, int64_t v) {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(atomicAdd(
      reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v)));
#else
  const int64_t old = *p;
  *p = old + v;
  return old;
#endif
}

RECXLA_CLUSTER_HD void atomic_min(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  atomicMin(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#else
  if (v < *p) *p = v;
#endif
}

RECXLA_CLUSTER_HD uint64_t atomic_cas(uint64_t* p, uint64_t expected, uint64_t desired) {
#if defined(__CUDA_ARCH__)
  return atomicCAS(reinterpret_cast<unsigned long long*>(p), expected, desired);
#else
  const uint64_t old = *p;
  if (old == expected) *p = desired;
  return old;
#endif
}

// ---------------------------------------------------------------------------------- records

// One row of lengths (a feature) as the CPU kernel's first scan sees it. sum wraps mod 2**64
// like the CPU's running sum; first_negative is -1 when no length is negative.
struct RowSummary {
  uint64_t sum;
  int64_t smallest, largest, first_negative, negative_value;
};

// What the host knows of each feature after the lengths' sync (copied to the device once).
struct FeatureParams {
  int64_t start, n;  // its values are values[start:start + n]
  double key_bytes;  // bytes per key, as given
  int32_t r_bits, bits;  // sampling rate and counting-table size of the scoring pass
  int32_t weight;  // integer bytes per key (reference: integer_weights)
  int32_t pad;
};

// Sizes only the device knows, zeroed before the first step.
struct Scalars {
  int32_t num_ranked, num_groups, num_keys, done;
  int32_t ranked[kMaxRanked];  // features, best first
  int32_t weight[kMaxRanked];  // their integer bytes per key
};

// A sample's sort key: the signature keys of the two best features (0 where a feature is not
// ranked, which leaves the order to the next key), then its index. A strict total order, so
// any correct sort gives the CPU kernel's order.
struct SortRecord {
  int64_t k0, k1, index;
};

RECXLA_CLUSTER_HD bool record_less(const SortRecord& a, const SortRecord& b) {
  if (a.k0 != b.k0) return a.k0 < b.k0;
  if (a.k1 != b.k1) return a.k1 < b.k1;
  return a.index < b.index;
}

// ---------------------------------------------------------------------------------- the view

// Every buffer of one call (the host carves them from one workspace) and the sizes the host
// knows. B = batch, R = rows (min(F, kMaxRanked)), T = 2**table_bits, P <= U, the values of the
// R largest features.
template <typename key_t>
struct View {
  const key_t* values;
  const FeatureParams* feature;  // [F]
  const int64_t* local;  // [F, B + 1]: each bag's first value, counted from its feature's start
  int64_t batch, m, features, rows, capacity;
  uint32_t* gain_table;  // [F, kTableSlots]
  uint64_t* saved;  // [F]: keys saved, before the sampling rate's shift
  Scalars* scalars;
  int64_t* fingerprint;  // [R, B], zeroed
  uint64_t* min_hash;  // [2, B], `ordered`, all ones (empty)
  SortRecord* records;  // [B]
  int32_t *order, *head, *group_number;  // [B] per sorted position; group_number = group + 1
  int32_t* group_first;  // [B + 1]: first position of each group, then B
  int32_t *group_size, *bins, *moved_from, *moved_round, *target;  // [B] per group
  int64_t* best_gain;  // [B]
  int table_bits;
  uint64_t *pair_words, *key_words;  // [T] each
  int32_t *pair_key_slot, *key_id;  // [T]: a pair's key slot; a key slot's shared key id
  uint32_t* key_groups;  // [T]: groups that hold each key
  int32_t* owner;  // [N]: the pair slot a value inserted first, -1 if it was there already
  // [B * R], position-major: pairs each bag adds (zeroed), their start, a cursor (zeroed)
  int64_t *bag_pairs, *bag_start, *bag_fill;
  int64_t* pair_start;  // [B + 1]: each group's first pair (pairs are grouped by group)
  int32_t *pair_key, *pair_bytes;  // [P]
  int32_t* count;  // [K, M]: groups of key k in bin t
  uint32_t* bin_key;  // [B]: the bin of each sorted position
  int64_t* sample;  // [B]: the sample at each sorted position

  RECXLA_CLUSTER_HD int64_t num_refine() const {
    const int32_t r = scalars->num_ranked;
    return r < kRefineFeatures ? r : kRefineFeatures;
  }

  // Bag (pos, i): the bag of refine row i of the sample at sorted position pos. It adds pairs
  // when row i's bytes are > 0 and the bag is its group's first or differs (by fingerprint)
  // from the bag before it. [lo, hi): its values.
  RECXLA_CLUSTER_HD bool adds_pairs(
      int64_t pos, int64_t i, int64_t& lo, int64_t& hi, int32_t& weight) const {
    if (i >= num_refine()) return false;
    weight = scalars->weight[i];
    if (weight <= 0) return false;
    const int32_t s = order[pos];
    const int64_t* fp = fingerprint + i * batch;
    if (pos > 0 && group_number[pos] == group_number[pos - 1] && fp[s] == fp[order[pos - 1]]) {
      return false;
    }
    const FeatureParams& p = feature[scalars->ranked[i]];
    const int64_t* off = local + scalars->ranked[i] * (batch + 1);
    lo = p.start + off[s];
    hi = p.start + off[s + 1];
    return true;
  }

  // Value j's pair is counted: j inserted it and its key is held by two groups or more.
  RECXLA_CLUSTER_HD bool shared_pair(int64_t j) const {
    const int32_t slot = owner[j];
    return slot >= 0 && key_groups[pair_key_slot[slot]] >= 2;
  }
};

// ---------------------------------------------------------------------------------- the steps
// Each is the body of one launch over [0, n); the comment gives n.

// n = N, every value of every feature: count the sampled keys of the scoring pass (reference:
// feature_gains). A slot's gain is summed step by step as its count grows (gain_step), so no
// second pass over the tables is needed.
template <typename key_t>
struct ScoreValues {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t i) const {
    int64_t lo = 0, hi = v.features - 1;  // the last feature starting at or before i
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (v.feature[mid].start <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const FeatureParams& p = v.feature[lo];
    const int64_t hash = key_hash(static_cast<int64_t>(v.values[i]));
    const uint64_t slot = sampled_slot(hash, p.r_bits, p.bits);
    if (slot >= (uint64_t{1} << p.bits)) return;
    const uint32_t before = atomic_add(v.gain_table + lo * kTableSlots + slot, 1u);
    const int64_t step = gain_step(before, v.batch, v.m);
    if (step != 0) atomic_add(v.saved + lo, static_cast<uint64_t>(step));
  }
};

// n = 1: the best features (reference: rank_features): gain > 0, best first, ties to the lower
// index, at most kMaxRanked; an insertion into a short sorted list.
template <typename key_t>
struct RankFeatures {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t) const {
    int32_t num = 0, ranked[kMaxRanked] = {};
    double best[kMaxRanked] = {};
    for (int64_t f = 0; f < v.features; ++f) {
      const int64_t saved = static_cast<int64_t>(v.saved[f] << v.feature[f].r_bits);
      const double gain = static_cast<double>(saved) * v.feature[f].key_bytes;
      if (!(gain > 0)) continue;
      int pos = num;
      while (pos > 0 && best[pos - 1] < gain) --pos;  // after every gain >= this one
      if (pos >= kMaxRanked) continue;
      for (int k = num < kMaxRanked ? num : kMaxRanked - 1; k > pos; --k) {
        ranked[k] = ranked[k - 1];
        best[k] = best[k - 1];
      }
      ranked[pos] = static_cast<int32_t>(f);
      best[pos] = gain;
      if (num < kMaxRanked) ++num;
    }
    v.scalars->num_ranked = num;
    for (int k = 0; k < num; ++k) {
      v.scalars->ranked[k] = ranked[k];
      v.scalars->weight[k] = v.feature[ranked[k]].weight;
    }
  }
};

// n = R * B * 32, index (i * B + s) * 32 + lane: a lane's share of the signatures of sample
// s's bag of ranked feature i (the min-hash only for the sort features).
template <typename key_t>
struct Signatures {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t t) const {
    const int64_t bag = t / kLanes, i = bag / v.batch, s = bag % v.batch;
    if (i >= v.scalars->num_ranked) return;
    const int64_t f = v.scalars->ranked[i];
    const int64_t* off = v.local + f * (v.batch + 1);
    const int64_t lo = v.feature[f].start + off[s], hi = v.feature[f].start + off[s + 1];
    if (lo + t % kLanes >= hi) return;
    int64_t smallest = kEmptySignature;
    uint64_t sum = 0;  // wraps mod 2**64, like the CPU kernel's sum
    for (int64_t j = lo + t % kLanes; j < hi; j += kLanes) {
      const int64_t h = key_hash(static_cast<int64_t>(v.values[j]));
      smallest = h < smallest ? h : smallest;
      sum += static_cast<uint64_t>(fingerprint_mix(h));
    }
    atomic_add(reinterpret_cast<uint64_t*>(v.fingerprint) + bag, sum);
    if (i < kSortFeatures) atomic_min(v.min_hash + bag, ordered(smallest));
  }
};

// n = B: sample s's sort record from the signatures of the two best features (0 for a feature
// that is not ranked).
template <typename key_t>
struct SortKeys {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t s) const {
    const int32_t num_ranked = v.scalars->num_ranked;
    int64_t key[kSortFeatures] = {0, 0};
    for (int i = 0; i < kSortFeatures && i < num_ranked; ++i) {
      const int64_t bag = i * v.batch + s;
      key[i] = signature_sort_key(from_ordered(v.min_hash[bag]), v.fingerprint[bag]);
    }
    v.records[s] = SortRecord{key[0], key[1], s};
  }
};

// n = B, over sorted positions: the sample there, and whether a group (a run of equal best
// keys) starts there.
template <typename key_t>
struct Heads {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t pos) const {
    v.order[pos] = static_cast<int32_t>(v.records[pos].index);
    v.head[pos] = pos == 0 || v.records[pos].k0 != v.records[pos - 1].k0;
  }
};

// n = B, after the inclusive sum of the heads: each group's first position, and G.
template <typename key_t>
struct GroupStarts {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t pos) const {
    const int32_t g = v.group_number[pos] - 1;
    if (v.head[pos]) v.group_first[g] = static_cast<int32_t>(pos);
    if (pos == v.batch - 1) {
      v.group_first[g + 1] = static_cast<int32_t>(v.batch);
      v.scalars->num_groups = g + 1;
    }
  }
};

// n = B (groups < G): sizes and first bins (the chunk holding the group's middle sample).
template <typename key_t>
struct InitGroups {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t g) const {
    if (g >= v.scalars->num_groups) return;
    const int32_t first = v.group_first[g], size = v.group_first[g + 1] - first;
    v.group_size[g] = size;
    v.bins[g] = static_cast<int32_t>(initial_bin(first + size / 2, v.batch, v.m));
    v.moved_round[g] = -1;
  }
};

// n = B, after the rounds: each sorted position's bin and sample, for the stable sort by bin.
template <typename key_t>
struct BinKeys {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t pos) const {
    v.bin_key[pos] = static_cast<uint32_t>(v.bins[v.group_number[pos] - 1]);
    v.sample[pos] = v.order[pos];
  }
};

// n = B: the identity (every order costs the same).
struct Iota {
  int64_t* out;
  RECXLA_CLUSTER_HD void operator()(int64_t i) const { out[i] = i; }
};

}  // namespace fused
}  // namespace cluster
}  // namespace recxla
