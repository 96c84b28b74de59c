// recxla::copy_runs on CUDA: every run of a wave in one launch (blockIdx.y picks the run, the
// blocks along x stride over its elements). Copy runs write disjoint elements, so they all go in
// the first wave; the k-th add run into a target goes in wave k, after the runs it adds to, which
// keeps the CPU kernel's order of the sums. The tensors' addresses and the runs reach the device
// in one copy from pinned memory. Per-element math: recxla/copy_runs.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "recxla/copy_runs.h"
#include "recxla/copy_runs_checks.h"

namespace recxla {
namespace {

using copy_runs::Run;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksPerRun = 1024;
constexpr int64_t kMaxRunsPerLaunch = 65535;  // gridDim.y

template <typename scalar_t>
__global__ void copy_runs_kernel(const int64_t* __restrict__ addresses, int64_t num_sources,
                                 const int64_t* __restrict__ runs) {
  const Run run = copy_runs::read_run(runs, blockIdx.y);
  const auto* source = reinterpret_cast<const scalar_t*>(addresses[run.source]);
  auto* target = reinterpret_cast<scalar_t*>(addresses[num_sources + run.target]);
  const int64_t total = copy_runs::elements(run);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / run.width, col = e - row * run.width;
    const scalar_t value = source[copy_runs::source_index(run, row, col)];
    scalar_t& out = target[copy_runs::target_index(run, row, col)];
    out = run.add ? static_cast<scalar_t>(static_cast<float>(out) + static_cast<float>(value))
                  : value;
  }
}

void copy_runs_cuda(at::TensorList sources, at::TensorList targets, at::IntArrayRef runs) {
  const std::vector<Run> read = copy_runs::checked_runs(sources, targets, runs);
  if (read.empty()) return;
  const at::Tensor& first = targets[0];
  TORCH_CHECK_VALUE(first.is_cuda(), copy_runs::kOp, ": targets must be CUDA tensors here");
  const c10::cuda::CUDAGuard guard(first.device());
  // Waves: copies first, then each target's adds in order.
  std::vector<int64_t> wave(read.size(), 0);
  std::vector<int64_t> adds_into(targets.size(), 0);
  int64_t waves = 1;
  for (size_t r = 0; r < read.size(); ++r) {
    if (read[r].add) {
      wave[r] = ++adds_into[read[r].target];
      waves = std::max(waves, wave[r] + 1);
    }
  }
  // Host buffer: the addresses (sources, then targets), then the non-empty runs wave by wave.
  const int64_t num_sources = static_cast<int64_t>(sources.size());
  const int64_t num_addresses = num_sources + static_cast<int64_t>(targets.size());
  std::vector<int64_t> wave_first(waves + 1, 0);
  std::vector<int64_t> wave_elements(waves, 0);
  std::vector<const Run*> ordered;
  for (int64_t w = 0; w < waves; ++w) {
    wave_first[w] = static_cast<int64_t>(ordered.size());
    for (size_t r = 0; r < read.size(); ++r) {
      if (wave[r] == w && copy_runs::elements(read[r]) > 0) {
        ordered.push_back(&read[r]);
        wave_elements[w] = std::max(wave_elements[w], copy_runs::elements(read[r]));
      }
    }
  }
  wave_first[waves] = static_cast<int64_t>(ordered.size());
  if (ordered.empty()) return;
  at::Tensor host = at::empty(
      {num_addresses + static_cast<int64_t>(ordered.size()) * copy_runs::kRunFields},
      at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_sources; ++i) {
    h[i] = reinterpret_cast<int64_t>(sources[i].const_data_ptr());
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    h[num_sources + i] = reinterpret_cast<int64_t>(targets[i].mutable_data_ptr());
  }
  int64_t* packed = h + num_addresses;
  for (const Run* run : ordered) {
    const int64_t fields[copy_runs::kRunFields] = {
        run->source, run->source_offset, run->source_stride, run->target, run->target_offset,
        run->target_stride, run->rows, run->width, run->add};
    std::copy(fields, fields + copy_runs::kRunFields, packed);
    packed += copy_runs::kRunFields;
  }
  const at::Tensor device = host.to(first.device(), /*non_blocking=*/true);
  const int64_t* addresses = device.const_data_ptr<int64_t>();
  const int64_t* device_runs = addresses + num_addresses;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, first.scalar_type(), "copy_runs",
                                  [&] {
    for (int64_t w = 0; w < waves; ++w) {
      const int64_t blocks_x = std::min<int64_t>(
          kMaxBlocksPerRun, std::max<int64_t>(1, (wave_elements[w] + kThreads - 1) / kThreads));
      for (int64_t r = wave_first[w]; r < wave_first[w + 1]; r += kMaxRunsPerLaunch) {
        const int64_t in_launch = std::min(kMaxRunsPerLaunch, wave_first[w + 1] - r);
        const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(in_launch));
        copy_runs_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
            addresses, num_sources, device_runs + r * copy_runs::kRunFields);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) { m.impl("copy_runs", &copy_runs_cuda); }

}  // namespace recxla
