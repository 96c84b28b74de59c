// FP8 row-wise quantize / dequantize: the AVX-512 row kernels (F, BW, VL), written with
// intrinsics because GCC's auto-vectorized version of the same loops runs at about half this
// speed (it derives the rounding anchor per element and narrows bytes one vector at a time).
//
// Every lane computes exactly what recxla/fp8.h computes for one element, so codes and values are
// bit-identical with the portable kernels, the CUDA and Triton kernels and the reference:
// - encode: |v| + anchor in fp32 rounds v onto the FP8 grid; the anchor and the code offset depend
//   only on v's (clamped) exponent, so they come from two 32-entry tables built from
//   fp8::anchor_bits / fp8::code_offset and looked up with one permute each;
// - decode: the code's bits placed in an fp32 pattern and rescaled by a power of two.
// The functions carry a target attribute instead of the file being compiled with -mavx512*, so
// the library still loads on CPUs without AVX-512; fp8_rows.cpp calls them only when
// have_avx512_fp8() says the CPU has it.
#include "fp8_rows_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECXLA_HAVE_AVX512_KERNELS 1
#include <immintrin.h>
#define RECXLA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
// GCC 12 reports the deliberately undefined source vectors inside avx512fintrin.h's shifts and
// extracts (`__m512i __Y = __Y;`) as (maybe-)uninitialized wherever they are inlined: false
// positives.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace recxla {
namespace cpu {

#ifdef RECXLA_HAVE_AVX512_KERNELS

using fp8::Format;

bool have_avx512_fp8() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return has;
}

namespace {

// Mask of the first `n` lanes of 16 (n <= 16).
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
}

// 16 consecutive values as fp32 (an exact widening); with a mask `k`, lanes outside it read as
// +0 and their memory is not touched. Loops run whole vectors unmasked and mask only the row's
// tail: a mask costs a uop on the port the permutes and conversions need.
RECXLA_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
RECXLA_AVX512 inline __m512 load16(const float* p, __mmask16 k) {
  return _mm512_maskz_loadu_ps(k, p);
}
RECXLA_AVX512 inline __m512 bf16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
RECXLA_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  return bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
RECXLA_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 k) {
  return bf16_to_f32(_mm256_maskz_loadu_epi16(k, p));
}
RECXLA_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
RECXLA_AVX512 inline __m512 load16(const c10::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// Stores the lanes of `k` as the output dtype, rounded to nearest even like c10's conversions
// (float -> BFloat16: NaN becomes 0x7FC0; float -> Half: NaN keeps its sign, payload 0x200).
RECXLA_AVX512 inline __m512i f32_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i h =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF)), 16);
  return _mm512_mask_mov_epi32(
      h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
RECXLA_AVX512 inline __m256i f32_to_f16(__m512 v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
RECXLA_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
RECXLA_AVX512 inline void store16(float* p, __mmask16 k, __m512 v) {
  _mm512_mask_storeu_ps(p, k, v);
}
RECXLA_AVX512 inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(f32_to_bf16(v)));
}
RECXLA_AVX512 inline void store16(c10::BFloat16* p, __mmask16 k, __m512 v) {
  _mm512_mask_cvtepi32_storeu_epi16(p, k, f32_to_bf16(v));
}
RECXLA_AVX512 inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_f16(v));
}
RECXLA_AVX512 inline void store16(c10::Half* p, __mmask16 k, __m512 v) {
  _mm256_mask_storeu_epi16(p, k, f32_to_f16(v));
}
// Non-temporal stores of 16 values to a 64-byte (fp32) or 32-byte (16-bit) aligned address: the
// line goes to memory without being read first (no read-for-ownership), which saves a third of a
// large dequantize's memory traffic.
RECXLA_AVX512 inline void stream16(float* p, __m512 v) { _mm512_stream_ps(p, v); }
RECXLA_AVX512 inline void stream16(c10::BFloat16* p, __m512 v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(f32_to_bf16(v)));
}
RECXLA_AVX512 inline void stream16(c10::Half* p, __m512 v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), f32_to_f16(v));
}

