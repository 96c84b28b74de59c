// The FP8 row codec's vector GPU kernels replayed on the CPU (tests/test_fp8_rows_vector.py builds
// this file with g++ and calls it through ctypes). The lane code, the lane -> (row, chunk) map and
// the launch plans are the kernels' own (recxla/fp8_vector.h); what this file adds is what the GPU
// does around them: the grid-stride loop over a warp's rows, as csrc/cuda/fp8_rows_vector.cuh
// writes it, and the warp's xor shuffles, replayed over the 32 lanes at once.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "recxla/fp8.h"
#include "recxla/fp8_vector.h"

namespace {

using recxla::fp8::Format;
namespace vec = recxla::fp8::vec;

// dtype codes shared with the Python side.
enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

template <typename T, Format F, int CHUNKS>
void replay_quantize(const T* x, int64_t x_stride, int64_t rows, int64_t chunks, int log2_lanes,
                     uint8_t* out, int64_t warps) {
  const int64_t out_stride = recxla::fp8::row_bytes(chunks * vec::kPerChunk<T>);
  const int rows_per_warp = vec::kWarp >> log2_lanes;
  const int64_t step = warps * rows_per_warp;
  for (int64_t warp = 0; warp < warps; ++warp) {
    for (int64_t first = warp * rows_per_warp; first < rows; first += step) {
      vec::QuantizeLane<T, CHUNKS> lanes[vec::kWarp];
      uint32_t amax[vec::kWarp];
      for (int lane = 0; lane < vec::kWarp; ++lane) {
        const vec::LaneMap m(log2_lanes, lane);
        const int64_t row = first + m.row_in_warp;
        const bool live = row < rows;
        lanes[lane].load(x + (live ? row : 0) * x_stride, live, m, chunks);
        amax[lane] = lanes[lane].amax_bits;
      }
      // __shfl_xor_sync(full mask, v, offset): lane l reads lane l ^ offset's value, all lanes at
      // once.
      for (int offset = (1 << log2_lanes) / 2; offset > 0; offset /= 2) {
        uint32_t next[vec::kWarp];
        for (int lane = 0; lane < vec::kWarp; ++lane) {
          next[lane] = std::max(amax[lane], amax[lane ^ offset]);
        }
        std::copy(next, next + vec::kWarp, amax);
      }
      for (int lane = 0; lane < vec::kWarp; ++lane) {
        const vec::LaneMap m(log2_lanes, lane);
        const int64_t row = first + m.row_in_warp;
        const bool live = row < rows;
        lanes[lane].template store<F>(out + (live ? row : 0) * out_stride, amax[lane], live, m,
                                      chunks);
      }
    }
  }
}

template <typename T, Format F>
void replay_dequantize(const uint8_t* in, int64_t rows, int64_t words, int log2_lanes, T* y,
                       int64_t warps) {
  const int64_t dim = 4 * words;
  const int rows_per_warp = vec::kWarp >> log2_lanes;
  const int64_t step = warps * rows_per_warp;
  for (int64_t warp = 0; warp < warps; ++warp) {
    for (int64_t first = warp * rows_per_warp; first < rows; first += step) {
      for (int lane = 0; lane < vec::kWarp; ++lane) {
        const vec::LaneMap m(log2_lanes, lane);
        const int64_t row = first + m.row_in_warp;
        const bool live = row < rows;
        const int64_t r = live ? row : 0;
        vec::dequantize_lane<T, F>(in + r * recxla::fp8::row_bytes(dim), y + r * dim, live, m,
                                   words);
      }
    }
  }
}

template <typename Body>
void with_dtype(int dtype, Body&& body) {
  if (dtype == kFloat32) {
    body(float{});
  } else if (dtype == kBFloat16) {
    body(c10::BFloat16{});
  } else {
    body(c10::Half{});
  }
}

template <typename Body>
void with_format(int fmt, Body&& body) {
  if (fmt == 0) {
    body(std::integral_constant<Format, Format::E4M3>{});
  } else {
    body(std::integral_constant<Format, Format::E5M2>{});
  }
}

int elem_size(int dtype) { return dtype == kFloat32 ? 4 : 2; }

}  // namespace

