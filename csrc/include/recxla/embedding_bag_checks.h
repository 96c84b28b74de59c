// Argument checks and the host-side layout of the pooled embedding ops (schemas:
// csrc/embedding_bag.cpp), shared by the CPU and CUDA kernels. Every message names the op and the
// argument. The per-id checks (ids in range, offsets monotone) need the data: the CPU kernels make
// them in their first pass, before anything is written; the CUDA kernels assert on the device.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "recxla/embedding_bag.h"

namespace recxla {
namespace emb {

// What the kernels need to know about the tables and features, on the host.
struct Layout {
  int64_t num_tables = 0;
  int64_t num_features = 0;
  int64_t batch_size = 0;
  int64_t num_ids = 0;
  int64_t num_unique = 0;
  int64_t total_dim = 0;                // columns of the pooled output
  int64_t row_stride = 0;               // elements between two samples' output (gradient) rows
  std::vector<int64_t> feature_table;   // [F]
  std::vector<int64_t> feature_column;  // [F] first output (gradient) column of the feature
  std::vector<int64_t> table_dim;       // [T]
  std::vector<int64_t> table_rows;      // [T]
  std::vector<int64_t> pooling;         // [T] Pooling
  std::vector<int64_t> unique_offsets;  // [T + 1] host copy (empty when not read: see below)
};

inline Layout check_layout(
    const char* op, at::TensorList weights, const at::Tensor& unique_values,
    const at::Tensor& unique_offsets, const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size, bool read_unique_offsets = true) {
  // read_unique_offsets = false: the values of unique_offsets are neither copied to the host nor
  // checked here (on a GPU the copy would stall the host until the device caught up; the data
  // checks of recxla.ops.embedding_bag_checks check them on the device).
  Layout l;
  l.num_tables = static_cast<int64_t>(weights.size());
  l.num_features = static_cast<int64_t>(feature_table.size());
  l.batch_size = batch_size;
  TORCH_CHECK_VALUE(batch_size >= 0, op, ": batch_size must be >= 0, got ", batch_size);
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(pooling.size()) == l.num_tables, op, ": pooling must have one entry per"
      " table (", l.num_tables, "), got ", pooling.size());
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const at::Tensor& w = weights[t];
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": weights[", t, "] must be 2-D [rows, dim], got ",
                      w.dim(), "-D");
    TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat, op, ": weights[", t,
                     "] must be float32, got ", w.scalar_type());
    TORCH_CHECK_VALUE(w.is_contiguous(), op, ": weights[", t, "] must be contiguous");
    TORCH_CHECK_VALUE(w.device() == unique_values.device(), op, ": weights[", t, "] is on ",
                      w.device(), " but unique_values is on ", unique_values.device());
    TORCH_CHECK_VALUE(pooling[t] == 0 || pooling[t] == 1, op, ": pooling[", t,
                      "] must be 0 (sum) or 1 (mean), got ", pooling[t]);
    l.table_rows.push_back(w.size(0));
    l.table_dim.push_back(w.size(1));
    l.pooling.push_back(pooling[t]);
  }
  for (int64_t f = 0; f < l.num_features; ++f) {
    const int64_t t = feature_table[f];
    TORCH_CHECK_VALUE(t >= 0 && t < l.num_tables, op, ": feature_table[", f, "] = ", t,
                      " is not a table index in [0, ", l.num_tables, ")");
    l.feature_table.push_back(t);
    l.feature_column.push_back(l.total_dim);
    l.total_dim += l.table_dim[t];
  }
  l.row_stride = l.total_dim;
  TORCH_CHECK_VALUE(unique_values.dim() == 1, op, ": unique_values must be 1-D, got ",
                    unique_values.dim(), "-D");
  TORCH_CHECK_TYPE(
      unique_values.scalar_type() == at::kInt || unique_values.scalar_type() == at::kLong, op,
      ": unique_values must be int32 or int64, got ", unique_values.scalar_type());
  l.num_unique = unique_values.numel();
  TORCH_CHECK_VALUE(unique_offsets.dim() == 1 && unique_offsets.numel() == l.num_tables + 1, op,
                    ": unique_offsets must be 1-D with num_tables + 1 = ", l.num_tables + 1,
                    " entries, got shape ", unique_offsets.sizes());
  TORCH_CHECK_TYPE(unique_offsets.scalar_type() == at::kLong, op,
                   ": unique_offsets must be int64, got ", unique_offsets.scalar_type());
  if (read_unique_offsets) {
    const at::Tensor uoff = unique_offsets.to(at::kCPU).contiguous();
    const int64_t* uo = uoff.const_data_ptr<int64_t>();
    l.unique_offsets.assign(uo, uo + l.num_tables + 1);
    TORCH_CHECK_VALUE(l.unique_offsets[0] == 0 && l.unique_offsets[l.num_tables] == l.num_unique,
                      op, ": unique_offsets must start at 0 and end at len(unique_values) = ",
                      l.num_unique, ", got ", l.unique_offsets[0], " and ",
                      l.unique_offsets[l.num_tables]);
    for (int64_t t = 0; t < l.num_tables; ++t) {
      TORCH_CHECK_VALUE(l.unique_offsets[t] <= l.unique_offsets[t + 1], op,
                        ": unique_offsets must be non-decreasing, but entry ", t + 1, " (",
                        l.unique_offsets[t + 1], ") < entry ", t, " (", l.unique_offsets[t],
                        ")");
    }
  }
  TORCH_CHECK_VALUE(inverse.dim() == 1, op, ": inverse must be 1-D, got ", inverse.dim(), "-D");
  TORCH_CHECK_TYPE(inverse.scalar_type() == at::kLong, op, ": inverse must be int64, got ",
                   inverse.scalar_type());
  l.num_ids = inverse.numel();
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() == l.num_features * batch_size + 1, op,
                    ": offsets must be 1-D with num_features * batch_size + 1 = ",
                    l.num_features * batch_size + 1, " entries, got shape ", offsets.sizes());
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kLong, op, ": offsets must be int64, got ",
                   offsets.scalar_type());
  if (per_sample_weights.has_value()) {
    const at::Tensor& psw = *per_sample_weights;
    TORCH_CHECK_VALUE(psw.dim() == 1 && psw.numel() == l.num_ids, op,
                      ": per_sample_weights must be 1-D with one weight per id (", l.num_ids,
                      "), got shape ", psw.sizes());
    TORCH_CHECK_TYPE(psw.scalar_type() == at::kFloat, op,
                     ": per_sample_weights must be float32, got ", psw.scalar_type());
  }
  for (const at::Tensor* t : {&inverse, &offsets, &unique_offsets}) {
    TORCH_CHECK_VALUE(t->device() == unique_values.device(), op, ": all tensors must be on ",
                      unique_values.device(), ", got one on ", t->device());
  }
  return l;
}

