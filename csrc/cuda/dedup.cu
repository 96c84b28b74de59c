// Segmented key dedup on CUDA: sort, mark heads, scan, scatter.
//
// 1. CUB's segmented radix sort orders each segment's keys, carrying their int32 positions;
// 2. a sorted position is a head when it starts a segment or differs from its left neighbour
//    (recxla/dedup.h `is_head`, the rule the Triton path uses too);
// 3. an inclusive sum of the head flags numbers the unique keys 1..U;
// 4. one kernel scatters each head's key to unique_values and every key's number - 1 to
//    inverse[position]; another reads unique_offsets off the sum at the segment bounds.
// The output size U is data-dependent, so it is read back once (one device sync); offsets are
// copied to the host first so that bad offsets raise the same ValueError as on CPU.
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

#include "recxla/dedup.h"

namespace recxla {
namespace {

namespace cub = ::recxla_cub::cub;

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads));
}

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

// Runs a CUB device-wide algorithm twice, as CUB wants: to size its scratch, then for real.
template <typename Call>
void run_cub(const at::Tensor& like, Call&& call) {
  size_t bytes = 0;
  C10_CUDA_CHECK(call(nullptr, bytes));
  // At least one byte: a null scratch pointer would make the second call a size query again.
  const int64_t size = std::max<int64_t>(1, static_cast<int64_t>(bytes));
  at::Tensor scratch = at::empty({size}, like.options().dtype(at::kByte));
  C10_CUDA_CHECK(call(scratch.data_ptr(), bytes));
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> segmented_unique_cuda(
    const at::Tensor& values_in, const at::Tensor& offsets_in) {
  constexpr const char* op = "recxla::segmented_unique";
  dedup::check_dedup_args(op, values_in, offsets_in);
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t n = values_in.numel();
  const int64_t count = offsets.numel();
  {
    const at::Tensor host = offsets.to(at::kCPU);
    dedup::check_dedup_offsets(op, host.const_data_ptr<int64_t>(), count, n);
  }
  TORCH_CHECK_VALUE(
      n <= std::numeric_limits<int>::max() && count - 1 <= std::numeric_limits<int>::max(), op,
      ": on CUDA values may hold at most ", std::numeric_limits<int>::max(),
      " keys in at most as many segments (CUB's limit), got ", n, " keys");
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

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) {
  m.impl("segmented_unique", &segmented_unique_cuda);
  m.impl("segmented_unique_out", &segmented_unique_out_cuda);
}

}  // namespace recxla
