// The receiver's plan for expanded rows on CPU (the sequence module): per micro-batch, which wire
// row of the received message fills each chunk of the output, computed by the sender right after
// encode_row_ids from what it already holds on the host (the routed ids' slots and samples, the
// batch's bag lengths, the runs). One pass over the ids; it replaces about forty torch calls a
// step (the ids' output positions, then per micro-batch a gather plan). Every chunk of the output
// must be filled exactly once: anything else (routes that do not tile an output row, ids that do
// not match the lengths) is an error naming the op. Semantics: recxla/reference/row_ids.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "recxla/checks.h"

namespace recxla {
namespace {

constexpr const char* kOp = "recxla::expand_row_plan";

void check_long_vector(const at::Tensor& t, const char* name, int64_t numel) {
  check_host_int64_vector(kOp, t, name, numel, "order", "the plan is made on the host");
}

at::Tensor expand_row_plan_cpu(const at::Tensor& order_t, const at::Tensor& inverse_t,
                               const at::Tensor& counts_t, const at::Tensor& bounds_t,
                               const at::Tensor& slot_t, const at::Tensor& sample_t,
                               const at::Tensor& input_lengths, at::IntArrayRef routes,
                               at::IntArrayRef micro, at::IntArrayRef group_chunks,
                               at::IntArrayRef group_first_chunk, int64_t chunks_per_row) {
  check_long_vector(order_t, "order", -1);
  const int64_t n = order_t.numel();
  check_long_vector(inverse_t, "inverse", n);
  check_long_vector(slot_t, "slot", n);
  check_long_vector(sample_t, "sample", n);
  const int64_t groups = static_cast<int64_t>(group_chunks.size());
  const int64_t num_micro = static_cast<int64_t>(micro.size());
  TORCH_CHECK_VALUE(num_micro >= 1, kOp, ": micro must hold at least one micro-batch size");
  int64_t batch = 0;
  for (int64_t k = 0; k < num_micro; ++k) {
    TORCH_CHECK_VALUE(micro[k] >= 0, kOp, ": micro-batch ", k, " has a negative size (",
                      micro[k], ")");
    batch += micro[k];
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(group_first_chunk.size()) == groups, kOp,
                    ": group_first_chunk must have ", groups, " entries like group_chunks, got ",
                    group_first_chunk.size());
  TORCH_CHECK_VALUE(chunks_per_row >= 1, kOp, ": chunks_per_row must be at least 1, got ",
                    chunks_per_row);
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK_VALUE(group_chunks[g] >= 1 && group_first_chunk[g] >= 0 &&
                          group_first_chunk[g] + group_chunks[g] <= chunks_per_row,
                      kOp, ": row group ", g, " fills chunks [", group_first_chunk[g], ", ",
                      group_first_chunk[g] + group_chunks[g], "), outside [0, ", chunks_per_row,
                      ") of an output row (or none)");
  }
  TORCH_CHECK_TYPE(counts_t.scalar_type() == at::kLong && bounds_t.scalar_type() == at::kLong, kOp,
                   ": counts and bounds must be int64");
  TORCH_CHECK_VALUE(counts_t.device().is_cpu() && counts_t.is_contiguous() && counts_t.dim() == 2 &&
                        counts_t.size(0) == groups && counts_t.size(1) == num_micro,
                    kOp, ": counts must be a contiguous CPU tensor [", groups, ", ", num_micro,
                    "] (row groups, micro-batches), got ", counts_t.sizes());
  check_long_vector(bounds_t, "bounds", groups * num_micro + 1);
  const int64_t* bounds = bounds_t.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(bounds[0] == 0 && bounds[groups * num_micro] == n, kOp,
                    ": bounds must run from 0 to ", n, " (order's entries)");
  for (int64_t r = 0; r < groups * num_micro; ++r) {
    TORCH_CHECK_VALUE(bounds[r] <= bounds[r + 1], kOp, ": bounds must not decrease (bounds[",
                      r + 1, "] = ", bounds[r + 1], " < ", bounds[r], ")");
  }
  TORCH_CHECK_TYPE(input_lengths.scalar_type() == at::kLong ||
                       input_lengths.scalar_type() == at::kInt,
                   kOp, ": input_lengths must be int32 or int64, got ",
                   input_lengths.scalar_type());
  TORCH_CHECK_VALUE(input_lengths.device().is_cpu() && input_lengths.is_contiguous() &&
                        input_lengths.dim() == 2 && input_lengths.size(1) == batch,
                    kOp, ": input_lengths must be a contiguous CPU tensor [slots, ", batch,
                    "] (the micro-batches' samples), got ", input_lengths.sizes());
  TORCH_CHECK_VALUE(static_cast<int64_t>(routes.size()) == input_lengths.size(0), kOp,
                    ": routes_per_slot must have one entry per input slot (",
                    input_lengths.size(0), "), got ", routes.size());
  for (size_t s = 0; s < routes.size(); ++s) {
    TORCH_CHECK_VALUE(routes[s] >= 1, kOp, ": routes_per_slot[", s,
                      "] must be at least 1, got ", routes[s]);
  }
  // int32 lengths (a KeyedJaggedTensor's) become int64: [slots, batch], a small copy.
  const at::Tensor lengths_t = input_lengths.to(at::kLong);
  const int64_t slots = lengths_t.size(0);
  const int64_t* lengths = lengths_t.const_data_ptr<int64_t>();
  const int64_t* order = order_t.const_data_ptr<int64_t>();
  const int64_t* inverse = inverse_t.const_data_ptr<int64_t>();
  const int64_t* counts = counts_t.const_data_ptr<int64_t>();
  const int64_t* slot = slot_t.const_data_ptr<int64_t>();
  const int64_t* sample = sample_t.const_data_ptr<int64_t>();