// The anchor and code offset of fp8.h for every clamped fp32 exponent a row can reach, in slot
// (biased exponent mod 32): e4m3 needs exponents 121..135 and e5m2 113..142 (15 and 30 slots),
// plus slot 31 (exponent 255, Inf and NaN), whose code the special-value path overwrites.
template <Format F>
struct EncodeTables {
  alignas(64) uint32_t anchor[32];
  alignas(64) uint32_t offset[32];
  EncodeTables() {
    constexpr uint32_t min_exp = fp8::kMinNormalBits<F> >> 23;
    for (uint32_t e = 0; e < 32; ++e) {
      // The exponent >= min_exp that lands in slot e (slot 31 also serves exponent 255).
      const uint32_t exp = min_exp + ((e - min_exp) & 31u);
      anchor[e] = fp8::anchor_bits<F>(exp << 23);
      offset[e] = fp8::code_offset<F>(anchor[e]);
    }
  }
};

template <Format F>
const EncodeTables<F>& encode_tables() {
  static const EncodeTables<F> tables;
  return tables;
}

template <Format F>
struct Encoder {
  __m512i anchor_lo, anchor_hi, offset_lo, offset_hi;

  RECXLA_AVX512 Encoder() {
    const EncodeTables<F>& t = encode_tables<F>();
    anchor_lo = _mm512_load_si512(t.anchor);
    anchor_hi = _mm512_load_si512(t.anchor + 16);
    offset_lo = _mm512_load_si512(t.offset);
    offset_hi = _mm512_load_si512(t.offset + 16);
  }

  // fp8::encode<F>(v * inv_scale) in every lane, for v of a row whose finite |v| are at most
  // amax and inv_scale = fp8::inv_scale_from_amax(amax). fp8::encode's saturation is left out:
  // it never changes such a value, as |v * inv_scale| <= RN(amax * RN(FP8_MAX / amax)) <= the
  // float after FP8_MAX, which rounds to FP8_MAX anyway (and amax * FLT_MAX < FP8_MAX when
  // inv_scale is clamped). Without kSpecials the lanes must be finite: no NaN / Inf codes.
  template <bool kSpecials>
  RECXLA_AVX512 __m512i encode(__m512 v, __m512 inv_scale) const {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(v, inv_scale));
    const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    // Inf / NaN lanes land in slot 31; their code is replaced below.
    const __m512i slot = _mm512_srli_epi32(
        _mm512_max_epu32(a, _mm512_set1_epi32(fp8::kMinNormalBits<F>)), 23);
    const __m512i anchor = _mm512_permutex2var_epi32(anchor_lo, slot, anchor_hi);
    const __m512i offset = _mm512_permutex2var_epi32(offset_lo, slot, offset_hi);
    const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(anchor));
    __m512i code = _mm512_sub_epi32(_mm512_castps_si512(sum), offset);
    if constexpr (kSpecials) {
      const __m512i inf = _mm512_set1_epi32(0x7F800000);
      code = _mm512_mask_mov_epi32(
          code, _mm512_cmpeq_epu32_mask(a, inf), _mm512_set1_epi32(fp8::Traits<F>::kInfCode));
      code = _mm512_mask_mov_epi32(
          code, _mm512_cmpgt_epu32_mask(a, inf), _mm512_set1_epi32(fp8::Traits<F>::kNanCode));
    }
    // code | (sign bit >> 24)
    return _mm512_ternarylogic_epi32(
        code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
  }
};

// Largest |x| bits of a row: over all values, or over the finite ones only.
template <bool kFiniteOnly, typename scalar_t>
RECXLA_AVX512 uint32_t row_amax_bits(const scalar_t* x, int64_t dim) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  __m512i amax = _mm512_setzero_si512();
  const auto accumulate = [&](__m512 v) RECXLA_AVX512 {
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
    amax = kFiniteOnly ? _mm512_mask_max_epu32(amax, _mm512_cmplt_epu32_mask(a, inf), amax, a)
                       : _mm512_max_epu32(amax, a);
  };
  int64_t j = 0;
  for (; j + 16 <= dim; j += 16) accumulate(load16(x + j));
  if (j < dim) accumulate(load16(x + j, first_lanes(dim - j)));
  return _mm512_reduce_max_epu32(amax);
}

