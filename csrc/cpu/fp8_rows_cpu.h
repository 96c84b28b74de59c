// Row kernels of the CPU FP8 codec, shared by csrc/cpu/fp8_rows.cpp (the ops, the portable
// kernels and the run-time choice between them) and csrc/cpu/fp8_rows_avx512.cpp.
//
// A row kernel handles rows [begin, end) of one matrix; the caller splits rows across threads.
// Quantize: x rows are `x_stride` elements apart (elements of a row are dense), `out` is dense
// [rows, dim + 4]. Dequantize: `in` is dense [rows, dim + 4], `y` is dense [rows, dim].
#pragma once

#include <cstdint>

#include "recxla/fp8.h"

namespace recxla {
namespace cpu {

// True when this CPU runs the AVX-512 kernels (AVX-512 F, BW and VL) and they were compiled in.
bool have_avx512_fp8();

template <typename scalar_t>
void quantize_rows_avx512(
    const scalar_t* x, int64_t x_stride, int64_t begin, int64_t end, int64_t dim, fp8::Format fmt,
    uint8_t* out);

// stream: store with non-temporal stores; only when every row of y is whole, aligned cache lines
// (dim * sizeof(scalar_t) a multiple of 64 and y 64-byte aligned).
template <typename scalar_t>
void dequantize_rows_avx512(
    const uint8_t* in, int64_t begin, int64_t end, int64_t dim, fp8::Format fmt, scalar_t* y,
    bool stream);

}  // namespace cpu
}  // namespace recxla