// Where each feature's columns lie in `t` (the out of embedding_bag_forward_out, the
// grad_output of embedding_bag_unique_grad), when the caller gives feature_columns: t is
// [B, C] with adjacent columns and rows at least C apart (a column range of a wider tensor, say),
// and feature f's D columns are [feature_columns[f], + D), inside [0, C) and disjoint from every
// other feature's. One op then pools straight into (reads straight from) the columns a caller's
// layout gives each feature, with no copy around it. Columns no feature holds are left alone.
inline void place_features(const char* op, Layout& l, const at::Tensor& t, const char* name,
                           at::IntArrayRef feature_columns) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(feature_columns.size()) == l.num_features, op,
                    ": feature_columns must have one entry per feature (", l.num_features,
                    "), got ", feature_columns.size());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == l.batch_size, op, ": ", name,
                    " must be [batch_size, columns] = [", l.batch_size, ", C], got ", t.sizes());
  const int64_t width = t.size(1);
  TORCH_CHECK_VALUE(t.stride(1) == 1 || width <= 1, op, ": ", name,
                    "'s columns must be adjacent (column stride 1), got stride ", t.stride(1));
  TORCH_CHECK_VALUE(t.size(0) <= 1 || t.stride(0) >= width, op, ": ", name,
                    "'s rows must not overlap (row stride >= ", width, "), got ", t.stride(0));
  std::vector<std::tuple<int64_t, int64_t, int64_t>> ranges;  // (first, end, feature)
  for (int64_t f = 0; f < l.num_features; ++f) {
    const int64_t first = feature_columns[f], dim = l.table_dim[l.feature_table[f]];
    TORCH_CHECK_VALUE(first >= 0 && first + dim <= width, op, ": feature_columns[", f, "] = ",
                      first, " puts feature ", f, "'s ", dim, " columns outside [0, ", width,
                      ") of ", name);
    if (dim > 0) ranges.emplace_back(first, first + dim, f);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) {
    TORCH_CHECK_VALUE(std::get<0>(ranges[k]) >= std::get<1>(ranges[k - 1]), op, ": features ",
                      std::get<2>(ranges[k - 1]), " and ", std::get<2>(ranges[k]),
                      " overlap in ", name, " (feature_columns)");
  }
  l.feature_column.assign(feature_columns.begin(), feature_columns.end());
  l.row_stride = t.size(0) > 1 ? t.stride(0) : width;
}

