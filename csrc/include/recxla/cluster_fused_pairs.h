// Key-centric sample clustering, "fused" GPU variant: the steps that find the (key, group)
// pairs the move rounds count (reference: group_key_pairs; CPU: collect_pairs in
// csrc/cpu/cluster_refine.cpp), shared by the CUDA kernels and their host run.
//
// The CPU kernel walks the bags in sorted order with one hash table per feature; here every
// bag's values are spread over 32 lanes at once, so the distinct pairs come from one shared
// open-addressing table of pair words (feature, key, group in 64 bits, as the reference packs
// them) instead:
// 1. insert: each value's pair word goes into the pair table; the value that inserts a word
//    owns that pair and counts one more group for its key in the key table;
// 2. key ids: keys of two groups or more are numbered (keys of one group never change a gain);
// 3. count, exclusive sum, emit: each bag counts the shared pairs it owns, a position-major
//    sum gives each bag its first pair, and groups (runs of positions) get contiguous pairs:
//    the per-group layout the rounds read, without a sort.
// Which value owns a pair, the keys' numbers and the order of pairs inside a bag change with
// the threads' timing; the set of pairs and every count do not, and the rounds only count and
// sum over them (integers), so the result does not change.
#pragma once

#include <cstdint>

#include "recxla/cluster.h"
#include "recxla/cluster_fused.h"

namespace recxla {
namespace cluster {
namespace fused {

// Bits of a pair word (reference: group_key_pairs): [key: 64 - shift][row: feature_bits]
// [group: group_bits]. A key is its hash's top 64 - shift bits, so two ids share a key exactly
// when the CPU kernel's hash >> shift does.
struct PairLayout {
  int group_bits, shift;
};

RECXLA_CLUSTER_HD PairLayout pair_layout(int64_t num_groups, int64_t num_refine) {
  const int g = bit_length(static_cast<uint64_t>(num_groups));
  const int group_bits = g > 1 ? g : 1;
  const int feature_bits =
      num_refine > 0 ? bit_length(static_cast<uint64_t>(num_refine - 1)) : 0;
  return {group_bits, group_bits + feature_bits};
}

// Finds or inserts `word` in an open-addressing table of 2**bits slots (linear probing from a
// multiplicative hash); `inserted` says whether this call put it there. The table never fills:
// it has more slots than words are ever inserted (the host sizes it).
RECXLA_CLUSTER_HD int64_t table_insert(uint64_t* table, int bits, uint64_t word, bool& inserted) {
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  uint64_t i = (word * kMixMultiplier) >> (64 - bits);
  while (true) {
    const uint64_t prev = atomic_cas(table + i, kEmptyWord, word);
    if (prev == kEmptyWord || prev == word) {
      inserted = prev == kEmptyWord;
      return static_cast<int64_t>(i);
    }
    i = (i + 1) & mask;
  }
}

// n = B * R * 32, index (pos * R + i) * 32 + lane: insert a lane's share of the (key, group)
// pairs of bag (pos, i) into the pair table; a pair's first inserter counts a group for its key
// and owns the pair.
template <typename key_t>
struct InsertPairs {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t t) const {
    const int64_t bag = t / kLanes, pos = bag / v.rows, i = bag % v.rows;
    int64_t lo = 0, hi = 0;
    int32_t weight = 0;
    if (!v.adds_pairs(pos, i, lo, hi, weight)) return;
    const PairLayout layout = pair_layout(v.scalars->num_groups, v.num_refine());
    const uint64_t tag = (static_cast<uint64_t>(i) << layout.group_bits) |
                         static_cast<uint64_t>(v.group_number[pos] - 1);
    for (int64_t j = lo + t % kLanes; j < hi; j += kLanes) {
      const uint64_t hash = static_cast<uint64_t>(key_hash(static_cast<int64_t>(v.values[j])));
      const uint64_t word = (hash >> layout.shift << layout.shift) | tag;
      bool inserted = false;
      const int64_t slot = table_insert(v.pair_words, v.table_bits, word, inserted);
      if (!inserted) {
        v.owner[j] = -1;
        continue;
      }
      v.owner[j] = static_cast<int32_t>(slot);
      bool new_key = false;
      const int64_t key_slot =
          table_insert(v.key_words, v.table_bits, word >> layout.group_bits, new_key);
      atomic_add(v.key_groups + key_slot, 1u);
      v.pair_key_slot[slot] = static_cast<int32_t>(key_slot);
    }
  }
};

// n = T, over key slots: number the keys of two groups or more 0..K-1 (in any order: results
// only count and sum over keys) and zero their count rows (`count` null: the host zeroes them).
template <typename key_t>
struct KeyIds {
  View<key_t> v;
  int32_t* count;
  RECXLA_CLUSTER_HD void operator()(int64_t slot) const {
    if (v.key_groups[slot] < 2) return;
    const int32_t id = atomic_add(&v.scalars->num_keys, 1);
    v.key_id[slot] = id;
    if (count == nullptr) return;
    for (int64_t t = 0; t < v.m; ++t) count[id * v.m + t] = 0;
  }
};

// n = B * R * 32: the pairs each bag adds (a position-major exclusive sum then gives each its
// start, grouped by group: groups are runs of positions).
template <typename key_t>
struct CountPairs {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t t) const {
    const int64_t bag = t / kLanes;
    int64_t lo = 0, hi = 0, n = 0;
    int32_t weight = 0;
    if (!v.adds_pairs(bag / v.rows, bag % v.rows, lo, hi, weight)) return;
    for (int64_t j = lo + t % kLanes; j < hi; j += kLanes) n += v.shared_pair(j) ? 1 : 0;
    if (n != 0) atomic_add(v.bag_pairs + bag, n);
  }
};

// n = B * R * 32: write each bag's pairs (key id, bytes; in any order inside the bag: only
// their sums matter) and count them in their group's first bin; each group's first pair, and
// the total.
template <typename key_t>
struct EmitPairs {
  View<key_t> v;
  RECXLA_CLUSTER_HD void operator()(int64_t t) const {
    const int64_t bag = t / kLanes, pos = bag / v.rows, i = bag % v.rows, lane = t % kLanes;
    const int32_t g = v.group_number[pos] - 1;
    if (lane == 0 && i == 0 && v.head[pos]) v.pair_start[g] = v.bag_start[bag];
    if (lane == 0 && bag == v.batch * v.rows - 1) {
      v.pair_start[v.scalars->num_groups] = v.bag_start[bag] + v.bag_pairs[bag];
    }
    int64_t lo = 0, hi = 0;
    int32_t weight = 0;
    if (!v.adds_pairs(pos, i, lo, hi, weight)) return;
    const int64_t bin = v.bins[g];
    for (int64_t j = lo + lane; j < hi; j += kLanes) {
      if (!v.shared_pair(j)) continue;
      const int64_t p = v.bag_start[bag] + atomic_fetch_add(v.bag_fill + bag, 1);
      const int32_t k = v.key_id[v.pair_key_slot[v.owner[j]]];
      v.pair_key[p] = k;
      v.pair_bytes[p] = weight;
      atomic_add(v.count + k * v.m + bin, 1);
    }
  }
};

}  // namespace fused
}  // namespace cluster
}  // namespace recxla
