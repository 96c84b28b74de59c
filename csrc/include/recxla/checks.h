// Argument checks shared by the CPU and CUDA kernels: every message names the op and the argument.
#pragma once

#include <ATen/ATen.h>

#include <string>

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

}  // namespace recxla
