// Segmented key dedup on CUDA: sort, mark heads, scan, scatter. Two variants (the family
// "dedup" of recxla/gpu_variants.h picks one per architecture):
//
// "segmented_sort" (index 0, the fallback):
// 1. CUB's segmented radix sort orders each segment's keys, carrying their int32 positions;
// 2. a sorted position is a head when it starts a segment or differs from its left neighbour
//    (recxla/dedup.h `is_head`, the rule the Triton path uses too);
// 3. an inclusive sum of the head flags numbers the unique keys 1..U;
// 4. one kernel scatters each head's key to unique_values and every key's number - 1 to
//    inverse[position]; another reads unique_offsets off the sum at the segment bounds.
// The output size U is data-dependent, so it is read back once (one device sync); offsets are
// copied to the host first so that bad offsets raise the same ValueError as on CPU.
//
// "packed_radix_sort" (dedup_packed.cuh): the segment id and the key share one word and one
// device-wide radix sort of the words replaces the segmented sort, whose one thread block per
// segment leaves most SMs idle; the offsets' host copy also brings the keys' range. A batch
// whose (segment, key) word needs more than 64 bits runs the segmented sort.
//
// CUB is compiled into a namespace of recxla's own: torch and other extensions carry their own
// copies of CUB's kernels, and the wrapped namespace keeps the symbols from colliding.
#define CUB_WRAPPED_NAMESPACE recxla_cub
#include <cub/cub.cuh>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "dedup_packed.cuh"
#include "recxla/dedup.h"
#include "recxla/gpu_variants.h"

namespace recxla {
namespace {

namespace cub = ::recxla_cub::cub;
using dedup_cuda::blocks_for;
using dedup_cuda::kThreads;
using dedup_cuda::run_cub;

// The index of "packed_radix_sort" among the family's variants (csrc/gpu_variants.cpp); every
// other index runs "segmented_sort".
constexpr int kPackedRadixSort = 1;

// Position i starts a segment when it equals some offsets[s] (i < N, so that segment is not
// empty); a binary search over the S + 1 offsets, which stay in L1.
__device__ __forceinline__ bool starts_segment(const int64_t* offsets, int64_t count, int64_t i) {
  int64_t lo = 0, hi = count;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] < i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < count && offsets[lo] == i;
}

template <typename key_t>
__global__ void mark_heads_kernel(
    const key_t* __restrict__ keys, const int64_t* __restrict__ offsets, int64_t count, int64_t n,
    int64_t* __restrict__ heads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const key_t key = keys[i];
  const key_t left = i > 0 ? keys[i - 1] : key;
  heads[i] = dedup::is_head(i, starts_segment(offsets, count, i), key, left) ? 1 : 0;
}

template <typename key_t>
__global__ void scatter_kernel(
    const key_t* __restrict__ keys, const int32_t* __restrict__ positions,
    const int64_t* __restrict__ heads, const int64_t* __restrict__ numbers, int64_t n,
    key_t* __restrict__ unique_values, int64_t* __restrict__ inverse) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t index = numbers[i] - 1;  // the inclusive sum counts this head too
  inverse[positions[i]] = index;
  if (heads[i]) unique_values[index] = keys[i];
}

__global__ void unique_offsets_kernel(
    const int64_t* __restrict__ offsets, const int64_t* __restrict__ numbers, int64_t count,
    int64_t* __restrict__ unique_offsets) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= count) return;
  // Segment s's uniques start after the heads that precede its first position.
  unique_offsets[s] = offsets[s] > 0 ? numbers[offsets[s] - 1] : 0;
}

