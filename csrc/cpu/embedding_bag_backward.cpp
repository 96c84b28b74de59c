// The fused backward of the pooled embedding lookup on CPU (the forward is embedding_bag.cpp).
//
// Each table's unique rows get a gradient accumulator; the table's bags are walked in batch
// order, each bag's output-gradient row is read once (into vector registers for the usual
// widths) and added, scaled, to the accumulator of every id of the bag; then every unique row is
// updated once, with its accumulated gradient, by the math of recxla/embedding_bag.h. Reading
// grad_output bag by bag is a forward sweep that touches each of its rows once per feature,
// and a multi-hot bag's row is read once for all of its ids; the accumulators of a skewed batch
// stay in cache.
//
// Tables whose ids rarely repeat get the other order ("gather"): there the accumulators are
// nearly one row per id (96 MB for a 1M-row table of i.i.d. ids at dim 64) and adding into them
// is a random read-modify-write over memory. Instead the table's ids are grouped by unique row
// (a counting sort of `inverse`: where each id's output-gradient row lies, and its scale), and
// each row sums its ids' gradient rows in registers and is updated at once. Both orders add a
// row's contributions in batch order to a zero start with the same float operations, so the
// choice never changes a bit of the result; it is made per table from the exact counts (ids per
// unique row, accumulator size), and RECXLA_EMB_BACKWARD=accumulate|gather forces one (tests).
//
// Tables are split into parts by unique row (one task each, largest first): a part adds only the
// ids of its rows, so no two threads write the same row and no atomics are needed. A row's
// gradient is summed in batch order whatever the split, which makes a step bitwise
// deterministic for any thread count.
//
// Every check that reads the data (offsets monotone, ids inside their table's segment, rows in
// range and strictly increasing) runs before the first write to a weight or optimizer state.
#include <torch/library.h>

#include "embedding_bag_cpu.h"

