// Key-centric sample clustering on CPU: moving whole groups between micro-batches (the
// reference's group_key_pairs and refine_bins, recxla/reference/cluster.py, bit for bit).
//
// Pairs: the distinct (key, group) pairs of the refine features, a key being (feature, its
// hash >> (group_bits + feature_bits)) as in the reference. A bag whose fingerprint equals that
// of the bag before it in its group adds nothing (a user-side bag is read once per group). Bags
// are read in sorted order, so the groups of a key arrive in non-decreasing order: a pair is new
// iff its group differs from the last group seen with that key, and one hash table per feature
// replaces the reference's sort and unique. Keys of a single group never change a gain and are
// dropped.
// Rounds: each walks the pairs group by group (CSR) and sums a group's leave and join bytes in
// registers, then applies the moves in order of falling gain, as the reference does.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cluster_cpu.h"
#include "recxla/cluster.h"

namespace recxla {
namespace cluster_cpu {
namespace {

constexpr uint64_t kEmptySlot = std::numeric_limits<uint64_t>::max();  // keys are < 2**63

// One key of a feature's table: its groups so far and the last one; once the feature's pairs
// are kept, `groups` holds -(shared id + 1).
struct Slot {
  uint64_t key;
  int32_t last_group;
  int32_t groups;
};

struct Pair {
  int32_t key;  // the slot in its feature's table, then the shared key id
  int32_t group;  // grouped by group (by_group): the key's bytes
};

// A key's bins as bit masks (up to 64 bins): those with no group of it, those with one.
struct KeyBins {
  uint64_t empty;
  uint64_t single;
};

// A value of a bag that adds pairs: its key, its home slot in the table, its group.
struct Probe {
  uint64_t key;
  uint32_t home;
  int32_t group;
};

struct RefineWorkspace {
  std::vector<uint8_t> fresh;
  std::vector<Slot> table;
  std::vector<Probe> probes;
  std::vector<Pair> feature_pairs, pairs, by_group;
  std::vector<int32_t> key_bytes, size, pair_start, count, target, movers;
  std::vector<KeyBins> key_bins;
  std::vector<int64_t> best_gain, load;
  int64_t num_pairs = 0, num_keys = 0;
};

RefineWorkspace& refine_workspace() {
  thread_local RefineWorkspace ws;
  return ws;
}

// Appends the (key, group) pairs of one feature whose key two groups or more hold to ws.pairs
// (ws.num_pairs of them so far), numbering new keys from ws.num_keys (their bytes: weight).
template <typename key_t>
void collect_pairs(
    const key_t* values, const int64_t* off, const int64_t* fp, const int32_t* order,
    const int32_t* group_in_order, int64_t batch, int shift, int32_t weight, RefineWorkspace& ws) {
  uint8_t* fresh = sized(ws.fresh, batch);
  int64_t total = 0;
  for (int64_t pos = 0; pos < batch; ++pos) {
    const int32_t s = order[pos];
    fresh[pos] = pos == 0 || group_in_order[pos] != group_in_order[pos - 1] ||
                 fp[s] != fp[order[pos - 1]];
    total += fresh[pos] ? off[s + 1] - off[s] : 0;
  }
  if (total == 0) return;
  // Slots for 1.25x the values or more (a power of two): the distinct keys, fewer, leave it at
  // most 80% full; a smaller table stays in cache.
  const int table_bits = std::max(4, cluster::bit_length(static_cast<uint64_t>(total + total / 4)));
  const uint64_t mask = (uint64_t{1} << table_bits) - 1;
  // The values' keys and home slots first (a sequential pass), so the table walk below can
  // prefetch the slots it will probe.
  Probe* probes = sized(ws.probes, total);
  int64_t n = 0;
  for (int64_t pos = 0; pos < batch; ++pos) {
    if (!fresh[pos]) continue;
    const int32_t g = group_in_order[pos];
    const int32_t s = order[pos];
    for (int64_t j = off[s]; j < off[s + 1]; ++j, ++n) {
      const uint64_t key = static_cast<uint64_t>(cluster::key_hash(values[j])) >> shift;
      probes[n] = {key, static_cast<uint32_t>((key * cluster::kMixMultiplier) >> (64 - table_bits)), g};
    }
  }
  ws.table.assign(mask + 1, Slot{kEmptySlot, -1, 0});
  Slot* table = ws.table.data();
  Pair* feature_pairs = sized(ws.feature_pairs, total);
  int64_t num_feature_pairs = 0;
  constexpr int64_t kAhead = 16;
  for (int64_t v = 0; v < total; ++v) {
    if (v + kAhead < total) __builtin_prefetch(table + probes[v + kAhead].home, 1);
    const Probe& probe = probes[v];
    uint64_t i = probe.home;
    while (table[i].key != probe.key && table[i].key != kEmptySlot) i = (i + 1) & mask;
    Slot& slot = table[i];
    if (slot.last_group == probe.group) continue;  // a group's values come together
    slot.key = probe.key;
    slot.last_group = probe.group;
    ++slot.groups;
    feature_pairs[num_feature_pairs++] = {static_cast<int32_t>(i), probe.group};
  }
  Pair* pairs = sized(ws.pairs, ws.num_pairs + num_feature_pairs);
  int32_t* key_bytes = sized(ws.key_bytes, ws.num_keys + num_feature_pairs);
  int64_t num_pairs = ws.num_pairs, num_keys = ws.num_keys;
  for (int64_t p = 0; p < num_feature_pairs; ++p) {
    Slot& slot = table[feature_pairs[p].key];
    if (slot.groups == 1) continue;  // one group: it never changes a gain
    if (slot.groups > 1) {
      key_bytes[num_keys] = weight;
      slot.groups = -static_cast<int32_t>(num_keys++) - 1;
    }
    pairs[num_pairs++] = {-slot.groups - 1, feature_pairs[p].group};
  }
  ws.num_pairs = num_pairs;
  ws.num_keys = num_keys;
}

void key_masks(const int32_t* count, int64_t num_keys, int64_t m, KeyBins* key_bins) {
  for (int64_t k = 0; k < num_keys; ++k) {
    const int32_t* c = count + k * m;
    uint64_t empty = 0, single = 0;
    for (int64_t t = 0; t < m; ++t) {
      empty |= static_cast<uint64_t>(c[t] == 0) << t;
      single |= static_cast<uint64_t>(c[t] == 1) << t;
    }
    key_bins[k] = {empty, single};
  }
}

struct RoundInputs {
  const int32_t* count;  // [K, M]: groups of key k in bin t
  const KeyBins* key_bins;  // [K], when M <= 64
  const Pair* by_group;  // (key, bytes) of each group's pairs
  const int32_t* pair_start;  // [G + 1]
  const int32_t* bins;  // [G]
  int64_t num_groups, m;
};

// Every group's best move of a round: best_gain[g] (0 when no move gains) and target[g].
// A group in bin b saves the bytes of its keys that no other group of b holds (leave) and
// pays those of its keys that no group of t holds (join[t]). kBins = 8: M <= 8, masks, join in
// registers; 64: M <= 64, masks, a loop over the empty bins; 0: any M, rows of counts.
template <int kBins>
void round_gains(const RoundInputs& in, int64_t* best_gain, int32_t* target) {
  const int64_t m = in.m;
  std::vector<int64_t> join_row(kBins == 0 ? m : kBins);
  for (int64_t g = 0; g < in.num_groups; ++g) {
    const int32_t b = in.bins[g];
    int64_t leave = 0;
    int64_t fixed_join[kBins == 8 ? 8 : 1] = {};
    int64_t* join = kBins == 8 ? fixed_join : join_row.data();
    if (kBins != 8) std::fill(join, join + m, 0);
    for (int32_t p = in.pair_start[g]; p < in.pair_start[g + 1]; ++p) {
      const int32_t k = in.by_group[p].key;
      const int64_t w = in.by_group[p].group;
      if constexpr (kBins == 0) {
        const int32_t* c = in.count + static_cast<int64_t>(k) * m;
        leave += c[b] == 1 ? w : 0;
        for (int64_t t = 0; t < m; ++t) join[t] += c[t] == 0 ? w : 0;
      } else {
        const KeyBins kb = in.key_bins[k];
        leave += (kb.single >> b) & 1 ? w : 0;
        if constexpr (kBins == 8) {
          for (int t = 0; t < 8; ++t) fixed_join[t] += (kb.empty >> t) & 1 ? w : 0;
        } else {
          for (uint64_t e = kb.empty; e != 0; e &= e - 1) join[__builtin_ctzll(e)] += w;
        }
      }
    }
    // The largest gain, ties to the lowest bin; staying gains nothing.
    int64_t best = b == 0 ? 0 : leave - join[0];
    int32_t best_t = 0;
    for (int64_t t = 1; t < m; ++t) {
      const int64_t gain = t == b ? 0 : leave - join[t];
      if (gain > best) best = gain, best_t = static_cast<int32_t>(t);
    }
    best_gain[g] = best;
    target[g] = best_t;
  }
}

}  // namespace

RECXLA_CLUSTER_MULTIVERSION void refine_bins(
    const void* values, bool int32_values, const int64_t* bag_offsets, const int64_t* fingerprint,
    const int32_t* weights, int64_t num_features, const int32_t* order,
    const int32_t* group_in_order, int64_t num_groups, int64_t batch, int64_t m, int32_t* bins) {
  RefineWorkspace& ws = refine_workspace();
  // Each group's first bin: the chunk [j * B / M, (j + 1) * B / M) holding its middle sample.
  int32_t* size = sized(ws.size, num_groups);
  std::fill(size, size + num_groups, 0);
  for (int64_t pos = 0; pos < batch; ++pos) ++size[group_in_order[pos]];
  int64_t first = 0, bin = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t middle = first + size[g] / 2;
    while (bin + 1 < m && (bin + 1) * batch / m <= middle) ++bin;
    bins[g] = static_cast<int32_t>(bin);
    first += size[g];
  }

