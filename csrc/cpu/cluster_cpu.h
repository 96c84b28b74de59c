// Key-centric sample clustering on CPU: the per-value passes (csrc/cpu/cluster.cpp) that the
// whole-order kernel (csrc/cpu/cluster_order.cpp) and the pass ops share.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// x86-64-v4 has AVX-512 DQ: 64-bit multiplies (the hashes) and min in vector registers.
#define RECXLA_CLUSTER_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define RECXLA_CLUSTER_MULTIVERSION
#endif

namespace recxla {
namespace cluster_cpu {

// Pass 1: keys clustering is estimated to save on one feature of n values (the reference's
// feature_gains for one feature): the hash sample's slot counts c, min(c, M) - ceil(c * M / B)
// summed over the slots, times the sampling rate. steps: from `gain_steps`, for this B and M;
// `table` is scratch, reused between calls.
int64_t feature_saved_keys(
    const int64_t* values, int64_t n, int64_t batch, const int8_t* steps,
    std::vector<uint32_t>& table);
int64_t feature_saved_keys(
    const int32_t* values, int64_t n, int64_t batch, const int8_t* steps,
    std::vector<uint32_t>& table);

// steps[c] = gain_of_count(c + 1) - gain_of_count(c) for 0 <= c < B (each -1, 0 or 1), and
// steps[B] = 0: B + 1 entries.
void gain_steps(int64_t batch, int64_t m, std::vector<int8_t>& steps);

// Pass 2: the signatures of bags [first, last) (bag i = values[offsets[i]:offsets[i + 1]]):
// the smallest key hash (kEmptySignature for an empty bag; skipped when min_hash is null) and
// the wrapping sum of fingerprint_mix over the key hashes.
void bag_signatures(
    const int64_t* values, const int64_t* offsets, int64_t first, int64_t last, int64_t* min_hash,
    int64_t* fingerprint);
void bag_signatures(
    const int32_t* values, const int64_t* offsets, int64_t first, int64_t last, int64_t* min_hash,
    int64_t* fingerprint);

// Group moves (the reference's refine_bins with group_key_pairs; csrc/cpu/cluster_refine.cpp).
// values: the batch's ids (int32 when int32_values, else int64); for each of the R refine
// features i: bag_offsets[i * (B + 1) + s] .. [s + 1] bound sample s's bag in values,
// fingerprint[i * B + s] is its fingerprint and weights[i] its integer bytes per key; order[pos]:
// the sample at each position of the sorted order; group_in_order[pos]: its group (groups are
// runs of positions, numbered 0..G-1). Writes the bin of every group to bins [G].
void refine_bins(
    const void* values, bool int32_values, const int64_t* bag_offsets, const int64_t* fingerprint,
    const int32_t* weights, int64_t num_features, const int32_t* order,
    const int32_t* group_in_order, int64_t num_groups, int64_t batch, int64_t m, int32_t* bins);

// A buffer of at least n elements, grown only: scratch reused from call to call.
template <typename T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Bags per parallel task of the signature pass: below this threads cost more than they save.
constexpr int64_t kSignatureGrain = 2048;

}  // namespace cluster_cpu
}  // namespace recxla
