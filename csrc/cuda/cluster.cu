// Key-centric sample clustering on CUDA: the two passes over every key (ops in csrc/cluster.cpp,
// per-key math in csrc/include/recxla/cluster.h, shared with the CPU kernels; the sorts and group
// moves around them are torch ops in recxla.ops.cluster.cluster_permutation_with_passes).
//
// - cluster_feature_gains: per feature, one kernel hashes every key and counts the sampled ones
//   in the feature's table (32-bit atomics), a second sums each slot's keys saved into the
//   feature's total (64-bit atomics: integer sums, exact in any order).
// - cluster_bag_signatures: one thread per bag keeps the smallest key hash and the wrapping sum
//   of the fingerprint mix. Offsets are copied to the host and checked first (one sync), so bad
//   offsets raise the same ValueError as on CPU instead of reading out of bounds.
// Kernels return early on empty input and run on the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "recxla/cluster.h"

namespace recxla {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride loops beyond this

int blocks_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

template <typename key_t>
__global__ void count_sampled_kernel(
    const key_t* __restrict__ values, int64_t n, int r_bits, int bits,
    unsigned int* __restrict__ counts) {
  const uint64_t slots = uint64_t{1} << bits;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t slot = cluster::sampled_slot(cluster::key_hash(values[i]), r_bits, bits);
    if (slot < slots) atomicAdd(counts + slot, 1u);
  }
}

__global__ void sum_slot_gains_kernel(
    const unsigned int* __restrict__ counts, int64_t slots, int64_t batch, int64_t m, int r_bits,
    unsigned long long* __restrict__ saved) {
  unsigned long long sum = 0;  // two's complement: unsigned adds give the signed sum
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    sum += static_cast<unsigned long long>(cluster::gain_of_count(counts[s], batch, m) << r_bits);
  }
  if (sum != 0) atomicAdd(saved, sum);
}

template <typename key_t>
__global__ void bag_signatures_kernel(
    const key_t* __restrict__ values, const int64_t* __restrict__ offsets, int64_t bags,
    int64_t* __restrict__ min_hash, int64_t* __restrict__ fingerprint) {
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bags;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t smallest = cluster::kEmptySignature;
    uint64_t sum = 0;
    for (int64_t j = offsets[b]; j < offsets[b + 1]; ++j) {
      const int64_t h = cluster::key_hash(values[j]);
      smallest = h < smallest ? h : smallest;
      sum += static_cast<uint64_t>(cluster::fingerprint_mix(h));
    }
    min_hash[b] = smallest;
    fingerprint[b] = static_cast<int64_t>(sum);
  }
}

template <typename key_t>
void feature_gains(
    const at::Tensor& values, c10::IntArrayRef feature_offsets, int64_t batch, int64_t m,
    at::Tensor& out) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* saved = reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>());
  for (size_t f = 0; f + 1 < feature_offsets.size(); ++f) {
    const int64_t n = feature_offsets[f + 1] - feature_offsets[f];
    if (n == 0) continue;
    const int r_bits = cluster::sample_bits(n);
    const int bits = cluster::table_bits(std::max<int64_t>(n >> r_bits, 1));
    const int64_t slots = int64_t{1} << bits;
    at::Tensor counts = at::zeros({slots}, values.options().dtype(at::kInt));
    auto* count = reinterpret_cast<unsigned int*>(counts.data_ptr<int32_t>());
    count_sampled_kernel<key_t><<<blocks_for(n), kThreads, 0, stream>>>(
        values.const_data_ptr<key_t>() + feature_offsets[f], n, r_bits, bits, count);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sum_slot_gains_kernel<<<blocks_for(slots), kThreads, 0, stream>>>(
        count, slots, batch, m, r_bits, saved + f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor cluster_feature_gains_cuda(
    const at::Tensor& values_in, c10::IntArrayRef feature_offsets, int64_t batch, int64_t m) {
  constexpr const char* op = "recxla::cluster_feature_gains";
  cluster::check_keys(op, values_in);
  cluster::check_gains_args(op, feature_offsets, values_in.numel(), batch, m);
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor values = values_in.contiguous();
  at::Tensor out = at::zeros(
      {static_cast<int64_t>(feature_offsets.size()) - 1}, values.options().dtype(at::kLong));
  if (values.scalar_type() == at::kInt) {
    feature_gains<int32_t>(values, feature_offsets, batch, m, out);
  } else {
    feature_gains<int64_t>(values, feature_offsets, batch, m, out);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> cluster_bag_signatures_cuda(
    const at::Tensor& values_in, const at::Tensor& offsets_in) {
  constexpr const char* op = "recxla::cluster_bag_signatures";
  cluster::check_keys(op, values_in);
  cluster::check_bag_offsets_tensor(op, offsets_in);
  TORCH_CHECK_VALUE(
      offsets_in.device() == values_in.device(), op,
      ": values and offsets must be on one device, got ", values_in.device(), " and ",
      offsets_in.device());
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t bags = offsets.numel() - 1;
  {
    const at::Tensor host = offsets.to(at::kCPU);
    cluster::check_bag_offsets(op, host.const_data_ptr<int64_t>(), bags, values_in.numel());
  }
  const at::Tensor values = values_in.contiguous();
  at::Tensor min_hash = at::empty({bags}, offsets.options());
  at::Tensor fingerprint = at::empty({bags}, offsets.options());
  if (bags == 0) return {min_hash, fingerprint};
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (values.scalar_type() == at::kInt) {
    bag_signatures_kernel<int32_t><<<blocks_for(bags), kThreads, 0, stream>>>(
        values.const_data_ptr<int32_t>(), offsets.const_data_ptr<int64_t>(), bags,
        min_hash.data_ptr<int64_t>(), fingerprint.data_ptr<int64_t>());
  } else {
    bag_signatures_kernel<int64_t><<<blocks_for(bags), kThreads, 0, stream>>>(
        values.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), bags,
        min_hash.data_ptr<int64_t>(), fingerprint.data_ptr<int64_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {min_hash, fingerprint};
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) {
  m.impl("cluster_feature_gains", &cluster_feature_gains_cuda);
  m.impl("cluster_bag_signatures", &cluster_bag_signatures_cuda);
}

}  // namespace recxla
