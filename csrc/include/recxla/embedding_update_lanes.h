// The embedding-bag fused update's `batched_ids` GPU variant (family "embedding_update" of
// recxla/gpu_variants.h): one lane's part of one unique row, shared by the CUDA kernel
// (csrc/cuda/embedding_bag.cu) and the CPU replay that tests it without a GPU
// (tests/embedding_update_harness.cpp).
//
// A warp owns a unique row and sums the output-gradient rows of its ids, in id order, then
// updates the row. The fallback variant `warp_per_row` does that one id at a time: read the id's
// offset and scale, then its gradient row, then add; each id waits for two dependent global
// loads, and a Zipf-hot row with thousands of ids is one warp's serial tail (2.1 ms of an H100
// trainer step). Here the lanes read 32 ids' offsets and scales at once (one coalesced load each,
// broadcast by shuffles), every lane loads its columns of kAhead gradient rows before it adds
// any of them, and the sum stays in registers: kAhead loads in flight instead of one, and no
// shared-memory round trip. The additions are the same, in the same order, with the same
// per-element math (recxla/embedding_bag.h), so the two variants give the same bits; the
// row-wise Adagrad squares are reduced by the same xor tree.
#pragma once

#include <cstdint>

#include "recxla/embedding_bag.h"

#if defined(__CUDACC__)
#define RECXLA_LANES_UNROLL _Pragma("unroll")
#else
#define RECXLA_LANES_UNROLL
#endif

namespace recxla {
namespace emb {
namespace lanes {

constexpr int kWarp = 32;
// Columns a lane keeps in registers: lane + kWarp * c for c < kMaxPerLane, so rows up to 256
// floats wide. A call with a wider table runs warp_per_row (fits()).
constexpr int kMaxPerLane = 8;
// Gradient rows a lane loads before it adds the first of them.
constexpr int kAhead = 4;

RECXLA_EB_HD bool fits(int64_t max_dim) { return max_dim <= kWarp * kMaxPerLane; }

RECXLA_EB_HD float load_readonly(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// One lane's columns d = lane + kWarp * c (c < kMaxPerLane, d < dim) of a unique row's summed
// gradient g.
struct RowGradLane {
  float g[kMaxPerLane];

  RECXLA_EB_HD void zero() {
    RECXLA_LANES_UNROLL
    for (int c = 0; c < kMaxPerLane; ++c) g[c] = 0.0f;
  }

  // Adds count (1..kAhead) ids' gradient rows, in order: g += scale[q] * src[q], the same
  // expression, operand order and rounding as warp_per_row's g[d] = g[d] + s * src[d].
  RECXLA_EB_HD void add(const float* const* src, const float* scale, int count, int lane,
                        int64_t dim) {
    float v[kAhead][kMaxPerLane];
    RECXLA_LANES_UNROLL
    for (int q = 0; q < kAhead; ++q) {
      RECXLA_LANES_UNROLL
      for (int c = 0; c < kMaxPerLane; ++c) {
        const int64_t d = lane + static_cast<int64_t>(kWarp) * c;
        v[q][c] = q < count && d < dim ? load_readonly(src[q] + d) : 0.0f;
      }
    }
    RECXLA_LANES_UNROLL
    for (int q = 0; q < kAhead; ++q) {
      if (q < count) {
        RECXLA_LANES_UNROLL
        for (int c = 0; c < kMaxPerLane; ++c) g[c] = g[c] + scale[q] * v[q][c];
      }
    }
  }

  // This lane's part of the row-wise Adagrad sum of squares, over its columns in order (as
  // warp_per_row's lane loop); the warp then sums the lanes by the xor tree.
  RECXLA_EB_HD float squares(const float* row, const Hparams& h, int lane, int64_t dim) const {
    float s = 0.0f;
    RECXLA_LANES_UNROLL
    for (int c = 0; c < kMaxPerLane; ++c) {
      const int64_t d = lane + static_cast<int64_t>(kWarp) * c;
      if (d < dim) s += rowwise_square(g[c], row[d], h);
    }
    return s;
  }

  // The row's update with this lane's columns (or its gradient into grad_row for Optim::None).
  // m_new: the row's new row-wise Adagrad accumulator (RowwiseAdagrad only); state: the table's
  // optimizer state, r the row.
  RECXLA_EB_HD void apply(Optim kind, const Hparams& h, float* row, float* state, int64_t r,
                          float* grad_row, float m_new, int lane, int64_t dim) const {
    const float mult = kind == Optim::RowwiseAdagrad ? rowwise_multiplier(m_new, h) : 0.0f;
    const float corr = kind == Optim::RowwiseAdagrad ? rowwise_correction(mult, h) : 0.0f;
    RECXLA_LANES_UNROLL
    for (int c = 0; c < kMaxPerLane; ++c) {
      const int64_t d = lane + static_cast<int64_t>(kWarp) * c;
      if (d >= dim) continue;
      switch (kind) {
        case Optim::None: grad_row[d] = g[c]; break;
        case Optim::SGD: row[d] = sgd_update(row[d], g[c], h); break;
        case Optim::Adagrad: row[d] = adagrad_update(row[d], g[c], state[r * dim + d], h); break;
        case Optim::RowwiseAdagrad: row[d] = rowwise_update(row[d], g[c], mult, corr); break;
      }
    }
  }
};

}  // namespace lanes
}  // namespace emb
}  // namespace recxla
