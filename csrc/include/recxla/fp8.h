// FP8 row-wise codec: the per-element math shared by the CPU and CUDA kernels.
//
// Wire format of one row of D values (recxla::row_bytes(D) = D + 4 bytes):
//   [D one-byte codes][fp32 scale, little-endian]
// No padding: D + 4 <= FBGEMM's FloatToFP8RowwiseQuantized row (D rounded up to 4, plus 8).
//
// Encoding (identical in the reference, CPU, CUDA and Triton paths, so codes are bit-identical):
//   amax      = max |x| over the row's finite values (NaN and +-Inf are left out, so one bad
//               value does not wipe out the precision of the rest of its row)
//   inv_scale = amax > 0 ? min(FP8_MAX / amax, FLT_MAX) : 1     (IEEE division)
//   scale     = 1 / inv_scale                                    (IEEE division; stored)
//   code      = fp8(x * inv_scale), round to nearest even, finite values saturate at +-FP8_MAX
//   NaN  -> NaN code; +-Inf -> +-Inf code in e5m2, NaN code in e4m3 (which has no infinity)
// Decoding: value(code) * scale, computed in fp32.
//
// The conversions follow c10's fp8 conversions bit for bit (the integer tricks need no FP8
// hardware and no lookup table), so torch's own `.to(torch.float8_*)` is the reference.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RECXLA_HD __host__ __device__ __forceinline__
#else
#define RECXLA_HD inline __attribute__((always_inline))
#endif

namespace recxla {
namespace fp8 {

enum class Format : int { E4M3 = 0, E5M2 = 1 };

// Largest finite magnitudes, as fp32 values and as fp32 bit patterns.
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr uint32_t kE4M3MaxBits = 0x43E00000u;
constexpr uint32_t kE5M2MaxBits = 0x47600000u;
constexpr float kFloatMax = 3.40282346638528859812e+38f;
constexpr int64_t kScaleBytes = 4;

RECXLA_HD int64_t row_bytes(int64_t dim) { return dim + kScaleBytes; }

RECXLA_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

RECXLA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

RECXLA_HD float max_finite(Format fmt) { return fmt == Format::E4M3 ? kE4M3Max : kE5M2Max; }

// The bits of |x| when x is finite, else 0: one value's contribution to its row's amax. For
// non-negative floats the bit patterns order like the values, so the row maximum is an integer
// maximum, which vectorizes without -ffast-math and treats NaN predictably.
RECXLA_HD uint32_t finite_abs_bits(float x) {
  const uint32_t a = float_bits(x) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? a : 0u;
}

RECXLA_HD float inv_scale_from_amax(float amax, Format fmt) {
  if (!(amax > 0.0f)) return 1.0f;
  const float inv = max_finite(fmt) / amax;
  return inv < kFloatMax ? inv : kFloatMax;
}

RECXLA_HD float scale_from_inv_scale(float inv_scale) { return 1.0f / inv_scale; }

// fp32 -> e4m3fn code: c10::detail::fp8e4m3fn_from_fp32_value with saturation of finite values.
// Written without branches (every candidate is computed, one is selected) so that the CPU loop
// vectorizes and GPU warps do not diverge.
RECXLA_HD uint8_t encode_e4m3(float f) {
  constexpr uint32_t nan_threshold = UINT32_C(1087) << 20;  // 464.0: rounds past 448
  constexpr uint32_t min_normal = UINT32_C(121) << 23;      // 2^-6
  constexpr uint32_t denorm_mask = UINT32_C(141) << 23;
  uint32_t bits = float_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  // Saturate finite values; Inf and NaN keep their bits and become the NaN code below.
  bits = (bits < 0x7F800000u && bits > kE4M3MaxBits) ? kE4M3MaxBits : bits;
  // Subnormal: adding 2^(141-127) makes the FPU round onto the subnormal grid (nearest even).
  const uint32_t subnormal = float_bits(bits_float(bits) + bits_float(denorm_mask)) - denorm_mask;
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  const uint32_t code = bits >= nan_threshold ? 0x7Fu : (bits < min_normal ? subnormal : normal);
  return static_cast<uint8_t>(code | (sign >> 24));
}

// fp32 -> e5m2 code: c10::detail::fp8e5m2_from_fp32_value with saturation of finite values.
RECXLA_HD uint8_t encode_e5m2(float f) {
  constexpr uint32_t overflow_threshold = UINT32_C(143) << 23;  // 65536.0
  constexpr uint32_t min_normal = UINT32_C(113) << 23;          // 2^-14
  constexpr uint32_t denorm_mask = UINT32_C(134) << 23;
  uint32_t bits = float_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  bits = (bits < 0x7F800000u && bits > kE5M2MaxBits) ? kE5M2MaxBits : bits;
  const uint32_t subnormal = float_bits(bits_float(bits) + bits_float(denorm_mask)) - denorm_mask;
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu + ((bits >> 21) & 1u)) >> 21;
  const uint32_t special = bits > 0x7F800000u ? 0x7Fu : 0x7Cu;  // NaN : Inf
  const uint32_t code =
      bits >= overflow_threshold ? special : (bits < min_normal ? subnormal : normal);
  return static_cast<uint8_t>(code | (sign >> 24));
}

// e4m3fn code -> fp32 (exact). The exponent and mantissa bits are placed in an fp32 pattern and
// rescaled by a power of two; fp32 subnormals then cover e4m3 subnormals with no special case.
RECXLA_HD float decode_e4m3(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  if (magnitude == 0x7Fu) return bits_float(sign | 0x7FC00000u);
  const float v = bits_float(magnitude << 20) * 0x1p120f;  // 2^(127 - 7)
  return bits_float(float_bits(v) | sign);
}

RECXLA_HD float decode_e5m2(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  if (magnitude >= 0x7Cu) return bits_float(sign | (magnitude == 0x7Cu ? 0x7F800000u : 0x7FC00000u));
  const float v = bits_float(magnitude << 21) * 0x1p112f;  // 2^(127 - 15)
  return bits_float(float_bits(v) | sign);
}

RECXLA_HD uint8_t encode(float f, Format fmt) {
  return fmt == Format::E4M3 ? encode_e4m3(f) : encode_e5m2(f);
}

RECXLA_HD float decode(uint8_t code, Format fmt) {
  return fmt == Format::E4M3 ? decode_e4m3(code) : decode_e5m2(code);
}

}  // namespace fp8
}  // namespace recxla
