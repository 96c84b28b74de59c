// The CPU dedup's segment pass (csrc/cpu/dedup.cpp), for the other host kernels that dedup runs
// of ids they have just ordered (csrc/cpu/row_ids.cpp): one dedup, one home.
#pragma once

#include <cstdint>
#include <vector>

namespace recxla {
namespace dedup_cpu {

// Dedups every segment of keys [n] (segment s: keys[off[s]:off[s + 1]], off [segments + 1]):
// segment s's distinct keys go, ascending, to stage[off[s]:off[s] + counts[s]], and inv[i] =
// the rank of keys[i] among its segment's distinct keys. Returns counts [segments]. The
// offsets are trusted (the caller made them).
std::vector<int64_t> dedup_int64_segments(const int64_t* keys, const int64_t* off,
                                          int64_t segments, int64_t n, int64_t* stage,
                                          int64_t* inv);

}  // namespace dedup_cpu
}  // namespace recxla