extern "C" {

// The plan of a quantize call: returns the fallback reason (0: the vector kernel runs) and
// writes lanes per row (as a log2) and chunks per lane.
int plan_quantize(int kernel, int64_t dim, int dtype, uint64_t x_addr, int64_t x_row_stride,
                  uint64_t out_addr, int* log2_lanes, int* chunks) {
  const vec::Plan p = vec::quantize_plan(static_cast<vec::Kernel>(kernel), dim, elem_size(dtype),
                                         x_addr, x_row_stride, out_addr);
  *log2_lanes = p.log2_lanes;
  *chunks = p.chunks;
  return static_cast<int>(p.fallback);
}

int plan_dequantize(int kernel, int64_t dim, int dtype, uint64_t in_addr, uint64_t y_addr,
                    int* log2_lanes) {
  const vec::Plan p = vec::dequantize_plan(static_cast<vec::Kernel>(kernel), dim,
                                           elem_size(dtype), in_addr, y_addr);
  *log2_lanes = p.log2_lanes;
  return static_cast<int>(p.fallback);
}

// Quantizes x [rows, dim] (rows x_row_stride elements apart) into out as the CUDA launcher would
// for `kernel` (1: vector_warp_per_row, 2: vector_rows_per_warp) on a grid of `warps` warps.
// Returns the plan's fallback reason; out is untouched unless it is 0.
int replay_quantize_rows(int kernel, int dtype, int fmt, const void* x, int64_t rows, int64_t dim,
                         int64_t x_row_stride, uint8_t* out, int64_t warps) {
  const vec::Plan p =
      vec::quantize_plan(static_cast<vec::Kernel>(kernel), dim, elem_size(dtype),
                         reinterpret_cast<uintptr_t>(x), x_row_stride,
                         reinterpret_cast<uintptr_t>(out));
  if (p.fallback != vec::Fallback::None) return static_cast<int>(p.fallback);
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    const int64_t chunks = dim / vec::kPerChunk<T>;
    with_format(fmt, [&](auto format_tag) {
      constexpr Format F = decltype(format_tag)::value;
      switch (p.chunks) {
        case 1:
          return replay_quantize<T, F, 1>(xt, x_row_stride, rows, chunks, p.log2_lanes, out,
                                          warps);
        case 2:
          return replay_quantize<T, F, 2>(xt, x_row_stride, rows, chunks, p.log2_lanes, out,
                                          warps);
        case 4:
          return replay_quantize<T, F, 4>(xt, x_row_stride, rows, chunks, p.log2_lanes, out,
                                          warps);
        default:
          return replay_quantize<T, F, vec::kMaxChunks>(xt, x_row_stride, rows, chunks,
                                                        p.log2_lanes, out, warps);
      }
    });
  });
  return 0;
}

// Decodes `rows` wire rows into y [rows, dim] as the CUDA launcher would; returns the plan's
// fallback reason (y untouched unless 0).
int replay_dequantize_rows(int kernel, int dtype, int fmt, const uint8_t* in, int64_t rows,
                           int64_t dim, void* y, int64_t warps) {
  const vec::Plan p = vec::dequantize_plan(static_cast<vec::Kernel>(kernel), dim,
                                           elem_size(dtype), reinterpret_cast<uintptr_t>(in),
                                           reinterpret_cast<uintptr_t>(y));
  if (p.fallback != vec::Fallback::None) return static_cast<int>(p.fallback);
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    with_format(fmt, [&](auto format_tag) {
      constexpr Format F = decltype(format_tag)::value;
      replay_dequantize<T, F>(in, rows, dim / 4, p.log2_lanes, static_cast<T*>(y), warps);
    });
  });
  return 0;
}

// Every code of `fmt` decoded by decode<F> (out) and by decode_select<F> (out_select).
void decode_all_codes(int fmt, float* out, float* out_select) {
  with_format(fmt, [&](auto format_tag) {
    constexpr Format F = decltype(format_tag)::value;
    for (int code = 0; code < 256; ++code) {
      out[code] = recxla::fp8::decode(static_cast<uint8_t>(code), F);
      out_select[code] = recxla::fp8::decode_select<F>(static_cast<uint8_t>(code));
    }
  });
}

}  // extern "C"
