// Schemas of the FP8 row codec (kernels: csrc/cpu/fp8_rows.cpp, csrc/cuda/fp8_rows.cu; math:
// csrc/include/recxla/fp8.h; Python API, fake kernels: recxla/ops/fp8_rows.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // x: [N, D] float32/bfloat16/float16 -> uint8 [N, D + 4]: D fp8 codes then the fp32 scale.
  m.def("quantize_fp8_rows(Tensor x, str fmt) -> Tensor");
  // packed: uint8 [N, D + 4] -> [N, D] of `dtype`.
  m.def("dequantize_fp8_rows(Tensor packed, int dim, str fmt, ScalarType dtype) -> Tensor");
}
