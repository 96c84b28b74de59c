// The FP8 row codec's vector GPU kernels (csrc/cuda/fp8_rows.cu: variants vector_warp_per_row and
// vector_rows_per_warp of the families fp8_quantize / fp8_dequantize): which rows and columns each
// lane handles, what one lane does with them, and when a call can run them at all. Everything
// here is __host__ __device__ or host code, so tests/fp8_rows_vector_harness.cpp runs the same
// lane code on the CPU, lane by lane, with the warp's shuffles replayed (tests/
// test_fp8_rows_vector.py), and the launch plans are tested there too. The kernels themselves are
// a thin loop around these functions.
//
// The layout. A group of G lanes (a power of two, 1 .. 32) owns one row; a warp holds 32 / G
// groups, so it works on 32 / G consecutive rows at a time, then moves on by the number of rows
// all warps of the grid cover. In the row, lane s of the group takes chunks s, s + G, s + 2G, ...:
//   quantize: a chunk is 16 bytes of x (4 float32 or 8 bfloat16 / float16 values), loaded with one
//     128-bit load; a lane keeps its CHUNKS chunks in registers, the group's amax is a shuffle
//     reduction over G lanes, and each chunk leaves as one or two 4-byte words of codes. The row is
//     read once (the warp_per_row kernel reads it twice, 4 bytes per load).
//   dequantize: a chunk is one 4-byte word of 4 codes, decoded into 4 values stored at once (16
//     bytes of float32, 8 of bfloat16 / float16). Every lane reads the row's scale (one broadcast
//     load per group).
// Wire rows are D + 4 bytes with no padding, so with D % 4 == 0 every row and its scale start on a
// 4-byte boundary but not a 16-byte one: the wire side moves 4-byte words, the float side 16-byte
// vectors (8-byte ones for 16-bit outputs).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "recxla/fp8.h"

namespace recxla {
namespace fp8 {
namespace vec {

constexpr int kWarp = 32;
constexpr int kChunkBytes = 16;
// The most 16-byte chunks one lane keeps in registers (quantize): rows up to 32 * 8 * 16 bytes,
// D <= 1024 float32 or 2048 bfloat16 / float16. Wider rows take the warp_per_row kernel.
constexpr int kMaxChunks = 8;

// Values of type T in one 16-byte chunk.
template <typename T>
constexpr int kPerChunk = kChunkBytes / static_cast<int>(sizeof(T));

// ---------------------------------------------------------------- memory
// Callers guarantee the alignment (the plans below check it): 16 bytes for chunks of x and
// 4-element output vectors of float32, 8 for those of 16-bit types, 4 for words of codes.

RECXLA_HD void load_chunk(const void* p, uint32_t (&w)[4]) {
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(static_cast<const uint4*>(p));
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
#else
  std::memcpy(w, p, sizeof(w));
#endif
}

RECXLA_HD uint32_t load_word(const void* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(static_cast<const unsigned int*>(p));
#else
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
#endif
}

RECXLA_HD void store_word(void* p, uint32_t w) {
#if defined(__CUDA_ARCH__)
  *static_cast<unsigned int*>(p) = w;
#else
  std::memcpy(p, &w, sizeof(w));
#endif
}

// ---------------------------------------------------------------- values of a chunk

// Element j (0 .. kPerChunk<T> - 1) of a chunk, widened to float32 exactly.
template <typename T>
RECXLA_HD float element(const uint32_t (&w)[4], int j);

template <>
RECXLA_HD float element<float>(const uint32_t (&w)[4], int j) {
  return bits_float(w[j]);
}

// A bfloat16 is the high half of a float32: element 2k is the low half of word k (the lower
// address), element 2k + 1 the high half.
template <>
RECXLA_HD float element<c10::BFloat16>(const uint32_t (&w)[4], int j) {
  const uint32_t word = w[j >> 1];
  return bits_float((j & 1) ? (word & 0xFFFF0000u) : (word << 16));
}

template <>
RECXLA_HD float element<c10::Half>(const uint32_t (&w)[4], int j) {
  const uint32_t word = w[j >> 1];
  const auto bits = static_cast<uint16_t>((j & 1) ? (word >> 16) : (word & 0xFFFFu));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Four decoded values stored at p as T: one 16-byte store for float32, one 8-byte store for the
// 16-bit types (converted as c10 converts, round to nearest even).
template <typename T>
RECXLA_HD void store4(T* p, const float (&v)[4]) {
  if constexpr (sizeof(T) == 4) {
#if defined(__CUDA_ARCH__)
    // One st.global.v4 in inline PTX: nvcc split a plain float4 assignment here into four 4-byte
    // stores (seen in this kernel's PTX), and __stwb's becomes a "strong" store in SASS.
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v[0]), "f"(v[1]),
                 "f"(v[2]), "f"(v[3]));
#else
    std::memcpy(p, v, sizeof(v));
#endif
  } else {
    uint32_t w[2];
    for (int k = 0; k < 2; ++k) {
      w[k] = static_cast<uint32_t>(static_cast<T>(v[2 * k]).x) |
             (static_cast<uint32_t>(static_cast<T>(v[2 * k + 1]).x) << 16);
    }
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(w[1]));
#else
    std::memcpy(p, w, sizeof(w));
#endif
  }
}

// ---------------------------------------------------------------- which lane does what

// A lane's place: its group of `lanes` lanes (lanes = 1 << log2_lanes) owns row
// `row_in_warp` of the warp's current rows; `sub` is the lane's index in its group.
struct LaneMap {
  int lanes;
  int rows_per_warp;
  int row_in_warp;
  int sub;