  ws.num_pairs = 0;
  ws.num_keys = 0;
  const int group_bits = std::max(1, cluster::bit_length(static_cast<uint64_t>(num_groups)));
  const int shift = group_bits + cluster::bit_length(static_cast<uint64_t>(num_features - 1));
  for (int64_t i = 0; i < num_features; ++i) {
    if (weights[i] <= 0) continue;
    const int64_t* off = bag_offsets + i * (batch + 1);
    const int64_t* fp = fingerprint + i * batch;
    if (int32_values) {
      collect_pairs(
          static_cast<const int32_t*>(values), off, fp, order, group_in_order, batch, shift,
          weights[i], ws);
    } else {
      collect_pairs(
          static_cast<const int64_t*>(values), off, fp, order, group_in_order, batch, shift,
          weights[i], ws);
    }
  }
  const int64_t num_keys = ws.num_keys;
  if (num_keys == 0) return;
  const int32_t* key_bytes = ws.key_bytes.data();
  // The pairs grouped by group (a counting sort).
  int32_t* pair_start = sized(ws.pair_start, num_groups + 1);
  std::fill(pair_start, pair_start + num_groups + 1, 0);
  const Pair* pairs = ws.pairs.data();
  for (int64_t p = 0; p < ws.num_pairs; ++p) ++pair_start[pairs[p].group + 1];
  for (int64_t g = 0; g < num_groups; ++g) pair_start[g + 1] += pair_start[g];
  const int64_t num_pairs = pair_start[num_groups];
  Pair* by_group = sized(ws.by_group, num_pairs);
  for (int64_t p = 0; p < ws.num_pairs; ++p) {
    by_group[pair_start[pairs[p].group]++] = {pairs[p].key, key_bytes[pairs[p].key]};
  }
  for (int64_t g = num_groups; g > 0; --g) pair_start[g] = pair_start[g - 1];
  pair_start[0] = 0;

