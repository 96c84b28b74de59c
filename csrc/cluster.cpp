// Schemas of key-centric sample clustering (kernels: csrc/cpu/cluster.cpp and
// csrc/cpu/cluster_order.cpp, csrc/cuda/cluster.cu, triton_kernels/cluster.py; the fused GPU
// variant: csrc/cuda/cluster_fused.cu and csrc/cpu/cluster_fused.cpp; per-value math:
// csrc/include/recxla/cluster.h and cluster_fused*.h; reference: recxla/reference/cluster.py;
// Python API and fake kernels: recxla/ops/cluster.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // The whole clustered order of one batch (CPU): values int32/int64 [>= N]; lengths
  // int32/int64 [F * B], feature-major, >= 0, summing to N; key_bytes: F finite numbers >= 0;
  // 1 <= num_micro_batches <= batch_size -> int64 [B], a permutation of range(B).
  m.def(
      "cluster_permutation(Tensor values, Tensor lengths, int batch_size, int num_micro_batches,"
      " float[] key_bytes) -> Tensor");
  // The same order, computed by the "fused" GPU variant (recxla/cluster_fused*.h): CUDA kernels
  // with one host sync (csrc/cuda/cluster_fused.cu); on CPU tensors the same steps run serially
  // on the host (csrc/cpu/cluster_fused.cpp), which is how machines without a GPU test them.
  m.def(
      "cluster_permutation_fused(Tensor values, Tensor lengths, int batch_size,"
      " int num_micro_batches, float[] key_bytes) -> Tensor");
  // Pass 1, scoring: values int32/int64 [>= N] holding F features one after another (feature f
  // is values[feature_offsets[f]:feature_offsets[f + 1]]) -> int64 [F], the keys clustering is
  // estimated to save on each feature (reference: feature_gains).
  m.def(
      "cluster_feature_gains(Tensor values, int[] feature_offsets, int batch_size,"
      " int num_micro_batches) -> Tensor");
  // Pass 2, signatures: values int32/int64 [>= N], offsets int64 [L + 1] (0 <= offsets[0],
  // non-decreasing, offsets[L] <= N); bag i is values[offsets[i]:offsets[i + 1]] ->
  // (min_hash int64 [L], fingerprint int64 [L]) of the bags' key hashes.
  m.def("cluster_bag_signatures(Tensor values, Tensor offsets) -> (Tensor, Tensor)");
}
