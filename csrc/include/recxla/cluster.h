// Key-centric sample clustering: the per-value math shared by the CPU, CUDA and Triton kernels
// and the plain-PyTorch reference (recxla/reference/cluster.py, whose constants these equal).
//
// - key_hash: a bijection of int64 keys that scatters them, (key ^ salt) * odd mod 2**64;
// - fingerprint_mix: what a bag's fingerprint sums per key hash (a wrapping sum: equal bags
//   tie exactly, different ones with probability about 2**-64);
// - sampled_slot: the counting-table slot of a key hash when the feature's sampling keeps it;
// - gain_of_count: keys saved by clustering on a key seen c times, min(c, M) - ceil(c * M / B);
// - signature_sort_key: one int64 per bag from its min-hash and fingerprint;
// - gain_step, initial_bin: a count's step of gain_of_count, a group's first micro-batch (the
//   fused GPU path, recxla/cluster_fused.h, computes these per thread).
// All integer arithmetic: every backend gets the same bits. Signed values wrap through their
// unsigned bit patterns (no signed overflow); `>>` on int64_t is arithmetic, as in torch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RECXLA_CLUSTER_HD __host__ __device__ __forceinline__
#else
#define RECXLA_CLUSTER_HD inline __attribute__((always_inline))
#endif

