// The "fused" GPU variant of key-centric sample clustering, run serially on the host: how this
// machine (no GPU) tests the CUDA path's steps. `recxla::cluster_permutation_fused` on CPU
// tensors runs the same host code (recxla/cluster_fused_run.h) and the same per-thread bodies
// (recxla/cluster_fused.h, cluster_fused_pairs.h, cluster_fused_rounds.h) as on CUDA, each
// launch as a loop over its index space; only the backend primitives differ:
// - the sorts and scans (CUB on CUDA) are std::sort, running sums and a counting sort;
// - the gains' warp (32 lanes, each summing every 32nd pair, then summed) and the move block
//   (its phases run for 8 threads in turn between the barriers, so the movers arrive out of
//   order and the bitonic network really sorts them) are emulated lane by lane.
// It must not run on several threads: its atomics are plain read-modify-writes. Not a fast
// path (the CPU's is torch.ops.recxla.cluster_permutation): it exists to be compared with it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "recxla/cluster_fused_run.h"

namespace recxla {
namespace {

using namespace cluster::fused;

// Threads of the emulated move block: few, so that each phase's striding is exercised.
constexpr int kHostMoveThreads = 8;

struct HostBackend {
  at::TensorOptions options = at::TensorOptions().device(at::kCPU);

  void fill(void* p, int byte, int64_t bytes) {
    if (bytes > 0) std::memset(p, byte, static_cast<size_t>(bytes));
  }

  template <class Step>
  void for_each(int64_t n, const Step& step) {
    for (int64_t i = 0; i < n; ++i) step(i);
  }

  template <typename len_t>
  void row_summaries(
      const len_t* lengths, int64_t rows, int64_t batch, RowSummary* out, int64_t* local) {
    for (int64_t f = 0; f < rows; ++f) {
      const len_t* row = lengths + f * batch;
      int64_t* off = local + f * (batch + 1);
      RowSummary r{0, 0, 0, -1, 0};
      for (int64_t s = 0; s < batch; ++s) {
        const int64_t len = row[s];
        off[s] = static_cast<int64_t>(r.sum);
        r.sum += static_cast<uint64_t>(len);
        r.smallest = std::min(r.smallest, len);
        r.largest = std::max(r.largest, len);
        if (len < 0 && r.first_negative < 0) r.first_negative = s, r.negative_value = len;
      }
      off[batch] = static_cast<int64_t>(r.sum);
      out[f] = r;
    }
  }

