// Segmented key dedup: what the CPU and CUDA kernels share.
//
// Contract (recxla.ops.dedup.segmented_unique): values [N] int32/int64 hold S segments laid one
// after another, segment s = values[offsets[s]:offsets[s + 1]]. The result lists each segment's
// distinct keys in ascending order, segments in order (unique_values, unique_offsets [S + 1]), and
// inverse [N] with values[i] == unique_values[inverse[i]].
//
// Shared here:
// - the argument checks, run on the host copy of offsets by both kernels, so a bad offsets tensor
//   raises the same ValueError before any work on every device;
// - the order-preserving map of a signed key onto unsigned bits (CPU radix sort and key ranges);
// - the head rule of the sort-based kernels (CUDA, Triton): a sorted position starts a new
//   unique key when it starts a segment or differs from its left neighbour;
// - the packed sort of the CUDA variant "packed_radix_sort" (csrc/cuda/dedup_packed.cuh): the
//   plan that decides whether (segment, key) fits one 32- or 64-bit word, and the per-position
//   steps around the sort, which its host mirror (recxla::_dedup_packed_host) runs on CPU.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RECXLA_DEDUP_HD __host__ __device__ __forceinline__
#else
#define RECXLA_DEDUP_HD inline __attribute__((always_inline))
#endif

#include <ATen/ATen.h>

