// The fused backward of the pooled embedding lookup on CPU (the forward is embedding_bag.cpp).
//
// The ids are grouped by unique row with a counting sort (one table per task), then the unique
// rows are split across threads: each thread sums the output gradient of its rows' ids (in
// registers for the usual widths, prefetching the gradient rows ahead) and updates those rows and
// their optimizer state in place with the math of recxla/embedding_bag.h. Every row is owned by
// exactly one thread, so there are no atomics, and the gradient sums have a fixed order (ids in
// batch order), which makes a step deterministic for any thread count.
//
// Every check that reads the data (offsets monotone, ids inside their table's segment, rows in
// range and strictly increasing) runs before the first write to a weight or optimizer state.
#include <torch/library.h>

#include "embedding_bag_cpu.h"

namespace recxla {
namespace emb_cpu {
namespace {

// The ids of every unique row, as a CSR: ids of row u are entries [start[u], start[u + 1]);
// an entry holds where the id's output gradient lives (grad_offset into grad_output) and the
// factor its gradient is scaled by (per-sample weight, 1 / bag length for mean, grad sign).
struct IdsByRow {
  std::vector<int64_t> start;                 // [U + 1]
  std::unique_ptr<int64_t[]> grad_offset;     // [N], left uninitialised until filled
  std::unique_ptr<float[]> scale;             // [N]
};

// Applies one table's optimizer to unique rows [begin, end) of its segment (or, for Optim::None,
// writes their gradient to grad_out). kDim > 0 makes the width a compile-time constant, so the
// gradient row stays in vector registers; kDim == 0 is the generic path over `buffer`.
template <int64_t kDim, typename index_t>
RECXLA_INLINE void update_segment(
    const Args& a, const IdsByRow& ids, const index_t* __restrict__ rows,
    const float* __restrict__ grad, Optim kind, const Hparams h, int64_t t, int64_t runtime_dim,
    float* __restrict__ grad_out, int64_t begin, int64_t end, float* __restrict__ buffer) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t lo = a.unique_offsets[t];
  const int64_t* __restrict__ start = ids.start.data();
  const int64_t* __restrict__ grad_offset = ids.grad_offset.get();
  const float* __restrict__ scale = ids.scale.get();
  const int64_t last_entry = start[end];
  float* __restrict__ w = a.weights[t];
  float* __restrict__ state = a.states != nullptr ? a.states[t] : nullptr;
  float local[kDim > 0 ? kDim : 1];
  float* __restrict__ g = kDim > 0 ? local : buffer;
  for (int64_t u = begin; u < end; ++u) {
    RowSum<kDim> sum(buffer, dim);
    for (int64_t e = start[u]; e < start[u + 1]; ++e) {
      // The output-gradient rows of the ids are scattered over grad_output: fetch ahead.
      if (e + kPrefetchAhead < last_entry) prefetch_row(grad + grad_offset[e + kPrefetchAhead], dim);
      sum.add(grad + grad_offset[e], scale[e]);
    }
    sum.store(g);
    const int64_t r = rows[u];
    float* __restrict__ row = w + r * dim;
    switch (kind) {
      case Optim::None: {
        float* __restrict__ o = grad_out + (u - lo) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = g[d];
        break;
      }
      case Optim::SGD:
        for (int64_t d = 0; d < dim; ++d) row[d] = emb::sgd_update(row[d], g[d], h);
        break;
      case Optim::Adagrad: {
        float* __restrict__ m = state + r * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] = emb::adagrad_update(row[d], g[d], m[d], h);
        break;
      }
      case Optim::RowwiseAdagrad: {
        // 16 independent partial sums, so the reduction vectorizes without reassociation.
        constexpr int kLanes = 16;
        float lanes[kLanes] = {};
        int64_t d = 0;
        for (; d + kLanes <= dim; d += kLanes) {
          for (int j = 0; j < kLanes; ++j) lanes[j] += emb::rowwise_square(g[d + j], row[d + j], h);
        }
        float tail = 0.0f;
        for (; d < dim; ++d) tail += emb::rowwise_square(g[d], row[d], h);
        for (int width = kLanes / 2; width > 0; width /= 2) {
          for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
        }
        const float m_new = emb::rowwise_accumulator(state[r], lanes[0] + tail, dim);
        state[r] = m_new;
        const float mult = emb::rowwise_multiplier(m_new, h);
        const float corr = emb::rowwise_correction(mult, h);
        for (d = 0; d < dim; ++d) row[d] = emb::rowwise_update(row[d], g[d], mult, corr);
        break;
      }
    }
  }
}

template <typename index_t>
RECXLA_INLINE void update_rows(
    const Args& a, const IdsByRow& ids, const index_t* __restrict__ rows,
    const float* __restrict__ grad, const int64_t* optim, const Hparams* hparams,
    float* const* grad_out, int64_t begin, int64_t end) {
  std::vector<float> buffer;
  while (begin < end) {
    const int64_t t =
        std::upper_bound(a.unique_offsets, a.unique_offsets + a.num_tables + 1, begin) -
        a.unique_offsets - 1;
    const int64_t stop = std::min(end, a.unique_offsets[t + 1]);
    const int64_t dim = a.table_dim[t];
    const auto kind = static_cast<Optim>(optim[t]);
    if (kind == Optim::None && grad_out[t] == nullptr) {
      begin = stop;  // a table without an optimizer in a fused update: nothing to do
      continue;
    }
    buffer.resize(std::max<int64_t>(dim, 1));
#define RECXLA_UPDATE(D)                                                                     \
  update_segment<D>(a, ids, rows, grad, kind, hparams[t], t, dim, grad_out[t], begin, stop, \
                    buffer.data())
    switch (dim) {
      case 16: RECXLA_UPDATE(16); break;
      case 32: RECXLA_UPDATE(32); break;
      case 64: RECXLA_UPDATE(64); break;
      case 128: RECXLA_UPDATE(128); break;
      default: RECXLA_UPDATE(0);
    }
#undef RECXLA_UPDATE
    begin = stop;
  }
}

#define RECXLA_EB_UPDATE(index_t, name)                                                          \
  RECXLA_MULTIVERSION void update_rows_##name(                                                  \
      const Args& a, const IdsByRow& ids, const index_t* rows, const float* grad,               \
      const int64_t* optim, const Hparams* hparams, float* const* grad_out, int64_t begin,      \
      int64_t end) {                                                                            \
    update_rows<index_t>(a, ids, rows, grad, optim, hparams, grad_out, begin, end);             \
  }

