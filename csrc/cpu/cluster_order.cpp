// Key-centric sample clustering on CPU: the whole order of one batch in one call, with the same
// result bit for bit as the plain-PyTorch reference (recxla/reference/cluster.py, which
// documents the algorithm; the steps below follow its function names).
//
// What replaces the reference's tensor passes:
// - lengths: one scan checks them and sizes every feature;
// - feature_gains, bag signatures: the passes of csrc/cpu/cluster.cpp (hash in registers);
// - the two stable sorts of the samples: an LSD radix sort by the best feature's key, then a
//   small sort by the next key inside each run of equal keys (runs are groups, ~20 samples);
// - group_key_pairs: the distinct (key, group) pairs come from one hash table per feature.
//   Bags are read in sorted order, so a key's groups arrive in non-decreasing order and a pair
//   is new iff its group differs from the key's last one: no sort, no unique;
// - refine_bins: each round walks the pairs group by group (CSR) and sums a group's leave and
//   join bytes in registers, instead of [P] and [G, M] tensors.
// All sums are integers, so threads and summation order cannot change a decision.
// Scratch lives in a per-thread workspace reused between calls: with the default allocator a
// fresh buffer of a few MB pays page faults on every call (DESIGN.md), about the cost of the work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cluster_cpu.h"
#include "recxla/cluster.h"

