// Key-centric sample clustering on CUDA, "fused" variant (family "cluster", recxla/gpu_variants.h):
// the whole permutation in one C++ call, the CPU kernel's result bit for bit.
//
// The host code of a call and the per-thread bodies are shared with the host run that the CPU
// tests compare with the CPU kernel (recxla/cluster_fused_run.h, cluster_fused.h,
// cluster_fused_pairs.h, cluster_fused_rounds.h; csrc/cpu/cluster_fused.cpp). This file holds
// only what a GPU needs beyond them: the grid-stride launch of a step, the lengths' per-feature
// pass (a block scan), CUB's sorts and scans, the warp-per-group gains and the single-block
// move loop.
//
// What the "passes" variant (recxla/ops/cluster.py) spent ~6 ms on at batch 8192 was ~400
// launches and ~60 host syncs (docs/clustering.md); this one queues ~44 device operations
// behind one sync (the lengths' check, which must raise before any id is read). Predicted, not
// measured: 0.2-0.3 ms per cluster_samples call on an H100 at batch 8192 (the basis:
// bench/gpu_campaign/cluster.py).
//
// Every kernel returns early on empty input and runs on the current stream.
#define CUB_WRAPPED_NAMESPACE recxla_cub
#include <cub/cub.cuh>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "recxla/cluster_fused_run.h"

namespace recxla {
namespace {

namespace cub = ::recxla_cub::cub;
using namespace cluster::fused;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride loops beyond this
constexpr int kRowThreads = 256, kRowItems = 4;
constexpr int kGainThreads = 256;  // 8 warps, a group each
constexpr int kMoveThreads = 1024;

int blocks_for(int64_t n, int threads) {
  return static_cast<int>(std::clamp<int64_t>((n + threads - 1) / threads, 1, kMaxBlocks));
}

// No __launch_bounds__: with it ptxas held these steps to 32 registers and spilled.
template <class Step>
__global__ void for_each_kernel(const Step step, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    step(i);
  }
}

struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};
struct MaxOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

// One block per feature: each bag's offset in its feature (an exclusive sum, 1024 lengths per
// step), and the summary the host checks: the sum (wrapping), extremes, first negative length.
template <typename len_t>
__global__ void __launch_bounds__(kRowThreads) row_summary_kernel(
    const len_t* __restrict__ lengths, int64_t batch, RowSummary* __restrict__ out,
    int64_t* __restrict__ local) {
  using Scan = cub::BlockScan<uint64_t, kRowThreads>;
  using Reduce = cub::BlockReduce<int64_t, kRowThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ uint64_t carry;
  const int64_t f = blockIdx.x;
  const len_t* row = lengths + f * batch;
  int64_t* off = local + f * (batch + 1);
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  int64_t smallest = 0, largest = 0, first_negative = INT64_MAX;
  for (int64_t base = 0; base < batch; base += kRowThreads * kRowItems) {
    uint64_t items[kRowItems];
#pragma unroll
    for (int k = 0; k < kRowItems; ++k) {
      const int64_t s = base + threadIdx.x * kRowItems + k;
      const int64_t len = s < batch ? static_cast<int64_t>(row[s]) : 0;
      smallest = len < smallest ? len : smallest;
      largest = len > largest ? len : largest;
      if (len < 0 && s < first_negative) first_negative = s;
      items[k] = static_cast<uint64_t>(len);
    }
    uint64_t total = 0;
    Scan(temp.scan).ExclusiveSum(items, items, total);
    const uint64_t before = carry;
#pragma unroll
    for (int k = 0; k < kRowItems; ++k) {
      const int64_t s = base + threadIdx.x * kRowItems + k;
      if (s < batch) off[s] = static_cast<int64_t>(before + items[k]);
    }
    __syncthreads();  // every thread has read `carry` and is done with the scan's storage
    if (threadIdx.x == 0) carry = before + total;
    __syncthreads();
  }
  smallest = Reduce(temp.reduce).Reduce(smallest, MinOp());
  __syncthreads();
  largest = Reduce(temp.reduce).Reduce(largest, MaxOp());
  __syncthreads();
  first_negative = Reduce(temp.reduce).Reduce(first_negative, MinOp());
  if (threadIdx.x == 0) {  // the reductions' results are valid in thread 0
    off[batch] = static_cast<int64_t>(carry);
    const bool negative = first_negative != INT64_MAX;
    out[f] = RowSummary{carry, smallest, largest, negative ? first_negative : -1,
                        negative ? static_cast<int64_t>(row[first_negative]) : 0};
  }
}