namespace recxla {
namespace emb_cpu {
namespace {

// One unique row's update with its gradient g (or, for Optim::None, g copied to `out`).
RECXLA_INLINE void apply_row(
    Optim kind, const Hparams& h, int64_t dim, float* __restrict__ row, float* __restrict__ state,
    int64_t r, const float* __restrict__ g, float* __restrict__ out) {
  switch (kind) {
    case Optim::None:
      for (int64_t d = 0; d < dim; ++d) out[d] = g[d];
      break;
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

// Starts the loads of unique row r's update (its weights, and its optimizer state) a few rows
// ahead of it: a table's updated rows lie far apart, and each update would otherwise wait for
// its lines from memory. Prefetched for writing, as the update writes them.
RECXLA_INLINE void prefetch_update(Optim kind, const float* row, const float* state, int64_t r,
                                   int64_t dim) {
  if (kind == Optim::None) return;
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d, 1);
  if (kind == Optim::Adagrad) {
    for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(state + r * dim + d, 1);
  } else if (kind == Optim::RowwiseAdagrad) {
    __builtin_prefetch(state + r, 1);
  }
}

// One id in the gather order: where its output-gradient row starts, and its scale (per-sample
// weight x 1 / bag length for mean x grad_sign, rounded as the accumulate order rounds it).
struct Entry {
  int64_t grad_offset;
  float scale;
};

// Unique rows [lo, hi) of table t, and the table's features. Gather parts also carry the
// table's groups: the entries of its unique row u are entries[start[u - lo_t]:start[u - lo_t + 1]].
struct Part {
  int64_t table, lo, hi;
  const int64_t* features;
  int64_t num_features;
  int64_t ids;  // ids of the table (an accumulate part reads them all)
  const int64_t* start = nullptr;  // gather only
  const Entry* entries = nullptr;
};

RECXLA_INLINE float bag_scale(bool mean, float sign, int64_t first, int64_t last) {
  return mean ? sign * (1.0f / static_cast<float>(last - first)) : sign;
}

// Accumulates the gradients of a part's rows in acc [(hi - lo) * dim], zeroed by the caller,
// then updates the rows (or writes their gradient to grad_out).
template <int64_t kDim, typename index_t>
RECXLA_INLINE void run_part(
    const Args& a, const Part& p, const index_t* __restrict__ rows, const float* __restrict__ grad,
    Optim kind, const Hparams& h, float sign, float* __restrict__ grad_out,
    float* __restrict__ acc) {
  const int64_t t = p.table, dim = kDim > 0 ? kDim : a.table_dim[t], B = a.batch_size;
  const int64_t lo = p.lo, hi = p.hi;
  const bool mean = a.pooling[t] == static_cast<int64_t>(emb::Pooling::Mean);
  for (int64_t k = 0; k < p.num_features; ++k) {
    const int64_t f = p.features[k];
    const int64_t* bags = a.offsets + f * B;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = bags[b], last = bags[b + 1];
      if (first == last) continue;
      const GradRow<kDim> g(grad + grad_row_offset(a, f, b), dim);
      const float scale = bag_scale(mean, sign, first, last);
      for (int64_t i = first; i < last; ++i) {
        const int64_t u = a.inverse[i];
        if (u < lo || u >= hi) continue;
        g.add_to(acc + (u - lo) * dim, a.psw != nullptr ? a.psw[i] * scale : scale);
      }
    }
  }
  float* w = a.weights[t];
  float* state = a.states != nullptr ? a.states[t] : nullptr;
  const int64_t segment = a.unique_offsets[t];
  for (int64_t u = lo; u < hi; ++u) {
    if (u + kPrefetchAhead < hi) {
      const int64_t ahead = rows[u + kPrefetchAhead];
      prefetch_update(kind, w + ahead * dim, state, ahead, dim);
    }
    const int64_t r = rows[u];
    apply_row(kind, h, dim, w + r * dim, state, r, acc + (u - lo) * dim,
              grad_out != nullptr ? grad_out + (u - segment) * dim : nullptr);
  }
}

// Sums each unique row's entries in registers (into `row_grad` [dim] for the update), in entry
// order, and updates the row.
template <int64_t kDim, typename index_t>
RECXLA_INLINE void run_gather_part(
    const Args& a, const Part& p, const index_t* __restrict__ rows, const float* __restrict__ grad,
    Optim kind, const Hparams& h, float* __restrict__ grad_out, float* __restrict__ row_grad) {
  const int64_t t = p.table, dim = kDim > 0 ? kDim : a.table_dim[t];
  const int64_t segment = a.unique_offsets[t];
  float* w = a.weights[t];
  float* state = a.states != nullptr ? a.states[t] : nullptr;
  const int64_t* start = p.start - segment;  // indexed by u
  const Entry* entries = p.entries;
  for (int64_t u = p.lo; u < p.hi; ++u) {
    RowSum<kDim> sum(row_grad, dim);
    const int64_t end = start[u + 1];
    for (int64_t e = start[u]; e < end; ++e) {
      // Gradient rows come in no useful order: keep a few loads in flight.
      if (e + kPrefetchAhead < end) {
        prefetch_row(grad + entries[e + kPrefetchAhead].grad_offset, dim);
      }
      sum.add(grad + entries[e].grad_offset, entries[e].scale);
    }
    sum.store(row_grad);
    if (u + kPrefetchAhead < p.hi) {
      const int64_t ahead = rows[u + kPrefetchAhead];
      prefetch_update(kind, w + ahead * dim, state, ahead, dim);
    }
    const int64_t r = rows[u];
    apply_row(kind, h, dim, w + r * dim, state, r, row_grad,
              grad_out != nullptr ? grad_out + (u - segment) * dim : nullptr);
  }
}

template <typename index_t>
RECXLA_INLINE void run_part_any_dim(
    const Args& a, const Part& p, const index_t* rows, const float* grad, Optim kind,
    const Hparams& h, float sign, float* grad_out, float* acc) {
  if (p.start != nullptr) {  // acc: [dim] scratch for the row's gradient
    switch (a.table_dim[p.table]) {
      case 16: run_gather_part<16>(a, p, rows, grad, kind, h, grad_out, acc); break;
      case 32: run_gather_part<32>(a, p, rows, grad, kind, h, grad_out, acc); break;
      case 64: run_gather_part<64>(a, p, rows, grad, kind, h, grad_out, acc); break;
      case 128: run_gather_part<128>(a, p, rows, grad, kind, h, grad_out, acc); break;
      default: run_gather_part<0>(a, p, rows, grad, kind, h, grad_out, acc);
    }
    return;
  }
  switch (a.table_dim[p.table]) {
    case 16: run_part<16>(a, p, rows, grad, kind, h, sign, grad_out, acc); break;
    case 32: run_part<32>(a, p, rows, grad, kind, h, sign, grad_out, acc); break;
    case 64: run_part<64>(a, p, rows, grad, kind, h, sign, grad_out, acc); break;
    case 128: run_part<128>(a, p, rows, grad, kind, h, sign, grad_out, acc); break;
    default: run_part<0>(a, p, rows, grad, kind, h, sign, grad_out, acc);
  }
}

#define RECXLA_EB_PART(index_t, name)                                                           \
  RECXLA_MULTIVERSION void run_part_##name(                                                     \
      const Args& a, const Part& p, const index_t* rows, const float* grad, Optim kind,         \
      const Hparams& h, float sign, float* grad_out, float* acc) {                              \
    run_part_any_dim<index_t>(a, p, rows, grad, kind, h, sign, grad_out, acc);                  \
  }

RECXLA_EB_PART(int32_t, i32)
RECXLA_EB_PART(int64_t, i64)
#undef RECXLA_EB_PART

// Every id inside its table's segment of unique_values, checked before anything is written.
void check_inverse(const char* op, const Call& c) {
  const Layout& l = c.l;
  const Args& a = c.args;
  std::vector<char> bad(l.num_features, 0);
  at::parallel_for(0, l.num_features, 1, [&](int64_t f0, int64_t f1) {
    for (int64_t f = f0; f < f1; ++f) {
      const int64_t t = l.feature_table[f];
      const int64_t lo = l.unique_offsets[t], hi = l.unique_offsets[t + 1];
      bool ok = true;
      for (int64_t i = a.offsets[f * l.batch_size]; i < a.offsets[(f + 1) * l.batch_size]; ++i) {
        ok &= a.inverse[i] >= lo && a.inverse[i] < hi;
      }
      bad[f] = !ok;  // one writer per feature
    }
  });
  for (int64_t f = 0; f < l.num_features; ++f) {
    TORCH_CHECK_INDEX(!bad[f], op, ": inverse holds an index outside the unique_values segment "
                      "of its table (feature ", f, ")");
  }
}

// Every non-empty bag's gradient row inside grad_output (`numel` elements), checked before
// anything is written.
void check_grad_offsets_data(const char* op, const Call& c, const int64_t* grad_offsets,
                             int64_t numel) {
  const Layout& l = c.l;
  const int64_t B = l.batch_size;
  std::vector<int64_t> bad(l.num_features, -1);  // per feature its first bad bag
  at::parallel_for(0, l.num_features, 1, [&](int64_t f0, int64_t f1) {
    for (int64_t f = f0; f < f1; ++f) {
      const int64_t dim = l.table_dim[l.feature_table[f]];
      const int64_t* bags = c.args.offsets + f * B;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t at = grad_offsets[f * B + b];
        if (bags[b] != bags[b + 1] && (at < 0 || at > numel - dim)) {
          bad[f] = f * B + b;  // one writer per feature
          break;
        }
      }
    }
  });
  for (int64_t f = 0; f < l.num_features; ++f) {
    if (bad[f] < 0) continue;
    const int64_t bag = bad[f], dim = l.table_dim[l.feature_table[f]];
    TORCH_CHECK_INDEX(false, op, ": grad_offsets[", bag, "] = ", grad_offsets[bag], " puts bag ",
                      bag, "'s ", dim, "-wide gradient row outside grad_output's ", numel,
                      " elements");
  }
}

// Accumulators up to this size stay in cache, and adding into them beats any reordering.
constexpr int64_t kCachedAccumulatorBytes = 4 << 20;
// With at least this many ids per unique row on average, a bag's gradient row read once for
// several of its ids (the accumulate order) saves more than the random adds cost.
constexpr int64_t kGatherMaxIdsPerRow = 2;

// Which order table t takes (see the top of the file): gather when its accumulators would leave
// the cache and its ids rarely repeat. RECXLA_EMB_BACKWARD=accumulate|gather overrides.
bool use_gather(int64_t ids, int64_t unique, int64_t dim) {
  const char* forced = std::getenv("RECXLA_EMB_BACKWARD");
  if (forced != nullptr && std::strcmp(forced, "gather") == 0) return true;
  if (forced != nullptr && std::strcmp(forced, "accumulate") == 0) return false;
  return unique * dim * static_cast<int64_t>(sizeof(float)) > kCachedAccumulatorBytes &&
         ids < kGatherMaxIdsPerRow * unique;
}

// The gather order's groups of table t: a counting sort of its ids by unique row, stable, so a
// row's entries keep batch order. start [U_t + 1] (start[0] = 0), entries [ids of t].
void group_by_row(const Args& a, int64_t t, const std::vector<int64_t>& features, int64_t* start,
                  Entry* entries) {
  const int64_t lo = a.unique_offsets[t], unique = a.unique_offsets[t + 1] - lo;
  const int64_t B = a.batch_size;
  const bool mean = a.pooling[t] == static_cast<int64_t>(emb::Pooling::Mean);
  std::fill(start, start + unique + 1, 0);
  for (const int64_t f : features) {
    for (int64_t i = a.offsets[f * B]; i < a.offsets[(f + 1) * B]; ++i) ++start[a.inverse[i] - lo + 1];
  }
  for (int64_t u = 0; u < unique; ++u) start[u + 1] += start[u];
  for (const int64_t f : features) {  // start[u] is row u's write cursor, then row u + 1's start
    const int64_t* bags = a.offsets + f * B;
    for (int64_t b = 0; b < B; ++b) {
      const float scale = bag_scale(mean, a.grad_sign[t], bags[b], bags[b + 1]);
      const int64_t grad_offset = grad_row_offset(a, f, b);
      for (int64_t i = bags[b]; i < bags[b + 1]; ++i) {
        entries[start[a.inverse[i] - lo]++] =
            Entry{grad_offset, a.psw != nullptr ? a.psw[i] * scale : scale};
      }
    }
  }
  std::memmove(start + 1, start, unique * sizeof(int64_t));
  start[0] = 0;
}

// The backward of every table: table t with optim[t] (grad_out[t] != nullptr: write the gradient
// of its unique rows there instead), gradients times sign[t].
void run_backward(
    const char* op, const Call& c, const at::Tensor& grad_output, const int64_t* optim,
    const Hparams* hparams, float* const* grad_out, const std::vector<float>& sign) {
  const Layout& l = c.l;
  check_inverse(op, c);
  if (l.num_unique == 0) return;
  const int64_t B = l.batch_size;
  std::vector<std::vector<int64_t>> features(l.num_tables);
  std::vector<int64_t> ids_of(l.num_tables, 0);
  for (int64_t f = 0; f < l.num_features; ++f) {
    features[l.feature_table[f]].push_back(f);
    ids_of[l.feature_table[f]] += c.args.offsets[(f + 1) * B] - c.args.offsets[f * B];
  }
  Args args = c.args;
  args.grad_sign = sign.data();
  // Gather tables' groups, one region each, in buffers the calling thread keeps.
  thread_local std::vector<int64_t> starts;
  thread_local std::vector<Entry> entries;
  std::vector<int64_t> gather_tables, start_at(l.num_tables, 0), entry_at(l.num_tables, 0);
  int64_t num_starts = 0, num_entries = 0;
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const int64_t unique = l.unique_offsets[t + 1] - l.unique_offsets[t];
    const bool idle = static_cast<Optim>(optim[t]) == Optim::None && grad_out[t] == nullptr;
    if (unique == 0 || idle || !use_gather(ids_of[t], unique, l.table_dim[t])) continue;
    gather_tables.push_back(t);
    start_at[t] = num_starts;
    entry_at[t] = num_entries;
    num_starts += unique + 1;
    num_entries += ids_of[t];
  }
  int64_t* start_base = reserve_for(starts, num_starts);
  Entry* entry_base = reserve_for(entries, num_entries);
  at::parallel_for(0, static_cast<int64_t>(gather_tables.size()), 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t t = gather_tables[k];
      group_by_row(args, t, features[t], start_base + start_at[t], entry_base + entry_at[t]);
    }
  });
  std::vector<char> gathered(l.num_tables, 0);
  for (const int64_t t : gather_tables) gathered[t] = 1;

  const int64_t threads = at::get_num_threads();
  constexpr int64_t kIdsPerPart = 1 << 16;  // below this, splitting a table costs more than it saves
  std::vector<Part> parts;
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const int64_t lo = l.unique_offsets[t], hi = l.unique_offsets[t + 1];
    const bool idle = static_cast<Optim>(optim[t]) == Optim::None && grad_out[t] == nullptr;
    if (hi == lo || idle) continue;
    const int64_t n = std::max<int64_t>(1, std::min({threads, ids_of[t] / kIdsPerPart, hi - lo}));
    for (int64_t k = 0; k < n; ++k) {
      Part part{t, lo + (hi - lo) * k / n, lo + (hi - lo) * (k + 1) / n, features[t].data(),
                static_cast<int64_t>(features[t].size()), ids_of[t]};
      if (gathered[t]) {
        part.start = start_base + start_at[t];
        part.entries = entry_base + entry_at[t];
        part.ids = ids_of[t] / n;  // a gather part reads only its own rows' ids
      }
      parts.push_back(part);
    }
  }
  // Largest first, taken from a shared counter: a static split of the list would put the parts
  // of one big table on the same thread.
  std::stable_sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) {
    return x.ids + (x.hi - x.lo) > y.ids + (y.hi - y.lo);
  });
  const float* grad = grad_output.const_data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(parts.size());
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    // Accumulators stay with the thread between calls: fresh pages every step would cost more
    // than the sums (first-touch faults).
    thread_local std::vector<float> acc;
    for (int64_t k = next++; k < n; k = next++) {
      const Part& p = parts[k];
      const int64_t t = p.table;
      const int64_t dim = l.table_dim[t];
      if (p.start != nullptr) {
        reserve_for(acc, dim);  // the gather order needs one row of scratch
      } else {
        const int64_t size = (p.hi - p.lo) * dim;
        float* zeroed = reserve_for(acc, size);
        std::fill(zeroed, zeroed + size, 0.0f);
      }
      const auto kind = static_cast<Optim>(optim[t]);
      if (c.rows.scalar_type() == at::kInt) {
        run_part_i32(args, p, c.rows.const_data_ptr<int32_t>(), grad, kind, hparams[t], sign[t],
                     grad_out[t], acc.data());
      } else {
        run_part_i64(args, p, c.rows.const_data_ptr<int64_t>(), grad, kind, hparams[t], sign[t],
                     grad_out[t], acc.data());
      }
    }
  });
}

