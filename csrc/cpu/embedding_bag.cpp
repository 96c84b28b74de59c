// Pooled embedding lookup over deduplicated ids, and its fused backward, on CPU.
//
// Forward: bags are split across threads; each bag sums its rows (table row unique_values[
// inverse[i]]) straight into its slice of the output, so no id-sized buffer is written.
// Backward: the ids are grouped by unique row with a counting sort (one table per task), then
// the unique rows are split across threads: each thread sums the output gradient of its rows'
// ids and updates those rows and their optimizer state in place. Every row is owned by exactly
// one thread, so there are no atomics and the gradient sums have a fixed order (ids in batch
// order), which makes the step deterministic for any thread count.
//
// Every check that reads the data (offsets monotone, ids inside their table's segment, rows in
// range and strictly increasing) runs before the first write to a weight or optimizer state.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "recxla/embedding_bag.h"
#include "recxla/embedding_bag_checks.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECXLA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RECXLA_MULTIVERSION
#endif
// The loops below must be inlined into each multiversioned entry point to be compiled for its
// instruction set; a call would run them as baseline x86-64 code.
#define RECXLA_INLINE inline __attribute__((always_inline))

namespace recxla {
namespace {

using emb::Hparams;
using emb::Layout;
using emb::Optim;

// Raw pointers of one call, so that the multiversioned loops below are plain functions.
struct Args {
  float* const* weights;         // [T]
  float* const* states;          // [T] (backward_update)
  const int64_t* inverse;
  const int64_t* offsets;
  const float* psw;              // may be null
  const int64_t* feature_table;  // [F]
  const int64_t* feature_column;
  const int64_t* table_dim;
  const int64_t* pooling;
  const int64_t* unique_offsets;  // [T + 1]
  int64_t batch_size;
  int64_t total_dim;
  int64_t num_tables;
  int64_t num_features;
};

// Ids ahead of the current one whose rows are prefetched: enough to keep several row loads in
// flight (ids of one bag, and of consecutive one-id bags, are independent of each other).
constexpr int64_t kPrefetchAhead = 8;
constexpr bool kPrefetchRows = true;

RECXLA_INLINE void prefetch_row(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d);  // one 64-byte line each
}

// A sum of rows. For a width kDim known at compile time (a multiple of 16) it lives in
// 64-byte vectors (GCC vector extensions: zmm registers in the AVX-512 clone, split in the
// others), so a bag's or a gradient row's sum never goes through memory; kDim == 0 is the
// generic path, summing in place in a caller's buffer of the runtime width.
typedef float vec16 __attribute__((vector_size(64)));

#pragma GCC diagnostic ignored "-Wpsabi"  // vec16 never crosses a call: everything here is inlined
RECXLA_INLINE vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

template <int64_t kDim>
struct RowSum {
  static constexpr int64_t kVecs = kDim / 16;
  vec16 v[kVecs];
  RECXLA_INLINE explicit RowSum(float*, int64_t) {
    for (int64_t j = 0; j < kVecs; ++j) v[j] = vec16{};
  }
  RECXLA_INLINE void add(const float* __restrict__ row) {
    for (int64_t j = 0; j < kVecs; ++j) v[j] += load16(row + 16 * j);
  }
  RECXLA_INLINE void add(const float* __restrict__ row, float s) {
    for (int64_t j = 0; j < kVecs; ++j) v[j] += s * load16(row + 16 * j);
  }
  RECXLA_INLINE void store(float* __restrict__ out) const {
    std::memcpy(out, v, sizeof(v));
  }
  RECXLA_INLINE void store(float* __restrict__ out, float s) const {
    for (int64_t j = 0; j < kVecs; ++j) {
      const vec16 x = v[j] * s;
      std::memcpy(out + 16 * j, &x, sizeof(x));
    }
  }
};

template <>
struct RowSum<0> {
  float* __restrict__ p;
  int64_t dim;
  RECXLA_INLINE RowSum(float* buffer, int64_t d) : p(buffer), dim(d) {
    for (int64_t i = 0; i < dim; ++i) p[i] = 0.0f;
  }
  RECXLA_INLINE void add(const float* __restrict__ row) {
    for (int64_t i = 0; i < dim; ++i) p[i] += row[i];
  }
  RECXLA_INLINE void add(const float* __restrict__ row, float s) {
    for (int64_t i = 0; i < dim; ++i) p[i] += s * row[i];
  }
  RECXLA_INLINE void store(float* __restrict__ out) const {
    if (out != p) std::memcpy(out, p, dim * sizeof(float));
  }
  RECXLA_INLINE void store(float* __restrict__ out, float s) const {
    for (int64_t i = 0; i < dim; ++i) out[i] = p[i] * s;
  }
};

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
    if (kPrefetchRows && i + kPrefetchAhead < feature_end) {
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
                      o + b * a.total_dim);                                                   \
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

// The ids of every unique row, as a CSR: ids of row u are entries [start[u], start[u + 1]);
// an entry holds where the id's output gradient lives (grad_offset into grad_output) and the
// factor its gradient is scaled by (per-sample weight, 1 / bag length for mean, grad sign).
struct IdsByRow {
  std::vector<int64_t> start;                 // [U + 1]
  std::unique_ptr<int64_t[]> grad_offset;     // [N], left uninitialised until filled
  std::unique_ptr<float[]> scale;             // [N]
};

// Applies one table's optimizer to unique rows [begin, end) of its segment (or, for Optim::None,
// writes their gradient to grad_out). kDim > 0 makes the width a compile-time constant, so the
// gradient row stays in vector registers; kDim == 0 is the generic path over `buffer`.
template <int64_t kDim, typename index_t>
RECXLA_INLINE void update_segment(
    const Args& a, const IdsByRow& ids, const index_t* __restrict__ rows,
    const float* __restrict__ grad, Optim kind, const Hparams h, int64_t t, int64_t runtime_dim,
    float* __restrict__ grad_out, int64_t begin, int64_t end, float* __restrict__ buffer) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t lo = a.unique_offsets[t];
  const int64_t* __restrict__ start = ids.start.data();
  const int64_t* __restrict__ grad_offset = ids.grad_offset.get();
  const float* __restrict__ scale = ids.scale.get();
  const int64_t last_entry = start[end];
  float* __restrict__ w = a.weights[t];
  float* __restrict__ state = a.states != nullptr ? a.states[t] : nullptr;
  float local[kDim > 0 ? kDim : 1];
  float* __restrict__ g = kDim > 0 ? local : buffer;
  for (int64_t u = begin; u < end; ++u) {
    RowSum<kDim> sum(buffer, dim);
    for (int64_t e = start[u]; e < start[u + 1]; ++e) {
      // The output-gradient rows of the ids are scattered over grad_output: fetch ahead.
      if (e + kPrefetchAhead < last_entry) prefetch_row(grad + grad_offset[e + kPrefetchAhead], dim);
      sum.add(grad + grad_offset[e], scale[e]);
    }
    sum.store(g);
    const int64_t r = rows[u];
    float* __restrict__ row = w + r * dim;
    switch (kind) {
      case Optim::None: {
        float* __restrict__ o = grad_out + (u - lo) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = g[d];
        break;
      }
      case Optim::SGD:
        for (int64_t d = 0; d < dim; ++d) row[d] = emb::sgd_update(row[d], g[d], h);
        break;
      case Optim::Adagrad: {
        float* __restrict__ m = state + r * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] = emb::adagrad_update(row[d], g[d], m[d], h);
        break;
      }
      case Optim::RowwiseAdagrad: {
        // 16 independent partial sums, so the reduction vectorizes without reassociation.
        constexpr int kLanes = 16;
        float lanes[kLanes] = {};
        int64_t d = 0;
        for (; d + kLanes <= dim; d += kLanes) {
          for (int j = 0; j < kLanes; ++j) lanes[j] += emb::rowwise_square(g[d + j], row[d + j], h);
        }
        float tail = 0.0f;
        for (; d < dim; ++d) tail += emb::rowwise_square(g[d], row[d], h);
        for (int width = kLanes / 2; width > 0; width /= 2) {
          for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
        }
        const float m_new = emb::rowwise_accumulator(state[r], lanes[0] + tail, dim);
        state[r] = m_new;
        const float mult = emb::rowwise_multiplier(m_new, h);
        const float corr = emb::rowwise_correction(mult, h);
        for (d = 0; d < dim; ++d) row[d] = emb::rowwise_update(row[d], g[d], mult, corr);
        break;
      }
    }
  }
}

