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
//   NaN  -> NaN code with the NaN's sign (scale_value: a GPU's multiply would drop it);
//   +-Inf -> +-Inf code in e5m2, +-NaN code in e4m3 (which has no infinity)
// Decoding: value(code) * scale, computed in fp32.
//
// The conversions agree bit for bit with c10's fp8 conversions (torch's `.to(torch.float8_*)`, the
// reference), checked on all 2^32 fp32 inputs; they need no FP8 hardware and no lookup table. They
// assume IEEE fp32 with subnormals (no flush-to-zero), the default of every backend here.
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
// maximum, which vectorizes without -ffast-math and treats NaN predictably. (A mask rather than a
// select: GCC 12 does not vectorize a max reduction fed by a select.)
RECXLA_HD uint32_t finite_abs_bits(float x) {
  const uint32_t a = float_bits(x) & 0x7FFFFFFFu;
  return a & (0u - static_cast<uint32_t>(a < 0x7F800000u));
}

RECXLA_HD float inv_scale_from_amax(float amax, Format fmt) {
  if (!(amax > 0.0f)) return 1.0f;
  const float inv = max_finite(fmt) / amax;
  return inv < kFloatMax ? inv : kFloatMax;
}

RECXLA_HD float scale_from_inv_scale(float inv_scale) { return 1.0f / inv_scale; }

// Per-format constants of the encoder. Normal FP8 values with unbiased exponent E (>= 1 - bias)
// are 2^(E - kMantissaBits) apart; subnormals keep the spacing of the smallest normal binade.
template <Format F>
struct Traits;
template <>
struct Traits<Format::E4M3> {
  static constexpr uint32_t kMantissaBits = 3;
  static constexpr uint32_t kBias = 7;
  static constexpr uint32_t kMaxBits = kE4M3MaxBits;
  static constexpr uint32_t kInfCode = 0x7Fu;  // e4m3fn has no infinity: Inf becomes NaN
  static constexpr uint32_t kNanCode = 0x7Fu;
};
template <>
struct Traits<Format::E5M2> {
  static constexpr uint32_t kMantissaBits = 2;
  static constexpr uint32_t kBias = 15;
  static constexpr uint32_t kMaxBits = kE5M2MaxBits;
  static constexpr uint32_t kInfCode = 0x7Cu;
  static constexpr uint32_t kNanCode = 0x7Fu;
};

// fp32 bits of the smallest normal FP8 magnitude, 2^(1 - bias).
template <Format F>
constexpr uint32_t kMinNormalBits = (128u - Traits<F>::kBias) << 23;

// Rounding to FP8 is one fp32 addition. For a magnitude v whose FP8 spacing is q = 2^(E - M)
// (E clamped to the smallest normal exponent), the anchor is A = 2^(E + 23 - M): the fp32 spacing
// at A is exactly q, and v < 2^(E + 1) keeps v + A inside A's binade, so the FPU's
// round-to-nearest-even of v + A rounds v onto the FP8 grid, normals and subnormals alike, carry
// into the next exponent included. The sum's bits minus A's bits count the multiples of q in the
// rounded value. `a` is the fp32 bit pattern of a finite magnitude <= the format's maximum.
template <Format F>
RECXLA_HD uint32_t anchor_bits(uint32_t a) {
  constexpr uint32_t min_normal = kMinNormalBits<F>;
  return ((a > min_normal ? a : min_normal) & 0x7F800000u) +
         ((23u - Traits<F>::kMantissaBits) << 23);
}

// What to subtract from bits(v + A) to get the FP8 code of v: A's own bits, minus the FP8 exponent
// field of A's binade. It depends on A alone, so a vector kernel may tabulate it per exponent.
template <Format F>
RECXLA_HD uint32_t code_offset(uint32_t anchor) {
  constexpr uint32_t m = Traits<F>::kMantissaBits;
  // code = (multiples of q) + ((E + bias) << M) - (1 << M), the implicit leading one removed;
  // (anchor >> (23 - M)) = (E + 23 - M + 127) << M.
  constexpr uint32_t k = ((23u - m + 127u - Traits<F>::kBias) << m) + (1u << m);
  return anchor - (anchor >> (23u - m)) + k;
}

