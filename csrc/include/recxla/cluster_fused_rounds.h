// Key-centric sample clustering, "fused" GPU variant: the move rounds (reference: refine_bins;
// CPU: csrc/cpu/cluster_refine.cpp), as pieces shared by the CUDA kernels and their host run.
//
// A round is three launches and no host sync:
// 1. gains: one warp per group sums, over the group's pairs, the bytes it would save by leaving
//    its bin and pay by joining each other bin, and picks the best target (lanes take every
//    32nd pair; `partial_join` is one lane's share). Up to 32 bins the joins are per-lane
//    registers summed across the warp; beyond, each lane owns bins and walks all pairs.
// 2. moves: one thread block. It sums the bins' loads, gathers the movers (best gain > 0),
//    sorts them by falling gain (ties: lower group) with a bitonic network, gathers each
//    mover's (target, size, bin), and then one thread applies them in order under the capacity
//    rule. That last loop is sequential by nature; it reads only shared memory (and registers
//    for the loads up to 8 bins), so a mover costs tens of cycles. Each block-wide phase is a
//    function of (thread, threads): the kernel runs it between barriers, the host run runs it
//    for every thread in turn, which is the same computation.
// 3. update: the groups that moved take their pairs out of the old bin's counts and into the
//    new one's, so the [K, M] count table never has to be rebuilt.
// A round with no mover sets `done`, and later rounds return at once (the CPU kernel breaks).
#pragma once

#include <cstdint>

#include "recxla/cluster.h"
#include "recxla/cluster_fused.h"

#if defined(__CUDACC__)
#define RECXLA_CLUSTER_UNROLL _Pragma("unroll")
#define RECXLA_CLUSTER_UNROLL_4 _Pragma("unroll 4")
#else
#define RECXLA_CLUSTER_UNROLL
#define RECXLA_CLUSTER_UNROLL_4
#endif