namespace recxla {
namespace {

using cluster::kRefineFeatures;
using cluster::kSortFeatures;

using cluster_cpu::sized;

struct Workspace {
  std::vector<int64_t> feature_start, bag_offsets, fingerprint, min_hash, sort_key;
  std::vector<uint64_t> radix_key, radix_key_tmp;
  std::vector<int32_t> order, order_tmp, group_in_order, bins;
  std::vector<int8_t> gain_steps;
};

Workspace& workspace() {
  thread_local Workspace ws;
  return ws;
}

// Checks the lengths and sizes every feature: start[f] = first value of feature f, F + 1 entries.
template <typename len_t>
void feature_starts(
    const char* op, const len_t* lengths, int64_t features, int64_t batch, int64_t num_values,
    int64_t* start) {
  start[0] = 0;
  for (int64_t f = 0; f < features; ++f) {
    const len_t* row = lengths + f * batch;
    int64_t sum = 0;
    len_t smallest = 0, largest = 0;
    bool wrapped = false;  // lengths each <= N can still wrap an int64 sum (N up to 2**63 - 1)
    for (int64_t s = 0; s < batch; ++s) {
      wrapped |= __builtin_add_overflow(sum, int64_t{row[s]}, &sum);
      smallest = std::min(smallest, row[s]);
      largest = std::max(largest, row[s]);
    }
    if (smallest < 0) {
      const int64_t s = std::find_if(row, row + batch, [](len_t x) { return x < 0; }) - row;
      TORCH_CHECK_VALUE(
          false, op, ": lengths must be >= 0, got ", int64_t{row[s]}, " at index ", f * batch + s,
          " (feature ", f, ", sample ", s, ")");
    }
    int64_t end = 0;
    wrapped |= __builtin_add_overflow(start[f], sum, &end);
    TORCH_CHECK_VALUE(
        !wrapped, op, ": lengths overrun values: features 0..", f,
        " need more values than an int64 counts, values holds ", num_values);
    TORCH_CHECK_VALUE(
        int64_t{largest} <= num_values && end <= num_values, op,
        ": lengths overrun values: features 0..", f, " need ",
        int64_t{largest} <= num_values ? end : int64_t{largest},
        " values or more, values holds ", num_values);
    TORCH_CHECK_VALUE(
        sum <= std::numeric_limits<uint32_t>::max(), op, ": feature ", f,
        " holds more than 2**32 - 1 values");
    start[f + 1] = start[f] + sum;
  }
}

// order = range(B) sorted by key (signed), ties by index: LSD radix sort, 11-bit digits.
void radix_sort(const int64_t* key, int64_t n, Workspace& ws, int32_t* order) {
  constexpr int kDigitBits = 11, kPasses = 6, kBuckets = 1 << kDigitBits;
  uint64_t* k = sized(ws.radix_key, n);
  uint64_t* k_tmp = sized(ws.radix_key_tmp, n);
  int32_t* o_tmp = sized(ws.order_tmp, n);
  std::vector<int64_t> hist(kPasses * kBuckets, 0);
  for (int64_t i = 0; i < n; ++i) {
    k[i] = static_cast<uint64_t>(key[i]) ^ (uint64_t{1} << 63);  // signed order as unsigned
    order[i] = static_cast<int32_t>(i);
    for (int p = 0; p < kPasses; ++p) ++hist[p * kBuckets + ((k[i] >> (p * kDigitBits)) & 2047)];
  }
  for (int p = 0; p < kPasses; ++p) {
    int64_t* h = hist.data() + p * kBuckets;
    if (*std::max_element(h, h + kBuckets) == n) continue;  // one digit value: order unchanged
    int64_t sum = 0;
    for (int b = 0; b < kBuckets; ++b) std::swap(sum, h[b]), sum += h[b];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t dst = h[(k[i] >> (p * kDigitBits)) & 2047]++;
      k_tmp[dst] = k[i];
      o_tmp[dst] = order[i];
    }
    std::swap(k, k_tmp);
    std::memcpy(order, o_tmp, n * sizeof(int32_t));
  }
}

at::Tensor cluster_permutation_cpu(
    const at::Tensor& values_in, const at::Tensor& lengths_in, int64_t batch, int64_t m,
    c10::ArrayRef<double> key_bytes) {
  constexpr const char* op = "recxla::cluster_permutation";
  TORCH_CHECK_VALUE(values_in.dim() == 1, op, ": values must be 1-D, got ", values_in.dim(), "-D");
  TORCH_CHECK_TYPE(
      values_in.scalar_type() == at::kInt || values_in.scalar_type() == at::kLong, op,
      ": values must be int32 or int64 ids, got ", values_in.scalar_type());
  TORCH_CHECK_VALUE(lengths_in.dim() == 1, op, ": lengths must be 1-D, got ", lengths_in.dim(), "-D");
  TORCH_CHECK_TYPE(
      lengths_in.scalar_type() == at::kInt || lengths_in.scalar_type() == at::kLong, op,
      ": lengths must be int32 or int64, got ", lengths_in.scalar_type());
  TORCH_CHECK_VALUE(
      1 <= batch && batch <= std::numeric_limits<int32_t>::max(), op,
      ": batch_size must be in [1, 2**31 - 1], got ", batch);
  TORCH_CHECK_VALUE(
      1 <= m && m <= batch, op, ": num_micro_batches must be in [1, batch_size ", batch, "], got ",
      m);
  TORCH_CHECK_VALUE(
      lengths_in.numel() % batch == 0, op, ": lengths must hold F * batch_size entries, got ",
      lengths_in.numel(), " for batch_size ", batch);
  const int64_t features = lengths_in.numel() / batch;
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(key_bytes.size()) == features, op, ": key_bytes must hold one number per",
      " feature (", features, "), got ", key_bytes.size());
  for (int64_t f = 0; f < features; ++f) {
    TORCH_CHECK_VALUE(
        std::isfinite(key_bytes[f]) && key_bytes[f] >= 0, op,
        ": key_bytes must be finite and >= 0, got ", key_bytes[f], " for feature ", f);
  }
  Workspace& ws = workspace();
  const at::Tensor lengths = lengths_in.contiguous();
  int64_t* start = sized(ws.feature_start, features + 1);
  if (lengths.scalar_type() == at::kInt) {
    feature_starts(op, lengths.const_data_ptr<int32_t>(), features, batch, values_in.numel(), start);
  } else {
    feature_starts(op, lengths.const_data_ptr<int64_t>(), features, batch, values_in.numel(), start);
  }
  at::Tensor out = at::empty({batch}, lengths.options().dtype(at::kLong));
  int64_t* perm = out.data_ptr<int64_t>();
  const auto identity = [&]() {
    for (int64_t i = 0; i < batch; ++i) perm[i] = i;
    return out;
  };
  if (m == 1 || m == batch || features == 0) return identity();  // every order costs the same
  const at::Tensor values = values_in.contiguous();
  const bool int32_values = values.scalar_type() == at::kInt;
  const auto* v32 = int32_values ? values.const_data_ptr<int32_t>() : nullptr;
  const auto* v64 = int32_values ? nullptr : values.const_data_ptr<int64_t>();

