// The block layouts Roofline's CPU kernel reads (cpu_native.cpp), in one place as ggml-common.h holds GGML's.
//
// A matrix (N, K), K a multiple of 32, w = d * c + m per block of 32 inputs of a row:
//   bits 4: codes (N, K / 2) uint8, byte j of a block = c[j] | c[j + 16] << 4, c in [0, 16)
//   bits 5: codes (N, K / 2 + K / 8) uint8: the low 4 bits of the codes as bits 4 (K / 2 bytes), then a 32-bit word
//           a block (little-endian, bit j = bit 4 of c[j]), c in [0, 32): GGML's Q5_0 and Q5_1 blocks as stored
//   bits 6: codes (N, K / 2 + K / 4) uint8: the low 4 bits of the codes as bits 4, then 8 bytes a block of their
//           top 2 bits (byte i: those of c[i], c[i + 8], c[i + 16], c[i + 24] at bits 0, 2, 4, 6), c in [0, 64),
//           w = d (c - 32) with a scale d per 16 inputs: GGML's Q6_K, whose d is the int8 scale of the 16 times
//           its super-block's float16
//   bits 8: codes (N, K) int8, c in [-128, 128)
//   d, m: (N, K / 32) float32 or float16 (both the same); m may be empty: no offsets, or with `zero` the offsets
//         -zero d (w = d (c - zero): Q4_0's and Q5_0's symmetric codes, whose offsets need no bytes of their own);
//         or, K a multiple of 256, (N, K / 32 + K / 128) uint8, two levels as GGML's k-quants hold them: a row's
//         K / 32 6-bit scales, then a float16 a super-block of 8 blocks (d, or -dmin for m); a block's scale is
//         their product, exact in float32; or, bits 6 only, (N, K / 16 + K / 128) int8: a row's K / 16 int8 scales
//         (one a half block of 16), then a float16 a super-block of 8 blocks (Q6_K's, its d).
// `dequant` writes such a matrix's rows as bfloat16, for a prefill's GEMM.
// y[r, n] = sum_b d[n, b] dx[r, b] sum_j c[n, b, j] xq[r, b, j] + m[n, b] dx[r, b] sum_j xq[r, b, j].
//
// Here: a row's bytes of codes, and its scales read one block or 8 blocks at a time.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

constexpr int QK = 32;

// A row's bytes of codes for K inputs (the layouts above)
constexpr int64_t row_bytes_of(int64_t bits, int64_t K) {
  return bits == 8 ? K : bits == 4 ? K / 2 : bits == 5 ? K / 2 + K / 8 : K / 2 + K / 4;
}

inline float load_scale(const float* p) { return *p; }
inline float load_scale(const uint16_t* p) { return _cvtsh_ss(*p); }

// A weight's scales: row r (its nb blocks' scales, where `scale_row` puts it), block b's, or blocks b..b+7 (b a
// multiple of 8). Two-level uint8 rows (the layouts above): the block's 6-bit scale times its super-block's float16
template <typename S>
constexpr int64_t scale_row_len(int64_t nb) {
  return std::is_same_v<S, uint8_t> ? nb + nb / 4 : std::is_same_v<S, int8_t> ? 2 * nb + nb / 4 : nb;
}
template <typename S>
inline const S* scale_row(const S* d, int64_t n, int64_t nb) { return d + n * scale_row_len<S>(nb); }
inline float super_scale(const uint8_t* r, int64_t b, int64_t nb) {
  uint16_t h;
  std::memcpy(&h, r + nb + b / 8 * 2, 2);
  return _cvtsh_ss(h);
}
// A 6-bit row's scale of half block h (inputs 16 h to 16 h + 15): its int8 times its super-block's float16
inline float half_scale(const int8_t* r, int64_t h, int64_t nb) {
  uint16_t s;
  std::memcpy(&s, r + 2 * nb + h / 16 * 2, 2);
  return _cvtsh_ss(s) * static_cast<float>(r[h]);
}
template <typename S>
inline float scale_at(const S* r, int64_t b, int64_t nb) {
  if constexpr (std::is_same_v<S, uint8_t>) return super_scale(r, b, nb) * static_cast<float>(r[b]);
  else return load_scale(r + b);
}

}  // namespace
