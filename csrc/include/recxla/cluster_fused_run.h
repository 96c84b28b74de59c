// Key-centric sample clustering, "fused" GPU variant: the host side of one call, the same for the
// CUDA kernels (csrc/cuda/cluster_fused.cu) and for their serial host run
// (csrc/cpu/cluster_fused.cpp), which differ only in their Backend:
//
//   options                       where the workspace lives
//   fill(ptr, byte, bytes)        memset
//   for_each(n, step)             step(i) for every i in [0, n) (one launch)
//   row_summaries(lengths, F, B, summaries, local)   one pass over the lengths per feature
//   to_host(tensor) / staging(bytes) / to_device(staging)   the one sync; params up, async
//   scratch_bytes(B, bag slots, bin bits)  the sorts' and scans' scratch
//   sort_records, inclusive_sum, exclusive_sum, sort_by_bin   (CUB on CUDA)
//   round_gains(view, B), move_bytes(B, M), moves(view, scratch, B, round)   (the rounds)
//   num_keys(scalars)             a sync, only when the [K, M] count table must be sized exactly
//
// Device operations of one call at batch 8192, M <= 8 (about 44, all queued after the one
// sync): the lengths pass; the summaries' copy down (the sync) and the params' copy up; 2 fills;
// scores, rank, signatures, sort keys; a merge sort (~9: 512-record tiles, 4 merge passes);
// heads, an inclusive sum (2), group starts, group init; pair insert, key ids, pair counts, an
// exclusive sum (2), pair emit; 4 rounds x (gains, moves, update); bin keys, a radix sort (1-3).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "recxla/cluster.h"
#include "recxla/cluster_fused.h"
#include "recxla/cluster_fused_pairs.h"
#include "recxla/cluster_fused_rounds.h"

namespace recxla {
namespace cluster {
namespace fused {

constexpr const char* kOp = "recxla::cluster_permutation_fused";
// Above this many bytes the [K, M] count table is sized from the keys' count, read back (one
// more sync), instead of from its bound U / 2 (many micro-batches).
constexpr int64_t kCountTableBoundBytes = int64_t{256} << 20;

// The CPU kernel's argument checks (csrc/cpu/cluster_order.cpp), message for message.
inline void check_arguments(
    const at::Tensor& values, const at::Tensor& lengths, int64_t batch, int64_t m,
    c10::ArrayRef<double> key_bytes) {
  TORCH_CHECK_VALUE(values.dim() == 1, kOp, ": values must be 1-D, got ", values.dim(), "-D");
  TORCH_CHECK_TYPE(
      values.scalar_type() == at::kInt || values.scalar_type() == at::kLong, kOp,
      ": values must be int32 or int64 ids, got ", values.scalar_type());
  TORCH_CHECK_VALUE(lengths.dim() == 1, kOp, ": lengths must be 1-D, got ", lengths.dim(), "-D");
  TORCH_CHECK_TYPE(
      lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong, kOp,
      ": lengths must be int32 or int64, got ", lengths.scalar_type());
  TORCH_CHECK_VALUE(
      1 <= batch && batch <= std::numeric_limits<int32_t>::max(), kOp,
      ": batch_size must be in [1, 2**31 - 1], got ", batch);
  TORCH_CHECK_VALUE(
      1 <= m && m <= batch, kOp, ": num_micro_batches must be in [1, batch_size ", batch,
      "], got ", m);
  TORCH_CHECK_VALUE(
      lengths.numel() % batch == 0, kOp, ": lengths must hold F * batch_size entries, got ",
      lengths.numel(), " for batch_size ", batch);
  const int64_t features = lengths.numel() / batch;
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(key_bytes.size()) == features, kOp,
      ": key_bytes must hold one number per feature (", features, "), got ", key_bytes.size());
  for (int64_t f = 0; f < features; ++f) {
    TORCH_CHECK_VALUE(
        std::isfinite(key_bytes[f]) && key_bytes[f] >= 0, kOp,
        ": key_bytes must be finite and >= 0, got ", key_bytes[f], " for feature ", f);
  }
}

// The lengths' checks from the rows' summaries (the CPU kernel's, in its order and words);
// start: F + 1 entries, each feature's first value.
inline void check_rows(
    const RowSummary* rows, int64_t features, int64_t batch, int64_t num_values, int64_t* start) {
  start[0] = 0;
  for (int64_t f = 0; f < features; ++f) {
    const RowSummary& r = rows[f];
    TORCH_CHECK_VALUE(
        r.smallest >= 0, kOp, ": lengths must be >= 0, got ", r.negative_value, " at index ",
        f * batch + r.first_negative, " (feature ", f, ", sample ", r.first_negative, ")");
    const int64_t sum = static_cast<int64_t>(r.sum);
    TORCH_CHECK_VALUE(
        r.largest <= num_values && start[f] + sum <= num_values, kOp,
        ": lengths overrun values: features 0..", f, " need ",
        r.largest <= num_values ? start[f] + sum : r.largest, " values or more, values holds ",
        num_values);
    TORCH_CHECK_VALUE(
        sum <= std::numeric_limits<uint32_t>::max(), kOp, ": feature ", f,
        " holds more than 2**32 - 1 values");
    start[f + 1] = start[f] + sum;
  }
}

// Hands out 16-byte aligned pieces of one buffer; with a null base it only measures.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<uint8_t*>(base)) {}
  template <typename T>
  T* take(int64_t count) {
    offset_ = (offset_ + 15) / 16 * 16;
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    offset_ += std::max<int64_t>(count, 1) * static_cast<int64_t>(sizeof(T));
    return p;
  }
  int64_t bytes() const { return (offset_ + 15) / 16 * 16; }

