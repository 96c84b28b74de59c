// Pooled embedding lookup over deduplicated ids, and its fused backward, on CUDA.
//
// Forward: one warp per bag (grid-stride over all bags of all features); the lanes stride over
// the row's columns, so every row load is coalesced, and the bag's sum lives in the warp's slice
// of shared memory until it is written once.
// Backward: the ids are grouped by unique row with ATen ops on the current stream (a stable
// argsort of `inverse`, a count and a scan), then one warp per unique row sums its ids'
// output gradients (in id order: deterministic) and updates the row and its optimizer state in
// place: in shared memory one id at a time (variant `warp_per_row`), or in registers with the
// ids read 32 at a time and several gradient rows in flight (`batched_ids`,
// recxla/embedding_update_lanes.h); the family "embedding_update" of recxla/gpu_variants.h picks
// one per architecture, and both give the same bits. A row belongs to one warp, so no atomics
// are needed; row-wise Adagrad reduces the row's squares with warp shuffles.
//
// The per-element math is recxla/embedding_bag.h, shared with the CPU kernel. Shape and dtype
// checks are the host-side ones of the CPU kernel (recxla/embedding_bag_checks.h). The data
// checks (rows in range and strictly increasing, ids inside their table's segment, offsets
// monotone) are not made here: these ops are internal on CUDA, and every public entry
// (recxla.ops.embedding_bag's functions, FusedPooledLookup, recxla.nn) runs
// recxla.ops.embedding_bag_checks on the device first and reads its one flag tensor before a
// kernel launches. A device assert stays on the forward's ids as a last guard.
// The forward and the fused update never wait for the device: unique_offsets stays there, and
// every small host array (the per-call metadata, the optimizer's kinds and hyperparameters) goes
// up from pinned memory without blocking. A blocking copy, or a read of a device value, would
// stall the host until the GPU caught up, and the host could no longer queue work ahead of it.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "recxla/embedding_bag.h"
#include "recxla/embedding_bag_checks.h"
#include "recxla/embedding_update_lanes.h"
#include "recxla/gpu_variants.h"

