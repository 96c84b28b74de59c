// The "packed_radix_sort" variant of segmented key dedup on CUDA (included by dedup.cu), and the
// CUB plumbing both variants share.
//
// Why it beats the segmented sort: CUB's segmented radix sort gives each segment ONE thread
// block, which runs every 6-bit digit pass of all 64 key bits (11 passes, each an upsweep and a
// downsweep over the segment) alone. A Criteo batch has 26 segments of 8-17k keys, so 26 of an
// H100's 132 SMs work, each through ~22 sweeps of its segment in a row. Here the segment id and
// the key's offset from the smallest key share one word (recxla/dedup.h, `pack_key`), and one
// device-wide onesweep radix sort orders all words on their end_bit significant bits: 29 bits
// (24 key + 5 segment) on a Criteo batch, 4 passes of 8 bits over 32-bit words, each pass a
// single sweep spread over every tile of the whole batch.
//
// Steps (one sync for the key range and the offsets check, one for the unique count):
// 1. probe: the offsets and the keys' least and greatest ordered bits into one small buffer,
//    read by the host in one copy; the host checks the offsets and picks the plan;
// 2. pack: word and int32 position of every key;
// 3. CUB DeviceRadixSort::SortPairs on (word, position), double-buffered (no copy back);
// 4. heads (int32 flags) and their inclusive sum (int32 numbers: n < 2^31), unique offsets;
// 5. read U, then scatter: each head's key to unique_values, every number - 1 to
//    inverse[position].
// The host mirror at the end runs the same steps on CPU with std::sort for CUB, so that every
// per-position step is tested on machines without a GPU.
#pragma once

#ifndef CUB_WRAPPED_NAMESPACE
#define CUB_WRAPPED_NAMESPACE recxla_cub
#endif
#include <cub/cub.cuh>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

#include "recxla/dedup.h"

namespace recxla {
namespace dedup_cuda {

namespace cub = ::recxla_cub::cub;

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads));
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

// ---------------------------------------------------------------------------------------------
// 1. The probe: probe[0:count) = offsets, probe[count] = max of ~ordered (so ~probe[count] is
// the least ordered key) and probe[count + 1] = max of ordered. Both maxima start at 0 (one
// memset), which neither can lose to, so complementing the minimum saves a second fill.

constexpr int kProbeThreads = 256;

__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
  for (int d = 16; d > 0; d /= 2) {
    const unsigned long long other = __shfl_down_sync(0xffffffffu, v, d);
    v = other > v ? other : v;
  }
  return v;
}

template <typename key_t>
__global__ void __launch_bounds__(kProbeThreads) probe_kernel(
    const key_t* __restrict__ values, int64_t n, const int64_t* __restrict__ offsets,
    int64_t count, unsigned long long* __restrict__ probe) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = first; s < count; s += stride) {
    probe[s] = static_cast<unsigned long long>(offsets[s]);
  }
  unsigned long long not_low = 0, high = 0;
  for (int64_t i = first; i < n; i += stride) {
    const unsigned long long bits = dedup::ordered_bits(values[i]);
    not_low = ~bits > not_low ? ~bits : not_low;
    high = bits > high ? bits : high;
  }
  // Every thread reaches the shuffles (no early return), as the full mask requires.
  not_low = warp_max(not_low);
  high = warp_max(high);
  __shared__ unsigned long long partial[2][kProbeThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    partial[0][warp] = not_low;
    partial[1][warp] = high;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    not_low = lane < warps ? partial[0][lane] : 0;
    high = lane < warps ? partial[1][lane] : 0;
    not_low = warp_max(not_low);
    high = warp_max(high);
    if (lane == 0) {
      atomicMax(probe + count, not_low);
      atomicMax(probe + count + 1, high);
    }
  }
}

struct Probe {
  std::vector<int64_t> offsets;  // the S + 1 offsets, on the host
  uint64_t lo = 0, hi = 0;       // least and greatest ordered bits of the keys (n > 0)
};