RECXLA_EB_UPDATE(int32_t, i32)
RECXLA_EB_UPDATE(int64_t, i64)
#undef RECXLA_EB_UPDATE

// Groups the ids by unique row (see IdsByRow); `sign[t]` multiplies table t's gradients.
//
// A parallel counting sort. One table can hold most ids of a batch (a long history feature), so
// a table's bags are cut into parts, one task each, with a count per unique row of the table per
// part: count, then scan (row by row, parts in order, so a row's ids stay in batch order),
// then place. Tasks are taken largest first from a shared counter.
IdsByRow group_ids(const char* op, const Call& c, const std::vector<float>& sign) {
  const Layout& l = c.l;
  const Args& a = c.args;
  const int64_t B = l.batch_size;
  std::vector<std::vector<int64_t>> features(l.num_tables);
  std::vector<int64_t> ids_of(l.num_tables, 0);
  for (int64_t f = 0; f < l.num_features; ++f) {
    features[l.feature_table[f]].push_back(f);
    ids_of[l.feature_table[f]] += a.offsets[(f + 1) * B] - a.offsets[f * B];
  }
  struct Task {
    int64_t table, first, last;     // bags [first, last) of the table's features, in order
    int64_t ids;                    // how many ids they hold
    std::vector<int64_t> cursor;    // per unique row of the table: count, then next place
  };
  const int64_t threads = at::get_num_threads();
  constexpr int64_t kIdsPerPart = 1 << 16;
  std::vector<Task> tasks;
  std::vector<std::vector<int64_t>> parts_of(l.num_tables);
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const int64_t bags = static_cast<int64_t>(features[t].size()) * B;
    const int64_t parts = std::max<int64_t>(1, std::min({threads, ids_of[t] / kIdsPerPart, bags}));
    for (int64_t p = 0; p < parts; ++p) {
      parts_of[t].push_back(static_cast<int64_t>(tasks.size()));
      tasks.push_back({t, bags * p / parts, bags * (p + 1) / parts, 0, {}});
    }
  }
  // Calls body(f, b, i) for every id i (of bag b of feature f) of a task.
  auto for_ids = [&](const Task& task, auto&& body) {
    if (task.first == task.last) return;  // also covers B == 0
    int64_t slot = task.first / B, b = task.first % B;
    for (int64_t k = task.first; k < task.last; ++k) {
      const int64_t f = features[task.table][slot];
      const int64_t* bag = a.offsets + f * B + b;
      for (int64_t i = bag[0]; i < bag[1]; ++i) body(f, b, i);
      if (++b == B) {
        b = 0;
        ++slot;
      }
    }
  };
  auto run_tasks = [&](auto&& run) {
    std::vector<int64_t> order(tasks.size());
    for (size_t k = 0; k < tasks.size(); ++k) order[k] = static_cast<int64_t>(k);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      return tasks[x].last - tasks[x].first > tasks[y].last - tasks[y].first;
    });
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(order.size());
    at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
      for (int64_t k = next++; k < n; k = next++) run(tasks[order[k]]);
    });
  };
  std::atomic<bool> bad{false};
  run_tasks([&](Task& task) {
    const int64_t lo = l.unique_offsets[task.table], hi = l.unique_offsets[task.table + 1];
    task.cursor.assign(hi - lo, 0);
    int64_t* count = task.cursor.data() - lo;
    bool ok = true;
    for_ids(task, [&](int64_t, int64_t, int64_t i) {
      const int64_t u = a.inverse[i];
      const bool inside = u >= lo && u < hi;
      ok &= inside;
      if (inside) ++count[u];
    });
    if (!ok) bad.store(true);
  });
  TORCH_CHECK_INDEX(!bad.load(), op,
                    ": inverse holds an index outside the unique_values segment of its table");
  IdsByRow ids;
  ids.start.assign(l.num_unique + 1, 0);
  ids.grad_offset.reset(new int64_t[std::max<int64_t>(l.num_ids, 1)]);
  ids.scale.reset(new float[std::max<int64_t>(l.num_ids, 1)]);
  int64_t running = 0;  // entries follow the unique rows: table by table, row by row
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const int64_t lo = l.unique_offsets[t], hi = l.unique_offsets[t + 1];
    for (int64_t u = lo; u < hi; ++u) {
      ids.start[u] = running;
      for (int64_t p : parts_of[t]) {
        const int64_t n = tasks[p].cursor[u - lo];
        tasks[p].cursor[u - lo] = running;
        running += n;
      }
    }
  }
  ids.start[l.num_unique] = running;
  run_tasks([&](Task& task) {
    const int64_t t = task.table;
    const bool mean = l.pooling[t] == static_cast<int64_t>(emb::Pooling::Mean);
    int64_t* cursor = task.cursor.data() - l.unique_offsets[t];
    for_ids(task, [&](int64_t f, int64_t b, int64_t i) {
      const int64_t len = a.offsets[f * B + b + 1] - a.offsets[f * B + b];
      const float bag_scale = mean ? sign[t] * (1.0f / static_cast<float>(len)) : sign[t];
      const int64_t e = cursor[a.inverse[i]]++;
      ids.grad_offset[e] = b * l.total_dim + l.feature_column[f];
      ids.scale[e] = a.psw != nullptr ? a.psw[i] * bag_scale : bag_scale;
    });
  });
  return ids;
}