namespace recxla {
namespace {

using emb::Hparams;
using emb::Layout;
using emb::Optim;

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarp * kWarpsPerBlock;
constexpr int64_t kMaxSharedBytes = 48 * 1024;
// The index of "batched_ids" among the family "embedding_update"'s variants
// (csrc/gpu_variants.cpp); every other index runs "warp_per_row".
constexpr int kBatchedIds = 1;

// Per-call metadata, one int64 array on the device:
//   [feature_table F][feature_column F][table_dim T][pooling T][weights T][states T][grad_out T]
// (the last three are pointers); unique_offsets points at the caller's device tensor.
struct Meta {
  const int64_t* feature_table;
  const int64_t* feature_column;
  const int64_t* table_dim;
  const int64_t* pooling;
  const int64_t* unique_offsets;
  const int64_t* weights;
  const int64_t* states;
  const int64_t* grad_out;
  int64_t num_tables;
};

struct DeviceMeta {
  at::Tensor storage;
  at::Tensor unique_offsets;  // kept alive with the metadata that points into it
  Meta meta;
};

// A small host array on `device`, copied from pinned memory without blocking the host (the
// caching host allocator keeps the pinned block until the copy has run).
template <typename T>
at::Tensor upload(const std::vector<T>& host, at::ScalarType dtype, const at::Device& device) {
  return at::tensor(host, at::TensorOptions().dtype(dtype))
      .pin_memory()
      .to(at::TensorOptions().device(device), /*non_blocking=*/true);
}

DeviceMeta make_meta(
    const Layout& l, const at::Tensor& unique_offsets, at::TensorList weights,
    at::TensorList states, const std::vector<at::Tensor>& grad_out, const at::Device& device) {
  const int64_t F = l.num_features, T = l.num_tables;
  std::vector<int64_t> host;
  host.insert(host.end(), l.feature_table.begin(), l.feature_table.end());
  host.insert(host.end(), l.feature_column.begin(), l.feature_column.end());
  host.insert(host.end(), l.table_dim.begin(), l.table_dim.end());
  host.insert(host.end(), l.pooling.begin(), l.pooling.end());
  for (int64_t t = 0; t < T; ++t) host.push_back(reinterpret_cast<int64_t>(weights[t].data_ptr()));
  for (int64_t t = 0; t < T; ++t) {
    const bool has = static_cast<int64_t>(states.size()) > t && states[t].numel() > 0;
    host.push_back(has ? reinterpret_cast<int64_t>(states[t].data_ptr()) : 0);
  }
  for (int64_t t = 0; t < T; ++t) {
    const bool has = static_cast<int64_t>(grad_out.size()) > t && grad_out[t].numel() > 0;
    host.push_back(has ? reinterpret_cast<int64_t>(grad_out[t].data_ptr()) : 0);
  }
  host.push_back(0);  // never empty
  DeviceMeta m;
  m.storage = upload(host, at::kLong, device);
  m.unique_offsets = unique_offsets.contiguous();
  const int64_t* p = m.storage.const_data_ptr<int64_t>();
  m.meta = Meta{p, p + F, p + 2 * F, p + 2 * F + T, m.unique_offsets.const_data_ptr<int64_t>(),
                p + 2 * F + 2 * T, p + 2 * F + 3 * T, p + 2 * F + 4 * T, T};
  return m;
}

int64_t max_dim(const Layout& l) {
  int64_t d = 1;
  for (int64_t x : l.table_dim) d = std::max(d, x);
  return d;
}

int blocks_for(int64_t warps) {
  const int64_t wanted = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t cap =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
}

template <typename index_t>
__global__ void forward_kernel(
    Meta m, const index_t* __restrict__ rows, const int64_t* __restrict__ inverse,
    const int64_t* __restrict__ offsets, const float* __restrict__ psw, int64_t bags,
    int64_t batch_size, int64_t row_stride, int64_t smem_dim, float* __restrict__ out) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  float* acc = smem + warp * smem_dim;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; k < bags; k += warps) {
    const int64_t f = k / batch_size, b = k - f * batch_size;
    const int64_t t = m.feature_table[f], dim = m.table_dim[t];
    const int64_t lo = m.unique_offsets[t], hi = m.unique_offsets[t + 1];
    const float* w = reinterpret_cast<const float*>(m.weights[t]);
    for (int64_t d = lane; d < dim; d += kWarp) acc[d] = 0.0f;
    const int64_t first = offsets[k], last = offsets[k + 1];
    for (int64_t i = first; i < last; ++i) {
      const int64_t u = inverse[i];
      CUDA_KERNEL_ASSERT(u >= lo && u < hi);
      const float* row = w + static_cast<int64_t>(rows[u]) * dim;
      const float s = psw != nullptr ? psw[i] : 1.0f;
      for (int64_t d = lane; d < dim; d += kWarp) {
        acc[d] = psw != nullptr ? acc[d] + s * __ldg(row + d) : acc[d] + __ldg(row + d);
      }
    }
    const bool mean = m.pooling[t] == static_cast<int64_t>(emb::Pooling::Mean) && last > first;
    const float inv_len = mean ? 1.0f / static_cast<float>(last - first) : 1.0f;
    float* o = out + b * row_stride + m.feature_column[f];
    for (int64_t d = lane; d < dim; d += kWarp) o[d] = mean ? acc[d] * inv_len : acc[d];
    __syncwarp();
  }
}

// What a warp of the fused update needs to know about unique row u's table.
struct RowTable {
  int64_t t;
  Optim kind;
  float* grad_out;  // Optim::None: the table's gradient output (nullptr: nothing to do)
  int64_t dim;
};

__device__ __forceinline__ RowTable row_table(const Meta& m, const int64_t* optim, int64_t u) {
  int64_t t = 0;  // the table whose segment holds u (few tables: a linear scan)
  while (t + 1 < m.num_tables && m.unique_offsets[t + 1] <= u) ++t;
  return RowTable{t, static_cast<Optim>(optim[t]), reinterpret_cast<float*>(m.grad_out[t]),
                  m.table_dim[t]};
}