__device__ __forceinline__ int64_t warp_sum(int64_t x) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// One warp per group (g is the same for the 32 lanes, so every shuffle has all of them).
template <int kBins>
__global__ void __launch_bounds__(kGainThreads) round_gains_kernel(const RoundView v) {
  if (v.scalars->done) return;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kGainThreads / 32);
  const int64_t groups = v.scalars->num_groups;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kGainThreads + threadIdx.x) / 32;
  for (int64_t g = first; g < groups; g += warps) {
    const int32_t b = v.bins[g];
    if constexpr (kBins > 0) {
      int64_t leave = 0, join[kBins];
#pragma unroll
      for (int t = 0; t < kBins; ++t) join[t] = 0;
      partial_join<kBins>(v, g, b, lane, 32, leave, join);
      leave = warp_sum(leave);
#pragma unroll
      for (int t = 0; t < kBins; ++t) join[t] = warp_sum(join[t]);
      if (lane == 0) best_of_joins<kBins>(v, g, b, leave, join);
    } else {
      const int64_t leave = warp_sum(partial_leave(v, g, b, lane, 32));
      int64_t best = INT64_MIN;
      int32_t best_t = INT32_MAX;
      for (int64_t t = lane; t < v.m; t += 32) {
        better(t == b ? 0 : leave - join_of(v, g, t), static_cast<int32_t>(t), best, best_t);
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) {
        const int64_t other = __shfl_xor_sync(0xffffffffu, best, d);
        const int32_t other_t = __shfl_xor_sync(0xffffffffu, best_t, d);
        better(other, other_t, best, best_t);
      }
      if (lane == 0) {
        v.best_gain[g] = best;
        v.target[g] = best_t;
      }
    }
  }
}

// One block: the round's moves (the phases of cluster_fused_rounds.h between barriers). Every
// thread reads `done` and the movers' count after the same barrier, so all return together.
template <int kBins>
__global__ void __launch_bounds__(kMoveThreads) moves_kernel(
    const RoundView v, const MoveScratch global, int64_t slots, bool use_shared, int32_t round) {
  if (v.scalars->done) return;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const MoveScratch s = use_shared ? carve_moves(shared_bytes, slots, v.m) : global;
  const int tid = threadIdx.x, threads = blockDim.x;
  moves_clear(v, s, tid, threads);
  __syncthreads();
  moves_collect(v, s, tid, threads);
  __syncthreads();
  const int64_t n = *s.count;
  if (n == 0) {
    if (tid == 0) v.scalars->done = 1;
    return;
  }
  const int64_t n_pad = padded(n);
  moves_pad(s, n, tid, threads);
  __syncthreads();
  for (int64_t k = 2; k <= n_pad; k <<= 1) {
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      bitonic_pass(s, n_pad, k, j, tid, threads);
      __syncthreads();
    }
  }
  moves_gather(v, s, n, tid, threads);
  __syncthreads();
  if (tid == 0) moves_walk<kBins>(v, s, n, round);
}

struct RecordLessOp {
  __host__ __device__ bool operator()(const SortRecord& a, const SortRecord& b) const {
    return record_less(a, b);
  }
};

struct CudaBackend {
  at::TensorOptions options;
  cudaStream_t stream;
  int64_t max_shared;  // opt-in dynamic shared memory of one block
  bool shared_moves = false;

  explicit CudaBackend(const at::Device& device)
      : options(at::TensorOptions().device(device)),
        stream(at::cuda::getCurrentCUDAStream(device.index()).stream()),
        max_shared(static_cast<int64_t>(
            at::cuda::getDeviceProperties(device.index())->sharedMemPerBlockOptin)) {}

  void fill(void* p, int byte, int64_t bytes) {
    if (bytes > 0) C10_CUDA_CHECK(cudaMemsetAsync(p, byte, static_cast<size_t>(bytes), stream));
  }

