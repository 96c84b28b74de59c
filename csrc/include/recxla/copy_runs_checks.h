// Argument checks of recxla::copy_runs, shared by its CPU and CUDA kernels (host code): every
// message names the op, the argument and the limit.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "recxla/checks.h"
#include "recxla/copy_runs.h"

namespace recxla {
namespace copy_runs {

constexpr const char* kOp = "recxla::copy_runs";

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Checks the tensors and every run; -> the runs, read.
inline std::vector<Run> checked_runs(
    const at::TensorList sources, const at::TensorList targets, at::IntArrayRef runs) {
  TORCH_CHECK_VALUE(runs.size() % kRunFields == 0, kOp, ": runs must hold ", kRunFields,
                    " ints per run, got ", runs.size(), " ints");
  const int64_t count = static_cast<int64_t>(runs.size()) / kRunFields;
  std::vector<Run> read(count);
  if (count == 0) return read;
  TORCH_CHECK_VALUE(!targets.empty(), kOp, ": runs need at least one target");
  const at::Tensor& first = targets[0];
  const auto check_tensor = [&](const at::Tensor& t, const char* name, size_t i) {
    TORCH_CHECK_TYPE(t.scalar_type() == first.scalar_type(), kOp, ": ", name, "[", i,
                     "] must be ", first.scalar_type(), " like targets[0], got ",
                     t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == first.device(), kOp, ": ", name, "[", i, "] must be on ",
                      first.device(), " like targets[0], got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), kOp, ": ", name, "[", i, "] must be contiguous");
  };
  TORCH_CHECK_TYPE(supported_dtype(first.scalar_type()), kOp,
                   ": the tensors must be float32, bfloat16 or float16, got ",
                   first.scalar_type());
  for (size_t i = 0; i < sources.size(); ++i) check_tensor(sources[i], "sources", i);
  for (size_t i = 0; i < targets.size(); ++i) {
    check_tensor(targets[i], "targets", i);
    for (size_t s = 0; s < sources.size(); ++s) {
      TORCH_CHECK_VALUE(!spans_overlap(targets[i], sources[s]), kOp, ": targets[", i,
                        "] shares memory with sources[", s, "]");
    }
  }
  const int64_t num_sources = static_cast<int64_t>(sources.size());
  const int64_t num_targets = static_cast<int64_t>(targets.size());
  for (int64_t r = 0; r < count; ++r) {
    const Run run = read_run(runs.data(), r);
    TORCH_CHECK_VALUE(run.source >= 0 && run.source < num_sources, kOp, ": run ", r,
                      " reads sources[", run.source, "] of ", num_sources);
    TORCH_CHECK_VALUE(run.target >= 0 && run.target < num_targets, kOp, ": run ", r,
                      " writes targets[", run.target, "] of ", num_targets);
    TORCH_CHECK_VALUE(run.rows >= 0 && run.width >= 0 && run.source_offset >= 0 &&
                          run.source_stride >= 0 && run.target_offset >= 0 &&
                          run.target_stride >= 0,
                      kOp, ": run ", r, " has a negative offset, stride, row count or width");
    TORCH_CHECK_VALUE(run.add == 0 || run.add == 1, kOp, ": run ", r,
                      "'s add must be 0 or 1, got ", run.add);
    TORCH_CHECK_VALUE(run.rows <= 1 || run.target_stride >= run.width, kOp, ": run ", r,
                      " writes rows of ", run.width, " elements ", run.target_stride,
                      " apart: its rows overlap");
    TORCH_CHECK_VALUE(source_end(run) <= sources[run.source].numel(), kOp, ": run ", r,
                      " reads up to element ", source_end(run), " of sources[", run.source,
                      "], which has ", sources[run.source].numel());
    TORCH_CHECK_VALUE(target_end(run) <= targets[run.target].numel(), kOp, ": run ", r,
                      " writes up to element ", target_end(run), " of targets[", run.target,
                      "], which has ", targets[run.target].numel());
    read[r] = run;
  }
  return read;
}

}  // namespace copy_runs
}  // namespace recxla