template <Format F, bool kSpecials, typename scalar_t>
RECXLA_AVX512 void encode_row(
    const Encoder<F>& enc, const scalar_t* x, int64_t dim, float inv_scale, uint8_t* out) {
  const __m512 inv = _mm512_set1_ps(inv_scale);
  // Groups of 64 values: two rounds of saturating packs (exact, codes are 0..255) and one permute
  // write 64 bytes at once, cheaper than narrowing each vector on its own.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  int64_t j = 0;
  for (; j + 64 <= dim; j += 64) {
    const __m512i c0 = enc.template encode<kSpecials>(load16(x + j), inv);
    const __m512i c1 = enc.template encode<kSpecials>(load16(x + j + 16), inv);
    const __m512i c2 = enc.template encode<kSpecials>(load16(x + j + 32), inv);
    const __m512i c3 = enc.template encode<kSpecials>(load16(x + j + 48), inv);
    const __m512i bytes =
        _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    _mm512_storeu_si512(out + j, _mm512_permutexvar_epi32(order, bytes));
  }
  for (; j + 16 <= dim; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm512_cvtepi32_epi8(enc.template encode<kSpecials>(load16(x + j), inv)));
  }
  if (j < dim) {
    const __mmask16 k = first_lanes(dim - j);
    const __m512i codes = enc.template encode<kSpecials>(load16(x + j, k), inv);
    _mm512_mask_cvtepi32_storeu_epi8(out + j, k, codes);
  }
}

template <Format F, typename scalar_t>
RECXLA_AVX512 void quantize_rows_fmt(
    const scalar_t* x, int64_t x_stride, int64_t begin, int64_t end, int64_t dim, uint8_t* out) {
  const Encoder<F> enc;
  const int64_t out_stride = fp8::row_bytes(dim);
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t* row = x + i * x_stride;
    uint8_t* out_row = out + i * out_stride;
    // Rows are nearly always all finite: one cheap max over every |x| proves it, and such rows
    // skip the finite-only mask and the NaN / Inf code selection.
    uint32_t amax_bits = row_amax_bits<false>(row, dim);
    const bool all_finite = amax_bits < 0x7F800000u;
    if (!all_finite) amax_bits = row_amax_bits<true>(row, dim);
    const float inv_scale = fp8::inv_scale_from_amax(fp8::bits_float(amax_bits), F);
    if (all_finite) {
      encode_row<F, false>(enc, row, dim, inv_scale, out_row);
    } else {
      encode_row<F, true>(enc, row, dim, inv_scale, out_row);
    }
    const float scale = fp8::scale_from_inv_scale(inv_scale);
    std::memcpy(out_row + dim, &scale, sizeof(scale));
  }
}

// fp8::decode<F>(code) * scale in every lane.
template <Format F>
RECXLA_AVX512 __m512 decode16(__m128i codes, __m512 scale) {
  constexpr uint32_t m = fp8::Traits<F>::kMantissaBits;
  const __m512i c = _mm512_cvtepu8_epi32(codes);
  const __m512i magnitude = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  // Exponent and mantissa bits placed in an fp32 pattern, rescaled by 2^(127 - bias).
  const float rebias = F == Format::E4M3 ? 0x1p120f : 0x1p112f;
  __m512 v = _mm512_mul_ps(
      _mm512_castsi512_ps(_mm512_slli_epi32(magnitude, 23 - m)), _mm512_set1_ps(rebias));
  if constexpr (F == Format::E4M3) {
    v = _mm512_mask_mov_ps(
        v, _mm512_cmpeq_epu32_mask(magnitude, _mm512_set1_epi32(0x7F)),
        _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  } else {
    v = _mm512_mask_mov_ps(
        v, _mm512_cmpeq_epu32_mask(magnitude, _mm512_set1_epi32(0x7C)),
        _mm512_castsi512_ps(_mm512_set1_epi32(0x7F800000)));
    v = _mm512_mask_mov_ps(
        v, _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7C)),
        _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  }
  // v | (code's sign bit << 24)
  const __m512i signed_v = _mm512_ternarylogic_epi32(
      _mm512_castps_si512(v), _mm512_slli_epi32(c, 24), _mm512_set1_epi32(0x80000000), 0xF8);
  return _mm512_mul_ps(_mm512_castsi512_ps(signed_v), scale);
}

