// The input dist's id routing on CPU: one batch's ids checked against their tables, routed to
// the owners of their row blocks, and ordered by send slot, in two passes over the ids.
//
// It replaces a dozen vectorized passes (repeat_interleave, gathers, a stable sort by slot, two
// bincounts) that each read or wrote every id: the first pass here checks each id, finds its
// row block and routes, and counts per send slot and per bag; the second writes each routed id
// at its place (a counting sort, stable: every bag keeps its order) or appends it to the row
// exchange's stream. Semantics: recxla/reference/route_ids.py, which the tests compare with.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace recxla {
namespace {

constexpr const char* kOp = "recxla.route_ids";

using Routed = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void check_index_tensor(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, kOp, ": ", name, " must be int64, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), kOp, ": ", name, " must be on the CPU (ids are routed "
                    "on the host), got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 1, kOp, ": ", name, " must be 1-D, got ", t.dim(), "-D");
  TORCH_CHECK_VALUE(numel < 0 || t.numel() == numel, kOp, ": ", name, " must have ", numel,
                    " entries, got ", t.numel());
}

// The tables of one sharded module's routing, read as raw pointers.
struct Tables {
  const int64_t* slot_rows;
  const int64_t* slot_first_block;
  const int64_t* block_starts;
  const int64_t* block_first_route;
  const int64_t* send_slot;
  const int64_t* row_group;
  const int64_t* row_offset;

  // The row block of `id` among slot s's blocks (their starts ascend from 0).
  int64_t block_of(int64_t s, int64_t id) const {
    const int64_t first = slot_first_block[s], last = slot_first_block[s + 1];
    if (last - first == 1) return first;
    const int64_t* end = block_starts + last;
    return (std::upper_bound(block_starts + first, end, id) - block_starts) - 1;
  }
};

template <typename id_t, typename len_t>
Routed route(const at::Tensor& values, const at::Tensor& lengths, const float* weights,
             int64_t batch, const Tables& t, int64_t num_slots, int64_t num_send_slots) {
  const id_t* ids = values.data_ptr<id_t>();
  const len_t* lens = lengths.data_ptr<len_t>();
  const int64_t n = values.numel();
  auto i64 = at::TensorOptions().dtype(at::kLong);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  // Pass 1: check every id and count what each send slot and each bag receives.
  at::Tensor slot_counts = at::zeros({num_send_slots}, i64);
  at::Tensor slot_lengths = at::zeros({num_send_slots * batch}, at::TensorOptions().dtype(at::kInt));
  int64_t* counts = slot_counts.data_ptr<int64_t>();
  int32_t* bag_lengths = slot_lengths.data_ptr<int32_t>();
  int64_t first_bad = -1, num_row = 0, i = 0;
  for (int64_t s = 0; s < num_slots && first_bad < 0; ++s) {
    const int64_t rows = t.slot_rows[s];
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = static_cast<int64_t>(lens[s * batch + b]);
      TORCH_CHECK_VALUE(len >= 0, kOp, ": lengths[", s * batch + b, "] is negative (", len, ")");
      TORCH_CHECK_VALUE(len <= n - i, kOp, ": lengths sum past values' ", n, " ids");
      for (int64_t end = i + len; i < end; ++i) {
        const int64_t id = static_cast<int64_t>(ids[i]);
        if (id < 0 || id >= rows) {
          first_bad = i;
          break;
        }
        const int64_t block = t.block_of(s, id);
        for (int64_t r = t.block_first_route[block]; r < t.block_first_route[block + 1]; ++r) {
          if (t.row_group[r] >= 0) {
            ++num_row;
          } else {
            const int64_t slot = t.send_slot[r];
            ++counts[slot];
            ++bag_lengths[slot * batch + b];
          }
        }
      }
      if (first_bad >= 0) break;
    }
  }
  at::Tensor bad = at::full({}, first_bad, i64);
  if (first_bad >= 0) {
    auto none = at::empty({0}, i64);
    return {none, at::empty({0}, f32), slot_lengths, slot_counts, none, none, none, none,
            at::empty({0}, f32), bad};
  }
  TORCH_CHECK_VALUE(i == n, kOp, ": lengths sum to ", i, " but values has ", n, " ids");
  // Pass 2: each id at its place.
  int64_t num_send = 0;
  std::vector<int64_t> next(num_send_slots);
  for (int64_t slot = 0; slot < num_send_slots; ++slot) {
    next[slot] = num_send;
    num_send += counts[slot];
  }
  at::Tensor send_ids = at::empty({num_send}, i64);
  at::Tensor send_weights = at::empty({weights ? num_send : 0}, f32);
  at::Tensor row_group = at::empty({num_row}, i64), row_slot = at::empty({num_row}, i64);
  at::Tensor row_sample = at::empty({num_row}, i64), row_ids = at::empty({num_row}, i64);
  at::Tensor row_weights = at::empty({weights ? num_row : 0}, f32);
  int64_t* out_ids = send_ids.data_ptr<int64_t>();
  float* out_weights = send_weights.data_ptr<float>();
  int64_t *rg = row_group.data_ptr<int64_t>(), *rs = row_slot.data_ptr<int64_t>();
  int64_t *rb = row_sample.data_ptr<int64_t>(), *ri = row_ids.data_ptr<int64_t>();
  float* rw = row_weights.data_ptr<float>();
  int64_t p = 0;
  i = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t end = i + static_cast<int64_t>(lens[s * batch + b]); i < end; ++i) {
        const int64_t id = static_cast<int64_t>(ids[i]);
        const int64_t block = t.block_of(s, id);
        for (int64_t r = t.block_first_route[block]; r < t.block_first_route[block + 1]; ++r) {
          const int64_t local = id - t.row_offset[r];
          if (t.row_group[r] >= 0) {
            rg[p] = t.row_group[r];
            rs[p] = s;
            rb[p] = b;
            ri[p] = local;
            if (weights) rw[p] = weights[i];
            ++p;
          } else {
            const int64_t at = next[t.send_slot[r]]++;
            out_ids[at] = local;
            if (weights) out_weights[at] = weights[i];
          }
        }
      }
    }
  }
  return {send_ids, send_weights, slot_lengths, slot_counts, row_group, row_slot, row_sample,
          row_ids, row_weights, bad};
}

