// The sender's half of the row exchange on CPU: the routed ids of the row groups ordered by
// (group, micro-batch, feature position, sample) with a counting sort over the bags, each
// (group, micro-batch) run deduplicated, and every micro-batch's message bags (what the
// receiver pools the rows it gets with) laid out in one int64 plan. The runs are deduplicated
// by the CPU dedup's own pass (csrc/cpu/dedup.cpp). It replaces a sort, two bincounts, a
// segmented unique and about twenty torch calls per micro-batch. Semantics:
// recxla/reference/row_ids.py, which the tests compare with.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "dedup_cpu.h"
#include "recxla/checks.h"

namespace recxla {
namespace {

constexpr const char* kOp = "recxla::encode_row_ids";

using Encoded = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                           at::Tensor>;

void check_ids_tensor(const at::Tensor& t, const char* name, int64_t numel) {
  check_host_int64_vector(kOp, t, name, numel, "group", "ids are encoded on the host");
}

Encoded encode_row_ids_cpu(const at::Tensor& group_t, const at::Tensor& slot_t,
                           const at::Tensor& sample_t, const at::Tensor& ids_t,
                           const std::optional<at::Tensor>& weights_t,
                           at::IntArrayRef slot_position, at::IntArrayRef group_features,
                           at::IntArrayRef micro) {
  check_ids_tensor(group_t, "group", -1);
  const int64_t n = group_t.numel();
  check_ids_tensor(slot_t, "slot", n);
  check_ids_tensor(sample_t, "sample", n);
  check_ids_tensor(ids_t, "ids", n);
  const float* weights = nullptr;
  if (weights_t.has_value()) {
    const at::Tensor& w = *weights_t;
    TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat, kOp, ": weights must be float32, got ",
                     w.scalar_type());
    TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 1 && w.is_contiguous() &&
                          w.numel() == n, kOp,
                      ": weights must be a contiguous 1-D CPU tensor of ", n, " entries");
    weights = w.const_data_ptr<float>();
  }
  const int64_t groups = static_cast<int64_t>(group_features.size());
  const int64_t num_micro = static_cast<int64_t>(micro.size());
  const int64_t slots = static_cast<int64_t>(slot_position.size());
  TORCH_CHECK_VALUE(num_micro >= 1, kOp, ": micro must hold at least one micro-batch size");
  std::vector<int64_t> micro_start(num_micro + 1, 0);
  for (int64_t k = 0; k < num_micro; ++k) {
    TORCH_CHECK_VALUE(micro[k] >= 0, kOp, ": micro-batch ", k, " has a negative size (",
                      micro[k], ")");
    micro_start[k + 1] = micro_start[k] + micro[k];
  }
  const int64_t batch = micro_start[num_micro];
  int64_t max_features = 1, features = 0;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK_VALUE(group_features[g] >= 1, kOp, ": row group ", g,
                      " must have at least one feature, got ", group_features[g]);
    max_features = std::max(max_features, group_features[g]);
    features += group_features[g];
  }
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK_VALUE(slot_position[s] >= 0, kOp, ": slot_position[", s, "] is negative (",
                      slot_position[s], ")");
  }
  const int64_t* group = group_t.const_data_ptr<int64_t>();
  const int64_t* slot = slot_t.const_data_ptr<int64_t>();
  const int64_t* sample = sample_t.const_data_ptr<int64_t>();
  const int64_t* ids = ids_t.const_data_ptr<int64_t>();

  // Pass 1: every id checked and counted into its bag (group, position, sample).
  const int64_t bags = groups * max_features * batch;
  std::vector<int64_t> bag_length(bags, 0);
  std::vector<int64_t> bag_of(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = group[i], s = slot[i], b = sample[i];
    TORCH_CHECK_VALUE(g >= 0 && g < groups, kOp, ": group[", i, "] = ", g, " is outside [0, ",
                      groups, ")");
    TORCH_CHECK_VALUE(s >= 0 && s < slots, kOp, ": slot[", i, "] = ", s, " is outside [0, ",
                      slots, ")");
    TORCH_CHECK_VALUE(b >= 0 && b < batch, kOp, ": sample[", i, "] = ", b, " is outside [0, ",
                      batch, ")");
    const int64_t position = slot_position[s];
    TORCH_CHECK_VALUE(position < group_features[g], kOp, ": id ", i, "'s slot ", s,
                      " is feature ", position, " of its table, but row group ", g, " has ",
                      group_features[g], " features");
    bag_of[i] = (g * max_features + position) * batch + b;
    ++bag_length[bag_of[i]];
  }
  // The bags' starts in (group, micro-batch, position, sample) order, and the runs' bounds.
  auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor bounds_t = at::empty({groups * num_micro + 1}, i64);
  int64_t* bounds = bounds_t.data_ptr<int64_t>();
  std::vector<int64_t> bag_next(bags, 0);  // the bag's next free place in that order
  int64_t at_id = 0;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t k = 0; k < num_micro; ++k) {
      bounds[g * num_micro + k] = at_id;
      for (int64_t f = 0; f < group_features[g]; ++f) {
        const int64_t first_bag = (g * max_features + f) * batch;
        for (int64_t b = micro_start[k]; b < micro_start[k + 1]; ++b) {
          bag_next[first_bag + b] = at_id;
          at_id += bag_length[first_bag + b];
        }
      }
    }
  }
  bounds[groups * num_micro] = at_id;
  // Pass 2: a stable scatter (each bag keeps its ids' input order).
  at::Tensor order_t = at::empty({n}, i64);
  int64_t* order = order_t.data_ptr<int64_t>();
  std::vector<int64_t> ordered_ids(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t to = bag_next[bag_of[i]]++;
    order[to] = i;
    ordered_ids[to] = ids[i];
  }
  // Each run's distinct ids, ascending, and each id's index into them: the CPU dedup's pass.
  at::Tensor counts_t = at::empty({groups, num_micro}, i64);
  int64_t* counts = counts_t.data_ptr<int64_t>();
  at::Tensor inverse_t = at::empty({n}, i64);
  int64_t* inverse = inverse_t.data_ptr<int64_t>();
  std::vector<int64_t> staged(n);
  const std::vector<int64_t> run_counts = dedup_cpu::dedup_int64_segments(
      ordered_ids.data(), bounds, groups * num_micro, n, staged.data(), inverse);
  int64_t total_unique = 0;
  for (int64_t r = 0; r < groups * num_micro; ++r) total_unique += run_counts[r];
  at::Tensor unique_t = at::empty({total_unique}, i64);
  int64_t* unique = unique_t.data_ptr<int64_t>();
  for (int64_t r = 0, u = 0; r < groups * num_micro; ++r) {
    counts[r] = run_counts[r];
    std::copy(staged.begin() + bounds[r], staged.begin() + bounds[r] + run_counts[r],
              unique + u);
    u += run_counts[r];
  }

  // The plan: per micro-batch k, its message bags, one table per row group (its rows in the
  // message, numbered from 0), bags (group, feature, sample).
  const int64_t plan_size = total_unique + num_micro * (groups + 2) + n + features * batch;
  at::Tensor plan_t = at::empty({plan_size}, i64);
  int64_t* plan = plan_t.data_ptr<int64_t>();
  at::Tensor message_weights_t = at::empty({weights != nullptr ? n : 0},
                                           at::TensorOptions().dtype(at::kFloat));
  float* message_weights = weights != nullptr ? message_weights_t.data_ptr<float>() : nullptr;
  int64_t p = 0, w = 0;
  for (int64_t k = 0; k < num_micro; ++k) {
    for (int64_t g = 0; g < groups; ++g) {  // unique values
      for (int64_t u = 0; u < counts[g * num_micro + k]; ++u) plan[p++] = u;
    }
    plan[p++] = 0;  // unique offsets
    for (int64_t g = 0; g < groups; ++g) plan[p] = plan[p - 1] + counts[g * num_micro + k], ++p;
    int64_t group_first = 0;
    for (int64_t g = 0; g < groups; ++g) {  // inverse, into the message's rows
      const int64_t r = g * num_micro + k;
      for (int64_t j = bounds[r]; j < bounds[r + 1]; ++j) {
        plan[p++] = inverse[j] + group_first;
        if (message_weights != nullptr) message_weights[w++] = weights[order[j]];
      }
      group_first += counts[r];
    }
    int64_t end = 0;  // bag offsets
    plan[p++] = 0;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t f = 0; f < group_features[g]; ++f) {
        const int64_t* length = bag_length.data() + (g * max_features + f) * batch;
        for (int64_t b = micro_start[k]; b < micro_start[k + 1]; ++b) {
          end += length[b];
          plan[p++] = end;
        }
      }
    }
  }
  TORCH_CHECK(p == plan_size, kOp, ": internal error: the plan holds ", p, " of ", plan_size,
              " entries");
  return {order_t, unique_t, counts_t, bounds_t, inverse_t, plan_t, message_weights_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) { m.impl("encode_row_ids", &encode_row_ids_cpu); }

}  // namespace recxla
