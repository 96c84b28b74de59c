// Schemas of the FP8 row codec (kernels: csrc/cpu/fp8_rows.cpp, csrc/cuda/fp8_rows.cu; math:
// csrc/include/recxla/fp8.h; Python API, fake kernels: recxla/ops/fp8_rows.py) and of the
// reusable CPU buffers its outputs and the quantized all-to-all's wire buffers come from
// (csrc/cpu/fp8_rows_buffers.cpp).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // x: [N, D] float32/bfloat16/float16 -> uint8 [N, D + 4]: D fp8 codes then the fp32 scale.
  m.def("quantize_fp8_rows(Tensor x, str fmt) -> Tensor");
  // The same into out: uint8 [N, D + 4], contiguous, on x's device.
  m.def("quantize_fp8_rows_out(Tensor x, str fmt, Tensor(a!) out) -> ()");
  // packed: uint8 [N, D + 4] -> [N, D] of `dtype`.
  m.def("dequantize_fp8_rows(Tensor packed, int dim, str fmt, ScalarType dtype) -> Tensor");
  // The same into out: [N, D] float32/bfloat16/float16 (the result's dtype), contiguous.
  m.def("dequantize_fp8_rows_out(Tensor packed, int dim, str fmt, Tensor(a!) out) -> ()");
  // An uninitialized contiguous CPU tensor whose memory is reused once nothing references it.
  m.def("empty_reusable(int[] size, ScalarType dtype) -> Tensor");
  // Frees the idle reusable buffers; returns the bytes freed.
  m.def("release_idle_buffers() -> int");
  // [bytes in use, bytes idle, buffers in use, buffers idle] of the reusable buffers.
  m.def("buffer_pool_stats() -> int[]");
}