  std::vector<int64_t> micro_start(num_micro + 1, 0);
  for (int64_t k = 0; k < num_micro; ++k) micro_start[k + 1] = micro_start[k] + micro[k];
  // The routes before each slot; the ids of each micro-batch; per (slot, micro-batch) the shift
  // from an id's index in its slot to its position in its micro-batch's output (the ids of the
  // earlier slots in that micro-batch, less the slot's ids in earlier micro-batches).
  std::vector<int64_t> first_route(slots + 1, 0), shift(slots * num_micro),
      micro_ids(num_micro, 0);
  for (int64_t s = 0; s < slots; ++s) {
    int64_t in_slot = 0;
    for (int64_t k = 0; k < num_micro; ++k) {
      int64_t ids = 0;
      for (int64_t b = micro_start[k]; b < micro_start[k + 1]; ++b) {
        const int64_t length = lengths[s * batch + b];
        TORCH_CHECK_VALUE(length >= 0, kOp, ": input_lengths[", s, ", ", b, "] is negative (",
                          length, ")");
        ids += length;
      }
      shift[s * num_micro + k] = micro_ids[k] - in_slot;
      micro_ids[k] += ids;
      in_slot += ids;
    }
    first_route[s + 1] = first_route[s] + in_slot * routes[s];
  }
  TORCH_CHECK_VALUE(first_route[slots] == n, kOp, ": the lengths give ", first_route[slots],
                    " routes (each slot's ids times its routes_per_slot), but order has ", n);

  // The plan's sections: per micro-batch its wire rows W_k and chunks C_k.
  std::vector<int64_t> section(num_micro + 1, 0), wire_rows(num_micro, 0);
  for (int64_t k = 0; k < num_micro; ++k) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t count = counts[g * num_micro + k];
      TORCH_CHECK_VALUE(count >= 0, kOp, ": counts[", g, ", ", k, "] is negative");
      wire_rows[k] += count * group_chunks[g];
    }
    section[k + 1] = section[k] + wire_rows[k] + 2 + 2 * micro_ids[k] * chunks_per_row + 1;
  }
  at::Tensor plan_t = at::empty({section[num_micro]}, at::TensorOptions().dtype(at::kLong));
  int64_t* plan = plan_t.data_ptr<int64_t>();
  for (int64_t k = 0; k < num_micro; ++k) {
    int64_t* p = plan + section[k];
    const int64_t chunks = micro_ids[k] * chunks_per_row;
    for (int64_t w = 0; w < wire_rows[k]; ++w) *p++ = w;  // unique values
    *p++ = 0;                                               // unique offsets
    *p++ = wire_rows[k];
    int64_t* index = p;
    std::fill(index, index + chunks, -1);
    p += chunks;
    for (int64_t c = 0; c <= chunks; ++c) *p++ = c;  // bag offsets: one wire row a bag
    int64_t row_base = 0;  // the group's first wire row in the message
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r = g * num_micro + k, width = group_chunks[g];
      for (int64_t j = bounds[r]; j < bounds[r + 1]; ++j) {
        const int64_t i = order[j];
        TORCH_CHECK_VALUE(i >= 0 && i < n, kOp, ": order[", j, "] = ", i, " is outside [0, ",
                          n, ")");
        const int64_t s = slot[i], b = sample[i];
        TORCH_CHECK_VALUE(s >= 0 && s < slots && i >= first_route[s] && i < first_route[s + 1],
                          kOp, ": slot[", i, "] = ", s, ", but route ", i,
                          " is not among that slot's routes");
        TORCH_CHECK_VALUE(b >= micro_start[k] && b < micro_start[k + 1], kOp, ": sample[", i,
                          "] = ", b, " is outside micro-batch ", k, "'s samples [",
                          micro_start[k], ", ", micro_start[k + 1], ")");
        const int64_t u = inverse[j];
        TORCH_CHECK_VALUE(u >= 0 && u < counts[r], kOp, ": inverse[", j, "] = ", u,
                          " is outside [0, ", counts[r], ") (row group ", g, ", micro-batch ", k,
                          ")");
        const int64_t position = (i - first_route[s]) / routes[s] + shift[s * num_micro + k];
        TORCH_CHECK_VALUE(position >= 0 && position < micro_ids[k], kOp, ": route ", i,
                          " lands outside micro-batch ", k, "'s ", micro_ids[k],
                          " output rows (sample and lengths disagree)");
        const int64_t target = position * chunks_per_row + group_first_chunk[g];
        const int64_t source = row_base + u * width;
        for (int64_t c = 0; c < width; ++c) {
          TORCH_CHECK_VALUE(index[target + c] < 0, kOp, ": chunk ", group_first_chunk[g] + c,
                            " of output row ", position, " of micro-batch ", k,
                            " is filled twice (routes that overlap)");
          index[target + c] = source + c;
        }
      }
      row_base += counts[r] * width;
    }
    for (int64_t c = 0; c < chunks; ++c) {
      TORCH_CHECK_VALUE(index[c] >= 0, kOp, ": chunk ", c % chunks_per_row, " of output row ",
                        c / chunks_per_row, " of micro-batch ", k,
                        " is filled by no route (routes that do not tile a row)");
    }
  }
  return plan_t;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) { m.impl("expand_row_plan", &expand_row_plan_cpu); }

}  // namespace recxla