template <typename index_t>
RECXLA_INLINE void update_rows(
    const Args& a, const IdsByRow& ids, const index_t* __restrict__ rows,
    const float* __restrict__ grad, const int64_t* optim, const Hparams* hparams,
    float* const* grad_out, int64_t begin, int64_t end) {
  std::vector<float> buffer;
  while (begin < end) {
    const int64_t t =
        std::upper_bound(a.unique_offsets, a.unique_offsets + a.num_tables + 1, begin) -
        a.unique_offsets - 1;
    const int64_t stop = std::min(end, a.unique_offsets[t + 1]);
    const int64_t dim = a.table_dim[t];
    const auto kind = static_cast<Optim>(optim[t]);
    if (kind == Optim::None && grad_out[t] == nullptr) {
      begin = stop;  // a table without an optimizer in a fused update: nothing to do
      continue;
    }
    buffer.resize(std::max<int64_t>(dim, 1));
#define RECXLA_UPDATE(D)                                                                     \
  update_segment<D>(a, ids, rows, grad, kind, hparams[t], t, dim, grad_out[t], begin, stop, \
                    buffer.data())
    switch (dim) {
      case 16: RECXLA_UPDATE(16); break;
      case 32: RECXLA_UPDATE(32); break;
      case 64: RECXLA_UPDATE(64); break;
      case 128: RECXLA_UPDATE(128); break;
      default: RECXLA_UPDATE(0);
    }
#undef RECXLA_UPDATE
    begin = stop;
  }
}