std::vector<at::Tensor> embedding_bag_unique_grad_cpu(
    const at::Tensor& grad_output, at::TensorList weights, const at::Tensor& unique_values,
    const at::Tensor& unique_offsets, const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size, at::OptionalIntArrayRef feature_columns) {
  constexpr const char* op = "recxla::embedding_bag_unique_grad";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/false);
  emb::check_grad_output(op, grad_output, c.l, feature_columns);
  c.use_layout();
  // Placed by feature_columns, the gradient is read where it lies (check_grad_output checked
  // its strides); otherwise from a contiguous [B, total_dim] copy.
  const at::Tensor grad = feature_columns.has_value() ? grad_output : grad_output.contiguous();
  std::vector<at::Tensor> out;
  std::vector<float*> out_ptrs;
  for (int64_t t = 0; t < c.l.num_tables; ++t) {
    const int64_t n = c.l.unique_offsets[t + 1] - c.l.unique_offsets[t];
    out.push_back(at::empty({n, c.l.table_dim[t]}, grad.options()));
    out_ptrs.push_back(out.back().data_ptr<float>());
  }
  const std::vector<int64_t> optim(c.l.num_tables, static_cast<int64_t>(Optim::None));
  const std::vector<Hparams> hparams(c.l.num_tables, Hparams{0.0f, 0.0f, 0.0f, 1.0f});
  run_backward(op, c, grad, optim.data(), hparams.data(), out_ptrs.data(),
               std::vector<float>(c.l.num_tables, 1.0f));
  return out;
}

