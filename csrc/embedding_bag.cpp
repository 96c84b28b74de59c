// Schemas of the pooled embedding lookup over deduplicated ids (kernels: csrc/cpu/embedding_bag.cpp,
// csrc/cuda/embedding_bag.cu; per-row optimizer math: csrc/include/recxla/embedding_bag.h; Python
// API, fake kernels, autograd: recxla/ops/embedding_bag.py; module: recxla/nn).
//
// Shared arguments (T tables, F features, B samples per feature, N ids, U unique rows):
//   weights        T float32 tensors [E_t, D_t], rows contiguous
//   unique_values  int32/int64 [U]: the distinct rows, table by table (segment t holds table t's
//                  rows in strictly increasing order)
//   unique_offsets int64 [T + 1]: segment bounds of unique_values
//   inverse        int64 [N]: for every id, its index into unique_values
//   offsets        int64 [F * B + 1]: bag bounds into the ids; bag f * B + b is sample b of
//                  feature f, and feature f's ids all belong to table feature_table[f]
//   per_sample_weights  float32 [N] or None
//   feature_table  F ints: the table of each feature; output columns follow feature order
//   pooling        T ints: 0 = sum, 1 = mean (sum / bag length; empty bags give zeros). With
//                  per-sample weights, mean is sum(w * row) / bag length (FBGEMM's TBE does the
//                  same; torch.nn.EmbeddingBag and so TorchRec reject weights with mean, and so
//                  does recxla.nn.EmbeddingBagCollection).
//
// Data checks (ids inside their table's segment, rows in range and, for the update, strictly
// increasing per table, offsets monotone): the CPU kernels make them before writing anything.
// The CUDA kernels check shapes and dtypes only: their callers in recxla.ops.embedding_bag check
// the data on the device first (recxla.ops.embedding_bag_checks, one flag read per step), so
// these ops are internal on CUDA.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // -> float32 [B, sum_f D_{feature_table[f]}]: the pooled rows of every bag.
  m.def(
      "embedding_bag_forward(Tensor[] weights, Tensor unique_values, Tensor unique_offsets, "
      "Tensor inverse, Tensor offsets, Tensor? per_sample_weights, int[] feature_table, "
      "int[] pooling, int batch_size) -> Tensor");
  // The same into a caller-owned float32 [B, sum_f D_{feature_table[f]}] contiguous tensor: a
  // training loop that hands in a free buffer every step allocates nothing. With
  // feature_columns (F ints), out is [B, C] with adjacent columns and rows at least C apart,
  // and feature f's columns are [feature_columns[f], + D_f), disjoint and inside [0, C): the
  // bags are pooled straight into a caller's layout (a module's output columns), and the other
  // columns are left as they are.
  m.def(
      "embedding_bag_forward_out(Tensor[] weights, Tensor unique_values, Tensor unique_offsets, "
      "Tensor inverse, Tensor offsets, Tensor? per_sample_weights, int[] feature_table, "
      "int[] pooling, int batch_size, Tensor(a!) out, int[]? feature_columns=None) -> ()");
  // -> T float32 tensors [U_t, D_t]: the gradient of every unique row, summed over its ids
  //    (what a dense weight gradient holds at those rows; it is zero everywhere else).
  //    grad_output: [B, sum_f D_f], or with feature_columns laid out as forward_out's out (each
  //    feature's gradient read where it lies, the other columns not read).
  m.def(
      "embedding_bag_unique_grad(Tensor grad_output, Tensor[] weights, Tensor unique_values, "
      "Tensor unique_offsets, Tensor inverse, Tensor offsets, Tensor? per_sample_weights, "
      "int[] feature_table, int[] pooling, int batch_size, int[]? feature_columns=None) "
      "-> Tensor[]");
  // Reduces the gradient per unique row as above and applies each table's optimizer to those rows
  // in place. optim: T ints (0 none, 1 SGD, 2 Adagrad, 3 row-wise Adagrad); states: T float32
  // tensors (SGD: any, unused; Adagrad: [E_t, D_t]; row-wise Adagrad: E_t values); hparams:
  // 4 * T floats, per table (lr, eps, weight_decay, grad_sign): lr, eps, weight_decay finite and
  // >= 0, grad_sign 1 or -1.
  // grad_offsets (int64 [F * B], optional): the gradient is read where another op left it, not
  // from a [B, total_dim] tensor: grad_output is then any contiguous float32 tensor, read flat,
  // and bag f * B + b's gradient row is its D_f elements from grad_offsets[f * B + b] on (a
  // received message, its rows in any order). Only non-empty bags' entries are read; each must
  // keep its row inside grad_output.
  m.def(
      "embedding_bag_backward_update(Tensor grad_output, Tensor(a!)[] weights, "
      "Tensor(b!)[] states, Tensor unique_values, Tensor unique_offsets, Tensor inverse, "
      "Tensor offsets, Tensor? per_sample_weights, int[] feature_table, int[] pooling, "
      "int batch_size, int[] optim, float[] hparams, Tensor? grad_offsets=None) -> ()");
}