// kStream: every row of y starts on a cache line and holds whole lines (the caller checks), so
// every 16-value store is aligned and non-temporal.
template <Format F, bool kStream, typename scalar_t>
RECXLA_AVX512 void dequantize_rows_fmt(
    const uint8_t* in, int64_t begin, int64_t end, int64_t dim, scalar_t* y) {
  const int64_t in_stride = fp8::row_bytes(dim);
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* row = in + i * in_stride;
    scalar_t* y_row = y + i * dim;
    float scale_value;
    std::memcpy(&scale_value, row + dim, sizeof(scale_value));
    const __m512 scale = _mm512_set1_ps(scale_value);
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j));
      if constexpr (kStream) {
        stream16(y_row + j, decode16<F>(codes, scale));
      } else {
        store16(y_row + j, decode16<F>(codes, scale));
      }
    }
    if (j < dim) {
      const __mmask16 k = first_lanes(dim - j);
      store16(y_row + j, k, decode16<F>(_mm_maskz_loadu_epi8(k, row + j), scale));
    }
  }
  // Non-temporal stores are weakly ordered: make them visible before the thread reports done.
  if constexpr (kStream) _mm_sfence();
}

}  // namespace

template <typename scalar_t>
void quantize_rows_avx512(
    const scalar_t* x, int64_t x_stride, int64_t begin, int64_t end, int64_t dim, Format fmt,
    uint8_t* out) {
  if (fmt == Format::E4M3) {
    quantize_rows_fmt<Format::E4M3>(x, x_stride, begin, end, dim, out);
  } else {
    quantize_rows_fmt<Format::E5M2>(x, x_stride, begin, end, dim, out);
  }
}

template <typename scalar_t>
void dequantize_rows_avx512(
    const uint8_t* in, int64_t begin, int64_t end, int64_t dim, Format fmt, scalar_t* y,
    bool stream) {
  if (fmt == Format::E4M3) {
    if (stream) {
      dequantize_rows_fmt<Format::E4M3, true>(in, begin, end, dim, y);
    } else {
      dequantize_rows_fmt<Format::E4M3, false>(in, begin, end, dim, y);
    }
  } else {
    if (stream) {
      dequantize_rows_fmt<Format::E5M2, true>(in, begin, end, dim, y);
    } else {
      dequantize_rows_fmt<Format::E5M2, false>(in, begin, end, dim, y);
    }
  }
}

#else  // no AVX-512 kernels in this build: fp8_rows.cpp never calls the stubs below

bool have_avx512_fp8() { return false; }

template <typename scalar_t>
void quantize_rows_avx512(
    const scalar_t*, int64_t, int64_t, int64_t, int64_t, fp8::Format, uint8_t*) {}

template <typename scalar_t>
void dequantize_rows_avx512(
    const uint8_t*, int64_t, int64_t, int64_t, fp8::Format, scalar_t*, bool) {}

#endif

template void quantize_rows_avx512<float>(
    const float*, int64_t, int64_t, int64_t, int64_t, fp8::Format, uint8_t*);
template void quantize_rows_avx512<c10::BFloat16>(
    const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, fp8::Format, uint8_t*);
template void quantize_rows_avx512<c10::Half>(
    const c10::Half*, int64_t, int64_t, int64_t, int64_t, fp8::Format, uint8_t*);
template void dequantize_rows_avx512<float>(
    const uint8_t*, int64_t, int64_t, int64_t, fp8::Format, float*, bool);
template void dequantize_rows_avx512<c10::BFloat16>(
    const uint8_t*, int64_t, int64_t, int64_t, fp8::Format, c10::BFloat16*, bool);
template void dequantize_rows_avx512<c10::Half>(
    const uint8_t*, int64_t, int64_t, int64_t, fp8::Format, c10::Half*, bool);

}  // namespace cpu
}  // namespace recxla
