// The x86 primitives every kernel here is written in (AVX2, F16C and FMA; AVX-512 and VNNI where the build has
// them): horizontal sums, 8 scales of any layout as float32 lanes, the byte dot product. A build without AVX-512
// takes the 256-bit forms (GROUPED false); the flags are cpu_native.py's `flags()`.

#pragma once

#include "formats.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// 4-bit codes four blocks a 512-bit register, in their packed order: the low nibbles of a block's 16 bytes are its
// inputs 0-15 and the high ones 16-31, so the activations of each group of four blocks are stored as their inputs
// 0-15 (4 x 16 bytes) then 16-31 (`quantize_rows`), and two vpdpbusd take the group without a shuffle
#define ROOFLINE_AVX512 1
constexpr bool GROUPED = true;

// p[0..3], each in four adjacent lanes
inline __m512 group_scales(const float* p) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                               _mm512_castps128_ps512(_mm_loadu_ps(p)));
}
#else
constexpr bool GROUPED = false;
#endif
constexpr int64_t GROUP = 4;  // blocks a 512-bit register of 4-bit codes

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <typename S>
inline __m256 scales8(const S* r, int64_t b, int64_t nb) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + b));
    const __m256 sub = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    return _mm256_mul_ps(sub, _mm256_set1_ps(super_scale(r, b, nb)));
  } else {
    return load8(r + b);
  }
}

// u (unsigned bytes) . s (signed bytes), four adjacent products summed into each int32 lane. The pair sums of
// vpmaddubsw saturate at int16, which these operands never reach (|u| <= 128, |s| <= 127)
inline __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

}  // namespace
