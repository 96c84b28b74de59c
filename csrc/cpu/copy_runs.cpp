// recxla::copy_runs on CPU: the runs in order, a row at a time (memcpy, or an add loop), the rows
// of a large run split over threads. Semantics: recxla/reference/copy_runs.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "recxla/copy_runs.h"
#include "recxla/copy_runs_checks.h"

namespace recxla {
namespace {

using copy_runs::Run;

// Elements a thread takes at least: below it one thread copies the whole run.
constexpr int64_t kGrainElements = 1 << 15;

template <typename scalar_t>
void apply_run(const Run& run, const scalar_t* source, scalar_t* target) {
  const int64_t grain_rows =
      std::max<int64_t>(1, kGrainElements / std::max<int64_t>(run.width, 1));
  at::parallel_for(0, run.rows, grain_rows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* from = source + copy_runs::source_index(run, row, 0);
      scalar_t* to = target + copy_runs::target_index(run, row, 0);
      if (run.add) {
        for (int64_t j = 0; j < run.width; ++j) {
          to[j] = static_cast<scalar_t>(static_cast<float>(to[j]) + static_cast<float>(from[j]));
        }
      } else {
        std::memcpy(to, from, sizeof(scalar_t) * run.width);
      }
    }
  });
}

void copy_runs_cpu(at::TensorList sources, at::TensorList targets, at::IntArrayRef runs) {
  const std::vector<Run> read = copy_runs::checked_runs(sources, targets, runs);
  if (read.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, targets[0].scalar_type(),
                                  "copy_runs", [&] {
    for (const Run& run : read) {
      if (copy_runs::elements(run) == 0) continue;
      apply_run<scalar_t>(run, sources[run.source].const_data_ptr<scalar_t>(),
                          targets[run.target].mutable_data_ptr<scalar_t>());
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) { m.impl("copy_runs", &copy_runs_cpu); }

}  // namespace recxla