 private:
  uint8_t* base_;
  int64_t offset_ = 0;
};

// What the host fixes after the lengths' sync.
struct Plan {
  int64_t batch, m, features, rows, num_values, table_bits, key_bound, scratch, move;
  bool exact_count;
};

// Lays every buffer of `v` out in one workspace (its zeroed and all-ones ranges first).
template <typename key_t>
int64_t carve(View<key_t>& v, const Plan& p, void* base, int64_t* zero_bytes,
              int64_t* ones_bytes, void** scratch, void** move) {
  Carver c(base);
  const int64_t b = p.batch, slots = int64_t{1} << p.table_bits;
  v.gain_table = c.take<uint32_t>(p.features * kTableSlots);
  v.saved = c.take<uint64_t>(p.features);
  v.scalars = c.take<Scalars>(1);
  v.key_groups = c.take<uint32_t>(slots);
  v.fingerprint = c.take<int64_t>(p.rows * b);
  v.bag_pairs = c.take<int64_t>(p.rows * b);
  v.bag_fill = c.take<int64_t>(p.rows * b);
  *zero_bytes = c.bytes();
  v.pair_words = c.take<uint64_t>(slots);
  v.key_words = c.take<uint64_t>(slots);
  v.min_hash = c.take<uint64_t>(kSortFeatures * b);
  *ones_bytes = c.bytes() - *zero_bytes;
  v.pair_key_slot = c.take<int32_t>(slots);
  v.key_id = c.take<int32_t>(slots);
  v.records = c.take<SortRecord>(b);
  v.order = c.take<int32_t>(b);
  v.head = c.take<int32_t>(b);
  v.group_number = c.take<int32_t>(b);
  v.group_first = c.take<int32_t>(b + 1);
  v.group_size = c.take<int32_t>(b);
  v.bins = c.take<int32_t>(b);
  v.moved_from = c.take<int32_t>(b);
  v.moved_round = c.take<int32_t>(b);
  v.target = c.take<int32_t>(b);
  v.best_gain = c.take<int64_t>(b);
  v.owner = c.take<int32_t>(p.num_values);
  v.bag_start = c.take<int64_t>(p.rows * b);
  v.pair_start = c.take<int64_t>(b + 1);
  v.pair_key = c.take<int32_t>(2 * p.key_bound + 1);  // pairs: at most U = 2 * key_bound + 1
  v.pair_bytes = c.take<int32_t>(2 * p.key_bound + 1);
  v.count = p.exact_count ? nullptr : c.take<int32_t>(p.key_bound * p.m);
  v.bin_key = c.take<uint32_t>(2 * b);  // and the sorted keys
  v.sample = c.take<int64_t>(b);
  *scratch = c.take<uint8_t>(p.scratch);
  *move = c.take<uint8_t>(p.move);
  return c.bytes();
}

// The clustered order of one batch into out (int64 [B]), lengths checked on the way. Arguments
// as for recxla::cluster_permutation, checked by `check_arguments`; values and lengths
// contiguous, on the backend's device.
template <class Backend, typename key_t, typename len_t>
void permutation(
    Backend& be, const at::Tensor& values, const at::Tensor& lengths, int64_t batch, int64_t m,
    c10::ArrayRef<double> key_bytes, at::Tensor& out) {
  int64_t* perm = out.data_ptr<int64_t>();
  const int64_t features = lengths.numel() / batch;
  if (features == 0) return be.for_each(batch, Iota{perm});

  // 1. Lengths: one pass per feature (sums, extremes, first negative, each bag's offset in its
  // feature), then the one sync, which raises the CPU kernel's errors before any value is read.
  static_assert(sizeof(RowSummary) == 5 * sizeof(int64_t), "RowSummary is 5 int64 words");
  at::Tensor head = at::empty({features * (5 + batch + 1)}, be.options.dtype(at::kLong));
  int64_t* local = head.data_ptr<int64_t>() + features * 5;
  be.row_summaries(lengths.const_data_ptr<len_t>(), features, batch,
                   reinterpret_cast<RowSummary*>(head.data_ptr<int64_t>()), local);
  const at::Tensor rows_host = be.to_host(head.narrow(0, 0, features * 5));
  std::vector<int64_t> start(features + 1);
  check_rows(reinterpret_cast<const RowSummary*>(rows_host.const_data_ptr<int64_t>()), features,
             batch, values.numel(), start.data());
  if (m == 1 || m == batch) return be.for_each(batch, Iota{perm});  // every order costs the same

  // 2. What every feature needs on the device; the buffers, sized from bounds the host knows.
  at::Tensor staging = be.staging(features * static_cast<int64_t>(sizeof(FeatureParams)));
  auto* params = reinterpret_cast<FeatureParams*>(staging.data_ptr());
  const double top = *std::max_element(key_bytes.begin(), key_bytes.end());
  std::vector<int64_t> sizes(features);
  for (int64_t f = 0; f < features; ++f) {
    const int64_t n = start[f + 1] - start[f];
    FeatureParams& p = params[f];
    p.start = start[f];
    p.n = sizes[f] = n;
    p.key_bytes = key_bytes[f];
    p.r_bits = sample_bits(n);
    p.bits = table_bits(std::max<int64_t>(n >> p.r_bits, 1));
    p.weight = top > 0 ? static_cast<int32_t>(std::nearbyint(key_bytes[f] / top * kWeightScale))
                       : 0;
    p.pad = 0;
  }
  const at::Tensor feature = be.to_device(staging);
  Plan plan{};
  plan.batch = batch;
  plan.m = m;
  plan.features = features;
  plan.rows = std::min<int64_t>(features, kMaxRanked);
  plan.num_values = start[features];
  // U: values of the R largest features, a bound on the values the pair steps insert.
  std::sort(sizes.begin(), sizes.end(), std::greater<int64_t>());
  int64_t bound = 0;
  for (int64_t i = 0; i < plan.rows; ++i) bound += sizes[i];
  plan.table_bits = std::max(4, bit_length(static_cast<uint64_t>(bound + bound / 4)));
  TORCH_CHECK_VALUE(
      plan.table_bits <= 30, kOp, ": the ", plan.rows, " largest features hold ", bound,
      " values; the pair tables take at most 2**30 slots (about 850 million values)");
  plan.key_bound = bound / 2;  // a key counted in the moves is held by two groups or more
  plan.exact_count = plan.key_bound * m * 4 > kCountTableBoundBytes;
  const int bin_bits = bit_length(static_cast<uint64_t>(m - 1));
  plan.scratch = be.scratch_bytes(batch, plan.rows * batch, bin_bits);
  plan.move = be.move_bytes(batch, m);

  View<key_t> v{};
  v.values = values.const_data_ptr<key_t>();
  v.feature = reinterpret_cast<const FeatureParams*>(feature.const_data_ptr());
  v.local = local;
  v.batch = batch;
  v.m = m;
  v.features = features;
  v.rows = plan.rows;
  v.capacity = (batch + m - 1) / m + batch / (m * kBalanceSlack);
  v.table_bits = static_cast<int>(plan.table_bits);
  int64_t zero_bytes = 0, ones_bytes = 0;
  void *scratch = nullptr, *move = nullptr;
  const int64_t bytes = carve(v, plan, nullptr, &zero_bytes, &ones_bytes, &scratch, &move);
  at::Tensor workspace = at::empty({bytes}, be.options.dtype(at::kByte));
  uint8_t* base = workspace.data_ptr<uint8_t>();
  carve(v, plan, base, &zero_bytes, &ones_bytes, &scratch, &move);
  be.fill(base, 0, zero_bytes);
  be.fill(base + zero_bytes, 0xFF, ones_bytes);

  // 3. Score and rank the features; signatures; the lexicographic order; groups.
  be.for_each(plan.num_values, ScoreValues<key_t>{v});
  be.for_each(1, RankFeatures<key_t>{v});
  be.for_each(plan.rows * batch * kLanes, Signatures<key_t>{v});
  be.for_each(batch, SortKeys<key_t>{v});
  be.sort_records(v.records, batch, scratch, plan.scratch);
  be.for_each(batch, Heads<key_t>{v});
  be.inclusive_sum(v.head, v.group_number, batch, scratch, plan.scratch);
  be.for_each(batch, GroupStarts<key_t>{v});
  be.for_each(batch, InitGroups<key_t>{v});

  // 4. The (key, group) pairs, grouped by group, and the [K, M] counts of the first bins.
  const int64_t bag_slots = plan.rows * batch;
  be.for_each(bag_slots * kLanes, InsertPairs<key_t>{v});
  be.for_each(int64_t{1} << plan.table_bits, KeyIds<key_t>{v, v.count});
  at::Tensor exact;
  if (plan.exact_count) {
    const int64_t keys = be.num_keys(v.scalars);
    exact = at::empty({std::max<int64_t>(keys * m, 1)}, be.options.dtype(at::kInt));
    v.count = exact.data_ptr<int32_t>();
    be.fill(v.count, 0, keys * m * 4);
  }
  be.for_each(bag_slots * kLanes, CountPairs<key_t>{v});
  be.exclusive_sum(v.bag_pairs, v.bag_start, bag_slots, scratch, plan.scratch);
  be.for_each(bag_slots * kLanes, EmitPairs<key_t>{v});

  // 5. The move rounds, then the order by bin (stable: the sorted order inside a bin).
  RoundView r{v.pair_start, v.pair_key, v.pair_bytes, v.count, v.bins, v.moved_from,
              v.moved_round, v.target, v.group_size, v.best_gain, v.scalars, m, v.capacity};
  for (int32_t round = 0; round < kRefineRounds; ++round) {
    be.round_gains(r, batch);
    be.moves(r, move, batch, round);
    be.for_each(batch * kLanes, UpdateCounts{r, round});
  }
  be.for_each(batch, BinKeys<key_t>{v});
  be.sort_by_bin(
      v.bin_key, v.bin_key + batch, v.sample, perm, batch, bin_bits, scratch, plan.scratch);
}

}  // namespace fused
}  // namespace cluster
}  // namespace recxla