// The gradient of the pooled output: float32 [B, total_dim] (any strides: the kernels read a
// contiguous copy), or with feature_columns as place_features says (read where it lies).
inline void check_grad_output(const char* op, const at::Tensor& grad_output, Layout& l,
                              at::OptionalIntArrayRef feature_columns = std::nullopt) {
  TORCH_CHECK_TYPE(grad_output.scalar_type() == at::kFloat, op,
                   ": grad_output must be float32, got ", grad_output.scalar_type());
  if (feature_columns.has_value()) {
    place_features(op, l, grad_output, "grad_output", *feature_columns);
    return;
  }
  TORCH_CHECK_VALUE(
      grad_output.dim() == 2 && grad_output.size(0) == l.batch_size &&
          grad_output.size(1) == l.total_dim,
      op, ": grad_output must be [batch_size, total_dim] = [", l.batch_size, ", ", l.total_dim,
      "], got ", grad_output.sizes());
}

// grad_offsets of embedding_bag_backward_update (csrc/embedding_bag.cpp): int64 [F * B] on the
// inputs' device, with grad_output a contiguous float32 tensor of any shape (read flat). The
// data (each non-empty bag's row inside grad_output) is checked where the data is read: by the
// CPU kernel, and by recxla.ops.embedding_bag_checks before a GPU kernel runs.
inline void check_grad_offsets(const char* op, const at::Tensor& grad_output,
                               const at::Tensor& grad_offsets, const Layout& l,
                               const at::Device& device) {
  TORCH_CHECK_TYPE(grad_output.scalar_type() == at::kFloat, op,
                   ": grad_output must be float32, got ", grad_output.scalar_type());
  TORCH_CHECK_VALUE(grad_output.is_contiguous(), op,
                    ": grad_output must be contiguous when grad_offsets places its rows");
  TORCH_CHECK_VALUE(grad_output.device() == device, op, ": grad_output is on ",
                    grad_output.device(), " but unique_values is on ", device);
  TORCH_CHECK_TYPE(grad_offsets.scalar_type() == at::kLong, op,
                   ": grad_offsets must be int64, got ", grad_offsets.scalar_type());
  TORCH_CHECK_VALUE(grad_offsets.dim() == 1 &&
                        grad_offsets.numel() == l.num_features * l.batch_size,
                    op, ": grad_offsets must be 1-D with num_features * batch_size = ",
                    l.num_features * l.batch_size, " entries, got shape ", grad_offsets.sizes());
  TORCH_CHECK_VALUE(grad_offsets.device() == device, op, ": grad_offsets is on ",
                    grad_offsets.device(), " but unique_values is on ", device);
}

