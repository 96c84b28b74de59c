// The FP8 row codec's vector kernels: variants vector_warp_per_row and vector_rows_per_warp of the
// families fp8_quantize / fp8_dequantize (csrc/gpu_variants.cpp). Included by fp8_rows.cu, which
// decides per call (recxla::fp8::vec::quantize_plan / dequantize_plan) whether they can run.
//
// The per-lane work and the lane -> (row, chunks) map are recxla/fp8_vector.h, shared with the CPU
// replay in tests/fp8_rows_vector_harness.cpp; these kernels add the loop over rows, the shuffle
// reduction of the row's amax and the launch. Why they should beat warp_per_row: the row is read
// once with 128-bit loads and kept in registers (warp_per_row reads it twice with 32-bit loads),
// codes leave as 4-byte words instead of bytes, decoded values leave as 16-byte vectors, and
// vector_rows_per_warp gives a D=64 or D=128 row 8 or 16 lanes, so no lane idles and a row's amax
// takes 3 or 4 shuffle steps, shared by the warp's rows.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>
#include <utility>

#include "recxla/fp8.h"
#include "recxla/fp8_vector.h"

namespace recxla {
namespace fp8_cuda {

using fp8::Format;
namespace vec = fp8::vec;

// Small blocks spread a short call (the trainer's ~4k rows of D=64) over more SMs; a persistent
// grid (vector_grid) keeps every SM full on long ones.
constexpr int kVectorThreads = 128;
constexpr int kVectorWarps = kVectorThreads / vec::kWarp;

template <typename T, Format F, int CHUNKS>
__device__ __forceinline__ void quantize_rows_vector(
    const T* __restrict__ x, int64_t x_stride, int64_t rows, int64_t chunks, int log2_lanes,
    uint8_t* __restrict__ out) {
  const vec::LaneMap m(log2_lanes, static_cast<int>(threadIdx.x % vec::kWarp));
  const int64_t out_stride = fp8::row_bytes(chunks * vec::kPerChunk<T>);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kVectorWarps + threadIdx.x / vec::kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kVectorWarps * m.rows_per_warp;
  // `first` depends on the warp alone, so every lane runs the same iterations and the full-warp
  // shuffles below always have all 32 lanes.
  for (int64_t first = warp * m.rows_per_warp; first < rows; first += step) {
    const int64_t row = first + m.row_in_warp;
    const bool live = row < rows;
    const int64_t r = live ? row : 0;
    vec::QuantizeLane<T, CHUNKS> lane;
    lane.load(x + r * x_stride, live, m, chunks);
    // xor offsets below the group's width stay inside the group.
    uint32_t amax = lane.amax_bits;
    for (int offset = m.lanes / 2; offset > 0; offset /= 2) {
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
    }
    lane.template store<F>(out + r * out_stride, amax, live, m, chunks);
  }
}

// Up to 4 chunks per lane ptxas's own register budget fits without spilling.
template <typename T, Format F, int CHUNKS>
__global__ void __launch_bounds__(kVectorThreads) quantize_rows_vector_kernel(
    const T* __restrict__ x, int64_t x_stride, int64_t rows, int64_t chunks, int log2_lanes,
    uint8_t* __restrict__ out) {
  quantize_rows_vector<T, F, CHUNKS>(x, x_stride, rows, chunks, log2_lanes, out);
}

// 8 chunks per lane (32 values kept) need about 75 registers; by default ptxas stopped at 64 and
// spilled to local memory. Asking for 6 resident blocks per SM lets it use up to 85.
template <typename T, Format F>
__global__ void __launch_bounds__(kVectorThreads, 6) quantize_rows_vector_wide_kernel(
    const T* __restrict__ x, int64_t x_stride, int64_t rows, int64_t chunks, int log2_lanes,
    uint8_t* __restrict__ out) {
  quantize_rows_vector<T, F, vec::kMaxChunks>(x, x_stride, rows, chunks, log2_lanes, out);
}

template <typename T, Format F>
__global__ void __launch_bounds__(kVectorThreads) dequantize_rows_vector_kernel(
    const uint8_t* __restrict__ in, int64_t rows, int64_t words, int log2_lanes,
    T* __restrict__ y) {
  const vec::LaneMap m(log2_lanes, static_cast<int>(threadIdx.x % vec::kWarp));
  const int64_t dim = 4 * words;
  const int64_t in_stride = fp8::row_bytes(dim);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kVectorWarps + threadIdx.x / vec::kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kVectorWarps * m.rows_per_warp;
  for (int64_t first = warp * m.rows_per_warp; first < rows; first += step) {
    const int64_t row = first + m.row_in_warp;
    const bool live = row < rows;
    const int64_t r = live ? row : 0;
    vec::dequantize_lane<T, F>(in + r * in_stride, y + r * dim, live, m, words);
  }
}

// Blocks of a persistent grid: as many as the device holds at once (so that no block waits for
// another to finish and leaves a tail), fewer when the rows need fewer. The occupancy is asked
// once per kernel and device.
inline int vector_grid(const void* kernel, int64_t rows, int rows_per_warp) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> resident;  // (kernel, device) -> blocks/SM
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int per_sm = 0;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(kernel, device);
    const auto it = resident.find(key);
    if (it != resident.end()) {
      per_sm = it->second;
    } else {
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, kernel, kVectorThreads, 0));
      per_sm = per_sm > 0 ? per_sm : 1;
      resident.emplace(key, per_sm);
    }
  }
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t rows_per_block = static_cast<int64_t>(kVectorWarps) * rows_per_warp;
  const int64_t wanted = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, per_sm * sms)));
}