namespace recxla {
namespace dedup {

// Signed keys map onto unsigned integers of the same order (flip the sign bit), so ranges and
// radix digits work on plain unsigned arithmetic and negative keys need no special case.
template <typename key_t>
RECXLA_DEDUP_HD uint64_t ordered_bits(key_t key) {
  static_assert(std::is_signed_v<key_t> && std::is_integral_v<key_t>, "signed integer keys");
  using ukey_t = std::make_unsigned_t<key_t>;
  constexpr ukey_t sign = ukey_t{1} << (8 * sizeof(key_t) - 1);
  return static_cast<uint64_t>(static_cast<ukey_t>(key) ^ sign);
}

template <typename key_t>
RECXLA_DEDUP_HD key_t from_ordered_bits(uint64_t bits) {
  using ukey_t = std::make_unsigned_t<key_t>;
  constexpr ukey_t sign = ukey_t{1} << (8 * sizeof(key_t) - 1);
  return static_cast<key_t>(static_cast<ukey_t>(bits) ^ sign);
}

// Position i of a segment-sorted key array starts a new unique key. `segment_start` is true when
// i is the first position of its segment (equal keys in different segments stay distinct).
template <typename key_t>
RECXLA_DEDUP_HD bool is_head(int64_t i, bool segment_start, key_t key, key_t left) {
  return i == 0 || segment_start || key != left;
}

// The CPU hash table numbers a segment's keys with 32 bits: a segment may hold at most this many
// keys (16 GiB of int32 keys).
constexpr int64_t kMaxSegmentKeys = std::numeric_limits<uint32_t>::max() - 1;

// Host-side checks. values: 1-D int32/int64; offsets: 1-D int64, S + 1 >= 1 entries, same device.
inline void check_dedup_args(const char* op, const at::Tensor& values, const at::Tensor& offsets) {
  TORCH_CHECK_VALUE(values.dim() == 1, op, ": values must be 1-D [N], got ", values.dim(), "-D");
  TORCH_CHECK_TYPE(
      values.scalar_type() == at::kInt || values.scalar_type() == at::kLong, op,
      ": values must be int32 or int64, got ", values.scalar_type());
  TORCH_CHECK_VALUE(
      offsets.dim() == 1, op, ": offsets must be 1-D [S + 1], got ", offsets.dim(), "-D");
  TORCH_CHECK_TYPE(
      offsets.scalar_type() == at::kLong, op, ": offsets must be int64, got ",
      offsets.scalar_type());
  TORCH_CHECK_VALUE(
      offsets.numel() >= 1, op, ": offsets must have S + 1 >= 1 entries (offsets[0] == 0), got 0");
  TORCH_CHECK_VALUE(
      values.device() == offsets.device(), op, ": values and offsets must be on one device, got ",
      values.device(), " and ", offsets.device());
}

// The out= tensors of segmented_unique_out: dtypes, device and layout (they are resized by the
// op; a storage that is large enough is kept).
inline void check_dedup_out(
    const char* op, const at::Tensor& values, const at::Tensor& unique_values,
    const at::Tensor& unique_offsets, const at::Tensor& inverse) {
  const std::pair<const char*, const at::Tensor*> outs[] = {
      {"unique_values", &unique_values}, {"unique_offsets", &unique_offsets},
      {"inverse", &inverse}};
  for (const auto& [name, t] : outs) {
    TORCH_CHECK_VALUE(t->device() == values.device(), op, ": ", name, " must be on ",
                      values.device(), " like values, got ", t->device());
    TORCH_CHECK_VALUE(t->dim() == 1 && t->is_contiguous(), op, ": ", name,
                      " must be a contiguous 1-D tensor, got shape ", t->sizes(), " strides ",
                      t->strides());
    TORCH_CHECK_VALUE(!t->is_same(values), op, ": ", name, " must not be values itself");
  }
  TORCH_CHECK_TYPE(unique_values.scalar_type() == values.scalar_type(), op,
                   ": unique_values must have values' dtype ", values.scalar_type(), ", got ",
                   unique_values.scalar_type());
  TORCH_CHECK_TYPE(unique_offsets.scalar_type() == at::kLong, op,
                   ": unique_offsets must be int64, got ", unique_offsets.scalar_type());
  TORCH_CHECK_TYPE(inverse.scalar_type() == at::kLong, op, ": inverse must be int64, got ",
                   inverse.scalar_type());
}

// offsets: a contiguous host array of S + 1 entries. Checked before any work: a bad offset
// would otherwise read or write out of bounds.
inline void check_dedup_offsets(const char* op, const int64_t* offsets, int64_t count, int64_t n) {
  TORCH_CHECK_VALUE(offsets[0] == 0, op, ": offsets[0] must be 0, got ", offsets[0]);
  for (int64_t s = 0; s + 1 < count; ++s) {
    TORCH_CHECK_VALUE(
        offsets[s] <= offsets[s + 1], op, ": offsets must be non-decreasing, but offsets[", s,
        "]=", offsets[s], " > offsets[", s + 1, "]=", offsets[s + 1]);
    TORCH_CHECK_VALUE(
        offsets[s + 1] - offsets[s] <= kMaxSegmentKeys, op, ": segment ", s, " holds ",
        offsets[s + 1] - offsets[s], " keys, more than the limit of ", kMaxSegmentKeys);
  }
  TORCH_CHECK_VALUE(
      offsets[count - 1] == n, op, ": offsets[-1] must equal values.numel()=", n, ", got ",
      offsets[count - 1]);
}

// ---------------------------------------------------------------------------------------------
// The packed sort. Each key becomes one unsigned word
//     word = (segment << key_bits) | (ordered_bits(key) - lo)
// where [lo, hi] is the range of all keys' ordered bits and key_bits the width of hi - lo. One
// device-wide radix sort of the words on bits [0, end_bit) then orders the keys by (segment,
// key), and two positions hold equal words exactly when they hold equal keys of one segment:
// the head rule needs no segment test (is_head with segment_start = false).

struct PackedPlan {
  int key_bits;      // width of hi - lo (0 when every key is equal)
  int segment_bits;  // width of S - 1 (0 for one segment)
  int end_bit;       // key_bits + segment_bits: the sort's bits are [0, end_bit)
  int word_bytes;    // 4 (end_bit <= 32) or 8 (<= 64); 0 when the word does not fit in 64 bits,
                     // and the CUDA op runs the segmented sort instead
};

// segments: S >= 1; lo <= hi: the least and greatest ordered_bits of the keys.
inline PackedPlan packed_sort_plan(int64_t segments, uint64_t lo, uint64_t hi) {
  TORCH_CHECK(segments >= 1 && lo <= hi,
              "recxla::packed_sort_plan: needs S >= 1 and lo <= hi, got S=", segments, " lo=", lo,
              " hi=", hi);
  PackedPlan plan;
  plan.key_bits = static_cast<int>(std::bit_width(hi - lo));
  plan.segment_bits = static_cast<int>(std::bit_width(static_cast<uint64_t>(segments - 1)));
  plan.end_bit = plan.key_bits + plan.segment_bits;
  // 32-bit words halve the bytes of every sort pass; the pass count is the same for a given
  // end_bit (CUB's onesweep sorts 8 bits a pass either way).
  plan.word_bytes = plan.end_bit <= 32 ? 4 : plan.end_bit <= 64 ? 8 : 0;
  return plan;
}

// The segment of position i (0 <= i < N, offsets checked): the last s with offsets[s] <= i. An
// empty segment shares its offset with the next one, so the search passes over it. A binary
// search over the S + 1 offsets, which stay in L1 on a GPU.
RECXLA_DEDUP_HD int64_t segment_of(const int64_t* offsets, int64_t count, int64_t i) {
  int64_t lo = 0, hi = count;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

// The word of a key: segment above the key's offset from lo. key_bits == 64 leaves no room for
// a segment (the plan then has segment_bits == 0, so segment == 0), and a shift by 64 would be
// undefined.
RECXLA_DEDUP_HD uint64_t pack_key(int64_t segment, uint64_t ordered, uint64_t lo, int key_bits) {
  const uint64_t offset = ordered - lo;
  return key_bits < 64 ? (static_cast<uint64_t>(segment) << key_bits) | offset : offset;
}

// The key of a word (the inverse of pack_key for any segment).
template <typename key_t>
RECXLA_DEDUP_HD key_t unpack_key(uint64_t word, uint64_t lo, int key_bits) {
  const uint64_t mask = key_bits < 64 ? (uint64_t{1} << key_bits) - 1 : ~uint64_t{0};
  return from_ordered_bits<key_t>(lo + (word & mask));
}

// Segment s's unique keys start after the heads that sort before its first position, since a
// segment-major sort leaves every segment at its own offsets. numbers: the inclusive count of
// heads at each sorted position.
template <typename number_t>
RECXLA_DEDUP_HD int64_t unique_offset(const int64_t* offsets, const number_t* numbers, int64_t s) {
  return offsets[s] > 0 ? static_cast<int64_t>(numbers[offsets[s] - 1]) : 0;
}

}  // namespace dedup
}  // namespace recxla
