// Pooled embedding lookup over deduplicated ids on CPU (the forward; the fused backward is
// embedding_bag_backward.cpp).
//
// Samples are split across threads in tiles of 64; a task walks its tile feature by feature and
// sums each bag's rows (table row unique_values[inverse[i]]) straight into its slice of the
// output, so no id-sized buffer is written. For the usual widths (16, 32, 64, 128) the sum lives
// in vector registers; the rows of the ids a few places ahead are prefetched.
//
// Every check that reads the data (offsets monotone, ids inside their table's segment, rows in
// range) runs before or while the output is written; nothing else is written.
#include <torch/library.h>

#include "embedding_bag_cpu.h"

namespace recxla {
namespace emb_cpu {
namespace {

// Pools one bag into o[0, dim) (the generic path sums in o itself).
template <int64_t kDim, typename index_t>
RECXLA_INLINE bool pool_bag(
    const Args& a, const index_t* __restrict__ rows, const float* __restrict__ w,
    int64_t runtime_dim, int64_t first, int64_t last, int64_t feature_end, int64_t lo, int64_t hi,
    bool mean, float* __restrict__ o) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  RowSum<kDim> acc(o, dim);
  bool ok = true;
  for (int64_t i = first; i < last; ++i) {
    if (i + kPrefetchAhead < feature_end) {
      const int64_t ahead = a.inverse[i + kPrefetchAhead];
      if (ahead >= lo && ahead < hi) prefetch_row(w + static_cast<int64_t>(rows[ahead]) * dim, dim);
    }
    const int64_t u = a.inverse[i];
    if (u < lo || u >= hi) {
      ok = false;
      continue;
    }
    const float* __restrict__ row = w + static_cast<int64_t>(rows[u]) * dim;
    if (a.psw != nullptr) {
      acc.add(row, a.psw[i]);
    } else {
      acc.add(row);
    }
  }
  if (mean && last > first) {
    acc.store(o, 1.0f / static_cast<float>(last - first));
  } else {
    acc.store(o);
  }
  return ok;
}

// Pools the bags of samples [begin, end) of every feature. Samples, not bags, are split across
// threads, and a task walks its samples feature by feature: each feature's ids are then read
// as one stretch, while the output rows written stay few enough to remain in the TLB (a sample's
// row of the [B, total_dim] output is several KiB, so bag after bag of one feature over the
// whole batch would touch a new page every time).
template <typename index_t>
RECXLA_INLINE void forward_bags(
    const Args& a, const index_t* __restrict__ rows, int64_t begin, int64_t end,
    float* __restrict__ out, std::atomic<bool>& bad) {
  bool ok = true;
  const int64_t num_features = a.num_features;
  for (int64_t f = 0; f < num_features; ++f) {
    const int64_t t = a.feature_table[f], dim = a.table_dim[t];
    const int64_t lo = a.unique_offsets[t], hi = a.unique_offsets[t + 1];
    const int64_t feature_end = a.offsets[(f + 1) * a.batch_size];
    const bool mean = a.pooling[t] == static_cast<int64_t>(emb::Pooling::Mean);
    const float* w = a.weights[t];
    const int64_t* offsets = a.offsets + f * a.batch_size;
    float* o = out + a.feature_column[f];
#define RECXLA_POOL(D)                                                                          \
  for (int64_t b = begin; b < end; ++b) {                                                     \
    ok &= pool_bag<D>(a, rows, w, dim, offsets[b], offsets[b + 1], feature_end, lo, hi, mean, \
                      o + b * a.row_stride);                                                  \
  }
    switch (dim) {
      case 16: RECXLA_POOL(16); break;
      case 32: RECXLA_POOL(32); break;
      case 64: RECXLA_POOL(64); break;
      case 128: RECXLA_POOL(128); break;
      default: RECXLA_POOL(0);
    }
#undef RECXLA_POOL
  }
  if (!ok) bad.store(true, std::memory_order_relaxed);
}

#define RECXLA_EB_FORWARD(index_t, name)                                                        \
  RECXLA_MULTIVERSION void forward_bags_##name(                                                 \
      const Args& a, const index_t* rows, int64_t begin, int64_t end, float* out,               \
      std::atomic<bool>& bad) {                                                                 \
    forward_bags<index_t>(a, rows, begin, end, out, bad);                                       \
  }

RECXLA_EB_FORWARD(int32_t, i32)
RECXLA_EB_FORWARD(int64_t, i64)
#undef RECXLA_EB_FORWARD

// Pools every bag of the call into out (float32 [B, total_dim] contiguous, or the columns
// check_forward_out placed).
void forward_into(const char* op, const Call& c, at::Tensor& out) {
  const int64_t batch_size = c.l.batch_size;
  if (out.numel() == 0) return;
  std::atomic<bool> bad{false};
  float* out_ptr = out.data_ptr<float>();
  // Tiles of 64 samples: 64 output rows per feature stay within the TLB's reach.
  constexpr int64_t kTile = 64;
  at::parallel_for(0, (batch_size + kTile - 1) / kTile, 1, [&](int64_t first, int64_t last) {
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t begin = tile * kTile, end = std::min(batch_size, begin + kTile);
      if (c.rows.scalar_type() == at::kInt) {
        forward_bags_i32(c.args, c.rows.const_data_ptr<int32_t>(), begin, end, out_ptr, bad);
      } else {
        forward_bags_i64(c.args, c.rows.const_data_ptr<int64_t>(), begin, end, out_ptr, bad);
      }
    }
  });
  TORCH_CHECK_INDEX(!bad.load(), op,
                    ": inverse holds an index outside the unique_values segment of its table");
}

at::Tensor embedding_bag_forward_cpu(
    at::TensorList weights, const at::Tensor& unique_values, const at::Tensor& unique_offsets,
    const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size) {
  constexpr const char* op = "recxla::embedding_bag_forward";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/false);
  at::Tensor out = at::empty({batch_size, c.l.total_dim}, unique_values.options().dtype(at::kFloat));
  forward_into(op, c, out);
  return out;
}

void embedding_bag_forward_out_cpu(
    at::TensorList weights, const at::Tensor& unique_values, const at::Tensor& unique_offsets,
    const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size, at::Tensor& out,
    at::OptionalIntArrayRef feature_columns) {
  constexpr const char* op = "recxla::embedding_bag_forward_out";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/false);
  emb::check_forward_out(op, out, c.l, unique_values.device(), feature_columns);
  c.use_layout();
  forward_into(op, c, out);
}

}  // namespace
}  // namespace emb_cpu

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("embedding_bag_forward", &emb_cpu::embedding_bag_forward_cpu);
  m.impl("embedding_bag_forward_out", &emb_cpu::embedding_bag_forward_out_cpu);
}

}  // namespace recxla