template <typename key_t>
at::Tensor dedup_sorted(
    const at::Tensor& values, const at::Tensor& offsets, at::Tensor& inverse,
    at::Tensor& unique_offsets) {
  const int64_t n = values.numel();
  const int64_t count = offsets.numel();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t* off = offsets.const_data_ptr<int64_t>();

  at::Tensor positions = at::arange(n, values.options().dtype(at::kInt));
  at::Tensor sorted_keys = at::empty_like(values);
  at::Tensor sorted_positions = at::empty_like(positions);
  run_cub(values, [&](void* scratch, size_t& bytes) {
    return cub::DeviceSegmentedRadixSort::SortPairs(
        scratch, bytes, values.const_data_ptr<key_t>(), sorted_keys.data_ptr<key_t>(),
        positions.const_data_ptr<int32_t>(), sorted_positions.data_ptr<int32_t>(),
        static_cast<int>(n), static_cast<int>(count - 1), off, off + 1, 0,
        static_cast<int>(8 * sizeof(key_t)), stream.stream());
  });

  at::Tensor heads = at::empty({n}, values.options().dtype(at::kLong));
  mark_heads_kernel<key_t><<<blocks_for(n), kThreads, 0, stream>>>(
      sorted_keys.const_data_ptr<key_t>(), off, count, n, heads.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  at::Tensor numbers = at::empty_like(heads);
  run_cub(values, [&](void* scratch, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(
        scratch, bytes, heads.const_data_ptr<int64_t>(), numbers.data_ptr<int64_t>(),
        static_cast<int>(n), stream.stream());
  });

  const int64_t unique_count = numbers[n - 1].item<int64_t>();
  at::Tensor unique_values = at::empty({unique_count}, values.options());
  scatter_kernel<key_t><<<blocks_for(n), kThreads, 0, stream>>>(
      sorted_keys.const_data_ptr<key_t>(), sorted_positions.const_data_ptr<int32_t>(),
      heads.const_data_ptr<int64_t>(), numbers.const_data_ptr<int64_t>(), n,
      unique_values.data_ptr<key_t>(), inverse.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  unique_offsets_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
      off, numbers.const_data_ptr<int64_t>(), count, unique_offsets.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return unique_values;
}

void check_cub_limit(const char* op, int64_t n, int64_t count) {
  TORCH_CHECK_VALUE(
      n <= std::numeric_limits<int>::max() && count - 1 <= std::numeric_limits<int>::max(), op,
      ": on CUDA values may hold at most ", std::numeric_limits<int>::max(),
      " keys in at most as many segments (CUB's limit), got ", n, " keys");
}

// The packed variant: the range read with the offsets, then the packed sort where the plan fits
// and the segmented sort where it does not. Returns unique_values.
template <typename key_t>
at::Tensor dedup_packed_or_sorted(const char* op, const at::Tensor& values,
                                  const at::Tensor& offsets, at::Tensor& inverse,
                                  at::Tensor& unique_offsets) {
  const int64_t n = values.numel();
  const int64_t count = offsets.numel();
  const dedup_cuda::Probe probe = dedup_cuda::read_probe<key_t>(values, offsets);
  dedup::check_dedup_offsets(op, probe.offsets.data(), count, n);
  check_cub_limit(op, n, count);
  const dedup::PackedPlan plan = dedup::packed_sort_plan(count - 1, probe.lo, probe.hi);
  if (plan.word_bytes == 4) {
    return dedup_cuda::dedup_packed<key_t, uint32_t>(values, offsets, plan, probe.lo, inverse,
                                                     unique_offsets);
  }
  if (plan.word_bytes == 8) {
    return dedup_cuda::dedup_packed<key_t, uint64_t>(values, offsets, plan, probe.lo, inverse,
                                                     unique_offsets);
  }
  return dedup_sorted<key_t>(values, offsets, inverse, unique_offsets);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> segmented_unique_cuda(
    const at::Tensor& values_in, const at::Tensor& offsets_in) {
  constexpr const char* op = "recxla::segmented_unique";
  dedup::check_dedup_args(op, values_in, offsets_in);
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t n = values_in.numel();
  const int64_t count = offsets.numel();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int variant = gpu_variants::chosen("dedup", 10 * props->major + props->minor);
  if (variant == kPackedRadixSort && n > 0) {
    // The probe reads values and offsets only within their sizes, so it may run before the
    // offsets are checked; nothing else does.
    const at::Tensor values = values_in.contiguous();
    at::Tensor inverse = at::empty({n}, values.options().dtype(at::kLong));
    at::Tensor unique_offsets = at::empty({count}, offsets.options());  // every entry written
    at::Tensor unique_values =
        values.scalar_type() == at::kInt
            ? dedup_packed_or_sorted<int32_t>(op, values, offsets, inverse, unique_offsets)
            : dedup_packed_or_sorted<int64_t>(op, values, offsets, inverse, unique_offsets);
    return {unique_values, unique_offsets, inverse};
  }
  {
    const at::Tensor host = offsets.to(at::kCPU);
    dedup::check_dedup_offsets(op, host.const_data_ptr<int64_t>(), count, n);
  }
  check_cub_limit(op, n, count);
  const at::Tensor values = values_in.contiguous();
  at::Tensor inverse = at::empty({n}, values.options().dtype(at::kLong));
  at::Tensor unique_offsets = at::zeros({count}, offsets.options());
  if (n == 0) return {at::empty({0}, values.options()), unique_offsets, inverse};
  at::Tensor unique_values =
      values.scalar_type() == at::kInt
          ? dedup_sorted<int32_t>(values, offsets, inverse, unique_offsets)
          : dedup_sorted<int64_t>(values, offsets, inverse, unique_offsets);
  return {unique_values, unique_offsets, inverse};
}

// Into caller-owned tensors (resized as out= arguments are). The caching allocator already
// reuses device memory, so this computes as above and copies: the out= form exists on CUDA for
// callers that keep one code path for both devices.
int64_t segmented_unique_out_cuda(
    const at::Tensor& values, const at::Tensor& offsets, at::Tensor& unique_values,
    at::Tensor& unique_offsets, at::Tensor& inverse) {
  dedup::check_dedup_out("recxla::segmented_unique_out", values, unique_values, unique_offsets,
                         inverse);
  const auto [u, uo, inv] = segmented_unique_cuda(values, offsets);
  unique_values.resize_(u.sizes()).copy_(u);
  unique_offsets.resize_(uo.sizes()).copy_(uo);
  inverse.resize_(inv.sizes()).copy_(inv);
  return u.numel();
}

// Test hooks of the packed variant (tests/test_dedup.py), so that its plan and every step around
// the sort run on machines without a GPU.

// [key_bits, segment_bits, end_bit, word_bytes] of a batch of `segments` segments whose keys of
// `dtype` span [key_min, key_max].
std::vector<int64_t> packed_plan_op(int64_t segments, int64_t key_min, int64_t key_max,
                                    c10::ScalarType dtype) {
  constexpr const char* op = "recxla::_dedup_packed_plan";
  TORCH_CHECK_TYPE(dtype == at::kInt || dtype == at::kLong, op,
                   ": dtype must be int32 or int64, got ", dtype);
  TORCH_CHECK_VALUE(segments >= 1 && key_min <= key_max, op,
                    ": needs segments >= 1 and key_min <= key_max, got ", segments, ", ",
                    key_min, ", ", key_max);
  uint64_t lo = dedup::ordered_bits(key_min), hi = dedup::ordered_bits(key_max);
  if (dtype == at::kInt) {
    constexpr int64_t low = std::numeric_limits<int32_t>::min();
    constexpr int64_t high = std::numeric_limits<int32_t>::max();
    TORCH_CHECK_VALUE(key_min >= low && key_max <= high, op, ": int32 keys must lie in [", low,
                      ", ", high, "], got [", key_min, ", ", key_max, "]");
    lo = dedup::ordered_bits(static_cast<int32_t>(key_min));
    hi = dedup::ordered_bits(static_cast<int32_t>(key_max));
  }
  const dedup::PackedPlan plan = dedup::packed_sort_plan(segments, lo, hi);
  return {plan.key_bits, plan.segment_bits, plan.end_bit, plan.word_bytes};
}

template <typename key_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_host(const char* op,
                                                           const at::Tensor& values,
                                                           const at::Tensor& offsets) {
  const int64_t n = values.numel();
  const int64_t count = offsets.numel();
  const key_t* v = values.const_data_ptr<key_t>();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  at::Tensor unique_offsets = at::zeros({count}, offsets.options());
  at::Tensor inverse = at::empty({n}, offsets.options());
  if (n == 0) return {at::empty({0}, values.options()), unique_offsets, inverse};
  uint64_t lo = dedup::ordered_bits(v[0]), hi = lo;
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, dedup::ordered_bits(v[i]));
    hi = std::max(hi, dedup::ordered_bits(v[i]));
  }
  const dedup::PackedPlan plan = dedup::packed_sort_plan(count - 1, lo, hi);
  TORCH_CHECK_VALUE(plan.word_bytes != 0, op, ": (segment, key) needs ", plan.end_bit,
                    " bits, more than 64; the CUDA op runs the segmented sort for such a batch");
  std::vector<key_t> uniques;
  if (plan.word_bytes == 4) {
    dedup_cuda::packed_host_steps<key_t, uint32_t>(v, off, count, n, lo, plan, uniques,
                                                   unique_offsets.data_ptr<int64_t>(),
                                                   inverse.data_ptr<int64_t>());
  } else {
    dedup_cuda::packed_host_steps<key_t, uint64_t>(v, off, count, n, lo, plan, uniques,
                                                   unique_offsets.data_ptr<int64_t>(),
                                                   inverse.data_ptr<int64_t>());
  }
  at::Tensor unique_values = at::empty({static_cast<int64_t>(uniques.size())}, values.options());
  std::copy(uniques.begin(), uniques.end(), unique_values.data_ptr<key_t>());
  return {unique_values, unique_offsets, inverse};
}

// The packed variant's steps on CPU tensors (std::sort for CUB's radix sort).
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_host_op(const at::Tensor& values_in,
                                                              const at::Tensor& offsets_in) {
  constexpr const char* op = "recxla::_dedup_packed_host";
  dedup::check_dedup_args(op, values_in, offsets_in);
  TORCH_CHECK_VALUE(values_in.device().is_cpu(), op, ": values must be on the CPU, got ",
                    values_in.device());
  const at::Tensor values = values_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  dedup::check_dedup_offsets(op, offsets.const_data_ptr<int64_t>(), offsets.numel(),
                             values.numel());
  check_cub_limit(op, values.numel(), offsets.numel());
  return values.scalar_type() == at::kInt ? packed_host<int32_t>(op, values, offsets)
                                          : packed_host<int64_t>(op, values, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) {
  m.impl("segmented_unique", &segmented_unique_cuda);
  m.impl("segmented_unique_out", &segmented_unique_out_cuda);
}

// Test hooks, defined only in builds with the CUDA kernels (recxla.built_with_cuda()).
TORCH_LIBRARY_FRAGMENT(recxla, m) {
  m.def("_dedup_packed_plan(int segments, int key_min, int key_max, ScalarType dtype) -> int[]",
        &packed_plan_op);
  m.def("_dedup_packed_host(Tensor values, Tensor offsets) -> (Tensor, Tensor, Tensor)",
        &packed_host_op);
}

}  // namespace recxla