namespace recxla {
namespace cluster {
namespace fused {

struct RoundView {
  const int64_t* pair_start;  // [G + 1]
  const int32_t *pair_key, *pair_bytes;  // [P]
  int32_t* count;  // [K, M]
  int32_t *bins, *moved_from, *moved_round, *target;  // [G]
  const int32_t* group_size;  // [G]
  int64_t* best_gain;  // [G]
  Scalars* scalars;
  int64_t m, capacity;
};

// ---------------------------------------------------------------------------------- gains

// One lane's share of group g's sums (pairs lane, lane + lanes, ...): leave += the bytes of
// keys no other group of bin b holds; join[t] += those of keys no group of bin t holds, for
// t < min(M, kBins).
template <int kBins>
RECXLA_CLUSTER_HD void partial_join(
    const RoundView& v, int64_t g, int32_t b, int lane, int lanes, int64_t& leave, int64_t* join) {
  // Unrolled so that a lane's loads of 4 pairs (key, then its count row) are in flight at
  // once: the largest group of the bench's batch has ~1400 pairs, ~44 per lane.
  RECXLA_CLUSTER_UNROLL_4
  for (int64_t p = v.pair_start[g] + lane; p < v.pair_start[g + 1]; p += lanes) {
    const int32_t* c = v.count + v.pair_key[p] * v.m;
    const int64_t w = v.pair_bytes[p];
    leave += c[b] == 1 ? w : 0;
RECXLA_CLUSTER_UNROLL
    for (int t = 0; t < kBins; ++t) {
      if (t < v.m) join[t] += c[t] == 0 ? w : 0;
    }
  }
}

// The CPU kernel's choice from the full sums: the largest gain, ties to the lowest bin,
// staying (t == b) gains 0.
template <int kBins>
RECXLA_CLUSTER_HD void best_of_joins(
    const RoundView& v, int64_t g, int32_t b, int64_t leave, const int64_t* join) {
  int64_t best = b == 0 ? 0 : leave - join[0];
  int32_t best_t = 0;
  for (int t = 1; t < kBins && t < v.m; ++t) {
    const int64_t gain = t == b ? 0 : leave - join[t];
    if (gain > best) best = gain, best_t = t;
  }
  v.best_gain[g] = best;
  v.target[g] = best_t;
}

// More than 32 bins: one lane's share of `leave`, and the join of one bin over all pairs.
RECXLA_CLUSTER_HD int64_t partial_leave(
    const RoundView& v, int64_t g, int32_t b, int lane, int lanes) {
  int64_t leave = 0;
  RECXLA_CLUSTER_UNROLL_4
  for (int64_t p = v.pair_start[g] + lane; p < v.pair_start[g + 1]; p += lanes) {
    leave += v.count[v.pair_key[p] * v.m + b] == 1 ? v.pair_bytes[p] : 0;
  }
  return leave;
}

RECXLA_CLUSTER_HD int64_t join_of(const RoundView& v, int64_t g, int64_t t) {
  int64_t join = 0;
  for (int64_t p = v.pair_start[g]; p < v.pair_start[g + 1]; ++p) {
    join += v.count[v.pair_key[p] * v.m + t] == 0 ? v.pair_bytes[p] : 0;
  }
  return join;
}

// Keeps the better of two (gain, bin) choices: the larger gain, ties to the lower bin. A total
// order, so lanes may combine their choices in any order.
RECXLA_CLUSTER_HD void better(int64_t gain, int32_t t, int64_t& best, int32_t& best_t) {
  if (gain > best || (gain == best && t < best_t)) best = gain, best_t = t;
}

// ---------------------------------------------------------------------------------- moves

// The move block's scratch: shared memory when it fits, else global (same code: generic
// pointers). slots: a power of two >= B (movers are groups, at most B).
struct MoveScratch {
  int64_t* load;  // [M]
  int64_t* key;  // [slots]: the gain while sorting, then (target << 32 | size)
  int32_t *id, *from;  // [slots]: the group; its bin
  int32_t* count;  // [1]: movers
};

RECXLA_CLUSTER_HD int64_t padded(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

RECXLA_CLUSTER_HD int64_t move_scratch_bytes(int64_t slots, int64_t m) {
  return (8 * m + 16 * slots + 4 + 15) / 16 * 16;
}

RECXLA_CLUSTER_HD MoveScratch carve_moves(void* base, int64_t slots, int64_t m) {
  MoveScratch s;
  s.load = static_cast<int64_t*>(base);
  s.key = s.load + m;
  s.id = reinterpret_cast<int32_t*>(s.key + slots);
  s.from = s.id + slots;
  s.count = s.from + slots;
  return s;
}

RECXLA_CLUSTER_HD void moves_clear(
    const RoundView& v, const MoveScratch& s, int tid, int threads) {
  if (tid == 0) *s.count = 0;
  for (int64_t t = tid; t < v.m; t += threads) s.load[t] = 0;
}

// Loads of the bins at the round's start, and the movers in any order (the sort orders them).
RECXLA_CLUSTER_HD void moves_collect(
    const RoundView& v, const MoveScratch& s, int tid, int threads) {
  const int64_t groups = v.scalars->num_groups;
  for (int64_t g = tid; g < groups; g += threads) {
    atomic_add(s.load + v.bins[g], static_cast<int64_t>(v.group_size[g]));
    if (v.best_gain[g] > 0) {
      const int32_t r = atomic_add(s.count, 1);
      s.key[r] = v.best_gain[g];
      s.id[r] = static_cast<int32_t>(g);
    }
  }
}

// Fills [n, padded(n)) with entries that sort after every mover.
RECXLA_CLUSTER_HD void moves_pad(const MoveScratch& s, int64_t n, int tid, int threads) {
  for (int64_t r = n + tid; r < padded(n); r += threads) {
    s.key[r] = INT64_MIN;
    s.id[r] = INT32_MAX;
  }
}

// Mover a goes before mover b: the larger gain first, ties to the lower group.
RECXLA_CLUSTER_HD bool mover_before(int64_t key_a, int32_t id_a, int64_t key_b, int32_t id_b) {
  return key_a > key_b || (key_a == key_b && id_a < id_b);
}

// One pass (k, j) of a bitonic sort of [0, n_pad) into mover_before order; each pair (i, i ^ j)
// belongs to the thread that holds its lower index.
RECXLA_CLUSTER_HD void bitonic_pass(
    const MoveScratch& s, int64_t n_pad, int64_t k, int64_t j, int tid, int threads) {
  for (int64_t i = tid; i < n_pad; i += threads) {
    const int64_t l = i ^ j;
    if (l <= i) continue;
    const bool l_first = mover_before(s.key[l], s.id[l], s.key[i], s.id[i]);
    const bool i_first = mover_before(s.key[i], s.id[i], s.key[l], s.id[l]);
    if ((i & k) == 0 ? l_first : i_first) {
      const int64_t key = s.key[i];
      const int32_t id = s.id[i];
      s.key[i] = s.key[l], s.id[i] = s.id[l];
      s.key[l] = key, s.id[l] = id;
    }
  }
}

// The sorted movers' targets, sizes and bins, next to each other for the walk.
RECXLA_CLUSTER_HD void moves_gather(
    const RoundView& v, const MoveScratch& s, int64_t n, int tid, int threads) {
  for (int64_t r = tid; r < n; r += threads) {
    const int32_t g = s.id[r];
    s.key[r] = static_cast<int64_t>((static_cast<uint64_t>(v.target[g]) << 32) |
                                    static_cast<uint32_t>(v.group_size[g]));
    s.from[r] = v.bins[g];
  }
}

// Applies the movers in order (one thread): a group moves when its target stays within the
// capacity; the gains are those of the round's start. kBins > 0 (M <= kBins): the loads live
// in registers, picked with selects rather than an indexed (local-memory) array.
template <int kBins>
RECXLA_CLUSTER_HD void moves_walk(
    const RoundView& v, const MoveScratch& s, int64_t n, int32_t round) {
  int64_t reg[kBins > 0 ? kBins : 1] = {};
  if constexpr (kBins > 0) {
    for (int u = 0; u < kBins; ++u) reg[u] = u < v.m ? s.load[u] : 0;
  }
  for (int64_t r = 0; r < n; ++r) {
    const uint64_t packed = static_cast<uint64_t>(s.key[r]);
    const int32_t t = static_cast<int32_t>(packed >> 32), b = s.from[r];
    const int64_t size = static_cast<int64_t>(packed & 0xFFFFFFFFu);
    int64_t load_t = 0;
    if constexpr (kBins > 0) {
RECXLA_CLUSTER_UNROLL
      for (int u = 0; u < kBins; ++u) load_t = u == t ? reg[u] : load_t;
    } else {
      load_t = s.load[t];
    }
    if (load_t + size > v.capacity) continue;
    if constexpr (kBins > 0) {
RECXLA_CLUSTER_UNROLL
      for (int u = 0; u < kBins; ++u) reg[u] += (u == t ? size : 0) - (u == b ? size : 0);
    } else {
      s.load[t] += size;
      s.load[b] -= size;
    }
    const int32_t g = s.id[r];
    v.bins[g] = t;
    v.moved_from[g] = b;
    v.moved_round[g] = round;
  }
}

// n = B * 32, index g * 32 + lane: a group that moved this round moves its keys' counts.
struct UpdateCounts {
  RoundView v;
  int32_t round;
  RECXLA_CLUSTER_HD void operator()(int64_t t) const {
    const int64_t g = t / kLanes;
    if (v.scalars->done || g >= v.scalars->num_groups || v.moved_round[g] != round) return;
    const int64_t from = v.moved_from[g], to = v.bins[g];
    for (int64_t p = v.pair_start[g] + t % kLanes; p < v.pair_start[g + 1]; p += kLanes) {
      int32_t* c = v.count + v.pair_key[p] * v.m;
      atomic_add(c + from, -1);
      atomic_add(c + to, 1);
    }
  }
};

}  // namespace fused
}  // namespace cluster
}  // namespace recxla
