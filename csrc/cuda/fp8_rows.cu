// FP8 row-wise quantize / dequantize on CUDA. The per-element math is recxla/fp8.h, shared with the
// CPU kernel. Each family (fp8_quantize, fp8_dequantize) has three kernels that write the same
// bytes (csrc/gpu_variants.cpp picks one per GPU architecture, the campaign measures them:
// bench/gpu_campaign/fp8_rows.py):
//   warp_per_row (here; the fallback): one warp per row (grid-stride over rows), the lanes stride
//     over the row's columns one value at a time, so loads and stores are coalesced, and the row's
//     amax is a warp shuffle reduction; quantize reads the row twice.
//   vector_warp_per_row, vector_rows_per_warp (fp8_rows_vector.cuh): 16-byte loads, the row read
//     once and kept in registers, codes moved as 4-byte words; 32 lanes per row, or as few as
//     give each lane two chunks of its row. They need D % 4 == 0 (quantize: a whole number of
//     16-byte chunks per row, D <= 1024 float32 / 2048 16-bit) and aligned buffers; a call that
//     breaks a condition runs warp_per_row (recxla/fp8_vector.h: quantize_plan, dequantize_plan).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include "fp8_rows_vector.cuh"
#include "recxla/checks.h"
#include "recxla/fp8.h"
#include "recxla/fp8_vector.h"
#include "recxla/gpu_variants.h"

namespace recxla {
namespace {

using fp8::Format;

constexpr int kWarp = 32;
constexpr int kThreads = 256;

__device__ __forceinline__ float load_float(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_float(const at::BFloat16* p) {
  return fp8::bits_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16);
}
__device__ __forceinline__ float load_float(const at::Half* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

template <typename scalar_t>
__global__ void quantize_rows_kernel(
    const scalar_t* __restrict__ x, int64_t x_stride, int64_t rows, int64_t dim, Format fmt,
    uint8_t* __restrict__ out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarp);
  const int64_t out_stride = fp8::row_bytes(dim);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
       row < rows; row += warps) {
    const scalar_t* xr = x + row * x_stride;
    uint32_t amax_bits = 0;
    for (int64_t j = lane; j < dim; j += kWarp) {
      amax_bits = max(amax_bits, fp8::finite_abs_bits(load_float(xr + j)));
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      amax_bits = max(amax_bits, __shfl_xor_sync(0xFFFFFFFFu, amax_bits, offset));
    }
    const float inv_scale = fp8::inv_scale_from_amax(fp8::bits_float(amax_bits), fmt);
    uint8_t* orow = out + row * out_stride;
    for (int64_t j = lane; j < dim; j += kWarp) {
      // Never contracted into an FMA (the product rounds as on the CPU); a NaN keeps its sign.
      orow[j] = fp8::encode(fp8::scale_value(load_float(xr + j), inv_scale), fmt);
    }
    if (lane < fp8::kScaleBytes) {
      const uint32_t scale_bits = fp8::float_bits(fp8::scale_from_inv_scale(inv_scale));
      orow[dim + lane] = static_cast<uint8_t>(scale_bits >> (8 * lane));
    }
  }
}

template <typename scalar_t>
__global__ void dequantize_rows_kernel(
    const uint8_t* __restrict__ in, int64_t rows, int64_t dim, Format fmt,
    scalar_t* __restrict__ y) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarp);
  const int64_t in_stride = fp8::row_bytes(dim);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
       row < rows; row += warps) {
    const uint8_t* irow = in + row * in_stride;
    const uint32_t scale_bits = static_cast<uint32_t>(irow[dim]) |
                                (static_cast<uint32_t>(irow[dim + 1]) << 8) |
                                (static_cast<uint32_t>(irow[dim + 2]) << 16) |
                                (static_cast<uint32_t>(irow[dim + 3]) << 24);
    const float scale = fp8::bits_float(scale_bits);
    for (int64_t j = lane; j < dim; j += kWarp) {
      y[row * dim + j] = static_cast<scalar_t>(__fmul_rn(fp8::decode(irow[j], fmt), scale));
    }
  }
}

// Runs `body` with scalar_t bound to the C++ type of a float32 / bfloat16 / float16 dtype (the
// only ones the checks let through).
template <typename Body>
void dispatch_float_type(at::ScalarType dtype, Body&& body) {
  switch (dtype) {
    case at::kFloat:
      body(float{});
      break;
    case at::kBFloat16:
      body(at::BFloat16{});
      break;
    default:
      body(at::Half{});
  }
}