void run_update(
    const Call& c, const IdsByRow& ids, const at::Tensor& grad, const int64_t* optim,
    const Hparams* hparams, float* const* grad_out) {
  if (c.l.num_unique == 0) return;
  int64_t max_dim = 1;
  for (int64_t d : c.l.table_dim) max_dim = std::max(max_dim, d);
  const float* g = grad.const_data_ptr<float>();
  at::parallel_for(0, c.l.num_unique, std::max<int64_t>(1, 8192 / max_dim), [&](int64_t b, int64_t e) {
    if (c.rows.scalar_type() == at::kInt) {
      update_rows_i32(c.args, ids, c.rows.const_data_ptr<int32_t>(), g, optim, hparams, grad_out, b, e);
    } else {
      update_rows_i64(c.args, ids, c.rows.const_data_ptr<int64_t>(), g, optim, hparams, grad_out, b, e);
    }
  });
}

std::vector<at::Tensor> embedding_bag_unique_grad_cpu(
    const at::Tensor& grad_output, at::TensorList weights, const at::Tensor& unique_values,
    const at::Tensor& unique_offsets, const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size) {
  constexpr const char* op = "recxla::embedding_bag_unique_grad";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/false);
  emb::check_grad_output(op, grad_output, c.l);
  const at::Tensor grad = grad_output.contiguous();
  std::vector<at::Tensor> out;
  std::vector<float*> out_ptrs;
  for (int64_t t = 0; t < c.l.num_tables; ++t) {
    const int64_t n = c.l.unique_offsets[t + 1] - c.l.unique_offsets[t];
    out.push_back(at::empty({n, c.l.table_dim[t]}, grad.options()));
    out_ptrs.push_back(out.back().data_ptr<float>());
  }
  const IdsByRow ids = group_ids(op, c, std::vector<float>(c.l.num_tables, 1.0f));
  const std::vector<int64_t> optim(c.l.num_tables, static_cast<int64_t>(Optim::None));
  const std::vector<Hparams> hparams(c.l.num_tables, Hparams{0.0f, 0.0f, 0.0f, 1.0f});
  run_update(c, ids, grad, optim.data(), hparams.data(), out_ptrs.data());
  return out;
}