// fp32 -> FP8 code, bit-identical to c10's fp8e4m3fn / fp8e5m2 conversions (round to nearest
// even) except that finite values saturate at +-max instead of becoming NaN / Inf. Branch-free:
// every candidate is computed and one selected, so CPU loops vectorize and warps do not diverge.
template <Format F>
RECXLA_HD uint8_t encode(float f) {
  const uint32_t bits = float_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits ^ sign;
  const uint32_t clamped = a < Traits<F>::kMaxBits ? a : Traits<F>::kMaxBits;
  const uint32_t anchor = anchor_bits<F>(clamped);
  const uint32_t code =
      float_bits(bits_float(clamped) + bits_float(anchor)) - code_offset<F>(anchor);
  const uint32_t special = a > 0x7F800000u ? Traits<F>::kNanCode : Traits<F>::kInfCode;
  return static_cast<uint8_t>((a >= 0x7F800000u ? special : code) | (sign >> 24));
}

RECXLA_HD uint8_t encode_e4m3(float f) { return encode<Format::E4M3>(f); }
RECXLA_HD uint8_t encode_e5m2(float f) { return encode<Format::E5M2>(f); }

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
  if (magnitude >= 0x7Cu) {
    return bits_float(sign | (magnitude == 0x7Cu ? 0x7F800000u : 0x7FC00000u));
  }
  const float v = bits_float(magnitude << 21) * 0x1p112f;  // 2^(127 - 15)
  return bits_float(float_bits(v) | sign);
}

RECXLA_HD uint8_t encode(float f, Format fmt) {
  return fmt == Format::E4M3 ? encode_e4m3(f) : encode_e5m2(f);
}

RECXLA_HD float decode(uint8_t code, Format fmt) {
  return fmt == Format::E4M3 ? decode_e4m3(code) : decode_e5m2(code);
}

// ---------------------------------------------------------------- four codes at once
// The vector kernels (recxla/fp8_vector.h) move codes as 4-byte words: byte j of a word (bits
// 8j .. 8j + 7, little-endian) is the code of the word's element j, the byte at the lower address.

// a * b rounded once: __fmul_rn on the GPU, which nvcc never contracts with a later addition into
// an FMA (a plain `*` may be, where --fmad=false is not given); the CPU builds use
// -ffp-contract=off, so a plain product rounds the same way there.
RECXLA_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// x * inv_scale as the encoder takes it: a NaN x passes unscaled. inv_scale is finite and > 0,
// so the product of a NaN is a NaN either way, but not the same one: a CPU returns the operand
// (its sign kept, as c10's casts keep it in the code), a GPU a canonical positive NaN.
RECXLA_HD float scale_value(float x, float inv_scale) {
  return x != x ? x : mul_rn(x, inv_scale);
}

template <Format F>
RECXLA_HD float decode(uint8_t code) {
  return F == Format::E4M3 ? decode_e4m3(code) : decode_e5m2(code);
}

// The codes of v[0..3] * inv_scale, packed into one word: what encode<F>(scale_value(v[j],
// inv_scale)) gives element by element.
template <Format F>
RECXLA_HD uint32_t encode_word(const float (&v)[4], float inv_scale) {
  uint32_t word = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < 4; ++j) {
    word |= static_cast<uint32_t>(encode<F>(scale_value(v[j], inv_scale))) << (8 * j);
  }
  return word;
}

// decode<F>(code) with the special codes selected rather than branched to: the GPU then runs the
// same instructions for every code (nvcc keeps decode_e4m3's early return as a branch per value).
template <Format F>
RECXLA_HD float decode_select(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  uint32_t bits;
  if constexpr (F == Format::E4M3) {
    const uint32_t finite = float_bits(bits_float(magnitude << 20) * 0x1p120f);
    bits = magnitude == 0x7Fu ? 0x7FC00000u : finite;
  } else {
    const uint32_t finite = float_bits(bits_float(magnitude << 21) * 0x1p112f);
    const uint32_t special = magnitude == 0x7Cu ? 0x7F800000u : 0x7FC00000u;
    bits = magnitude >= 0x7Cu ? special : finite;
  }
  return bits_float(bits | sign);
}

// The four values of a word of codes times the row's scale, in fp32: what decode<F>(code) * scale
// gives code by code.
template <Format F>
RECXLA_HD void decode_word(uint32_t word, float scale, float (&out)[4]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < 4; ++j) {
    out[j] = mul_rn(decode_select<F>(static_cast<uint8_t>(word >> (8 * j))), scale);
  }
}

}  // namespace fp8
}  // namespace recxla
