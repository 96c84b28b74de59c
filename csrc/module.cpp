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

// The library is defined here; each op family declares its schemas in its own csrc/<family>.cpp
// (TORCH_LIBRARY_FRAGMENT), with kernels per dispatch key in csrc/cpu and csrc/cuda, and fake
// kernels and autograd in recxla/ops.
TORCH_LIBRARY(recxla, m) {
  // Reports whether this build compiled the CUDA kernels, for recxla.built_with_cuda().
  m.def("built_with_cuda() -> bool", []() -> bool {
#ifdef RECXLA_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