  // Score the features (reference: feature_gains, rank_features).
  std::vector<double> gain(features);
  std::vector<int8_t>& steps = ws.gain_steps;
  cluster_cpu::gain_steps(batch, m, steps);
  at::parallel_for(0, features, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint32_t> table;
    for (int64_t f = begin; f < end; ++f) {
      const int64_t n = start[f + 1] - start[f];
      const int64_t saved = int32_values
          ? cluster_cpu::feature_saved_keys(v32 + start[f], n, batch, steps.data(), table)
          : cluster_cpu::feature_saved_keys(v64 + start[f], n, batch, steps.data(), table);
      gain[f] = static_cast<double>(saved) * key_bytes[f];
    }
  });
  std::vector<int64_t> ranked;
  for (int64_t f = 0; f < features; ++f) {
    if (gain[f] > 0) ranked.push_back(f);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [&](int64_t a, int64_t b) {
    return gain[a] > gain[b];
  });
  const int64_t num_ranked = std::min<int64_t>(ranked.size(), std::max(kSortFeatures, kRefineFeatures));
  if (num_ranked == 0) return identity();
  const int64_t num_sort = std::min<int64_t>(num_ranked, kSortFeatures);

  // Signatures of every bag of the ranked features (min-hash only for the sort features).
  int64_t* bag_offsets = sized(ws.bag_offsets, num_ranked * (batch + 1));
  int64_t* fingerprint = sized(ws.fingerprint, num_ranked * batch);
  int64_t* min_hash = sized(ws.min_hash, num_sort * batch);
  for (int64_t i = 0; i < num_ranked; ++i) {
    const int64_t f = ranked[i];
    int64_t* off = bag_offsets + i * (batch + 1);
    off[0] = start[f];
    if (lengths.scalar_type() == at::kInt) {
      const int32_t* len = lengths.const_data_ptr<int32_t>() + f * batch;
      for (int64_t s = 0; s < batch; ++s) off[s + 1] = off[s] + len[s];
    } else {
      const int64_t* len = lengths.const_data_ptr<int64_t>() + f * batch;
      for (int64_t s = 0; s < batch; ++s) off[s + 1] = off[s] + len[s];
    }
    int64_t* mh = i < num_sort ? min_hash + i * batch : nullptr;
    int64_t* fp = fingerprint + i * batch;
    at::parallel_for(0, batch, cluster_cpu::kSignatureGrain, [&](int64_t begin, int64_t end) {
      if (int32_values) {
        cluster_cpu::bag_signatures(v32, off, begin, end, mh, fp);
      } else {
        cluster_cpu::bag_signatures(v64, off, begin, end, mh, fp);
      }
    });
  }
  int64_t* sort_key = sized(ws.sort_key, num_sort * batch);
  for (int64_t i = 0; i < num_sort * batch; ++i) {
    sort_key[i] = cluster::signature_sort_key(min_hash[i], fingerprint[i]);
  }

  // Lexicographic order: by the best feature's key, ties by the next key, then by index.
  int32_t* order = sized(ws.order, batch);
  radix_sort(sort_key, batch, ws, order);
  int32_t* group_in_order = sized(ws.group_in_order, batch);
  int64_t num_groups = 0;
  for (int64_t pos = 0; pos < batch;) {
    int64_t end = pos + 1;
    while (end < batch && sort_key[order[end]] == sort_key[order[pos]]) ++end;
    if (num_sort > 1 && end - pos > 1) {
      const int64_t* next = sort_key + batch;
      std::sort(order + pos, order + end, [&](int32_t a, int32_t b) {
        return next[a] != next[b] ? next[a] < next[b] : a < b;
      });
    }
    for (int64_t p = pos; p < end; ++p) group_in_order[p] = static_cast<int32_t>(num_groups);
    ++num_groups;
    pos = end;
  }

  // Integer bytes per key (reference: integer_weights): the largest over all features is 2**20.
  const double top = *std::max_element(key_bytes.begin(), key_bytes.end());
  std::vector<int32_t> weights(num_ranked);
  for (int64_t i = 0; i < num_ranked; ++i) {
    weights[i] = static_cast<int32_t>(std::nearbyint(key_bytes[ranked[i]] / top * cluster::kWeightScale));
  }
  int32_t* bins = sized(ws.bins, num_groups);
  cluster_cpu::refine_bins(
      int32_values ? static_cast<const void*>(v32) : static_cast<const void*>(v64), int32_values,
      bag_offsets, fingerprint, weights.data(), std::min<int64_t>(num_ranked, kRefineFeatures),
      order, group_in_order, num_groups, batch, m, bins);

  // The order by bin, the sorted order inside a bin (a stable counting sort).
  std::vector<int64_t> bin_start(m + 1, 0);
  for (int64_t pos = 0; pos < batch; ++pos) ++bin_start[bins[group_in_order[pos]] + 1];
  for (int64_t b = 0; b < m; ++b) bin_start[b + 1] += bin_start[b];
  for (int64_t pos = 0; pos < batch; ++pos) perm[bin_start[bins[group_in_order[pos]]]++] = order[pos];
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) { m.impl("cluster_permutation", &cluster_permutation_cpu); }

}  // namespace recxla
