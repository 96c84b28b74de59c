// Runs: batched strided copies between flat buffers, the layout moves of a sharded module's
// messages as one op each (recxla/ops/copy_runs.py says which). The per-element math, shared by
// the CPU and CUDA kernels.
//
// A run moves `rows` rows of `width` elements: row i of it reads
// sources[source][source_offset + i * source_stride + j] and writes (or, with add, adds to)
// targets[target][target_offset + i * target_stride + j] for j in [0, width). Offsets and strides
// count elements of the flat (contiguous) tensors. `runs` holds kRunFields int64 per run, in the
// order of the Run fields.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RECXLA_RUNS_HD __host__ __device__ __forceinline__
#else
#define RECXLA_RUNS_HD inline __attribute__((always_inline))
#endif

namespace recxla {
namespace copy_runs {

constexpr int kRunFields = 9;

struct Run {
  int64_t source, source_offset, source_stride;
  int64_t target, target_offset, target_stride;
  int64_t rows, width, add;
};

RECXLA_RUNS_HD Run read_run(const int64_t* runs, int64_t r) {
  const int64_t* f = runs + r * kRunFields;
  return Run{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8]};
}

RECXLA_RUNS_HD int64_t source_index(const Run& run, int64_t row, int64_t col) {
  return run.source_offset + row * run.source_stride + col;
}

RECXLA_RUNS_HD int64_t target_index(const Run& run, int64_t row, int64_t col) {
  return run.target_offset + row * run.target_stride + col;
}

RECXLA_RUNS_HD int64_t elements(const Run& run) { return run.rows * run.width; }

// One past the last element index a run reads (its source) or writes (its target); 0 for an
// empty run. Strides are >= 0, so the last row's end is the furthest.
RECXLA_RUNS_HD int64_t source_end(const Run& run) {
  return elements(run) == 0 ? 0 : source_index(run, run.rows - 1, run.width);
}

RECXLA_RUNS_HD int64_t target_end(const Run& run) {
  return elements(run) == 0 ? 0 : target_index(run, run.rows - 1, run.width);
}

}  // namespace copy_runs
}  // namespace recxla
