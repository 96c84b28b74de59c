// FP8 row-wise quantize / dequantize on CPU.
//
// Rows are split across threads (at::parallel_for). Each thread runs one of two row kernels:
// - the AVX-512 kernels (fp8_rows_avx512.cpp, intrinsics), when the CPU has AVX-512 F/BW/VL;
// - the portable kernels below: branch-free loops over recxla/fp8.h, compiled for AVX2 and
//   baseline x86-64 and picked at load time (GCC function multiversioning).
// Both compute fp8.h's arithmetic element by element, so their output is bit-identical.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

// fp8.h's encoder selects among values it computes for every element (an fp32 addition among
// them); with the default -ftrapping-math GCC will not compute an addition whose result a select
// may discard, so it keeps a branch and the loops do not vectorize. The results do not depend on
// this flag (no fp32 exception is ever observed), so it is dropped for the kernels below.
#pragma GCC optimize("no-trapping-math")

#include "fp8_rows_buffers.h"
#include "fp8_rows_cpu.h"
#include "recxla/checks.h"
#include "recxla/fp8.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECXLA_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define RECXLA_MULTIVERSION
#endif

namespace recxla {
namespace {

using fp8::Format;

RECXLA_HD float to_float(float v) { return v; }
RECXLA_HD float to_float(c10::BFloat16 v) {
  return fp8::bits_float(static_cast<uint32_t>(v.x) << 16);
}
RECXLA_HD float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename scalar_t, Format fmt>
inline void quantize_row(const scalar_t* __restrict__ x, int64_t dim, uint8_t* __restrict__ out) {
  uint32_t amax_bits = 0;
  for (int64_t j = 0; j < dim; ++j) {
    amax_bits = std::max(amax_bits, fp8::finite_abs_bits(to_float(x[j])));
  }
  const float inv_scale = fp8::inv_scale_from_amax(fp8::bits_float(amax_bits), fmt);
  for (int64_t j = 0; j < dim; ++j) {
    out[j] = fp8::encode<fmt>(to_float(x[j]) * inv_scale);
  }
  const float scale = fp8::scale_from_inv_scale(inv_scale);
  std::memcpy(out + dim, &scale, sizeof(scale));
}

template <typename scalar_t, Format fmt>
inline void dequantize_row(const uint8_t* __restrict__ in, int64_t dim, scalar_t* __restrict__ y) {
  float scale;
  std::memcpy(&scale, in + dim, sizeof(scale));
  for (int64_t j = 0; j < dim; ++j) {
    const float v = fp8::decode(in[j], fmt);
    y[j] = static_cast<scalar_t>(v * scale);
  }
}

// One multiversioned entry per (dtype, format): target_clones needs plain functions.
#define RECXLA_ROW_KERNELS(scalar_t, name)                                                     \
  RECXLA_MULTIVERSION void quantize_rows_##name(                                               \
      const scalar_t* x, int64_t x_stride, int64_t begin, int64_t end, int64_t dim, Format fmt, \
      uint8_t* out) {                                                                          \
    const int64_t out_stride = fp8::row_bytes(dim);                                            \
    for (int64_t i = begin; i < end; ++i) {                                                    \
      if (fmt == Format::E4M3) {                                                               \
        quantize_row<scalar_t, Format::E4M3>(x + i * x_stride, dim, out + i * out_stride);     \
      } else {                                                                                 \
        quantize_row<scalar_t, Format::E5M2>(x + i * x_stride, dim, out + i * out_stride);     \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  RECXLA_MULTIVERSION void dequantize_rows_##name(                                             \
      const uint8_t* in, int64_t begin, int64_t end, int64_t dim, Format fmt, scalar_t* y) {   \
    const int64_t in_stride = fp8::row_bytes(dim);                                             \
    for (int64_t i = begin; i < end; ++i) {                                                    \
      if (fmt == Format::E4M3) {                                                               \
        dequantize_row<scalar_t, Format::E4M3>(in + i * in_stride, dim, y + i * dim);          \
      } else {                                                                                 \
        dequantize_row<scalar_t, Format::E5M2>(in + i * in_stride, dim, y + i * dim);          \
      }                                                                                        \
    }                                                                                          \
  }

RECXLA_ROW_KERNELS(float, f32)
RECXLA_ROW_KERNELS(c10::BFloat16, bf16)
RECXLA_ROW_KERNELS(c10::Half, f16)
#undef RECXLA_ROW_KERNELS

#define RECXLA_DISPATCH_ROWS(scalar_t, name)                                                  \
  void quantize_rows(                                                                         \
      const scalar_t* x, int64_t x_stride, int64_t begin, int64_t end, int64_t dim, Format fmt, \
      uint8_t* out, bool avx512) {                                                            \
    if (avx512) {                                                                             \
      cpu::quantize_rows_avx512(x, x_stride, begin, end, dim, fmt, out);                      \
    } else {                                                                                  \
      quantize_rows_##name(x, x_stride, begin, end, dim, fmt, out);                           \
    }                                                                                         \
  }                                                                                           \
  void dequantize_rows(                                                                       \
      const uint8_t* in, int64_t begin, int64_t end, int64_t dim, Format fmt, scalar_t* y,    \
      bool avx512, bool stream) {                                                             \
    if (avx512) {                                                                             \
      cpu::dequantize_rows_avx512(in, begin, end, dim, fmt, y, stream);                       \
    } else {                                                                                  \
      dequantize_rows_##name(in, begin, end, dim, fmt, y);                                    \
    }                                                                                         \
  }

RECXLA_DISPATCH_ROWS(float, f32)
RECXLA_DISPATCH_ROWS(c10::BFloat16, bf16)
RECXLA_DISPATCH_ROWS(c10::Half, f16)
#undef RECXLA_DISPATCH_ROWS

// RECXLA_CPU_KERNELS=portable runs the portable kernels on an AVX-512 CPU as well, so that tests
// check both kernels on one machine.
bool use_avx512() {
  if (!cpu::have_avx512_fp8()) return false;
  const char* choice = std::getenv("RECXLA_CPU_KERNELS");
  return choice == nullptr || std::strcmp(choice, "portable") != 0;
}

// Rows per task: enough bytes that a thread's share outweighs the cost of handing it out.
int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)); }

