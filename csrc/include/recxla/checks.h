// Argument checks shared by the CPU and CUDA kernels: every message names the op and the argument.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "recxla/fp8.h"

namespace recxla {

inline fp8::Format parse_fp8_format(const std::string& op, const std::string& fmt) {
  if (fmt == "e4m3") return fp8::Format::E4M3;
  if (fmt == "e5m2") return fp8::Format::E5M2;
  TORCH_CHECK_VALUE(false, op, ": fmt must be 'e4m3' or 'e5m2', got '", fmt, "'");
}

inline void check_quantize_input(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be 2-D [rows, dim], got ", x.dim(), "-D");
  TORCH_CHECK_TYPE(
      x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
          x.scalar_type() == at::kHalf,
      op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
}

inline void check_dequantize_input(
    const char* op, const at::Tensor& packed, int64_t dim, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(
      packed.dim() == 2, op, ": packed must be 2-D [rows, row_bytes], got ", packed.dim(), "-D");
  TORCH_CHECK_TYPE(
      packed.scalar_type() == at::kByte, op, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK_VALUE(dim >= 0, op, ": dim must be >= 0, got ", dim);
  TORCH_CHECK_VALUE(
      packed.size(1) == fp8::row_bytes(dim), op, ": packed has ", packed.size(1),
      " bytes per row but dim=", dim, " needs ", fp8::row_bytes(dim), " (dim codes + ",
      fp8::kScaleBytes, " scale bytes)");
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
      ": dtype must be float32, bfloat16 or float16, got ", dtype);
}

// A host op's index argument: an int64, 1-D, contiguous CPU tensor of `numel` entries (numel < 0:
// any), `like` naming the argument that sets that count. `host_why` says why it must be on the
// CPU.
inline void check_host_int64_vector(const char* op, const at::Tensor& t, const char* name,
                                    int64_t numel, const char* like, const char* host_why) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU (", host_why,
                    ")");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), op, ": ", name,
                    " must be 1-D and contiguous");
  TORCH_CHECK_VALUE(numel < 0 || t.numel() == numel, op, ": ", name, " must have ", numel,
                    " entries like ", like, ", got ", t.numel());
}

// True when the byte ranges that a and b span intersect (conservative for strided tensors, whose
// gaps count as theirs; at::get_overlap_status gives up on those). Tensors without elements read
// and write nothing.
inline bool spans_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * std::abs(t.stride(d));
    const auto* begin = static_cast<const char*>(t.const_data_ptr());
    return std::make_pair(begin, begin + extent * static_cast<int64_t>(t.element_size()));
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

// `out` of an op that writes `rows` x `width` elements of `dtype` next to its input `in`: the shape
// and dtype it needs, on in's device, dense, and sharing no memory with `in`.
inline void check_out(
    const char* op, const at::Tensor& in, const at::Tensor& out, int64_t rows, int64_t width,
    at::ScalarType dtype) {
  TORCH_CHECK_VALUE(
      out.dim() == 2 && out.size(0) == rows && out.size(1) == width, op, ": out must have shape [",
      rows, ", ", width, "], got ", out.sizes());
  TORCH_CHECK_TYPE(
      out.scalar_type() == dtype, op, ": out must be ", dtype, ", got ", out.scalar_type());
  TORCH_CHECK_VALUE(
      out.device() == in.device(), op, ": out must be on ", in.device(), " like the input, got ",
      out.device());
  TORCH_CHECK_VALUE(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK_VALUE(!spans_overlap(in, out), op, ": out must not share memory with the input");
}

inline void check_quantize_out(const char* op, const at::Tensor& x, const at::Tensor& out) {
  check_out(op, x, out, x.size(0), fp8::row_bytes(x.size(1)), at::kByte);
}

// packed (as check_dequantize_input) and out, whose dtype is the result's.
inline void check_dequantize_out(
    const char* op, const at::Tensor& packed, int64_t dim, const at::Tensor& out) {
  TORCH_CHECK_TYPE(
      out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 ||
          out.scalar_type() == at::kHalf,
      op, ": out must be float32, bfloat16 or float16, got ", out.scalar_type());
  check_dequantize_input(op, packed, dim, out.scalar_type());
  check_out(op, packed, out, packed.size(0), dim, out.scalar_type());
}

}  // namespace recxla