  RECXLA_HD LaneMap(int log2_lanes, int lane)
      : lanes(1 << log2_lanes),
        rows_per_warp(kWarp >> log2_lanes),
        row_in_warp(lane >> log2_lanes),
        sub(lane & ((1 << log2_lanes) - 1)) {}
};

// One lane's part of quantizing one row: its chunks of x (kept in registers), then its codes.
// Lanes of a row that is past the end (live == false) or chunks past the row's end do nothing;
// such lanes still take part in the group's shuffles with amax 0.
template <typename T, int CHUNKS>
struct QuantizeLane {
  uint32_t w[CHUNKS][4];
  uint32_t amax_bits;

  // x_row: the row's first element (16-byte aligned); chunks: D / kPerChunk<T>.
  RECXLA_HD void load(const T* x_row, bool live, const LaneMap& m, int64_t chunks) {
    amax_bits = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < CHUNKS; ++k) {
      const int64_t c = m.sub + static_cast<int64_t>(k) * m.lanes;
      if (live && c < chunks) {
        load_chunk(x_row + c * kPerChunk<T>, w[k]);
        for (int j = 0; j < kPerChunk<T>; ++j) {
          const uint32_t a = finite_abs_bits(element<T>(w[k], j));
          amax_bits = amax_bits > a ? amax_bits : a;
        }
      } else {
        w[k][0] = w[k][1] = w[k][2] = w[k][3] = 0;
      }
    }
  }

  // row_amax_bits: the group's maximum of amax_bits (the same on every lane of the group).
  // out_row: the row's wire bytes (4-byte aligned); dim = chunks * kPerChunk<T>.
  template <Format F>
  RECXLA_HD void store(uint8_t* out_row, uint32_t row_amax_bits, bool live, const LaneMap& m,
                       int64_t chunks) const {
    if (!live) return;
    const float inv_scale = inv_scale_from_amax(bits_float(row_amax_bits), F);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < CHUNKS; ++k) {
      const int64_t c = m.sub + static_cast<int64_t>(k) * m.lanes;
      if (c < chunks) {
        for (int q = 0; q < kPerChunk<T> / 4; ++q) {
          const float v[4] = {element<T>(w[k], 4 * q), element<T>(w[k], 4 * q + 1),
                              element<T>(w[k], 4 * q + 2), element<T>(w[k], 4 * q + 3)};
          store_word(out_row + c * kPerChunk<T> + 4 * q, encode_word<F>(v, inv_scale));
        }
      }
    }
    if (m.sub == 0) {
      const int64_t dim = chunks * kPerChunk<T>;
      store_word(out_row + dim, float_bits(scale_from_inv_scale(inv_scale)));
    }
  }
};

// One lane's part of dequantizing one row of `words` words of codes (dim = 4 * words): words
// sub, sub + G, ... , two per step so that two loads are in flight before the first store.
// in_row: the row's wire bytes (4-byte aligned); y_row: its output (16-byte aligned for float32,
// 8 for 16-bit types).
template <typename T, Format F>
RECXLA_HD void dequantize_lane(const uint8_t* in_row, T* y_row, bool live, const LaneMap& m,
                               int64_t words) {
  if (!live) return;
  const float scale = bits_float(load_word(in_row + 4 * words));
  const int64_t step = static_cast<int64_t>(m.lanes);
  for (int64_t k = m.sub; k < words; k += 2 * step) {
    const bool second = k + step < words;
    const uint32_t w0 = load_word(in_row + 4 * k);
    const uint32_t w1 = second ? load_word(in_row + 4 * (k + step)) : 0u;
    float v[4];
    decode_word<F>(w0, scale, v);
    store4(y_row + 4 * k, v);
    if (second) {
      decode_word<F>(w1, scale, v);
      store4(y_row + 4 * (k + step), v);
    }
  }
}