// offsets: contiguous int64 on values' device; values: contiguous, n > 0. One device sync.
template <typename key_t>
Probe read_probe(const at::Tensor& values, const at::Tensor& offsets) {
  const int64_t n = values.numel();
  const int64_t count = offsets.numel();
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor probe = at::empty({count + 2}, offsets.options());
  auto* bits = reinterpret_cast<unsigned long long*>(probe.data_ptr<int64_t>());
  C10_CUDA_CHECK(cudaMemsetAsync(bits + count, 0, 2 * sizeof(unsigned long long), stream));
  // Eight keys a thread before the grid strides: 128 blocks for a Criteo batch, and few enough
  // block results for the two atomics per block not to queue.
  const int64_t blocks = std::clamp<int64_t>((n + 8 * kProbeThreads - 1) / (8 * kProbeThreads),
                                             1, 1024);
  probe_kernel<key_t><<<static_cast<int>(blocks), kProbeThreads, 0, stream>>>(
      values.const_data_ptr<key_t>(), n, offsets.const_data_ptr<int64_t>(), count, bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Probe out;
  out.offsets.resize(count + 2);
  c10::cuda::memcpy_and_sync(out.offsets.data(), bits, (count + 2) * sizeof(int64_t),
                             cudaMemcpyDeviceToHost, stream);
  out.lo = ~static_cast<uint64_t>(out.offsets[count]);
  out.hi = static_cast<uint64_t>(out.offsets[count + 1]);
  out.offsets.resize(count);
  return out;
}

// ---------------------------------------------------------------------------------------------
// 2-5. Pack, sort, number, scatter.

template <typename key_t, typename word_t>
__global__ void pack_kernel(
    const key_t* __restrict__ values, const int64_t* __restrict__ offsets, int64_t count,
    int64_t n, uint64_t lo, int key_bits, word_t* __restrict__ words,
    int32_t* __restrict__ positions) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  // The plan guarantees the word fits word_t: the cast drops only zero bits.
  words[i] = static_cast<word_t>(dedup::pack_key(dedup::segment_of(offsets, count, i),
                                                 dedup::ordered_bits(values[i]), lo, key_bits));
  positions[i] = static_cast<int32_t>(i);
}

template <typename word_t>
__global__ void packed_heads_kernel(const word_t* __restrict__ words, int64_t n,
                                    int32_t* __restrict__ heads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const word_t word = words[i];
  heads[i] = dedup::is_head(i, false, word, i > 0 ? words[i - 1] : word) ? 1 : 0;
}

__global__ void packed_unique_offsets_kernel(
    const int64_t* __restrict__ offsets, const int32_t* __restrict__ numbers, int64_t count,
    int64_t* __restrict__ unique_offsets) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= count) return;
  unique_offsets[s] = dedup::unique_offset(offsets, numbers, s);
}

template <typename key_t, typename word_t>
__global__ void packed_scatter_kernel(
    const word_t* __restrict__ words, const int32_t* __restrict__ positions,
    const int32_t* __restrict__ numbers, int64_t n, uint64_t lo, int key_bits,
    key_t* __restrict__ unique_values, int64_t* __restrict__ inverse) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const word_t word = words[i];
  const int32_t index = numbers[i] - 1;  // the inclusive sum counts this head too
  inverse[positions[i]] = index;
  if (dedup::is_head(i, false, word, i > 0 ? words[i - 1] : word)) {
    unique_values[index] = dedup::unpack_key<key_t>(word, lo, key_bits);
  }
}

