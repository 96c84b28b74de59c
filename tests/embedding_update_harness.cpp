// The embedding-bag fused update's `batched_ids` CUDA kernel replayed on the CPU
// (tests/test_embedding_update_lanes.py builds this file with g++ and calls it through ctypes).
// The lane code is the kernel's own (recxla/embedding_update_lanes.h); what this file adds is
// what the GPU does around it, as csrc/cuda/embedding_bag.cu's update_kernel_batched_ids writes
// it: the walk over a row's ids 32 at a time and kAhead at a time, the shuffles that hand every
// lane the same ids' offsets and scales, and the xor tree of the row-wise squares, replayed over
// the 32 lanes of a warp at once. Each unique row is a warp of its own: rows share no data.
#include <cstdint>

#include "recxla/embedding_bag.h"
#include "recxla/embedding_update_lanes.h"

namespace {

namespace emb = recxla::emb;
namespace ln = recxla::emb::lanes;

}  // namespace

extern "C" {

int fits(int64_t max_dim) { return ln::fits(max_dim) ? 1 : 0; }

// One update of every unique row u < num_unique, as the kernel does it. The CSR of ids per row
// (start [U + 1], grad_offset [N], scale [N]) is the kernel's input, built as its launcher's
// group_ids builds it. Per table t: unique rows [unique_offsets[t], unique_offsets[t + 1]),
// table_dim, optim (recxla::emb::Optim), hparams [4] (lr, eps, weight decay, grad sign), and the
// addresses of its weights, optimizer state and (Optim::None) gradient output.
void replay_update(int64_t num_unique, const int64_t* rows, const int64_t* start,
                   const int64_t* grad_offset, const float* scale, const float* grad,
                   int64_t num_tables, const int64_t* unique_offsets, const int64_t* table_dim,
                   const int64_t* optim, const float* hparams, float* const* weights,
                   float* const* states, float* const* grad_out) {
  for (int64_t u = 0; u < num_unique; ++u) {
    int64_t t = 0;
    while (t + 1 < num_tables && unique_offsets[t + 1] <= u) ++t;
    const auto kind = static_cast<emb::Optim>(optim[t]);
    if (kind == emb::Optim::None && grad_out[t] == nullptr) continue;
    const int64_t dim = table_dim[t];
    ln::RowGradLane lane_sum[ln::kWarp];
    for (auto& s : lane_sum) s.zero();
    const int64_t first = start[u], last = start[u + 1];
    for (int64_t base = first; base < last; base += ln::kWarp) {
      const int n = static_cast<int>(last - base < ln::kWarp ? last - base : ln::kWarp);
      for (int j = 0; j < n; j += ln::kAhead) {
        // __shfl_sync(full mask, v, from): every lane reads lane `from`'s offset and scale,
        // which lane `from` loaded from grad_offset[base + from] and scale[base + from].
        const float* src[ln::kAhead];
        float s[ln::kAhead];
        for (int q = 0; q < ln::kAhead; ++q) {
          const int from = j + q < n ? j + q : 0;
          src[q] = grad + grad_offset[base + from];
          s[q] = scale[base + from];
        }
        const int count = n - j < ln::kAhead ? n - j : ln::kAhead;
        for (int lane = 0; lane < ln::kWarp; ++lane) lane_sum[lane].add(src, s, count, lane, dim);
      }
    }
    const float* hp = hparams + 4 * t;
    const emb::Hparams h{hp[0], hp[1], hp[2], hp[3]};
    const int64_t r = rows[u];
    float* row = weights[t] + r * dim;
    float* state = states[t];
    float m_new = 0.0f;
    if (kind == emb::Optim::RowwiseAdagrad) {
      float squares[ln::kWarp];
      for (int lane = 0; lane < ln::kWarp; ++lane) {
        squares[lane] = lane_sum[lane].squares(row, h, lane, dim);
      }
      // squares += __shfl_xor_sync(full mask, squares, offset), every lane at once.
      for (int offset = ln::kWarp / 2; offset > 0; offset /= 2) {
        float next[ln::kWarp];
        for (int lane = 0; lane < ln::kWarp; ++lane) {
          next[lane] = squares[lane] + squares[lane ^ offset];
        }
        for (int lane = 0; lane < ln::kWarp; ++lane) squares[lane] = next[lane];
      }
      m_new = emb::rowwise_accumulator(state[r], squares[0], dim);
      state[r] = m_new;
    }
    float* grad_row = kind == emb::Optim::None ? grad_out[t] + (u - unique_offsets[t]) * dim
                                                : nullptr;
    for (int lane = 0; lane < ln::kWarp; ++lane) {
      lane_sum[lane].apply(kind, h, row, state, r, grad_row, m_new, lane, dim);
    }
  }
}

}  // extern "C"