// The kernel family `family` runs on the current device: the variant gpu_variants picks for its
// architecture (or the process's override).
fp8::vec::Kernel chosen_kernel(const char* family) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const std::string f(family);
  const std::string& name =
      gpu_variants::names(f)[gpu_variants::chosen(f, props->major * 10 + props->minor)];
  if (name == "vector_warp_per_row") return fp8::vec::Kernel::VectorWarpPerRow;
  if (name == "vector_rows_per_warp") return fp8::vec::Kernel::VectorRowsPerWarp;
  TORCH_INTERNAL_ASSERT(name == "warp_per_row", "recxla: ", family, " has a variant '", name,
                        "' that csrc/cuda/fp8_rows.cu does not know");
  return fp8::vec::Kernel::WarpPerRow;
}

uint64_t address(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

int blocks_for(int64_t rows) {
  const int64_t warps_per_block = kThreads / kWarp;
  const int64_t wanted = (rows + warps_per_block - 1) / warps_per_block;
  const int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
}

// The kernel behind both forms of the op; `op` names the form in error messages.
void quantize_rows_into(
    const char* op, const at::Tensor& x_in, c10::string_view fmt_name, const at::Tensor& out) {
  check_quantize_input(op, x_in);
  check_quantize_out(op, x_in, out);
  const Format fmt = parse_fp8_format(op, std::string(fmt_name));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.stride(1) == 1 || x_in.size(1) <= 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1);
  if (rows == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const fp8::vec::Plan plan = fp8::vec::quantize_plan(
      chosen_kernel("fp8_quantize"), dim, static_cast<int>(x.element_size()),
      address(x.const_data_ptr()), x.stride(0), address(out.const_data_ptr()));
  dispatch_float_type(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if (plan.fallback == fp8::vec::Fallback::None) {
      fp8_cuda::quantize_vector<scalar_t>(plan, fmt, x.const_data_ptr<scalar_t>(), x.stride(0),
                                          rows, dim, out.data_ptr<uint8_t>(), stream);
      return;
    }
    quantize_rows_kernel<scalar_t><<<blocks_for(rows), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), x.stride(0), rows, dim, fmt, out.data_ptr<uint8_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quantize_fp8_rows_out_cuda(const at::Tensor& x, c10::string_view fmt_name, at::Tensor& out) {
  quantize_rows_into("recxla::quantize_fp8_rows_out", x, fmt_name, out);
}

at::Tensor quantize_fp8_rows_cuda(const at::Tensor& x, c10::string_view fmt_name) {
  constexpr const char* op = "recxla::quantize_fp8_rows";
  check_quantize_input(op, x);
  at::Tensor out = at::empty({x.size(0), fp8::row_bytes(x.size(1))}, x.options().dtype(at::kByte));
  quantize_rows_into(op, x, fmt_name, out);
  return out;
}

// The kernel behind both forms of the op; `op` names the form in error messages.
void dequantize_rows_into(
    const char* op, const at::Tensor& packed_in, int64_t dim, c10::string_view fmt_name,
    const at::Tensor& y) {
  check_dequantize_out(op, packed_in, dim, y);
  const Format fmt = parse_fp8_format(op, std::string(fmt_name));
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = packed_in.contiguous();
  const int64_t rows = packed.size(0);
  if (rows == 0 || dim == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const fp8::vec::Plan plan = fp8::vec::dequantize_plan(
      chosen_kernel("fp8_dequantize"), dim, static_cast<int>(y.element_size()),
      address(packed.const_data_ptr()), address(y.const_data_ptr()));
  dispatch_float_type(y.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if (plan.fallback == fp8::vec::Fallback::None) {
      fp8_cuda::dequantize_vector<scalar_t>(plan, fmt, packed.const_data_ptr<uint8_t>(), rows,
                                            dim, y.data_ptr<scalar_t>(), stream);
      return;
    }
    dequantize_rows_kernel<scalar_t><<<blocks_for(rows), kThreads, 0, stream>>>(
        packed.const_data_ptr<uint8_t>(), rows, dim, fmt, y.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_fp8_rows_out_cuda(
    const at::Tensor& packed, int64_t dim, c10::string_view fmt_name, at::Tensor& y) {
  dequantize_rows_into("recxla::dequantize_fp8_rows_out", packed, dim, fmt_name, y);
}

at::Tensor dequantize_fp8_rows_cuda(
    const at::Tensor& packed, int64_t dim, c10::string_view fmt_name, at::ScalarType dtype) {
  constexpr const char* op = "recxla::dequantize_fp8_rows";
  check_dequantize_input(op, packed, dim, dtype);
  at::Tensor y = at::empty({packed.size(0), dim}, packed.options().dtype(dtype));
  dequantize_rows_into(op, packed, dim, fmt_name, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) {
  m.impl("quantize_fp8_rows", &quantize_fp8_rows_cuda);
  m.impl("quantize_fp8_rows_out", &quantize_fp8_rows_out_cuda);
  m.impl("dequantize_fp8_rows", &dequantize_fp8_rows_cuda);
  m.impl("dequantize_fp8_rows_out", &dequantize_fp8_rows_out_cuda);
}

}  // namespace recxla