template <typename T, Format F, int CHUNKS>
void launch_quantize_vector(const T* x, int64_t x_stride, int64_t rows, int64_t dim,
                            int log2_lanes, uint8_t* out, cudaStream_t stream) {
  const auto launch = [&](auto kernel) {
    const int blocks =
        vector_grid(reinterpret_cast<const void*>(kernel), rows, vec::kWarp >> log2_lanes);
    kernel<<<blocks, kVectorThreads, 0, stream>>>(x, x_stride, rows, dim / vec::kPerChunk<T>,
                                                  log2_lanes, out);
  };
  if constexpr (CHUNKS == vec::kMaxChunks) {
    launch(quantize_rows_vector_wide_kernel<T, F>);
  } else {
    launch(quantize_rows_vector_kernel<T, F, CHUNKS>);
  }
}

// Quantizes x [rows, dim] (dense rows x_stride elements apart) into `out` with the plan's lanes
// per row and chunks per lane (quantize_plan said the vector kernel may run).
template <typename T>
void quantize_vector(const vec::Plan& plan, Format fmt, const T* x, int64_t x_stride,
                     int64_t rows, int64_t dim, uint8_t* out, cudaStream_t stream) {
  const auto with_format = [&](auto format_tag) {
    constexpr Format F = decltype(format_tag)::value;
    switch (plan.chunks) {
      case 1:
        return launch_quantize_vector<T, F, 1>(x, x_stride, rows, dim, plan.log2_lanes, out,
                                               stream);
      case 2:
        return launch_quantize_vector<T, F, 2>(x, x_stride, rows, dim, plan.log2_lanes, out,
                                               stream);
      case 4:
        return launch_quantize_vector<T, F, 4>(x, x_stride, rows, dim, plan.log2_lanes, out,
                                               stream);
      default:
        TORCH_INTERNAL_ASSERT(plan.chunks == vec::kMaxChunks, "recxla::quantize_fp8_rows: plan ",
                              "with ", plan.chunks, " chunks per lane");
        return launch_quantize_vector<T, F, vec::kMaxChunks>(x, x_stride, rows, dim,
                                                             plan.log2_lanes, out, stream);
    }
  };
  if (fmt == Format::E4M3) {
    with_format(std::integral_constant<Format, Format::E4M3>{});
  } else {
    with_format(std::integral_constant<Format, Format::E5M2>{});
  }
}

// Decodes `rows` wire rows at `in` into y [rows, dim] (dim % 4 == 0; dequantize_plan said the
// vector kernel may run).
template <typename T>
void dequantize_vector(const vec::Plan& plan, Format fmt, const uint8_t* in, int64_t rows,
                       int64_t dim, T* y, cudaStream_t stream) {
  const auto launch = [&](auto kernel) {
    const int blocks =
        vector_grid(reinterpret_cast<const void*>(kernel), rows, vec::kWarp >> plan.log2_lanes);
    kernel<<<blocks, kVectorThreads, 0, stream>>>(in, rows, dim / 4, plan.log2_lanes, y);
  };
  if (fmt == Format::E4M3) {
    launch(dequantize_rows_vector_kernel<T, Format::E4M3>);
  } else {
    launch(dequantize_rows_vector_kernel<T, Format::E5M2>);
  }
}

}  // namespace fp8_cuda
}  // namespace recxla