void embedding_bag_backward_update_cpu(
    const at::Tensor& grad_output, at::TensorList weights, at::TensorList states,
    const at::Tensor& unique_values, const at::Tensor& unique_offsets, const at::Tensor& inverse,
    const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
    at::IntArrayRef feature_table, at::IntArrayRef pooling, int64_t batch_size,
    at::IntArrayRef optim, at::ArrayRef<double> hparams,
    const std::optional<at::Tensor>& grad_offsets) {
  constexpr const char* op = "recxla::embedding_bag_backward_update";
  Call c(op, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
         feature_table, pooling, batch_size, /*increasing=*/true);
  at::Tensor grad, placed;
  if (grad_offsets.has_value()) {  // read where it lies
    emb::check_grad_offsets(op, grad_output, *grad_offsets, c.l, unique_values.device());
    placed = grad_offsets->contiguous();
    check_grad_offsets_data(op, c, placed.const_data_ptr<int64_t>(), grad_output.numel());
    c.args.grad_offsets = placed.const_data_ptr<int64_t>();
    grad = grad_output;
  } else {
    emb::check_grad_output(op, grad_output, c.l);
    grad = grad_output.contiguous();
  }
  const std::vector<Hparams> h =
      emb::check_optimizer(op, c.l, unique_values.device(), states, optim, hparams);
  for (const at::Tensor& s : states) {
    c.state_ptrs.push_back(s.numel() > 0 && s.scalar_type() == at::kFloat ? s.data_ptr<float>()
                                                                          : nullptr);
  }
  c.args.states = c.state_ptrs.data();
  std::vector<float> sign;
  for (const Hparams& p : h) sign.push_back(p.grad_sign);
  std::vector<float*> no_grad_out(c.l.num_tables, nullptr);
  run_backward(op, c, grad, optim.data(), h.data(), no_grad_out.data(), sign);
}

}  // namespace
}  // namespace emb_cpu

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("embedding_bag_unique_grad", &emb_cpu::embedding_bag_unique_grad_cpu);
  m.impl("embedding_bag_backward_update", &emb_cpu::embedding_bag_backward_update_cpu);
}

}  // namespace recxla
