// Pooled embedding lookup on CPU: what the forward (embedding_bag.cpp) and the fused backward
// (embedding_bag_backward.cpp) share: the raw-pointer view of a call, the data checks that run
// before anything is written, and register-resident rows (RowSum, GradRow).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "recxla/embedding_bag.h"
#include "recxla/embedding_bag_checks.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECXLA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RECXLA_MULTIVERSION
#endif
// The loops must be inlined into each multiversioned entry point to be compiled for its
// instruction set; a call would run them as baseline x86-64 code.
#define RECXLA_INLINE inline __attribute__((always_inline))

// vec16 values never cross a call (everything that uses them is inlined), so the ABI note that
// GCC gives for 64-byte vectors in the non-AVX-512 clones does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace recxla {
namespace emb_cpu {

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
  const float* grad_sign;         // [T] (backward)
  int64_t batch_size;
  int64_t row_stride;  // elements between two samples' output (gradient) rows
  int64_t num_tables;
  int64_t num_features;
  // Backward: where each bag's gradient row starts ([F * B]), or null: at
  // b * row_stride + feature_column[f].
  const int64_t* grad_offsets = nullptr;
};

// Where bag f * B + b's output-gradient row starts in the backward's gradient.
RECXLA_INLINE int64_t grad_row_offset(const Args& a, int64_t f, int64_t b) {
  return a.grad_offsets != nullptr ? a.grad_offsets[f * a.batch_size + b]
                                   : b * a.row_stride + a.feature_column[f];
}

// Ids ahead of the current one whose rows are prefetched: enough to keep several row loads in
// flight (ids of one bag, and of consecutive one-id bags, are independent of each other).
constexpr int64_t kPrefetchAhead = 8;

RECXLA_INLINE void prefetch_row(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d);  // one 64-byte line each
}

// Rows held in registers. For a width kDim known at compile time (a multiple of 16) a row lives
// in 64-byte vectors (GCC vector extensions: zmm registers in the AVX-512 clone, split in the
// others); kDim == 0 is the generic path over memory of the runtime width.
//
// RowSum: a bag's sum in the forward, which never goes through memory until it is stored.
typedef float vec16 __attribute__((vector_size(64)));

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

// One output-gradient row, read once per bag and added to the accumulators of the bag's ids.
template <int64_t kDim>
struct GradRow {
  static constexpr int64_t kVecs = kDim / 16;
  vec16 v[kVecs];
  RECXLA_INLINE GradRow(const float* __restrict__ src, int64_t) {
    for (int64_t j = 0; j < kVecs; ++j) v[j] = load16(src + 16 * j);
  }
  RECXLA_INLINE void add_to(float* __restrict__ acc, float s) const {
    for (int64_t j = 0; j < kVecs; ++j) {
      const vec16 x = load16(acc + 16 * j) + s * v[j];
      std::memcpy(acc + 16 * j, &x, sizeof(x));
    }
  }
};

template <>
struct GradRow<0> {
  const float* __restrict__ src;
  int64_t dim;
  RECXLA_INLINE GradRow(const float* __restrict__ p, int64_t d) : src(p), dim(d) {}
  RECXLA_INLINE void add_to(float* __restrict__ acc, float s) const {
    for (int64_t d = 0; d < dim; ++d) acc[d] += s * src[d];
  }
};

// Room for n elements in a buffer kept across calls (thread_local): it grows with headroom, so
// steps whose sizes vary a little do not reallocate (fresh pages fault on first touch).
template <typename T>
T* reserve_for(std::vector<T>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(n + n / 8);
  return buffer.data();
}

template <typename index_t>
inline void check_rows(const char* op, const Layout& l, const index_t* rows, bool increasing) {
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

inline void check_offsets(const char* op, const Layout& l, const int64_t* offsets) {
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
    args.row_stride = l.row_stride;
    args.num_tables = l.num_tables;
    args.num_features = l.num_features;
  }

  // The output's (gradient's) layout, after emb::check_forward_out or check_grad_output may
  // have placed the features elsewhere (feature_columns).
  void use_layout() {
    args.feature_column = l.feature_column.data();
    args.row_stride = l.row_stride;
  }
};

}  // namespace emb_cpu
}  // namespace recxla

#pragma GCC diagnostic pop