  const int64_t capacity = (batch + m - 1) / m + batch / (m * cluster::kBalanceSlack);
  int32_t* count = sized(ws.count, num_keys * m);
  int64_t* best_gain = sized(ws.best_gain, num_groups);
  int32_t* target = sized(ws.target, num_groups);
  int64_t* load = sized(ws.load, m);
  KeyBins* key_bins = sized(ws.key_bins, m <= 64 ? num_keys : 0);
  for (int round = 0; round < cluster::kRefineRounds; ++round) {
    std::fill(count, count + num_keys * m, 0);
    for (int64_t g = 0; g < num_groups; ++g) {
      for (int64_t p = pair_start[g]; p < pair_start[g + 1]; ++p) ++count[by_group[p].key * m + bins[g]];
    }
    RoundInputs in{count, key_bins, by_group, pair_start, bins, num_groups, m};
    if (m <= 8) {
      key_masks(count, num_keys, m, key_bins);
      round_gains<8>(in, best_gain, target);
    } else if (m <= 64) {
      key_masks(count, num_keys, m, key_bins);
      round_gains<64>(in, best_gain, target);
    } else {
      round_gains<0>(in, best_gain, target);
    }
    ws.movers.clear();
    for (int64_t g = 0; g < num_groups; ++g) {
      if (best_gain[g] > 0) ws.movers.push_back(static_cast<int32_t>(g));
    }
    if (ws.movers.empty()) break;
    std::stable_sort(ws.movers.begin(), ws.movers.end(), [&](int32_t a, int32_t b) {
      return best_gain[a] > best_gain[b];
    });
    std::fill(load, load + m, 0);
    for (int64_t g = 0; g < num_groups; ++g) load[bins[g]] += size[g];
    for (const int32_t g : ws.movers) {  // gains of the round's start
      const int32_t t = target[g];
      if (load[t] + size[g] <= capacity) {
        load[t] += size[g];
        load[bins[g]] -= size[g];
        bins[g] = t;
      }
    }
  }
}

}  // namespace cluster_cpu
}  // namespace recxla