// ---------------------------------------------------------------- launch plans (host)

enum class Kernel : int { WarpPerRow = 0, VectorWarpPerRow = 1, VectorRowsPerWarp = 2 };

// Why a call runs the warp_per_row kernel although a vector one was asked for.
enum class Fallback : int {
  None = 0,            // the vector kernel runs
  Asked = 1,           // warp_per_row was the variant asked for
  DimNotMultiple = 2,  // D is not a multiple of the values per chunk (quantize) or of 4
  TooWide = 3,         // quantize: D above 32 * kMaxChunks chunks (a row no longer fits registers)
  Misaligned = 4,      // a base address or the row stride breaks the 16 / 8 / 4-byte alignment
};

struct Plan {
  Fallback fallback;  // None: the vector kernel runs with the fields below
  int log2_lanes;     // lanes per row = 1 << log2_lanes
  int chunks;         // quantize: 16-byte chunks each lane keeps (1, 2, 4 or 8); dequantize: 0
};

// Smallest k with (1 << k) >= n (n >= 1), at most 5 (a whole warp).
inline int ceil_log2_lanes(int64_t n) {
  int k = 0;
  while (k < 5 && (int64_t{1} << k) < n) ++k;
  return k;
}

// Lanes per row of vector_rows_per_warp: enough that each lane has about 2 units (chunks or
// words) of its row, so a D=64 or D=128 row keeps every lane busy and takes fewer shuffle
// steps than a whole warp would.
inline int rows_per_warp_log2_lanes(int64_t units) {
  return ceil_log2_lanes((units + 1) / 2);
}

// quantize x [rows, dim] of `elem_size`-byte values (4: float32, 2: bfloat16 / float16), rows
// `x_row_stride` elements apart and dense, starting at byte address x_addr, into wire rows at
// out_addr (contiguous).
inline Plan quantize_plan(Kernel kernel, int64_t dim, int elem_size, uint64_t x_addr,
                          int64_t x_row_stride, uint64_t out_addr) {
  if (kernel == Kernel::WarpPerRow) return {Fallback::Asked, 5, 0};
  const int per_chunk = kChunkBytes / elem_size;
  if (dim % per_chunk != 0) return {Fallback::DimNotMultiple, 5, 0};
  const int64_t chunks = dim / per_chunk;
  if (chunks > int64_t{kWarp} * kMaxChunks) return {Fallback::TooWide, 5, 0};
  if (x_addr % kChunkBytes != 0 || (x_row_stride * elem_size) % kChunkBytes != 0 ||
      out_addr % 4 != 0) {
    return {Fallback::Misaligned, 5, 0};
  }
  const int log2_lanes =
      kernel == Kernel::VectorWarpPerRow ? 5 : rows_per_warp_log2_lanes(chunks);
  const int64_t lanes = int64_t{1} << log2_lanes;
  int per_lane = 1;
  while (per_lane * lanes < chunks) per_lane *= 2;
  return {Fallback::None, log2_lanes, per_lane};
}

// dequantize wire rows at in_addr (contiguous, dim + 4 bytes each) into y [rows, dim] of
// `elem_size`-byte values at y_addr (contiguous).
inline Plan dequantize_plan(Kernel kernel, int64_t dim, int elem_size, uint64_t in_addr,
                            uint64_t y_addr) {
  if (kernel == Kernel::WarpPerRow) return {Fallback::Asked, 5, 0};
  if (dim % 4 != 0) return {Fallback::DimNotMultiple, 5, 0};
  if (in_addr % 4 != 0 || y_addr % (4 * static_cast<uint64_t>(elem_size)) != 0) {
    return {Fallback::Misaligned, 5, 0};
  }
  const int log2_lanes =
      kernel == Kernel::VectorWarpPerRow ? 5 : rows_per_warp_log2_lanes(dim / 4);
  return {Fallback::None, log2_lanes, 0};
}

}  // namespace vec
}  // namespace fp8
}  // namespace recxla