template <typename index_t>
__global__ void update_kernel(
    Meta m, const index_t* __restrict__ rows, const int64_t* __restrict__ start,
    const int64_t* __restrict__ grad_offset, const float* __restrict__ scale,
    const float* __restrict__ grad, const int64_t* __restrict__ optim,
    const float* __restrict__ hparams, int64_t num_unique, int64_t smem_dim) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  float* g = smem + warp * smem_dim;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; u < num_unique;
       u += warps) {
    const RowTable rt = row_table(m, optim, u);
    if (rt.kind == Optim::None && rt.grad_out == nullptr) continue;
    const int64_t t = rt.t, dim = rt.dim;
    const Optim kind = rt.kind;
    float* grad_out = rt.grad_out;
    for (int64_t d = lane; d < dim; d += kWarp) g[d] = 0.0f;
    for (int64_t e = start[u]; e < start[u + 1]; ++e) {
      const float* src = grad + grad_offset[e];
      const float s = scale[e];
      for (int64_t d = lane; d < dim; d += kWarp) g[d] = g[d] + s * __ldg(src + d);
    }
    const Hparams h{hparams[4 * t], hparams[4 * t + 1], hparams[4 * t + 2], hparams[4 * t + 3]};
    const int64_t r = rows[u];
    float* row = reinterpret_cast<float*>(m.weights[t]) + r * dim;
    float* state = reinterpret_cast<float*>(m.states[t]);
    if (kind == Optim::None) {
      for (int64_t d = lane; d < dim; d += kWarp) grad_out[(u - m.unique_offsets[t]) * dim + d] = g[d];
    } else if (kind == Optim::SGD) {
      for (int64_t d = lane; d < dim; d += kWarp) row[d] = emb::sgd_update(row[d], g[d], h);
    } else if (kind == Optim::Adagrad) {
      float* mom = state + r * dim;
      for (int64_t d = lane; d < dim; d += kWarp) row[d] = emb::adagrad_update(row[d], g[d], mom[d], h);
    } else {
      float squares = 0.0f;
      for (int64_t d = lane; d < dim; d += kWarp) squares += emb::rowwise_square(g[d], row[d], h);
      for (int offset = kWarp / 2; offset > 0; offset /= 2) {
        squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
      }
      const float m_new = emb::rowwise_accumulator(state[r], squares, dim);
      __syncwarp();
      if (lane == 0) state[r] = m_new;
      const float mult = emb::rowwise_multiplier(m_new, h);
      const float corr = emb::rowwise_correction(mult, h);
      for (int64_t d = lane; d < dim; d += kWarp) row[d] = emb::rowwise_update(row[d], g[d], mult, corr);
    }
    __syncwarp();
  }
}

// The `batched_ids` variant of update_kernel (recxla/embedding_update_lanes.h says why): the same
// rows, sums and updates, with the ids' offsets and scales read 32 at a time and kAhead gradient
// rows in flight per lane. Needs every table's dim <= lanes::kWarp * lanes::kMaxPerLane.
template <typename index_t>
__global__ void update_kernel_batched_ids(
    Meta m, const index_t* __restrict__ rows, const int64_t* __restrict__ start,
    const int64_t* __restrict__ grad_offset, const float* __restrict__ scale,
    const float* __restrict__ grad, const int64_t* __restrict__ optim,
    const float* __restrict__ hparams, int64_t num_unique) {
  namespace ln = emb::lanes;
  static_assert(ln::kWarp == kWarp, "the lane code's warp is the launch's");
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; u < num_unique;
       u += warps) {
    const auto [t, kind, grad_out, dim] = row_table(m, optim, u);
    if (kind == Optim::None && grad_out == nullptr) continue;
    ln::RowGradLane sum;
    sum.zero();
    const int64_t first = start[u], last = start[u + 1];
    for (int64_t base = first; base < last; base += kWarp) {
      const int n = static_cast<int>(last - base < kWarp ? last - base : kWarp);
      const int64_t my_offset = lane < n ? grad_offset[base + lane] : 0;
      const float my_scale = lane < n ? scale[base + lane] : 0.0f;
      for (int j = 0; j < n; j += ln::kAhead) {
        const float* src[ln::kAhead];
        float s[ln::kAhead];
#pragma unroll
        for (int q = 0; q < ln::kAhead; ++q) {
          // Every lane takes part in every shuffle; lanes past n hold offset 0 and scale 0.
          const int from = j + q < n ? j + q : 0;
          src[q] = grad + __shfl_sync(0xFFFFFFFFu, my_offset, from);
          s[q] = __shfl_sync(0xFFFFFFFFu, my_scale, from);
        }
        sum.add(src, s, n - j < ln::kAhead ? n - j : ln::kAhead, lane, dim);
      }
    }
    const Hparams h{hparams[4 * t], hparams[4 * t + 1], hparams[4 * t + 2], hparams[4 * t + 3]};
    const int64_t r = rows[u];
    float* row = reinterpret_cast<float*>(m.weights[t]) + r * dim;
    float* state = reinterpret_cast<float*>(m.states[t]);
    float m_new = 0.0f;
    if (kind == Optim::RowwiseAdagrad) {
      float squares = sum.squares(row, h, lane, dim);
      for (int offset = kWarp / 2; offset > 0; offset /= 2) {
        squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
      }
      m_new = emb::rowwise_accumulator(state[r], squares, dim);
      __syncwarp();
      if (lane == 0) state[r] = m_new;
    }
    float* grad_row = kind == Optim::None ? grad_out + (u - m.unique_offsets[t]) * dim : nullptr;
    sum.apply(kind, h, row, state, r, grad_row, m_new, lane, dim);
    __syncwarp();
  }
}