  at::Tensor to_host(const at::Tensor& t) { return t; }
  at::Tensor staging(int64_t bytes) {
    return at::empty({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  }
  at::Tensor to_device(const at::Tensor& t) { return t; }
  int64_t scratch_bytes(int64_t, int64_t, int) { return 0; }

  void sort_records(SortRecord* records, int64_t n, void*, int64_t) {
    std::sort(records, records + n, record_less);
  }

  void inclusive_sum(const int32_t* in, int32_t* out, int64_t n, void*, int64_t) {
    int32_t sum = 0;
    for (int64_t i = 0; i < n; ++i) out[i] = sum += in[i];
  }

  void exclusive_sum(const int64_t* in, int64_t* out, int64_t n, void*, int64_t) {
    int64_t sum = 0;
    for (int64_t i = 0; i < n; ++i) out[i] = sum, sum += in[i];
  }

  // Stable: positions in order inside each bin.
  void sort_by_bin(const uint32_t* key, uint32_t*, const int64_t* value, int64_t* out, int64_t n,
                   int bits, void*, int64_t) {
    std::vector<int64_t> start((size_t{1} << bits) + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++start[key[i] + 1];
    for (size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
    for (int64_t i = 0; i < n; ++i) out[start[key[i]]++] = value[i];
  }

  template <int kBins>
  static void warp_of_registers(const RoundView& v, int64_t g, int32_t b) {
    int64_t leave = 0, join[kBins] = {};
    for (int lane = 0; lane < 32; ++lane) {
      int64_t lane_leave = 0, lane_join[kBins] = {};
      partial_join<kBins>(v, g, b, lane, 32, lane_leave, lane_join);
      leave += lane_leave;
      for (int t = 0; t < kBins; ++t) join[t] += lane_join[t];
    }
    best_of_joins<kBins>(v, g, b, leave, join);
  }

  void round_gains(const RoundView& v, int64_t) {
    if (v.scalars->done) return;
    for (int64_t g = 0; g < v.scalars->num_groups; ++g) {
      const int32_t b = v.bins[g];
      if (v.m <= 8) {
        warp_of_registers<8>(v, g, b);
      } else if (v.m <= 32) {
        warp_of_registers<32>(v, g, b);
      } else {
        int64_t leave = 0;
        for (int lane = 0; lane < 32; ++lane) leave += partial_leave(v, g, b, lane, 32);
        int64_t best = INT64_MIN;
        int32_t best_t = INT32_MAX;
        for (int lane = 0; lane < 32; ++lane) {  // each lane's choice, then across lanes
          int64_t lane_best = INT64_MIN;
          int32_t lane_t = INT32_MAX;
          for (int64_t t = lane; t < v.m; t += 32) {
            const int64_t gain = t == b ? 0 : leave - join_of(v, g, t);
            better(gain, static_cast<int32_t>(t), lane_best, lane_t);
          }
          better(lane_best, lane_t, best, best_t);
        }
        v.best_gain[g] = best;
        v.target[g] = best_t;
      }
    }
  }

  int64_t move_bytes(int64_t batch, int64_t m) { return move_scratch_bytes(padded(batch), m); }

  void moves(const RoundView& v, void* scratch, int64_t batch, int32_t round) {
    if (v.scalars->done) return;
    const MoveScratch s = carve_moves(scratch, padded(batch), v.m);
    constexpr int nt = kHostMoveThreads;
    for (int tid = 0; tid < nt; ++tid) moves_clear(v, s, tid, nt);
    for (int tid = 0; tid < nt; ++tid) moves_collect(v, s, tid, nt);
    const int64_t n = *s.count;
    if (n == 0) {
      v.scalars->done = 1;
      return;
    }
    const int64_t n_pad = padded(n);
    for (int tid = 0; tid < nt; ++tid) moves_pad(s, n, tid, nt);
    for (int64_t k = 2; k <= n_pad; k <<= 1) {
      for (int64_t j = k >> 1; j > 0; j >>= 1) {
        for (int tid = 0; tid < nt; ++tid) bitonic_pass(s, n_pad, k, j, tid, nt);
      }
    }
    for (int tid = 0; tid < nt; ++tid) moves_gather(v, s, n, tid, nt);
    if (v.m <= 8) {
      moves_walk<8>(v, s, n, round);
    } else {
      moves_walk<0>(v, s, n, round);
    }
  }

  int64_t num_keys(const Scalars* scalars) { return scalars->num_keys; }
};

at::Tensor cluster_permutation_fused_cpu(
    const at::Tensor& values_in, const at::Tensor& lengths_in, int64_t batch, int64_t m,
    c10::ArrayRef<double> key_bytes) {
  check_arguments(values_in, lengths_in, batch, m, key_bytes);
  const at::Tensor values = values_in.contiguous();
  const at::Tensor lengths = lengths_in.contiguous();
  at::Tensor out = at::empty({batch}, lengths.options().dtype(at::kLong));
  HostBackend be;
  const bool v32 = values.scalar_type() == at::kInt, l32 = lengths.scalar_type() == at::kInt;
  if (v32 && l32) {
    permutation<HostBackend, int32_t, int32_t>(be, values, lengths, batch, m, key_bytes, out);
  } else if (v32) {
    permutation<HostBackend, int32_t, int64_t>(be, values, lengths, batch, m, key_bytes, out);
  } else if (l32) {
    permutation<HostBackend, int64_t, int32_t>(be, values, lengths, batch, m, key_bytes, out);
  } else {
    permutation<HostBackend, int64_t, int64_t>(be, values, lengths, batch, m, key_bytes, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("cluster_permutation_fused", &cluster_permutation_fused_cpu);
}

}  // namespace recxla