#define RECXLA_EB_KERNELS(index_t, name)                                                         \
  RECXLA_MULTIVERSION void forward_bags_##name(                                                  \
      const Args& a, const index_t* rows, int64_t begin, int64_t end, float* out,                \
      std::atomic<bool>& bad) {                                                                  \
    forward_bags<index_t>(a, rows, begin, end, out, bad);                                        \
  }                                                                                              \
  RECXLA_MULTIVERSION void update_rows_##name(                                                   \
      const Args& a, const IdsByRow& ids, const index_t* rows, const float* grad,                \
      const int64_t* optim, const Hparams* hparams, float* const* grad_out, int64_t begin,       \
      int64_t end) {                                                                             \
    update_rows<index_t>(a, ids, rows, grad, optim, hparams, grad_out, begin, end);              \
  }

RECXLA_EB_KERNELS(int32_t, i32)
RECXLA_EB_KERNELS(int64_t, i64)
#undef RECXLA_EB_KERNELS

// Rows of every table segment in [0, rows) (and, for the backward, strictly increasing, which
// makes each row owned by one thread). One task per table.
template <typename index_t>
void check_rows(const char* op, const Layout& l, const index_t* rows, bool increasing) {
  // One flag per table, so the message names the first bad table whatever the thread timing.
  // Split over rows, not tables (one table may hold most of them); a batch's few thousand
  // unique rows are checked on one thread, which beats waking the others.
  std::unique_ptr<std::atomic<bool>[]> out_of_range(new std::atomic<bool>[l.num_tables]);
  std::unique_ptr<std::atomic<bool>[]> unsorted(new std::atomic<bool>[l.num_tables]);
  for (int64_t t = 0; t < l.num_tables; ++t) out_of_range[t] = unsorted[t] = false;
  at::parallel_for(0, l.num_unique, 1 << 16, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t t = std::upper_bound(l.unique_offsets.begin(), l.unique_offsets.end(), begin) -
                        l.unique_offsets.begin() - 1;
      const int64_t lo = l.unique_offsets[t], stop = std::min(end, l.unique_offsets[t + 1]);
      const int64_t n = l.table_rows[t];
      bool in_range = true, sorted = true;
      for (int64_t u = begin; u < stop; ++u) {
        in_range &= rows[u] >= 0 && static_cast<int64_t>(rows[u]) < n;
        sorted &= u == lo || rows[u] > rows[u - 1];
      }
      if (!in_range) out_of_range[t] = true;
      if (increasing && !sorted) unsorted[t] = true;
      begin = stop;
    }
  });
  for (int64_t t = 0; t < l.num_tables; ++t) {
    TORCH_CHECK_INDEX(!out_of_range[t], op, ": unique_values of table ", t, " must lie in [0, ",
                      l.table_rows[t], ")");
    TORCH_CHECK_VALUE(!unsorted[t], op, ": unique_values must be strictly increasing within "
                      "each table's segment, but table ", t, "'s are not");
  }
}

void check_offsets(const char* op, const Layout& l, const int64_t* offsets) {
  const int64_t bags = l.num_features * l.batch_size;
  TORCH_CHECK_VALUE(offsets[0] == 0 && offsets[bags] == l.num_ids, op,
                    ": offsets must start at 0 and end at the number of ids (", l.num_ids,
                    "), got ", offsets[0], " and ", offsets[bags]);
  bool monotone = true;
  for (int64_t k = 0; k < bags; ++k) monotone &= offsets[k] <= offsets[k + 1];
  TORCH_CHECK_VALUE(monotone, op, ": offsets must be non-decreasing (bag lengths >= 0)");
}