// The out= tensor of embedding_bag_forward_out, on the inputs' device: float32 [B, total_dim],
// contiguous (it is written whole, so its contents do not matter), or with feature_columns as
// place_features says (only the features' columns are written).
inline void check_forward_out(const char* op, const at::Tensor& out, Layout& l,
                              const at::Device& device,
                              at::OptionalIntArrayRef feature_columns = std::nullopt) {
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, op, ": out must be float32, got ",
                   out.scalar_type());
  TORCH_CHECK_VALUE(out.device() == device, op, ": out is on ", out.device(),
                    " but unique_values is on ", device);
  if (feature_columns.has_value()) {
    place_features(op, l, out, "out", *feature_columns);
    return;
  }
  TORCH_CHECK_VALUE(
      out.dim() == 2 && out.size(0) == l.batch_size && out.size(1) == l.total_dim, op,
      ": out must be [batch_size, total_dim] = [", l.batch_size, ", ", l.total_dim, "], got ",
      out.sizes());
  TORCH_CHECK_VALUE(out.is_contiguous(), op, ": out must be contiguous");
}

// Reads the per-table optimizer arguments of embedding_bag_backward_update.
inline std::vector<Hparams> check_optimizer(
    const char* op, const Layout& l, const at::Device& device, at::TensorList states,
    at::IntArrayRef optim, at::ArrayRef<double> hparams) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(optim.size()) == l.num_tables, op,
                    ": optim must have one entry per table (", l.num_tables, "), got ",
                    optim.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(states.size()) == l.num_tables, op,
                    ": states must have one tensor per table (", l.num_tables, "), got ",
                    states.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(hparams.size()) == kNumHparams * l.num_tables, op,
                    ": hparams must hold ", kNumHparams, " values per table (",
                    kNumHparams * l.num_tables, "), got ", hparams.size());
  std::vector<Hparams> out;
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const int64_t kind = optim[t];
    TORCH_CHECK_VALUE(kind >= 0 && kind <= 3, op, ": optim[", t,
                      "] must be 0 (none), 1 (SGD), 2 (Adagrad) or 3 (row-wise Adagrad), got ",
                      kind);
    const auto k = static_cast<Optim>(kind);
    if (k == Optim::Adagrad || k == Optim::RowwiseAdagrad) {
      const at::Tensor& s = states[t];
      const int64_t want = k == Optim::Adagrad ? l.table_rows[t] * l.table_dim[t] : l.table_rows[t];
      TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": states[", t,
                       "] must be float32, got ", s.scalar_type());
      TORCH_CHECK_VALUE(s.is_contiguous() && s.numel() == want, op, ": states[", t,
                        "] must be a contiguous tensor of ", want, " values (",
                        k == Optim::Adagrad ? "one per weight" : "one per row", "), got shape ",
                        s.sizes());
      TORCH_CHECK_VALUE(s.device() == device, op, ": states[", t, "] is on ", s.device(),
                        " but the weights are on ", device);
    }
    const double* h = hparams.data() + kNumHparams * t;
    // A NaN or Inf here would silently turn every touched row into NaN.
    const char* names[] = {"lr", "eps", "weight_decay"};
    for (int k = 0; k < 3; ++k) {
      TORCH_CHECK_VALUE(std::isfinite(h[k]) && h[k] >= 0.0, op, ": hparams[", kNumHparams * t + k,
                        "] (", names[k], " of table ", t, ") must be finite and >= 0, got ", h[k]);
    }
    TORCH_CHECK_VALUE(h[3] == 1.0 || h[3] == -1.0, op, ": hparams[", kNumHparams * t + 3,
                      "] (grad_sign of table ", t, ") must be 1 or -1, got ", h[3]);
    out.push_back(Hparams{static_cast<float>(h[0]), static_cast<float>(h[1]),
                          static_cast<float>(h[2]), static_cast<float>(h[3])});
  }
  return out;
}

}  // namespace emb
}  // namespace recxla