namespace recxla {
namespace cluster {

constexpr uint64_t kHashSalt = UINT64_C(0x5EEDC1A5D1CEF00D);
constexpr uint64_t kHashMultiplier = UINT64_C(0x2545F4914F6CDD1D);
constexpr uint64_t kMixMultiplier = UINT64_C(0x9E3779B97F4A7C15);
constexpr int64_t kEmptySignature = INT64_MAX;  // the min-hash of an empty bag
// Tuning of the algorithm (see recxla/reference/cluster.py for what each one buys).
constexpr int kSortFeatures = 2;
constexpr int kRefineFeatures = 6;
constexpr int kRefineRounds = 4;
constexpr int64_t kBalanceSlack = 32;
constexpr int64_t kSampleValues = 8192;
constexpr double kWeightScale = 1048576.0;  // 2**20

RECXLA_CLUSTER_HD int64_t key_hash(int64_t key) {
  return static_cast<int64_t>((static_cast<uint64_t>(key) ^ kHashSalt) * kHashMultiplier);
}

RECXLA_CLUSTER_HD int64_t fingerprint_mix(int64_t h) {
  const uint64_t x = static_cast<uint64_t>(h ^ (h >> 29)) * kMixMultiplier;
  const int64_t s = static_cast<int64_t>(x);
  return s ^ (s >> 32);
}

// The reference clamps an arithmetic shift of h into [-1, 2**bits]; the same keys are sampled
// and share slots when the logical shift below is < 2**bits: that holds iff the top r_bits of
// h (sign included) are zero. With r_bits = 0 every key is sampled and the slot is the top
// `bits` bits. Needs 1 <= bits and r_bits + bits <= 64.
RECXLA_CLUSTER_HD uint64_t sampled_slot(int64_t h, int r_bits, int bits) {
  return static_cast<uint64_t>(h) >> (64 - r_bits - bits);
}

// c: the times a key was seen, 0 <= c; capped at B as in the reference.
RECXLA_CLUSTER_HD int64_t gain_of_count(int64_t c, int64_t batch, int64_t m) {
  c = c < batch ? c : batch;
  return (c < m ? c : m) - (c * m + batch - 1) / batch;
}

RECXLA_CLUSTER_HD int64_t signature_sort_key(int64_t min_hash, int64_t fingerprint) {
  constexpr uint64_t low32 = UINT64_C(0xFFFFFFFF);
  return static_cast<int64_t>(
      (static_cast<uint64_t>(min_hash) & ~low32) | (static_cast<uint64_t>(fingerprint) >> 32));
}

// What gain_of_count gains when a key's count goes from c to c + 1 (0 once c >= B, where the
// count is capped): summing it over every increment of a slot's count gives gain_of_count of
// the final count, in any order of the increments (integers: exact).
RECXLA_CLUSTER_HD int64_t gain_step(int64_t c, int64_t batch, int64_t m) {
  return c >= batch ? 0 : gain_of_count(c + 1, batch, m) - gain_of_count(c, batch, m);
}

// The first bin of a group whose middle sample sits at sorted position `middle` (0 <= middle
// < B): the chunk [j * B / M, (j + 1) * B / M) that holds it, i.e. the largest j <= M - 1 with
// floor(j * B / M) <= middle, which is j < (middle + 1) * M / B. No overflow for B < 2**31.
RECXLA_CLUSTER_HD int64_t initial_bin(int64_t middle, int64_t batch, int64_t m) {
  const int64_t j = ((middle + 1) * m - 1) / batch;
  return j < m - 1 ? j : m - 1;
}

// Number of bits of x (the reference's int.bit_length).
RECXLA_CLUSTER_HD int bit_length(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return x == 0 ? 0 : 64 - __clzll(static_cast<long long>(x));
#else
  return x == 0 ? 0 : 64 - __builtin_clzll(x);
#endif
}

// log2 of the sampling rate R of a feature with n values: R >= n / kSampleValues.
RECXLA_CLUSTER_HD int sample_bits(int64_t n) {
  return bit_length(static_cast<uint64_t>(n > 0 ? (n - 1) / kSampleValues : 0));
}

// log2 of a counting table for n sampled values: the power of two in [n, 2n), at least 2 slots.
// With n = max(N >> sample_bits(N), 1) it is at most 13 for any N: N <= kSampleValues * R.
RECXLA_CLUSTER_HD int table_bits(int64_t n) {
  const int b = bit_length(static_cast<uint64_t>(n - 1));
  return b > 1 ? b : 1;
}

// Host-side argument checks of the pass ops, shared by the CPU and CUDA kernels.
inline void check_keys(const char* op, const at::Tensor& values) {
  TORCH_CHECK_VALUE(values.dim() == 1, op, ": values must be 1-D [N], got ", values.dim(), "-D");
  TORCH_CHECK_TYPE(
      values.scalar_type() == at::kInt || values.scalar_type() == at::kLong, op,
      ": values must be int32 or int64 ids, got ", values.scalar_type());
}

// feature_offsets: F + 1 ints, from >= 0, non-decreasing, within n values, each feature below
// 2**32 values (the counting tables count in 32 bits); and 1 <= m <= batch.
inline void check_gains_args(
    const char* op, c10::IntArrayRef feature_offsets, int64_t n, int64_t batch, int64_t m) {
  TORCH_CHECK_VALUE(batch >= 1, op, ": batch_size must be >= 1, got ", batch);
  TORCH_CHECK_VALUE(
      1 <= m && m <= batch, op, ": num_micro_batches must be in [1, batch_size ", batch, "], got ",
      m);
  TORCH_CHECK_VALUE(
      !feature_offsets.empty(), op, ": feature_offsets must have F + 1 >= 1 entries, got 0");
  const int64_t features = static_cast<int64_t>(feature_offsets.size()) - 1;
  TORCH_CHECK_VALUE(
      feature_offsets[0] >= 0, op, ": feature_offsets[0] must be >= 0, got ", feature_offsets[0]);
  for (int64_t f = 0; f < features; ++f) {
    TORCH_CHECK_VALUE(
        feature_offsets[f] <= feature_offsets[f + 1], op,
        ": feature_offsets must be non-decreasing, but feature_offsets[", f,
        "]=", feature_offsets[f], " > feature_offsets[", f + 1, "]=", feature_offsets[f + 1]);
    TORCH_CHECK_VALUE(
        feature_offsets[f + 1] - feature_offsets[f] <= std::numeric_limits<uint32_t>::max(), op,
        ": feature ", f, " holds more than 2**32 - 1 values");
  }
  TORCH_CHECK_VALUE(
      feature_offsets[features] <= n, op, ": feature_offsets[-1]=", feature_offsets[features],
      " overruns values, which holds ", n);
}

inline void check_bag_offsets_tensor(const char* op, const at::Tensor& offsets) {
  TORCH_CHECK_VALUE(
      offsets.dim() == 1 && offsets.numel() >= 1, op,
      ": offsets must be 1-D [L + 1] with L + 1 >= 1 entries, got shape ", offsets.sizes());
  TORCH_CHECK_TYPE(
      offsets.scalar_type() == at::kLong, op, ": offsets must be int64, got ",
      offsets.scalar_type());
}

// off: a host array of L + 1 offsets into n values.
inline void check_bag_offsets(const char* op, const int64_t* off, int64_t bags, int64_t n) {
  TORCH_CHECK_VALUE(off[0] >= 0, op, ": offsets[0] must be >= 0, got ", off[0]);
  for (int64_t i = 0; i < bags; ++i) {
    TORCH_CHECK_VALUE(
        off[i] <= off[i + 1], op, ": offsets must be non-decreasing, but offsets[", i, "]=", off[i],
        " > offsets[", i + 1, "]=", off[i + 1]);
  }
  TORCH_CHECK_VALUE(
      off[bags] <= n, op, ": offsets[-1]=", off[bags], " overruns values, which holds ", n);
}

}  // namespace cluster
}  // namespace recxla