// Inputs made contiguous and their raw pointers, shared by the three ops.
struct Call {
  Layout l;
  at::Tensor rows, inverse, offsets, psw, unique_offsets;
  std::vector<float*> weight_ptrs, state_ptrs;
  Args args{};

  Call(const char* op, at::TensorList weights, const at::Tensor& unique_values,
       const at::Tensor& unique_offsets_in, const at::Tensor& inverse_in,
       const at::Tensor& offsets_in, const std::optional<at::Tensor>& psw_in,
       at::IntArrayRef feature_table, at::IntArrayRef pooling, int64_t batch_size, bool increasing)
      : l(emb::check_layout(op, weights, unique_values, unique_offsets_in, inverse_in, offsets_in,
                            psw_in, feature_table, pooling, batch_size)) {
    rows = unique_values.contiguous();
    inverse = inverse_in.contiguous();
    offsets = offsets_in.contiguous();
    if (psw_in.has_value()) psw = psw_in->contiguous();
    for (const at::Tensor& w : weights) weight_ptrs.push_back(w.data_ptr<float>());
    check_offsets(op, l, offsets.const_data_ptr<int64_t>());
    if (rows.scalar_type() == at::kInt) {
      check_rows(op, l, rows.const_data_ptr<int32_t>(), increasing);
    } else {
      check_rows(op, l, rows.const_data_ptr<int64_t>(), increasing);
    }
    args.weights = weight_ptrs.data();
    args.inverse = inverse.const_data_ptr<int64_t>();
    args.offsets = offsets.const_data_ptr<int64_t>();
    args.psw = psw.defined() ? psw.const_data_ptr<float>() : nullptr;
    args.feature_table = l.feature_table.data();
    args.feature_column = l.feature_column.data();
    args.table_dim = l.table_dim.data();
    args.pooling = l.pooling.data();
    args.unique_offsets = l.unique_offsets.data();
    args.batch_size = l.batch_size;
    args.total_dim = l.total_dim;
    args.num_tables = l.num_tables;
    args.num_features = l.num_features;
  }
};

at::Tensor embedding_bag_forward_cpu(
    at::TensorList weights, const at::Tensor& unique_values, const at::Tensor& unique_offsets,
    const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size) {
  constexpr const char* op = "recxla::embedding_bag_forward";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/false);
  at::Tensor out = at::empty({batch_size, c.l.total_dim}, unique_values.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
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
  return out;
}

// Groups the ids by unique row (see IdsByRow); `sign[t]` multiplies table t's gradients.
IdsByRow group_ids(const char* op, const Call& c, const std::vector<float>& sign) {
  const Layout& l = c.l;
  const Args& a = c.args;
  const int64_t B = l.batch_size;
  std::vector<std::vector<int64_t>> features(l.num_tables);
  std::vector<int64_t> base(l.num_tables + 1, 0);
  for (int64_t f = 0; f < l.num_features; ++f) {
    features[l.feature_table[f]].push_back(f);
    base[l.feature_table[f] + 1] += a.offsets[(f + 1) * B] - a.offsets[f * B];
  }
  for (int64_t t = 0; t < l.num_tables; ++t) base[t + 1] += base[t];
  IdsByRow ids;
  ids.start.assign(l.num_unique + 1, 0);
  ids.grad_offset.reset(new int64_t[std::max<int64_t>(l.num_ids, 1)]);
  ids.scale.reset(new float[std::max<int64_t>(l.num_ids, 1)]);
  std::vector<int64_t> cursor(l.num_unique, 0);
  std::atomic<bool> bad{false};
  at::parallel_for(0, l.num_tables, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = l.unique_offsets[t], hi = l.unique_offsets[t + 1];
      bool ok = true;
      for (int64_t f : features[t]) {
        for (int64_t i = a.offsets[f * B]; i < a.offsets[(f + 1) * B]; ++i) {
          const int64_t u = a.inverse[i];
          const bool inside = u >= lo && u < hi;
          ok &= inside;
          if (inside) ++cursor[u];
        }
      }
      if (!ok) bad.store(true);
      int64_t running = base[t];
      for (int64_t u = lo; u < hi; ++u) {
        const int64_t n = cursor[u];
        ids.start[u] = cursor[u] = running;
        running += n;
      }
    }
  });
  TORCH_CHECK_INDEX(!bad.load(), op,
                    ": inverse holds an index outside the unique_values segment of its table");
  ids.start[l.num_unique] = l.num_ids;
  at::parallel_for(0, l.num_tables, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bool mean = l.pooling[t] == static_cast<int64_t>(emb::Pooling::Mean);
      for (int64_t f : features[t]) {
        for (int64_t b = 0; b < B; ++b) {
          const int64_t k = f * B + b, first = a.offsets[k], last = a.offsets[k + 1];
          const float bag_scale =
              mean && last > first ? sign[t] * (1.0f / static_cast<float>(last - first)) : sign[t];
          const int64_t goff = b * l.total_dim + l.feature_column[f];
          for (int64_t i = first; i < last; ++i) {
            const int64_t e = cursor[a.inverse[i]]++;
            ids.grad_offset[e] = goff;
            ids.scale[e] = a.psw != nullptr ? a.psw[i] * bag_scale : bag_scale;
          }
        }
      }
    }
  });
  return ids;
}

