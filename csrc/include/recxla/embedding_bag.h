// Pooled embedding lookup with a fused sparse optimizer: the per-row math shared by the CPU and
// CUDA kernels (csrc/cpu/embedding_bag.cpp, csrc/cuda/embedding_bag.cu).
//
// A backward step reduces the output gradient of every occurrence of a row into one gradient row
// g[D] and then updates the row in place, once, with one of:
//
//   SGD (torch.optim.SGD, FBGEMM EXACT_SGD):
//     g' = g + wd * w;  w = w + (-lr) * g'
//   Adagrad (torch.optim.Adagrad, FBGEMM EXACT_ADAGRAD), one accumulator per element:
//     g' = g + wd * w;  m = m + g' * g';  w = w + ((-lr) * g') / (sqrt(m) + eps)
//   Row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD, torchrec.optim.RowWiseAdagrad), one
//   accumulator per row:
//     g' = g + wd * w;  m = m + sum_d(g'^2) / D;  multiplier = lr / (sqrt(m) + eps)
//     w = (1 - multiplier * wd) * w - g * multiplier                (FBGEMM's L2 form)
//
// The operation order of each formula is the one of the upstream implementation it names (torch's
// addcmul_/addcdiv_ for SGD and Adagrad, FBGEMM's CPU template for row-wise Adagrad), so results
// agree with theirs to the rounding of the gradient sum. `lr` is the step's learning rate after
// torch's lr_decay; maximize is applied by negating g before the update. Rows that no id of the
// batch touched are not updated at all (FBGEMM's sparse semantics), also with weight decay.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RECXLA_EB_HD __host__ __device__ __forceinline__
#else
#define RECXLA_EB_HD inline __attribute__((always_inline))
#endif

namespace recxla {
namespace emb {

// The optimizer of one table; the values are part of the op schema (`optim` argument).
enum class Optim : int64_t { None = 0, SGD = 1, Adagrad = 2, RowwiseAdagrad = 3 };

// Pooling of one feature; the values are part of the op schema (`feature_mean` argument).
enum class Pooling : int64_t { Sum = 0, Mean = 1 };

// Hyperparameters of one table's update, in the order of the op's `hparams` rows.
struct Hparams {
  float lr;
  float eps;
  float weight_decay;
  float grad_sign;  // -1 when maximizing, else 1
};
constexpr int kNumHparams = 4;

RECXLA_EB_HD float sqrt_f32(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);  // correctly rounded, like std::sqrt and torch's sqrt
#else
  return std::sqrt(x);
#endif
}

// The gradient that enters the update, with L2 weight decay folded in (torch: grad.add(param,
// alpha=weight_decay), i.e. g + (wd * w)).
RECXLA_EB_HD float decayed_grad(float g, float w, const Hparams& h) {
  return h.weight_decay != 0.0f ? g + h.weight_decay * w : g;
}

RECXLA_EB_HD float sgd_update(float w, float g, const Hparams& h) {
  return w + (-h.lr) * decayed_grad(g, w, h);
}

// Returns the new weight; `m` is the element's accumulator, updated in place.
RECXLA_EB_HD float adagrad_update(float w, float g, float& m, const Hparams& h) {
  const float gd = decayed_grad(g, w, h);
  m = m + gd * gd;
  const float std_dev = sqrt_f32(m) + h.eps;
  return w + ((-h.lr) * gd) / std_dev;
}

// Row-wise Adagrad in two halves: the row's mean square (a reduction whose order is the backend's)
// enters `rowwise_multiplier`, then every element takes `rowwise_update`.
RECXLA_EB_HD float rowwise_square(float g, float w, const Hparams& h) {
  const float gd = decayed_grad(g, w, h);
  return gd * gd;
}

// New accumulator of the row (stored by the caller) from the old one and sum_d(g'^2).
RECXLA_EB_HD float rowwise_accumulator(float m, float sum_squares, int64_t dim) {
  return m + sum_squares / static_cast<float>(dim);
}

RECXLA_EB_HD float rowwise_multiplier(float m_new, const Hparams& h) {
  return h.lr / (sqrt_f32(m_new) + h.eps);
}

RECXLA_EB_HD float rowwise_correction(float multiplier, const Hparams& h) {
  return h.weight_decay != 0.0f ? 1.0f - multiplier * h.weight_decay : 1.0f;
}

RECXLA_EB_HD float rowwise_update(float w, float g, float multiplier, float correction) {
  return correction * w - g * multiplier;
}

}  // namespace emb
}  // namespace recxla