int64_t shared_dim(const char* op, const Layout& l) {
  const int64_t dim = max_dim(l);
  TORCH_CHECK_VALUE(dim * kWarpsPerBlock * static_cast<int64_t>(sizeof(float)) <= kMaxSharedBytes,
                    op, ": CUDA kernels support embedding dims up to ",
                    kMaxSharedBytes / (kWarpsPerBlock * sizeof(float)), ", got ", dim);
  return dim;
}

void forward_into(const char* op, const Layout& l, at::TensorList weights,
                  const at::Tensor& unique_values, const at::Tensor& unique_offsets,
                  const at::Tensor& inverse, const at::Tensor& offsets,
                  const std::optional<at::Tensor>& per_sample_weights, at::Tensor& out) {
  const int64_t bags = l.num_features * l.batch_size;
  if (out.numel() == 0) return;
  const int64_t smem_dim = shared_dim(op, l);
  const DeviceMeta meta = make_meta(l, unique_offsets, weights, {}, {}, unique_values.device());
  const at::Tensor rows = unique_values.contiguous(), inv = inverse.contiguous();
  const at::Tensor offs = offsets.contiguous();
  const at::Tensor psw = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const size_t smem = smem_dim * kWarpsPerBlock * sizeof(float);
  AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_forward_cuda", [&] {
    forward_kernel<index_t><<<blocks_for(bags), kThreads, smem, stream>>>(
        meta.meta, rows.const_data_ptr<index_t>(), inv.const_data_ptr<int64_t>(),
        offs.const_data_ptr<int64_t>(), psw.defined() ? psw.const_data_ptr<float>() : nullptr,
        bags, l.batch_size, l.row_stride, smem_dim, out.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor embedding_bag_forward_cuda(
    at::TensorList weights, const at::Tensor& unique_values, const at::Tensor& unique_offsets,
    const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size) {
  constexpr const char* op = "recxla::embedding_bag_forward";
  const Layout l = emb::check_layout(op, weights, unique_values, unique_offsets, inverse, offsets,
                                     per_sample_weights, feature_table, pooling, batch_size,
                                     /*read_unique_offsets=*/false);
  const c10::cuda::CUDAGuard guard(unique_values.device());
  at::Tensor out = at::empty({batch_size, l.total_dim}, unique_values.options().dtype(at::kFloat));
  forward_into(op, l, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
               out);
  return out;
}

void embedding_bag_forward_out_cuda(
    at::TensorList weights, const at::Tensor& unique_values, const at::Tensor& unique_offsets,
    const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size, at::Tensor& out,
    at::OptionalIntArrayRef feature_columns) {
  constexpr const char* op = "recxla::embedding_bag_forward_out";
  Layout l = emb::check_layout(op, weights, unique_values, unique_offsets, inverse, offsets,
                               per_sample_weights, feature_table, pooling, batch_size,
                               /*read_unique_offsets=*/false);
  emb::check_forward_out(op, out, l, unique_values.device(), feature_columns);
  const c10::cuda::CUDAGuard guard(unique_values.device());
  forward_into(op, l, weights, unique_values, unique_offsets, inverse, offsets, per_sample_weights,
               out);
}

// The ids of every unique row (start [U + 1], grad_offset [N], scale [N]), in ATen ops; the
// same CSR as the CPU kernel's IdsByRow, with the same scale rounding (sign x 1/len, then x psw).
// grad_offsets (defined: int64 [F * B]): where each bag's gradient row starts, instead of the
// layout's rows and columns.
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_ids(
    const Layout& l, const at::Tensor& inverse, const at::Tensor& offsets, const at::Tensor& psw,
    const std::vector<float>& sign, const at::Tensor& grad_offsets) {
  const auto dev = inverse.device();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  const int64_t B = std::max<int64_t>(l.batch_size, 1);
  const at::Tensor lengths = offsets.slice(0, 1) - offsets.slice(0, 0, -1);
  const at::Tensor bag = at::repeat_interleave(at::arange(lengths.numel(), i64), lengths, 0,
                                               inverse.numel());
  const at::Tensor feature = at::floor_divide(bag, B);
  at::Tensor grad_offset;
  if (grad_offsets.defined()) {
    grad_offset = grad_offsets.index_select(0, bag);
  } else {
    const at::Tensor column = upload(l.feature_column, at::kLong, dev).index_select(0, feature);
    grad_offset = (bag - feature * B) * l.row_stride + column;
  }
  std::vector<float> feature_sign;
  std::vector<uint8_t> feature_mean;
  for (int64_t f = 0; f < l.num_features; ++f) {
    feature_sign.push_back(sign[l.feature_table[f]]);
    feature_mean.push_back(l.pooling[l.feature_table[f]] == 1);
  }
  const at::Tensor fsign = upload(feature_sign, at::kFloat, dev).index_select(0, feature);
  const at::Tensor fmean = upload(feature_mean, at::kByte, dev).index_select(0, feature);
  const at::Tensor inv_len = at::reciprocal(lengths.index_select(0, bag).to(at::kFloat));
  at::Tensor scale = at::where(fmean.to(at::kBool), fsign * inv_len, fsign);
  if (psw.defined()) scale = psw * scale;
  const at::Tensor order = std::get<1>(at::sort(inverse, /*stable=*/true, 0, false));
  at::Tensor start = at::zeros({l.num_unique + 1}, i64);
  // Ids per unique row by index_add (bincount would read the largest id back to the host).
  if (l.num_ids > 0) {
    at::Tensor count = at::zeros({l.num_unique}, i64).index_add_(0, inverse, at::ones_like(inverse));
    start.slice(0, 1).copy_(at::cumsum(count, 0));
  }
  return {start, grad_offset.index_select(0, order), scale.index_select(0, order)};
}

void run_update(
    const char* op, const Layout& l, at::TensorList weights, at::TensorList states,
    const std::vector<at::Tensor>& grad_out, const at::Tensor& grad_output,
    const at::Tensor& unique_values, const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, const std::vector<int64_t>& optim,
    const std::vector<Hparams>& h, const at::Tensor& unique_offsets, bool read_in_place,
    const at::Tensor& grad_offsets = at::Tensor()) {
  if (l.num_unique == 0) return;
  const int64_t smem_dim = shared_dim(op, l);
  const auto dev = unique_values.device();
  std::vector<float> sign, hp;
  for (const Hparams& p : h) {
    sign.push_back(p.grad_sign);
    hp.insert(hp.end(), {p.lr, p.eps, p.weight_decay, p.grad_sign});
  }
  const at::Tensor psw = per_sample_weights.has_value() ? per_sample_weights->contiguous() : at::Tensor();
  const auto ids = group_ids(l, inverse.contiguous(), offsets.contiguous(), psw, sign,
                             grad_offsets.defined() ? grad_offsets.contiguous() : grad_offsets);
  const at::Tensor& start = std::get<0>(ids);
  const at::Tensor& grad_offset = std::get<1>(ids);
  const at::Tensor& scale = std::get<2>(ids);
  const DeviceMeta meta = make_meta(l, unique_offsets, weights, states, grad_out, dev);
  const at::Tensor optim_d = upload(optim, at::kLong, dev);
  const at::Tensor hp_d = upload(hp, at::kFloat, dev);
  // read_in_place: the gradient's layout was placed by feature_columns (strides checked) or by
  // grad_offsets (contiguous, checked).
  const at::Tensor rows = unique_values.contiguous();
  const at::Tensor grad = read_in_place ? grad_output : grad_output.contiguous();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const bool batched = gpu_variants::chosen("embedding_update", 10 * props->major + props->minor) ==
                           kBatchedIds &&
                       emb::lanes::fits(smem_dim);
  if (batched) {
    AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_update_cuda", [&] {
      update_kernel_batched_ids<index_t><<<blocks_for(l.num_unique), kThreads, 0, stream>>>(
          meta.meta, rows.const_data_ptr<index_t>(), start.const_data_ptr<int64_t>(),
          grad_offset.const_data_ptr<int64_t>(), scale.const_data_ptr<float>(),
          grad.const_data_ptr<float>(), optim_d.const_data_ptr<int64_t>(),
          hp_d.const_data_ptr<float>(), l.num_unique);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const size_t smem = smem_dim * kWarpsPerBlock * sizeof(float);
  AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_update_cuda", [&] {
    update_kernel<index_t><<<blocks_for(l.num_unique), kThreads, smem, stream>>>(
        meta.meta, rows.const_data_ptr<index_t>(), start.const_data_ptr<int64_t>(),
        grad_offset.const_data_ptr<int64_t>(), scale.const_data_ptr<float>(),
        grad.const_data_ptr<float>(), optim_d.const_data_ptr<int64_t>(),
        hp_d.const_data_ptr<float>(), l.num_unique, smem_dim);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<at::Tensor> embedding_bag_unique_grad_cuda(
    const at::Tensor& grad_output, at::TensorList weights, const at::Tensor& unique_values,
    const at::Tensor& unique_offsets, const at::Tensor& inverse, const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef pooling, int64_t batch_size, at::OptionalIntArrayRef feature_columns) {
  constexpr const char* op = "recxla::embedding_bag_unique_grad";
  Layout l = emb::check_layout(op, weights, unique_values, unique_offsets, inverse, offsets,
                               per_sample_weights, feature_table, pooling, batch_size);
  emb::check_grad_output(op, grad_output, l, feature_columns);
  const c10::cuda::CUDAGuard guard(unique_values.device());
  std::vector<at::Tensor> out;
  for (int64_t t = 0; t < l.num_tables; ++t) {
    const int64_t n = l.unique_offsets[t + 1] - l.unique_offsets[t];
    out.push_back(at::zeros({n, l.table_dim[t]}, grad_output.options()));
  }
  const std::vector<int64_t> optim(l.num_tables, static_cast<int64_t>(Optim::None));
  const std::vector<Hparams> h(l.num_tables, Hparams{0.0f, 0.0f, 0.0f, 1.0f});
  run_update(op, l, weights, {}, out, grad_output, unique_values, inverse, offsets,
             per_sample_weights, optim, h, unique_offsets, feature_columns.has_value());
  return out;
}

void embedding_bag_backward_update_cuda(
    const at::Tensor& grad_output, at::TensorList weights, at::TensorList states,
    const at::Tensor& unique_values, const at::Tensor& unique_offsets, const at::Tensor& inverse,
    const at::Tensor& offsets, const std::optional<at::Tensor>& per_sample_weights,
    at::IntArrayRef feature_table, at::IntArrayRef pooling, int64_t batch_size,
    at::IntArrayRef optim, at::ArrayRef<double> hparams,
    const std::optional<at::Tensor>& grad_offsets) {
  constexpr const char* op = "recxla::embedding_bag_backward_update";
  Layout l = emb::check_layout(op, weights, unique_values, unique_offsets, inverse, offsets,
                               per_sample_weights, feature_table, pooling, batch_size,
                               /*read_unique_offsets=*/false);
  if (grad_offsets.has_value()) {
    emb::check_grad_offsets(op, grad_output, *grad_offsets, l, unique_values.device());
  } else {
    emb::check_grad_output(op, grad_output, l);
  }
  const std::vector<Hparams> h =
      emb::check_optimizer(op, l, unique_values.device(), states, optim, hparams);
  const c10::cuda::CUDAGuard guard(unique_values.device());
  run_update(op, l, weights, states, {}, grad_output, unique_values, inverse, offsets,
             per_sample_weights, std::vector<int64_t>(optim.begin(), optim.end()), h,
             unique_offsets, /*read_in_place=*/grad_offsets.has_value(),
             grad_offsets.has_value() ? *grad_offsets : at::Tensor());
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CUDA, m) {
  m.impl("embedding_bag_forward", &embedding_bag_forward_cuda);
  m.impl("embedding_bag_forward_out", &embedding_bag_forward_out_cuda);
  m.impl("embedding_bag_unique_grad", &embedding_bag_unique_grad_cuda);
  m.impl("embedding_bag_backward_update", &embedding_bag_backward_update_cuda);
}

}  // namespace recxla