void embedding_bag_backward_update_cpu(
    const at::Tensor& grad_output, at::TensorList weights, at::TensorList states,
    const at::Tensor& unique_values, const at::Tensor& unique_offsets, const at::Tensor& inverse,
    const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
    at::IntArrayRef feature_table, at::IntArrayRef pooling, int64_t batch_size,
    at::IntArrayRef optim, at::ArrayRef<double> hparams) {
  constexpr const char* op = "recxla::embedding_bag_backward_update";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/true);
  emb::check_grad_output(op, grad_output, c.l);
  const std::vector<Hparams> h =
      emb::check_optimizer(op, c.l, unique_values.device(), states, optim, hparams);
  const at::Tensor grad = grad_output.contiguous();
  for (const at::Tensor& s : states) {
    c.state_ptrs.push_back(s.numel() > 0 && s.scalar_type() == at::kFloat ? s.data_ptr<float>()
                                                                          : nullptr);
  }
  c.args.states = c.state_ptrs.data();
  std::vector<float> sign;
  for (const Hparams& p : h) sign.push_back(p.grad_sign);
  const IdsByRow ids = group_ids(op, c, sign);
  std::vector<float*> no_grad_out(c.l.num_tables, nullptr);
  run_update(c, ids, grad, optim.data(), h.data(), no_grad_out.data());
}

}  // namespace
}  // namespace emb_cpu

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("embedding_bag_unique_grad", &emb_cpu::embedding_bag_unique_grad_cpu);
  m.impl("embedding_bag_backward_update", &emb_cpu::embedding_bag_backward_update_cpu);
}

}  // namespace recxla
