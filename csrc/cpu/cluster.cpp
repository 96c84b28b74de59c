// Key-centric sample clustering on CPU: the two passes over every key (scoring, signatures)
// and their ops. The per-value math is csrc/include/recxla/cluster.h; the rest of the
// algorithm (sort, groups, moves) is csrc/cpu/cluster_order.cpp.
//
// Both passes are a single read of the keys with the hash computed in registers: the reference
// spends a pass (and a tensor) on each of hash, slot, count, mix, running sum and scatter-min.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "cluster_cpu.h"
#include "recxla/cluster.h"

namespace recxla {
namespace cluster_cpu {
namespace {

// The bodies are inlined into each multiversioned entry below, so each gets its ISA's code.

template <typename key_t>
__attribute__((always_inline)) inline int64_t saved_keys_impl(
    const key_t* values, int64_t n, int64_t batch, const int8_t* steps,
    std::vector<uint32_t>& table) {
  const int r_bits = cluster::sample_bits(n);
  const int bits = cluster::table_bits(std::max<int64_t>(n >> r_bits, 1));
  const uint64_t slots = uint64_t{1} << bits;
  table.assign(slots, 0);
  uint32_t* count = table.data();
  // Slots of a chunk first (a loop the compiler vectorizes), then the counts: for a big
  // feature only about 1 key in R is sampled, so the hashing is most of the work. The sum over
  // slots of gain_of_count(count) is summed step by step as the counts grow (no pass over the
  // slots, no division).
  constexpr int64_t kChunk = 256;
  uint64_t slot[kChunk];
  int64_t sum = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t len = std::min(kChunk, n - j0);
    for (int64_t j = 0; j < len; ++j) {
      slot[j] = cluster::sampled_slot(cluster::key_hash(values[j0 + j]), r_bits, bits);
    }
    for (int64_t j = 0; j < len; ++j) {
      if (slot[j] < slots) sum += steps[std::min<int64_t>(count[slot[j]]++, batch)];
    }
  }
  return sum << r_bits;
}

template <typename key_t>
__attribute__((always_inline)) inline void signatures_impl(
    const key_t* values, const int64_t* offsets, int64_t first, int64_t last, int64_t* min_hash,
    int64_t* fingerprint) {
  for (int64_t i = first; i < last; ++i) {
    uint64_t sum = 0;  // wraps mod 2**64, like the reference's running sum
    int64_t smallest = cluster::kEmptySignature;
    for (int64_t j = offsets[i]; j < offsets[i + 1]; ++j) {
      const int64_t h = cluster::key_hash(values[j]);
      smallest = std::min(smallest, h);
      sum += static_cast<uint64_t>(cluster::fingerprint_mix(h));
    }
    if (min_hash != nullptr) min_hash[i] = smallest;
    fingerprint[i] = static_cast<int64_t>(sum);
  }
}

}  // namespace

void gain_steps(int64_t batch, int64_t m, std::vector<int8_t>& steps) {
  steps.resize(batch + 1);
  for (int64_t c = 0; c < batch; ++c) {
    steps[c] = static_cast<int8_t>(
        cluster::gain_of_count(c + 1, batch, m) - cluster::gain_of_count(c, batch, m));
  }
  steps[batch] = 0;  // counts are capped at B
}

RECXLA_CLUSTER_MULTIVERSION int64_t feature_saved_keys(
    const int64_t* values, int64_t n, int64_t batch, const int8_t* steps,
    std::vector<uint32_t>& table) {
  return saved_keys_impl(values, n, batch, steps, table);
}

RECXLA_CLUSTER_MULTIVERSION int64_t feature_saved_keys(
    const int32_t* values, int64_t n, int64_t batch, const int8_t* steps,
    std::vector<uint32_t>& table) {
  return saved_keys_impl(values, n, batch, steps, table);
}

RECXLA_CLUSTER_MULTIVERSION void bag_signatures(
    const int64_t* values, const int64_t* offsets, int64_t first, int64_t last, int64_t* min_hash,
    int64_t* fingerprint) {
  signatures_impl(values, offsets, first, last, min_hash, fingerprint);
}

RECXLA_CLUSTER_MULTIVERSION void bag_signatures(
    const int32_t* values, const int64_t* offsets, int64_t first, int64_t last, int64_t* min_hash,
    int64_t* fingerprint) {
  signatures_impl(values, offsets, first, last, min_hash, fingerprint);
}

}  // namespace cluster_cpu

namespace {

at::Tensor cluster_feature_gains_cpu(
    const at::Tensor& values_in, c10::IntArrayRef feature_offsets, int64_t batch, int64_t m) {
  constexpr const char* op = "recxla::cluster_feature_gains";
  cluster::check_keys(op, values_in);
  cluster::check_gains_args(op, feature_offsets, values_in.numel(), batch, m);
  const int64_t features = static_cast<int64_t>(feature_offsets.size()) - 1;
  const at::Tensor values = values_in.contiguous();
  at::Tensor out = at::empty({features}, values.options().dtype(at::kLong));
  int64_t* saved = out.data_ptr<int64_t>();
  std::vector<int8_t> steps;
  cluster_cpu::gain_steps(batch, m, steps);
  at::parallel_for(0, features, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> table;
    for (int64_t f = begin; f < end; ++f) {
      const int64_t n = feature_offsets[f + 1] - feature_offsets[f];
      saved[f] = values.scalar_type() == at::kInt
          ? cluster_cpu::feature_saved_keys(
                values.const_data_ptr<int32_t>() + feature_offsets[f], n, batch, steps.data(), table)
          : cluster_cpu::feature_saved_keys(
                values.const_data_ptr<int64_t>() + feature_offsets[f], n, batch, steps.data(), table);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> cluster_bag_signatures_cpu(
    const at::Tensor& values_in, const at::Tensor& offsets_in) {
  constexpr const char* op = "recxla::cluster_bag_signatures";
  cluster::check_keys(op, values_in);
  cluster::check_bag_offsets_tensor(op, offsets_in);
  const at::Tensor values = values_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t bags = offsets.numel() - 1;
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  cluster::check_bag_offsets(op, off, bags, values.numel());
  at::Tensor min_hash = at::empty({bags}, offsets.options());
  at::Tensor fingerprint = at::empty({bags}, offsets.options());
  int64_t* mh = min_hash.data_ptr<int64_t>();
  int64_t* fp = fingerprint.data_ptr<int64_t>();
  at::parallel_for(0, bags, cluster_cpu::kSignatureGrain, [&](int64_t begin, int64_t end) {
    if (values.scalar_type() == at::kInt) {
      cluster_cpu::bag_signatures(values.const_data_ptr<int32_t>(), off, begin, end, mh, fp);
    } else {
      cluster_cpu::bag_signatures(values.const_data_ptr<int64_t>(), off, begin, end, mh, fp);
    }
  });
  return {min_hash, fingerprint};
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("cluster_feature_gains", &cluster_feature_gains_cpu);
  m.impl("cluster_bag_signatures", &cluster_bag_signatures_cpu);
}

}  // namespace recxla
