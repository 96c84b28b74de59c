// Schemas of segmented key dedup (kernels: csrc/cpu/dedup.cpp, csrc/cuda/dedup.cu; shared checks
// and rules: csrc/include/recxla/dedup.h; Python API, fake kernel: recxla/ops/dedup.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // values: int32/int64 [N], S segments; offsets: int64 [S + 1] (0, non-decreasing, ends at N)
  // -> (unique_values [U] values' dtype, ascending per segment; unique_offsets int64 [S + 1];
  //     inverse int64 [N], values[i] == unique_values[inverse[i]]).
  m.def("segmented_unique(Tensor values, Tensor offsets) -> (Tensor, Tensor, Tensor)");
  // The same into caller-owned tensors, resized as out= arguments are (a large enough storage is
  // kept, so a loop passing the same buffers allocates nothing) -> U. CPU only: on GPU the
  // caching allocator already reuses memory (recxla.ops.dedup copies into out= there).
  m.def(
      "segmented_unique_out(Tensor values, Tensor offsets, Tensor(a!) unique_values, "
      "Tensor(b!) unique_offsets, Tensor(c!) inverse) -> int");
}
