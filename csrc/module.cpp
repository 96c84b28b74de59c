// recxla._C: the shared library that holds recxla's operators. Python imports it only to run the
// static registrations below; operators are reached through torch.ops.recxla.*, so no pybind11.
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

// Every schema has one home: here. Kernels register per dispatch key in csrc/cpu and csrc/cuda;
// fake (meta) kernels and autograd live in recxla/ops.
TORCH_LIBRARY(recxla, m) {
  // x: [N, D] float32/bfloat16/float16 -> uint8 [N, D + 4]: D fp8 codes then the fp32 scale.
  m.def("quantize_fp8_rows(Tensor x, str fmt) -> Tensor");
  // packed: uint8 [N, D + 4] -> [N, D] of `dtype`.
  m.def("dequantize_fp8_rows(Tensor packed, int dim, str fmt, ScalarType dtype) -> Tensor");
}

// Reports which backends this build compiled, for `recxla.build_info()` and the tests.
TORCH_LIBRARY_FRAGMENT(recxla, m) {
  m.def("built_with_cuda() -> bool", []() -> bool {
#ifdef RECXLA_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
