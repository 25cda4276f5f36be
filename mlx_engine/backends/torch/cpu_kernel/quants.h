// The activations rounded to int8 per block of 32 (`quantize_rows`, llama.cpp's q8_0 rounding), and each format's
// block of codes and its dot product with a block of activations (`block_codes`, `block_dot`, `block_scale`):
// the per-format pieces of the matrix-vector kernel (matvec.h). Their numpy twins: cpu_reference.py.

#pragma once

#include <vector>

#include "isa_x86.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

// x (M, K) -> xq int8 (M, K), dx = max|x| / 127 and sx = dx * sum(xq) per block: (M, K / 32). Rounds half to
// even (vcvtps2dq under the default rounding mode), as the scalar nearbyint would. `grouped`: each row's whole
// groups of GROUP blocks in the 4-bit kernel's order (ROOFLINE_AVX512), the blocks after them in input order.
// `hx`, where given: (M, 2 nb) the sums of xq a half block (the 6-bit kernel's offsets)
void quantize_rows(const float* x, int64_t M, int64_t nb, bool grouped, int8_t* xq, float* dx, float* sx,
                   float* hx = nullptr) {
  const int64_t in_groups = grouped && GROUPED ? nb / GROUP * GROUP : 0;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t i = 0, j = 0; i < M * nb; ++i, j = j + 1 == nb ? 0 : j + 1) {  // j: block i's place in its row
    const float* v = x + i * QK;
    __m256 f[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      f[j] = _mm256_loadu_ps(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[j]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], id));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(p, order);
    if (j < in_groups) {
      int8_t* g = xq + (i - j) * QK + (j - j % GROUP) * QK + (j % GROUP) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(g), _mm256_castsi256_si128(ordered));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(g + GROUP * 16), _mm256_extracti128_si256(ordered, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * QK), ordered);
    }
    dx[i] = d;
    sx[i] = d * static_cast<float>(hsum(sum));
    if (hx) {
      hx[2 * i] = static_cast<float>(hsum(_mm256_add_epi32(q[0], q[1])));
      hx[2 * i + 1] = static_cast<float>(hsum(_mm256_add_epi32(q[2], q[3])));
    }
  }
}

// The 32 codes of block b of a row as unsigned bytes in input order (bits 4 and 5), or as signed bytes (bits 8);
// `high`: a 5-bit row's words of high bits
template <int BITS>
inline __m256i block_codes(const uint8_t* row, const uint8_t* high, int64_t b) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));
  } else {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
    if constexpr (BITS == 4) return low;
    if constexpr (BITS == 6) {  // 64-bit lane k: codes 8k to 8k + 7, whose top bits are bits 2k, 2k + 1 of the 8 bytes
      uint64_t t;
      std::memcpy(&t, high + b * 8, 8);
      const __m256i top = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(static_cast<int64_t>(t)),
                                                             _mm256_set_epi64x(6, 4, 2, 0)),
                                           _mm256_set1_epi8(3));
      return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
    }
    uint32_t h;
    std::memcpy(&h, high + b * 4, 4);
#ifdef ROOFLINE_AVX512
    return _mm256_mask_add_epi8(low, static_cast<__mmask32>(h), low, _mm256_set1_epi8(16));
#else
    // bit j of h to byte j (GGML's bytes_from_bits_32): byte j holds h's byte j / 8, every bit but j's set, so
    // it is all ones exactly where bit j is
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(h)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
  }
}

// Block b's integer dot product with activation row xr, as float32 lanes (lanes 0-3 its inputs 0-15, 4-7 the
// rest). 8-bit codes, and 6-bit ones less 32, are signed: vpdpbusd and vpmaddubsw take one unsigned operand, so
// |c| goes with the activations given c's signs
template <int BITS>
inline __m256 block_dot(__m256i q, const int8_t* xr) {
  __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
  if constexpr (BITS == 8 || BITS == 6) return _mm256_cvtepi32_ps(dot4(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q)));
  else return _mm256_cvtepi32_ps(dot4(q, xv));
}

// A block's scales times the activations', as its dot product's lanes take them: one (broadcast), or a 6-bit
// block's two, of its halves (lanes 0-3, 4-7), from a scratch row of two a block
template <int BITS>
inline __m256 block_scale(const float* ds, int64_t b) {
  if constexpr (BITS == 6) {
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ds + 2 * b)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else {
    return _mm256_broadcast_ss(ds + b);
  }
}

}  // namespace