// values: contiguous, 0 < n <= INT_MAX; offsets: checked, contiguous, on the device; plan fits
// word_t. Writes inverse [n] and unique_offsets [S + 1]; returns unique_values.
template <typename key_t, typename word_t>
at::Tensor dedup_packed(const at::Tensor& values, const at::Tensor& offsets,
                        const dedup::PackedPlan& plan, uint64_t lo, at::Tensor& inverse,
                        at::Tensor& unique_offsets) {
  static_assert(sizeof(word_t) == 4 || sizeof(word_t) == 8, "32- or 64-bit words");
  const int64_t n = values.numel();
  const int64_t count = offsets.numel();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const auto word_dtype = sizeof(word_t) == 4 ? at::kInt : at::kLong;  // bit patterns only

  // Both halves of each double buffer: CUB sorts back and forth between them and says which
  // half holds the result, so no pass copies back. The second half starts 512-byte aligned
  // like the first (a stride of whole 128-element blocks), as a tensor of its own would.
  const int64_t stride = (n + 127) / 128 * 128;
  at::Tensor words = at::empty({2 * stride}, values.options().dtype(word_dtype));
  at::Tensor positions = at::empty({2 * stride}, values.options().dtype(at::kInt));
  word_t* w0 = reinterpret_cast<word_t*>(words.data_ptr());
  int32_t* p0 = positions.data_ptr<int32_t>();
  pack_kernel<key_t, word_t><<<blocks_for(n), kThreads, 0, stream>>>(
      values.const_data_ptr<key_t>(), off, count, n, lo, plan.key_bits, w0, p0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  cub::DoubleBuffer<word_t> keys(w0, w0 + stride);
  cub::DoubleBuffer<int32_t> order(p0, p0 + stride);
  // end_bit == 0 (one segment, one distinct key) sorts nothing and leaves the input current.
  run_cub(values, [&](void* scratch, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(scratch, bytes, keys, order, static_cast<int>(n), 0,
                                           plan.end_bit, stream.stream());
  });
  const word_t* sorted = keys.Current();
  const int32_t* sorted_positions = order.Current();

  at::Tensor counts = at::empty({2 * stride}, values.options().dtype(at::kInt));
  int32_t* heads = counts.data_ptr<int32_t>();
  int32_t* numbers = heads + stride;
  packed_heads_kernel<word_t><<<blocks_for(n), kThreads, 0, stream>>>(sorted, n, heads);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  run_cub(values, [&](void* scratch, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(scratch, bytes, heads, numbers, static_cast<int>(n),
                                         stream.stream());
  });
  packed_unique_offsets_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
      off, numbers, count, unique_offsets.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  int32_t unique_count = 0;
  c10::cuda::memcpy_and_sync(&unique_count, numbers + n - 1, sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream);
  at::Tensor unique_values = at::empty({unique_count}, values.options());
  packed_scatter_kernel<key_t, word_t><<<blocks_for(n), kThreads, 0, stream>>>(
      sorted, sorted_positions, numbers, n, lo, plan.key_bits, unique_values.data_ptr<key_t>(),
      inverse.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return unique_values;
}

// ---------------------------------------------------------------------------------------------
// The host mirror: the steps above on CPU tensors, std::sort standing in for CUB's radix sort
// (any order of equal words is right: they share one unique number). Test hook only
// (recxla::_dedup_packed_host); a plan that does not fit raises, where the CUDA op would run the
// segmented sort.

template <typename key_t, typename word_t>
void packed_host_steps(const key_t* values, const int64_t* offsets, int64_t count, int64_t n,
                       uint64_t lo, const dedup::PackedPlan& plan, std::vector<key_t>& uniques,
                       int64_t* unique_offsets, int64_t* inverse) {
  std::vector<word_t> words(n);
  std::vector<int32_t> order(n);
  for (int64_t i = 0; i < n; ++i) {
    words[i] = static_cast<word_t>(dedup::pack_key(dedup::segment_of(offsets, count, i),
                                                   dedup::ordered_bits(values[i]), lo,
                                                   plan.key_bits));
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return words[a] < words[b]; });
  std::vector<word_t> sorted(n);
  for (int64_t i = 0; i < n; ++i) sorted[i] = words[order[i]];
  std::vector<int32_t> numbers(n);
  int32_t running = 0;
  for (int64_t i = 0; i < n; ++i) {
    running += dedup::is_head(i, false, sorted[i], i > 0 ? sorted[i - 1] : sorted[i]) ? 1 : 0;
    numbers[i] = running;
  }
  for (int64_t s = 0; s < count; ++s) {
    unique_offsets[s] = dedup::unique_offset(offsets, numbers.data(), s);
  }
  uniques.assign(running, key_t{});
  for (int64_t i = 0; i < n; ++i) {
    const int32_t index = numbers[i] - 1;
    inverse[order[i]] = index;
    if (dedup::is_head(i, false, sorted[i], i > 0 ? sorted[i - 1] : sorted[i])) {
      uniques[index] = dedup::unpack_key<key_t>(sorted[i], lo, plan.key_bits);
    }
  }
}

}  // namespace dedup_cuda
}  // namespace recxla