void run_update(
    const Call& c, const IdsByRow& ids, const at::Tensor& grad, const int64_t* optim,
    const Hparams* hparams, float* const* grad_out) {
  if (c.l.num_unique == 0) return;
  int64_t max_dim = 1;
  for (int64_t d : c.l.table_dim) max_dim = std::max(max_dim, d);
  const float* g = grad.const_data_ptr<float>();
  at::parallel_for(0, c.l.num_unique, std::max<int64_t>(1, 8192 / max_dim), [&](int64_t b, int64_t e) {
    if (c.rows.scalar_type() == at::kInt) {
      update_rows_i32(c.args, ids, c.rows.const_data_ptr<int32_t>(), g, optim, hparams, grad_out, b, e);
    } else {
      update_rows_i64(c.args, ids, c.rows.const_data_ptr<int64_t>(), g, optim, hparams, grad_out, b, e);
    }
  });
}

std::vector<at::Tensor> embedding_bag_unique_grad_cpu(
    const at::Tensor& grad_output, at::TensorList weights, const at::Tensor& unique_values,
    const at::Tensor& unique_offsets, const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size) {
  constexpr const char* op = "recxla::embedding_bag_unique_grad";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/false);
  emb::check_grad_output(op, grad_output, c.l);
  const at::Tensor grad = grad_output.contiguous();
  std::vector<at::Tensor> out;
  std::vector<float*> out_ptrs;
  for (int64_t t = 0; t < c.l.num_tables; ++t) {
    const int64_t n = c.l.unique_offsets[t + 1] - c.l.unique_offsets[t];
    out.push_back(at::empty({n, c.l.table_dim[t]}, grad.options()));
    out_ptrs.push_back(out.back().data_ptr<float>());
  }
  const IdsByRow ids = group_ids(op, c, std::vector<float>(c.l.num_tables, 1.0f));
  const std::vector<int64_t> optim(c.l.num_tables, static_cast<int64_t>(Optim::None));
  const std::vector<Hparams> hparams(c.l.num_tables, Hparams{0.0f, 0.0f, 0.0f, 1.0f});
  run_update(c, ids, grad, optim.data(), hparams.data(), out_ptrs.data());
  return out;
}

void embedding_bag_backward_update_cpu(
    const at::Tensor& grad_output, at::TensorList weights, at::TensorList states,
    const at::Tensor& unique_values, const at::Tensor& unique_offsets, const at::Tensor& inverse,
    const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
    at::IntArrayRef feature_table, at::IntArrayRef pooling, int64_t batch_size,
    at::IntArrayRef optim, at::ArrayRef<double> hparams) {
  constexpr const char* op = "recxla::embedding_bag_backward_update";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/true);
  emb::check_grad_output(op, grad_output, c.l);
  const std::vector<Hparams> h =
      emb::check_optimizer(op, c.l, unique_values.device(), states, optim, hparams);
  const at::Tensor grad = grad_output.contiguous();
  for (const at::Tensor& s : states) {
    c.state_ptrs.push_back(s.numel() > 0 && s.scalar_type() == at::kFloat ? s.data_ptr<float>()
                                                                          : nullptr);
  }
  c.args.states = c.state_ptrs.data();
  std::vector<float> sign;
  for (const Hparams& p : h) sign.push_back(p.grad_sign);
  const IdsByRow ids = group_ids(op, c, sign);
  std::vector<float*> no_grad_out(c.l.num_tables, nullptr);
  run_update(c, ids, grad, optim.data(), h.data(), no_grad_out.data());
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("embedding_bag_forward", &embedding_bag_forward_cpu);
  m.impl("embedding_bag_unique_grad", &embedding_bag_unique_grad_cpu);
  m.impl("embedding_bag_backward_update", &embedding_bag_backward_update_cpu);
}

}  // namespace recxla