Routed route_ids_cpu(const at::Tensor& values, const at::Tensor& lengths,
                     const std::optional<at::Tensor>& weights, int64_t batch,
                     const at::Tensor& slot_rows, const at::Tensor& slot_first_block,
                     const at::Tensor& block_starts, const at::Tensor& block_first_route,
                     const at::Tensor& route_send_slot, const at::Tensor& route_row_group,
                     const at::Tensor& route_row_offset, int64_t num_send_slots) {
  TORCH_CHECK_VALUE(batch >= 0, kOp, ": batch must be >= 0, got ", batch);
  TORCH_CHECK_VALUE(num_send_slots >= 0, kOp, ": num_send_slots must be >= 0, got ",
                    num_send_slots);
  TORCH_CHECK_TYPE(values.scalar_type() == at::kInt || values.scalar_type() == at::kLong, kOp,
                   ": values must be int32 or int64, got ", values.scalar_type());
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong, kOp,
                   ": lengths must be int32 or int64, got ", lengths.scalar_type());
  TORCH_CHECK_VALUE(values.dim() == 1 && lengths.dim() == 1, kOp,
                    ": values and lengths must be 1-D");
  TORCH_CHECK_VALUE(values.device().is_cpu() && lengths.device().is_cpu(), kOp,
                    ": values and lengths must be on the CPU (ids are routed on the host)");
  const int64_t num_slots = slot_rows.numel();
  check_index_tensor(slot_rows, "slot_rows", -1);
  TORCH_CHECK_VALUE(lengths.numel() == num_slots * batch, kOp, ": lengths must have slots x "
                    "batch = ", num_slots * batch, " entries, got ", lengths.numel());
  check_index_tensor(slot_first_block, "slot_first_block", num_slots + 1);
  check_index_tensor(block_starts, "block_starts", -1);
  const int64_t num_blocks = block_starts.numel();
  check_index_tensor(block_first_route, "block_first_route", num_blocks + 1);
  check_index_tensor(route_send_slot, "route_send_slot", -1);
  const int64_t num_routes = route_send_slot.numel();
  check_index_tensor(route_row_group, "route_row_group", num_routes);
  check_index_tensor(route_row_offset, "route_row_offset", num_routes);
  const at::Tensor w = weights.has_value() ? weights->contiguous() : at::Tensor();
  if (w.defined()) {
    TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat, kOp, ": weights must be float32, got ",
                     w.scalar_type());
    TORCH_CHECK_VALUE(w.dim() == 1 && w.numel() == values.numel() && w.device().is_cpu(), kOp,
                      ": weights must be a CPU [", values.numel(), "] tensor (one per id)");
  }
  // The tables are built once per module; check they are consistent, so no id can index past
  // them.
  Tables t{};
  const at::Tensor sfb = slot_first_block.contiguous(), bs = block_starts.contiguous();
  const at::Tensor bfr = block_first_route.contiguous(), rss = route_send_slot.contiguous();
  const at::Tensor rrg = route_row_group.contiguous(), rro = route_row_offset.contiguous();
  const at::Tensor rows = slot_rows.contiguous();
  t.slot_rows = rows.data_ptr<int64_t>();
  t.slot_first_block = sfb.data_ptr<int64_t>();
  t.block_starts = bs.data_ptr<int64_t>();
  t.block_first_route = bfr.data_ptr<int64_t>();
  t.send_slot = rss.data_ptr<int64_t>();
  t.row_group = rrg.data_ptr<int64_t>();
  t.row_offset = rro.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(t.slot_first_block[0] == 0 && t.slot_first_block[num_slots] == num_blocks,
                    kOp, ": slot_first_block must run from 0 to ", num_blocks);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t first = t.slot_first_block[s], last = t.slot_first_block[s + 1];
    TORCH_CHECK_VALUE(first < last && last <= num_blocks && t.block_starts[first] == 0, kOp,
                      ": slot ", s, " must have at least one row block, the first at row 0");
  }
  TORCH_CHECK_VALUE(t.block_first_route[0] == 0 && t.block_first_route[num_blocks] == num_routes,
                    kOp, ": block_first_route must run from 0 to ", num_routes);
  for (int64_t k = 0; k < num_blocks; ++k) {
    TORCH_CHECK_VALUE(t.block_first_route[k] <= t.block_first_route[k + 1], kOp,
                      ": block_first_route must be non-decreasing");
  }
  for (int64_t r = 0; r < num_routes; ++r) {
    TORCH_CHECK_VALUE(t.row_group[r] >= 0 || (t.send_slot[r] >= 0 &&
                      t.send_slot[r] < num_send_slots), kOp, ": route ", r,
                      " has send slot ", t.send_slot[r], " outside [0, ", num_send_slots, ")");
  }
  const at::Tensor v = values.contiguous(), l = lengths.contiguous();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  if (v.scalar_type() == at::kInt) {
    return l.scalar_type() == at::kInt
               ? route<int32_t, int32_t>(v, l, wp, batch, t, num_slots, num_send_slots)
               : route<int32_t, int64_t>(v, l, wp, batch, t, num_slots, num_send_slots);
  }
  return l.scalar_type() == at::kInt
             ? route<int64_t, int32_t>(v, l, wp, batch, t, num_slots, num_send_slots)
             : route<int64_t, int64_t>(v, l, wp, batch, t, num_slots, num_send_slots);
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) { m.impl("route_ids", &route_ids_cpu); }

}  // namespace recxla