  template <class Step>
  void for_each(int64_t n, const Step& step) {
    if (n <= 0) return;
    for_each_kernel<Step><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(step, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename len_t>
  void row_summaries(
      const len_t* lengths, int64_t rows, int64_t batch, RowSummary* out, int64_t* local) {
    if (rows <= 0) return;
    row_summary_kernel<len_t><<<static_cast<unsigned int>(rows), kRowThreads, 0, stream>>>(
        lengths, batch, out, local);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  at::Tensor to_host(const at::Tensor& t) { return t.to(at::kCPU); }  // the sync

  at::Tensor staging(int64_t bytes) {
    const auto pinned = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
    return at::empty({std::max<int64_t>(bytes, 1)}, pinned);
  }

  // Asynchronous: torch keeps the pinned block until the copy has run.
  at::Tensor to_device(const at::Tensor& t) {
    return t.to(options.dtype(at::kByte), /*non_blocking=*/true, /*copy=*/false);
  }

  int64_t scratch_bytes(int64_t batch, int64_t bag_slots, int bin_bits) {
    size_t sort = 0, inclusive = 0, exclusive = 0, by_bin = 0;
    C10_CUDA_CHECK(cub::DeviceMergeSort::SortKeys(
        nullptr, sort, static_cast<SortRecord*>(nullptr), batch, RecordLessOp(), stream));
    C10_CUDA_CHECK(cub::DeviceScan::InclusiveSum(
        nullptr, inclusive, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
        batch, stream));
    C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(
        nullptr, exclusive, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
        bag_slots, stream));
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, by_bin, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), batch, 0, bin_bits,
        stream));
    return static_cast<int64_t>(std::max({sort, inclusive, exclusive, by_bin, size_t{16}}));
  }

  // The scratch is never null (the workspace gives every piece one byte or more): CUB takes a
  // null scratch for a size query and would silently do nothing.
  void sort_records(SortRecord* records, int64_t n, void* scratch, int64_t bytes) {
    size_t size = static_cast<size_t>(bytes);
    C10_CUDA_CHECK(
        cub::DeviceMergeSort::SortKeys(scratch, size, records, n, RecordLessOp(), stream));
  }

  void inclusive_sum(const int32_t* in, int32_t* out, int64_t n, void* scratch, int64_t bytes) {
    size_t size = static_cast<size_t>(bytes);
    C10_CUDA_CHECK(cub::DeviceScan::InclusiveSum(scratch, size, in, out, n, stream));
  }

  void exclusive_sum(const int64_t* in, int64_t* out, int64_t n, void* scratch, int64_t bytes) {
    size_t size = static_cast<size_t>(bytes);
    C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scratch, size, in, out, n, stream));
  }

  void sort_by_bin(const uint32_t* key, uint32_t* key_out, const int64_t* value, int64_t* out,
                   int64_t n, int bits, void* scratch, int64_t bytes) {
    size_t size = static_cast<size_t>(bytes);
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        scratch, size, key, key_out, value, out, n, 0, bits, stream));
  }

  void round_gains(const RoundView& v, int64_t max_groups) {
    const int blocks = blocks_for(max_groups * 32, kGainThreads);
    if (v.m <= 8) {
      round_gains_kernel<8><<<blocks, kGainThreads, 0, stream>>>(v);
    } else if (v.m <= 32) {
      round_gains_kernel<32><<<blocks, kGainThreads, 0, stream>>>(v);
    } else {
      round_gains_kernel<0><<<blocks, kGainThreads, 0, stream>>>(v);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // Shared memory when the block's scratch fits (B = 8192, M = 8: 128 KiB), else global.
  int64_t move_bytes(int64_t batch, int64_t m) {
    const int64_t bytes = move_scratch_bytes(padded(batch), m);
    shared_moves = bytes <= max_shared;
    if (shared_moves) {
      const auto set = [&](const void* kernel) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
      };
      set(reinterpret_cast<const void*>(&moves_kernel<8>));
      set(reinterpret_cast<const void*>(&moves_kernel<0>));
    }
    return shared_moves ? 0 : bytes;
  }

  void moves(const RoundView& v, void* scratch, int64_t batch, int32_t round) {
    const int64_t slots = padded(batch);
    const MoveScratch global = shared_moves ? MoveScratch{} : carve_moves(scratch, slots, v.m);
    const size_t shared = shared_moves ? static_cast<size_t>(move_scratch_bytes(slots, v.m)) : 0;
    if (v.m <= 8) {
      moves_kernel<8><<<1, kMoveThreads, shared, stream>>>(v, global, slots, shared_moves, round);
    } else {
      moves_kernel<0><<<1, kMoveThreads, shared, stream>>>(v, global, slots, shared_moves, round);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  int64_t num_keys(const Scalars* scalars) {  // a sync
    int32_t keys = 0;
    c10::cuda::memcpy_and_sync(
        &keys, &scalars->num_keys, sizeof(keys), cudaMemcpyDeviceToHost, stream);
    return keys;
  }
};

at::Tensor cluster_permutation_fused_cuda(
    const at::Tensor& values_in, const at::Tensor& lengths_in, int64_t batch, int64_t m,
    c10::ArrayRef<double> key_bytes) {
  check_arguments(values_in, lengths_in, batch, m, key_bytes);
  TORCH_CHECK_VALUE(
      values_in.is_cuda() && lengths_in.device() == values_in.device(), kOp,
      ": values and lengths must be on one CUDA device, got ", values_in.device(), " and ",
      lengths_in.device());
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor values = values_in.contiguous();
  const at::Tensor lengths = lengths_in.contiguous();
  at::Tensor out = at::empty({batch}, lengths.options().dtype(at::kLong));
  CudaBackend be(values.device());
  const bool v32 = values.scalar_type() == at::kInt, l32 = lengths.scalar_type() == at::kInt;
  if (v32 && l32) {
    permutation<CudaBackend, int32_t, int32_t>(be, values, lengths, batch, m, key_bytes, out);
  } else if (v32) {
    permutation<CudaBackend, int32_t, int64_t>(be, values, lengths, batch, m, key_bytes, out);
  } else if (l32) {
    permutation<CudaBackend, int64_t, int32_t>(be, values, lengths, batch, m, key_bytes, out);
  } else {
    permutation<CudaBackend, int64_t, int64_t>(be, values, lengths, batch, m, key_bytes, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) {
  m.impl("cluster_permutation_fused", &cluster_permutation_fused_cuda);
}

}  // namespace recxla
