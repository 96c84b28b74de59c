// FP8 row-wise quantize / dequantize on CPU.
//
// Rows are split across threads (at::parallel_for); inside a row every loop is branch-free over
// contiguous memory, so the compiler vectorizes it. Each row kernel is compiled for AVX-512, AVX2
// and baseline x86-64 and picked at load time (GCC function multiversioning), so one binary is
// fast on the build machine and still runs on older CPUs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "recxla/checks.h"
#include "recxla/fp8.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECXLA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
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
    const float scaled = to_float(x[j]) * inv_scale;
    out[j] = fmt == Format::E4M3 ? fp8::encode_e4m3(scaled) : fp8::encode_e5m2(scaled);
  }
  const float scale = fp8::scale_from_inv_scale(inv_scale);
  std::memcpy(out + dim, &scale, sizeof(scale));
}

template <typename scalar_t, Format fmt>
inline void dequantize_row(const uint8_t* __restrict__ in, int64_t dim, scalar_t* __restrict__ y) {
  float scale;
  std::memcpy(&scale, in + dim, sizeof(scale));
  for (int64_t j = 0; j < dim; ++j) {
    const float v = fmt == Format::E4M3 ? fp8::decode_e4m3(in[j]) : fp8::decode_e5m2(in[j]);
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

// Rows per task: enough bytes that a thread's share outweighs the cost of handing it out.
int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)); }

at::Tensor quantize_fp8_rows_cpu(const at::Tensor& x_in, c10::string_view fmt_name) {
  constexpr const char* op = "recxla::quantize_fp8_rows";
  check_quantize_input(op, x_in);
  const Format fmt = parse_fp8_format(op, std::string(fmt_name));
  // Rows may be strided (a slice of a larger buffer); only the elements of a row must be dense.
  const at::Tensor x = x_in.stride(1) == 1 || x_in.size(1) <= 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1), x_stride = x.stride(0);
  at::Tensor out = at::empty({rows, fp8::row_bytes(dim)}, x.options().dtype(at::kByte));
  if (rows == 0) return out;
  uint8_t* out_ptr = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    switch (x.scalar_type()) {
      case at::kFloat:
        quantize_rows_f32(x.const_data_ptr<float>(), x_stride, begin, end, dim, fmt, out_ptr);
        break;
      case at::kBFloat16:
        quantize_rows_bf16(
            x.const_data_ptr<c10::BFloat16>(), x_stride, begin, end, dim, fmt, out_ptr);
        break;
      default:
        quantize_rows_f16(x.const_data_ptr<c10::Half>(), x_stride, begin, end, dim, fmt, out_ptr);
    }
  });
  return out;
}

at::Tensor dequantize_fp8_rows_cpu(
    const at::Tensor& packed_in, int64_t dim, c10::string_view fmt_name, at::ScalarType dtype) {
  constexpr const char* op = "recxla::dequantize_fp8_rows";
  check_dequantize_input(op, packed_in, dim, dtype);
  const Format fmt = parse_fp8_format(op, std::string(fmt_name));
  const at::Tensor packed = packed_in.contiguous();
  const int64_t rows = packed.size(0);
  at::Tensor y = at::empty({rows, dim}, packed.options().dtype(dtype));
  if (rows == 0 || dim == 0) return y;
  const uint8_t* in = packed.const_data_ptr<uint8_t>();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    switch (dtype) {
      case at::kFloat:
        dequantize_rows_f32(in, begin, end, dim, fmt, y.data_ptr<float>());
        break;
      case at::kBFloat16:
        dequantize_rows_bf16(in, begin, end, dim, fmt, y.data_ptr<c10::BFloat16>());
        break;
      default:
        dequantize_rows_f16(in, begin, end, dim, fmt, y.data_ptr<c10::Half>());
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("quantize_fp8_rows", &quantize_fp8_rows_cpu);
  m.impl("dequantize_fp8_rows", &dequantize_fp8_rows_cpu);
}

}  // namespace recxla