// Outputs at least this large are written with non-temporal stores: they cannot stay in cache
// anyway (half of the 32 MiB L3 of the AMD EPYC machines here; on a CPU with a much larger L3 a
// result this size would stay cached), and skipping the read-for-ownership of every line saves
// a third of the traffic: 65536 x 128 float32 in 0.85 ms instead of 1.1 ms on one thread.
constexpr int64_t kStreamingStoreBytes = int64_t{16} << 20;

// The kernel behind both forms of the op; `op` names the form in error messages.
void quantize_rows_into(
    const char* op, const at::Tensor& x_in, c10::string_view fmt_name, const at::Tensor& out) {
  check_quantize_input(op, x_in);
  check_quantize_out(op, x_in, out);
  const Format fmt = parse_fp8_format(op, std::string(fmt_name));
  // Rows may be strided (a slice of a larger buffer); only the elements of a row must be dense.
  const at::Tensor x = x_in.stride(1) == 1 || x_in.size(1) <= 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1), x_stride = x.stride(0);
  if (rows == 0) return;
  uint8_t* out_ptr = out.data_ptr<uint8_t>();
  const bool avx512 = use_avx512();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    switch (x.scalar_type()) {
      case at::kFloat:
        quantize_rows(x.const_data_ptr<float>(), x_stride, begin, end, dim, fmt, out_ptr, avx512);
        break;
      case at::kBFloat16:
        quantize_rows(
            x.const_data_ptr<c10::BFloat16>(), x_stride, begin, end, dim, fmt, out_ptr, avx512);
        break;
      default:
        quantize_rows(
            x.const_data_ptr<c10::Half>(), x_stride, begin, end, dim, fmt, out_ptr, avx512);
    }
  });
}

void quantize_fp8_rows_out_cpu(const at::Tensor& x, c10::string_view fmt_name, at::Tensor& out) {
  quantize_rows_into("recxla::quantize_fp8_rows_out", x, fmt_name, out);
}

at::Tensor quantize_fp8_rows_cpu(const at::Tensor& x, c10::string_view fmt_name) {
  constexpr const char* op = "recxla::quantize_fp8_rows";
  check_quantize_input(op, x);
  at::Tensor out = cpu::empty_reusable({x.size(0), fp8::row_bytes(x.size(1))}, at::kByte);
  quantize_rows_into(op, x, fmt_name, out);
  return out;
}

// The kernel behind both forms of the op; `op` names the form in error messages.
void dequantize_rows_into(
    const char* op, const at::Tensor& packed_in, int64_t dim, c10::string_view fmt_name,
    const at::Tensor& y) {
  check_dequantize_out(op, packed_in, dim, y);
  const Format fmt = parse_fp8_format(op, std::string(fmt_name));
  const at::Tensor packed = packed_in.contiguous();
  const int64_t rows = packed.size(0);
  if (rows == 0 || dim == 0) return;
  const uint8_t* in = packed.const_data_ptr<uint8_t>();
  const bool avx512 = use_avx512();
  const int64_t row_out_bytes = dim * static_cast<int64_t>(y.element_size());
  const bool stream = rows * row_out_bytes >= kStreamingStoreBytes && row_out_bytes % 64 == 0 &&
                      reinterpret_cast<uintptr_t>(y.data_ptr()) % 64 == 0;
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    switch (y.scalar_type()) {
      case at::kFloat:
        dequantize_rows(in, begin, end, dim, fmt, y.data_ptr<float>(), avx512, stream);
        break;
      case at::kBFloat16:
        dequantize_rows(in, begin, end, dim, fmt, y.data_ptr<c10::BFloat16>(), avx512, stream);
        break;
      default:
        dequantize_rows(in, begin, end, dim, fmt, y.data_ptr<c10::Half>(), avx512, stream);
    }
  });
}

void dequantize_fp8_rows_out_cpu(
    const at::Tensor& packed, int64_t dim, c10::string_view fmt_name, at::Tensor& y) {
  dequantize_rows_into("recxla::dequantize_fp8_rows_out", packed, dim, fmt_name, y);
}

at::Tensor dequantize_fp8_rows_cpu(
    const at::Tensor& packed, int64_t dim, c10::string_view fmt_name, at::ScalarType dtype) {
  constexpr const char* op = "recxla::dequantize_fp8_rows";
  check_dequantize_input(op, packed, dim, dtype);
  at::Tensor y = cpu::empty_reusable({packed.size(0), dim}, dtype);
  dequantize_rows_into(op, packed, dim, fmt_name, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("quantize_fp8_rows", &quantize_fp8_rows_cpu);
  m.impl("quantize_fp8_rows_out", &quantize_fp8_rows_out_cpu);
  m.impl("dequantize_fp8_rows", &dequantize_fp8_rows_cpu);
  m.impl("dequantize_fp8_rows_out", &dequantize_fp8_rows_out_cpu);
}

}  // namespace recxla
