// Schema of the runs op (kernels: csrc/cpu/copy_runs.cpp, csrc/cuda/copy_runs.cu; per-element
// math recxla/copy_runs.h; Python API, fake kernel and Triton path: recxla/ops/copy_runs.py;
// the plain-PyTorch reference: recxla/reference/copy_runs.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // sources, targets: contiguous float32 / bfloat16 / float16 tensors of one dtype and device;
  // runs: 9 ints per run (recxla/copy_runs.h). Writes the targets, run by run in order: a run
  // with add adds to what the runs before it wrote. Copy runs must write disjoint elements (on
  // CUDA they run side by side), and no target may share memory with a source.
  m.def("copy_runs(Tensor[] sources, Tensor(a!)[] targets, int[] runs) -> ()");
}
