// Roofline's own CPU matmul for quantized weights on an x86-64 CPU with AVX2 (cpu_native.py builds and loads it).
// torch's int4 kernel widens every weight to float32 and FMAs it: on AVX2 about 2.5 weights a cycle, a third of a
// core's memory bandwidth. Here, as in llama.cpp's q4_0 x q8_0 dot products, the activations are rounded to int8
// per block of 32 (scale max|x| / 127) and each block's products are summed in integers (vpmaddubsw and vpmaddwd,
// or VNNI's vpdpbusd where the build has it), 32 weights in a few instructions.
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int QK = 32;
constexpr int MB = 4;       // activation rows sharing one unpacking of a block's codes
// Bytes ahead whose codes a row's loop prefetches, into L2: a decode step streams each matrix once, and the
// hardware's prefetchers alone left one core at ~9 GB/s of codes (docs/benchmarks/torch-cpu.md,
// "Issue 27 on an AMX Xeon"). 16 rows ahead into L1 was tuned on SmolLM2's 288-byte rows; a 1.1B model's rows are
// 1-3 KB, where 16 KB ahead into L2 read 1.2-1.7x the bytes a second on an AMD EPYC (docs/benchmarks/torch-cpu.md,
// "Issue 27 at 1.1B")
constexpr int64_t PF_BYTES = 16384;
constexpr int64_t NT = 64;  // output rows a tile: their codes stay in L1/L2 across the activation rows

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

// Rows [n0, n1) against R activation rows. A row's block scales times the activations' (and its offsets' sum)
// are taken 8 blocks at a time before its dot products, which then broadcast them from memory; two accumulators
// a row, even and odd blocks, so that one FMA's latency does not bound a single-row decode
// OFF: 0 no offsets, 1 offsets m, 2 offsets zf d (a zero point: zf = -zero)
template <int BITS, typename S, int OFF, int R>
void rows_kernel(const uint8_t* codes, const S* d, const S* m, float zf, const int8_t* xq, const float* dx,
                 const float* sx, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK, nb8 = nb & ~int64_t{7}, row_bytes = row_bytes_of(BITS, K);
  const int64_t pf = std::max<int64_t>(2, PF_BYTES / row_bytes);  // rows ahead
  const int64_t dw = BITS == 6 ? 2 * nb : nb;  // a scratch row's scales: one a block, or one a half block
  thread_local std::vector<float> scratch;
  scratch.resize(R * dw);
  float* ds = scratch.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * row_bytes;
    const uint8_t* h = c + K / 2;  // a 5-bit row's high bits
    const S* dn = scale_row(d, n, nb);
    const S* mn = OFF == 1 ? scale_row(m, n, nb) : nullptr;
    if (n + pf < N) {  // the codes and scales of the row pf ahead
      const char* ahead = reinterpret_cast<const char*>(c + pf * row_bytes);
      for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T2);
      _mm_prefetch(reinterpret_cast<const char*>(dn + pf * scale_row_len<S>(nb)), _MM_HINT_T2);
      if constexpr (OFF == 1) _mm_prefetch(reinterpret_cast<const char*>(mn + pf * scale_row_len<S>(nb)), _MM_HINT_T2);
    }
    __m256 offv[R];
    float off[R];
    for (int r = 0; r < R; ++r) {
      offv[r] = _mm256_setzero_ps();
      off[r] = 0.f;
    }
    if constexpr (BITS == 6) {  // 16 half blocks' scales a super-block of 8 blocks (K a multiple of 256)
      const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
      for (int64_t b = 0; b < nb; b += 8) {
        uint16_t h;
        std::memcpy(&h, dn + 2 * nb + b / 4, 2);
        const __m256 sup = _mm256_set1_ps(_cvtsh_ss(h));
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(dn + 2 * b));
        const __m256 s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), sup);
        const __m256 s1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), sup);
        for (int r = 0; r < R; ++r) {
          const __m256 x8 = _mm256_loadu_ps(dx + r * nb + b);
          const __m256 d0 = _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(x8, first));
          const __m256 d1 = _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(x8, second));
          _mm256_storeu_ps(ds + r * dw + 2 * b, d0);
          _mm256_storeu_ps(ds + r * dw + 2 * b + 8, d1);
#ifdef ROOFLINE_AVX512  // the group path's codes are unsigned: less 32 the half blocks' sums, sx here (qmatmul)
          offv[r] = _mm256_fmadd_ps(d0, _mm256_loadu_ps(sx + r * dw + 2 * b), offv[r]);
          offv[r] = _mm256_fmadd_ps(d1, _mm256_loadu_ps(sx + r * dw + 2 * b + 8), offv[r]);
#endif
        }
      }
    } else {
    for (int64_t b = 0; b < nb8; b += 8) {
      const __m256 d8 = scales8(dn, b, nb);
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(ds + r * nb + b, _mm256_mul_ps(d8, _mm256_loadu_ps(dx + r * nb + b)));
      if constexpr (OFF != 0) {
        const __m256 m8 = OFF == 1 ? scales8(mn, b, nb) : d8;
        for (int r = 0; r < R; ++r) offv[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + r * nb + b), offv[r]);
      }
    }
    for (int64_t b = nb8; b < nb; ++b) {
      const float db = scale_at(dn, b, nb);
      for (int r = 0; r < R; ++r) ds[r * nb + b] = db * dx[r * nb + b];
      if constexpr (OFF != 0) {
        const float mb = OFF == 1 ? scale_at(mn, b, nb) : db;
        for (int r = 0; r < R; ++r) off[r] += mb * sx[r * nb + b];
      }
    }
    }
    __m256 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t b = 0;
#ifdef ROOFLINE_AVX512
    __m512 z0[R], z1[R];
    for (int r = 0; r < R; ++r) z0[r] = z1[r] = _mm512_setzero_ps();
    if constexpr (BITS == 4 || BITS == 5) {  // two groups a step, an accumulator each; then a last group; then as below
      const __m512i low = _mm512_set1_epi8(0x0F);
      auto group = [&](int64_t g, __m512* z) {
        const __m512i raw = _mm512_loadu_si512(c + g * 16);
        __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        if constexpr (BITS == 5) {  // the four blocks' high bits of inputs 0-15, then of 16-31: a byte mask each
          const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g * 4));
          const __m128i split =
              _mm_shuffle_epi8(words, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
          const __m512i sixteen = _mm512_set1_epi8(16);
          lo = _mm512_mask_add_epi8(lo, static_cast<__mmask64>(_mm_cvtsi128_si64(split)), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, static_cast<__mmask64>(_mm_extract_epi64(split, 1)), hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + g * QK;
          const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr)),
                                                hi, _mm512_loadu_si512(xr + GROUP * 16));
          z[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), group_scales(ds + r * nb + g), z[r]);
        }
      };
      for (; b + 2 * GROUP <= nb; b += 2 * GROUP) {
        group(b, z0);
        group(b + GROUP, z1);
      }
      if (b + GROUP <= nb) {
        group(b, z0);
        b += GROUP;
      }
    }
    if constexpr (BITS == 6) {  // every block (K a multiple of 256), its codes unsigned: offsets -32 sx above
      const __m512i low = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
      // the 8 bytes of top bits of block j to 64-bit lanes 2j, 2j + 1; their codes 0-7, 8-15 (low nibbles), 16-23,
      // 24-31 (high) take bits 0-1, 2-3, 4-5, 6-7, each shifted to its byte's bits 4-5 (what crosses into a
      // neighbouring byte lands outside them)
      const __m512i spread = _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0);
      const __m512i lo_shl = _mm512_set_epi64(2, 4, 2, 4, 2, 4, 2, 4), hi_shr = _mm512_set_epi64(2, 0, 2, 0, 2, 0, 2, 0);
      const __m512i half0 = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
      const __m512i half1 = _mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1);
      auto group = [&](int64_t g, __m512* z) {
        const __m512i raw = _mm512_loadu_si512(c + g * 16);
        const __m512i top = _mm512_permutexvar_epi64(
            spread, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + g * 8))));
        // a | (b & c): vpternlog's 0xF8
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(raw, low), _mm512_sllv_epi64(top, lo_shl), top2, 0xF8);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low),
                                                     _mm512_srlv_epi64(top, hi_shr), top2, 0xF8);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + g * QK;
          const __m512 sc = _mm512_castps256_ps512(_mm256_loadu_ps(ds + r * dw + 2 * g));
          const __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
          const __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(xr + GROUP * 16));
          z[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_permutexvar_ps(half0, sc), z[r]);
          z[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_permutexvar_ps(half1, sc), z[r]);
        }
      };
      for (; b + 2 * GROUP <= nb; b += 2 * GROUP) {
        group(b, z0);
        group(b + GROUP, z1);
      }
    }
#endif
    for (; b + 1 < nb; b += 2) {
      const __m256i q0 = block_codes<BITS>(c, h, b), q1 = block_codes<BITS>(c, h, b + 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + b * QK;
        acc0[r] = _mm256_fmadd_ps(block_dot<BITS>(q0, xr), block_scale<BITS>(ds + r * dw, b), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(block_dot<BITS>(q1, xr + QK), block_scale<BITS>(ds + r * dw, b + 1), acc1[r]);
      }
    }
    if (b < nb) {
      const __m256i q0 = block_codes<BITS>(c, h, b);
      for (int r = 0; r < R; ++r)
        acc0[r] = _mm256_fmadd_ps(block_dot<BITS>(q0, xq + r * K + b * QK), block_scale<BITS>(ds + r * dw, b), acc0[r]);
    }
    for (int r = 0; r < R; ++r) {
      float o = OFF == 0 ? 0.f : OFF == 1 ? hsum(offv[r]) + off[r] : zf * (hsum(offv[r]) + off[r]);
#ifdef ROOFLINE_AVX512
      if constexpr (BITS == 6) o = -32.f * hsum(offv[r]);
      if constexpr (BITS != 8) o += _mm512_reduce_add_ps(_mm512_add_ps(z0[r], z1[r]));
#endif
      y[r * N + n] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + o;
    }
  }
}

template <int BITS, typename S, int OFF>
void tile(const uint8_t* codes, const S* d, const S* m, float zf, const int8_t* xq, const float* dx, const float* sx,
          int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK;
  for (int64_t r0 = 0; r0 < M; r0 += MB) {
    const int64_t rows = std::min<int64_t>(MB, M - r0);
    const int8_t* xr = xq + r0 * K;
    const float *dr = dx + r0 * nb, *sr = sx + r0 * (BITS == 6 ? 2 * nb : nb);  // 6: sums a half block
    float* yr = y + r0 * N;
    switch (rows) {
      case 1: rows_kernel<BITS, S, OFF, 1>(codes, d, m, zf, xr, dr, sr, K, N, n0, n1, yr); break;
      case 2: rows_kernel<BITS, S, OFF, 2>(codes, d, m, zf, xr, dr, sr, K, N, n0, n1, yr); break;
      case 3: rows_kernel<BITS, S, OFF, 3>(codes, d, m, zf, xr, dr, sr, K, N, n0, n1, yr); break;
      default: rows_kernel<BITS, S, OFF, 4>(codes, d, m, zf, xr, dr, sr, K, N, n0, n1, yr); break;
    }
  }
}

template <int BITS, typename S, int OFF>
void run(const uint8_t* codes, const S* d, const S* m, float zf, const int8_t* xq, const float* dx, const float* sx,
         int64_t M, int64_t K, int64_t N, float* y) {
  if (M <= MB) {  // a decode step's rows: no tile to share across rows, so N in equal shares, one a thread
    const int64_t T = std::min<int64_t>(at::get_num_threads(), N);
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        tile<BITS, S, OFF>(codes, d, m, zf, xq, dx, sx, M, K, N, N * t / T, N * (t + 1) / T, y);
    });
    return;
  }
  // Whole tiles a thread
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile<BITS, S, OFF>(codes, d, m, zf, xq, dx, sx, M, K, N, t * NT, std::min(N, (t + 1) * NT), y);
  });
}

template <int BITS, typename S>
void dispatch_offsets(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t zero,
                      const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t K, int64_t N, float* y) {
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* dp = static_cast<const S*>(d.data_ptr());
  if (m.numel() > 0)
    run<BITS, S, 1>(c, dp, static_cast<const S*>(m.data_ptr()), 0.f, xq, dx, sx, M, K, N, y);
  else if (zero != 0)
    run<BITS, S, 2>(c, dp, nullptr, -static_cast<float>(zero), xq, dx, sx, M, K, N, y);
  else
    run<BITS, S, 0>(c, dp, nullptr, 0.f, xq, dx, sx, M, K, N, y);
}

// A weight's tensors as the kernel reads them, K inputs a row
void check_weight(const char* op, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                  int64_t zero, int64_t K) {
  TORCH_CHECK(codes.dim() == 2 && d.dim() == 2, op, ": codes and d 2-D");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, op, ": bits 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(K % QK == 0, op, ": K a multiple of 32, got ", K);
  const int64_t row_bytes = row_bytes_of(bits, K);
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && codes.is_contiguous() &&
                  codes.size(1) == row_bytes,
              op, ": codes (N, ", row_bytes, ") ", bits == 8 ? "int8" : "uint8", " contiguous");
  const bool two_level = d.scalar_type() == at::kByte, halves = d.scalar_type() == at::kChar;
  TORCH_CHECK(!(two_level || halves) || K % 256 == 0, op, ": two-level scales need K a multiple of 256, got ", K);
  TORCH_CHECK(halves == (bits == 6), op, ": 6-bit codes take int8 scales a half block (Q6_K's), and only they");
  TORCH_CHECK(!halves || (d.is_contiguous() && d.size(0) == codes.size(0) && d.size(1) == K / 16 + K / 128 &&
                          m.numel() == 0 && zero == 0),
              op, ": 6-bit codes' d (N, K / 16 + K / 128) int8 contiguous, m empty, zero 0");
  TORCH_CHECK(halves || ((d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf || two_level) &&
                          d.is_contiguous() && d.size(0) == codes.size(0) &&
                          d.size(1) == (two_level ? K / QK + K / 128 : K / QK)),
              op, ": d (N, K / 32) float32 or float16, or (N, K / 32 + K / 128) uint8, contiguous");
  TORCH_CHECK(m.numel() == 0 || (m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.sizes() == d.sizes()),
              op, ": m empty or as d");
  TORCH_CHECK(zero >= 0 && zero <= 128 && (zero == 0 || m.numel() == 0),
              op, ": zero in [0, 128], and m empty with it");
}

// float32 to bfloat16, to nearest with ties to even (as torch converts finite values)
inline __m128i to_bf16(__m256 w) {
  const __m256i u = _mm256_castps_si256(w);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Rows [n0, n1) (or rows which[n0..n1) of the matrix, where `which` is given) as bfloat16 or float32, d (c - zero)
// + m in float32 (a product, then a sum: torch's order, as cpu_gemm.native_float), bfloat16 rounded once
template <int BITS, typename S, bool OFFSETS, typename OUT>
void dequant_rows(const uint8_t* codes, const S* d, const S* m, int zero, int64_t K, int64_t n0, int64_t n1,
                  OUT* out, const int64_t* which = nullptr) {
  const int64_t nb = K / QK, row_bytes = row_bytes_of(BITS, K);
  for (int64_t i = n0; i < n1; ++i) {
    const int64_t n = which ? which[i] : i;
    const uint8_t* c = codes + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i q = block_codes<BITS>(c, c + K / 2, b);
      __m256 dv[2];  // the scales of inputs 0-15 and 16-31
      if constexpr (BITS == 6) {
        dv[0] = _mm256_set1_ps(half_scale(scale_row(d, n, nb), 2 * b, nb));
        dv[1] = _mm256_set1_ps(half_scale(scale_row(d, n, nb), 2 * b + 1, nb));
      } else {
        dv[0] = dv[1] = _mm256_set1_ps(scale_at(scale_row(d, n, nb), b, nb));
      }
      __m256 mv = _mm256_setzero_ps();
      if constexpr (OFFSETS && BITS != 6) mv = _mm256_set1_ps(scale_at(scale_row(m, n, nb), b, nb));  // 6: none
      OUT* o = out + i * K + b * QK;
      for (int j = 0; j < 4; ++j) {
        const __m128i half = j < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
        const __m128i eight = j % 2 ? _mm_srli_si128(half, 8) : half;
        const __m256i i32 = _mm256_sub_epi32(BITS == 8 || BITS == 6 ? _mm256_cvtepi8_epi32(eight)
                                                                    : _mm256_cvtepu8_epi32(eight),
                                             _mm256_set1_epi32(zero));
        __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(i32), dv[j / 2]);
        if constexpr (OFFSETS) w = _mm256_add_ps(w, mv);
        if constexpr (std::is_same_v<OUT, float>) _mm256_storeu_ps(o + 8 * j, w);
        else _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 * j), to_bf16(w));
      }
    }
  }
}

// f.operator()<S>() for d's scale type: float32, float16 (uint16_t) or two-level uint8
template <typename F>
void by_scale_type(const at::Tensor& d, F&& f) {
  if (d.scalar_type() == at::kHalf) f.template operator()<uint16_t>();
  else if (d.scalar_type() == at::kByte) f.template operator()<uint8_t>();
  else f.template operator()<float>();
}

// Blocks a row of d holds scales for (K / 32)
int64_t scale_blocks(const at::Tensor& d) {
  return d.scalar_type() == at::kByte ? d.size(-1) * 4 / 5 : d.scalar_type() == at::kChar ? d.size(-1) * 4 / 9
                                                                                          : d.size(-1);
}

template <int BITS, typename S>
void dequant_dispatch(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int zero, int64_t K,
                      uint16_t* out) {
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* dp = static_cast<const S*>(d.data_ptr());
  const auto* mp = m.numel() > 0 ? static_cast<const S*>(m.data_ptr()) : nullptr;
  at::parallel_for(0, codes.size(0), 16, [&](int64_t n0, int64_t n1) {
    if (mp) dequant_rows<BITS, S, true>(c, dp, mp, zero, K, n0, n1, out);
    else dequant_rows<BITS, S, false>(c, dp, nullptr, zero, K, n0, n1, out);
  });
}

// codes, d, m as qmatmul's -> `out` (N, K) bfloat16, contiguous
void dequant_to(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits, int64_t zero,
                at::Tensor& out) {
  const int64_t K = scale_blocks(d) * QK;
  check_weight("dequant", codes, d, m, bits, zero, K);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == codes.size(0) && out.size(1) == K,
              "dequant: out (", codes.size(0), ", ", K, ") bfloat16 contiguous");
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto each = [&]<int BITS>() {
    by_scale_type(d, [&]<typename S>() { dequant_dispatch<BITS, S>(codes, d, m, static_cast<int>(zero), K, o); });
  };
  if (bits == 6) dequant_dispatch<6, int8_t>(codes, d, m, 0, K, o);
  else if (bits == 4) each.template operator()<4>();
  else if (bits == 5) each.template operator()<5>();
  else each.template operator()<8>();
}

// codes, d, m as qmatmul's -> (N, K) bfloat16
at::Tensor dequant(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits, int64_t zero) {
  const int64_t K = scale_blocks(d) * QK;
  check_weight("dequant", codes, d, m, bits, zero, K);
  at::Tensor out = at::empty({codes.size(0), K}, codes.options().dtype(at::kBFloat16));
  dequant_to(codes, d, m, bits, zero, out);
  return out;
}

at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                   int64_t bits, int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && d.dim() == 2, "qmatmul: x (M, K), codes and d 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check_weight("qmatmul", codes, d, m, bits, zero, K);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t blocks = M * (K / QK);
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(blocks), sx(blocks), hx(bits == 6 ? 2 * blocks : 0);
  quantize_rows(xf.data_ptr<float>(), M, K / QK, bits != 8, xq.data(), dx.data(), sx.data(),
                bits == 6 ? hx.data() : nullptr);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  auto each = [&]<int BITS>() {
    by_scale_type(d, [&]<typename S>() {
      dispatch_offsets<BITS, S>(codes, d, m, zero, xq.data(), dx.data(), sx.data(), M, K, N, yp);
    });
  };
  if (bits == 6)  // symmetric codes (less 32), no offsets (check_weight)
    run<6, int8_t, 0>(static_cast<const uint8_t*>(codes.data_ptr()), static_cast<const int8_t*>(d.data_ptr()), nullptr,
                      0.f, xq.data(), dx.data(), hx.data(), M, K, N, yp);
  else if (bits == 4) each.template operator()<4>();
  else if (bits == 5) each.template operator()<5>();
  else each.template operator()<8>();
  return y;
}

// The output head: x (R, K) float32 -> logits (R, N) through qmatmul, each row's `top` largest recomputed in
// float32 from their rows dequantized exactly and x unrounded: cpu_packed.head_matmul's ops, in one call
at::Tensor head_logits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                       int64_t bits, int64_t zero, int64_t top) {
  at::Tensor y = qmatmul(x, codes, d, m, bits, zero);
  const int64_t R = y.size(0), K = x.size(1), T = std::min(top, y.size(1));
  TORCH_CHECK(T >= 1, "head_logits: top >= 1");
  const at::Tensor idx = std::get<1>(y.topk(T, -1)).contiguous();  // (R, T)
  at::Tensor rows = at::empty({R * T, K}, x.options().dtype(at::kFloat));
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const int64_t* which = idx.data_ptr<int64_t>();
  float* o = rows.data_ptr<float>();
  auto each = [&]<int BITS, typename S>() {
    const auto* dp = static_cast<const S*>(d.data_ptr());
    at::parallel_for(0, R * T, 8, [&](int64_t i0, int64_t i1) {
      if (m.numel()) dequant_rows<BITS, S, true>(c, dp, static_cast<const S*>(m.data_ptr()), zero, K, i0, i1, o, which);
      else dequant_rows<BITS, S, false>(c, dp, static_cast<const S*>(nullptr), zero, K, i0, i1, o, which);
    });
  };
  auto by_scale = [&]<int BITS>() { by_scale_type(d, [&]<typename S>() { each.template operator()<BITS, S>(); }); };
  if (bits == 6) each.template operator()<6, int8_t>();
  else if (bits == 4) by_scale.template operator()<4>();
  else if (bits == 5) by_scale.template operator()<5>();
  else by_scale.template operator()<8>();
  y.scatter_(1, idx, at::matmul(rows.view({R, T, K}), x.to(at::kFloat).view({R, K, 1})).select(2, 0));
  return y;
}

// --- a forward's layers (forward_layers) ---
// One call for every layer of a forward of N rows (one new token of each of N sequences, a verification's, a
// prefill chunk's): the norms, projections, rope, the K/V written to and read from the pools, attention, the
// SiLU gate and the residuals, as the Python model's ops (model.py's TransformerBlock) compute them in float32,
// with the projections through qmatmul above, or from gemm_rows rows the prefill's dequantizing GEMM. Each layer's tensors and ints follow one another in `ws` and `meta`
// (cpu_native.NativeStep writes them): tensors in_norm, post_norm, q_norm, k_norm, q_bias, k_bias, v_bias (empty
// where the model has none), then the matrices (codes, d, m each): the n_qkv of q/k/v, o, the n_gu of gate/up,
// down; ints n_qkv, n_gu, then the columns where q, k, v start in the q/k/v matrices' outputs side by side,
// where gate and up start in the gate/up ones', the MLP's width, then each matrix's bits and zero.

struct Matrix {
  const at::Tensor *codes, *d, *m;
  int64_t bits, zero;
};

// A layer's attention: N rows over S gathered slots (row n's at gather + n * gs: gs S, or 0 where every row
// gathers the same), Hkv K/V heads of G query heads each, of D; the new K/V at k_off and v_off of q/k/v's yw columns
struct Heads {
  int64_t N, S, gs, Hkv, G, D, yw, k_off, v_off;
  float scale;
};

// When to take a prefill's GEMM (cpu_gemm.native_matmul's, op for op): from `rows` rows of x, the weights
// dequantized to bfloat16 `slice` elements at a time
struct Gemm {
  int64_t rows, slice;
};

// The buffers of one forward's GEMM path (a prefill chunk's rows), a role each, grown to the largest a layer asks
// and taken again by the next layer: the layers' transients then land on the same memory. As fresh tensors a layer,
// malloc spread them over the heap's free space, which the load had handed back: a 1.1B model's 256-row chunk grew
// the RSS by 103 MB where 42 MB were ever in use at once (docs/benchmarks/torch-cpu.md,
// "Issue 27: one workspace a forward"). A role serves values whose lifetimes do not meet: F the normed input, then
// attention's output, then the MLP's activation; YZ q/k/v's outputs, then gate/up's.
struct Workspace {
  enum Role { F, Q, YZ, XB, W, PART, ROLES };
  std::array<at::Tensor, ROLES> bufs;  // bytes

  at::Tensor get(Role r, at::IntArrayRef shape, at::ScalarType dtype) {
    int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t v : shape) n *= v;
    at::Tensor& b = bufs[r];
    if (!b.defined() || b.numel() < n) {
      b = at::Tensor();  // the outgrown buffer freed before its successor is made
      b = at::empty({n}, at::TensorOptions().dtype(at::kByte));
    }
    return b.narrow(0, 0, n).view(dtype).view(shape);
  }
};

// x (N, K) float32 through matrices of that input by the dequantizing GEMM (cpu_gemm.native_matmul's, op for op):
// each slice of `gemm.slice` weights dequantized into the workspace, multiplied into it, and handed on as
// put(column, part), part (N, s) bfloat16 of the outputs side by side from `column`
template <typename Put>
void gemm_parts(const at::Tensor& x, const std::vector<Matrix>& ms, const Gemm& gemm, Workspace& w, Put put) {
  const int64_t N = x.size(0), K = x.size(1);
  at::Tensor xb = w.get(Workspace::XB, {N, K}, at::kBFloat16);
  xb.copy_(x);
  int64_t col = 0;
  for (const Matrix& m : ms) {
    const int64_t n = m.codes->size(0), step = std::max<int64_t>(1, gemm.slice / K);
    for (int64_t lo = 0; lo < n; lo += step) {
      const int64_t hi = std::min(n, lo + step);
      at::Tensor wt = w.get(Workspace::W, {hi - lo, K}, at::kBFloat16);
      dequant_to(m.codes->slice(0, lo, hi), m.d->slice(0, lo, hi), m.m->numel() ? m.m->slice(0, lo, hi) : *m.m,
                 m.bits, m.zero, wt);
      at::Tensor part = w.get(Workspace::PART, {N, hi - lo}, at::kBFloat16);
      at::mm_out(part, xb, wt.t());  // F.linear's product, into the workspace
      put(col + lo, part);
    }
    col += n;
  }
}

// Outputs of matrices of one input side by side (N, columns) in the workspace's `role`, in `dtype`: float32, or
// bfloat16, which holds the GEMM's outputs as they are
at::Tensor project(const at::Tensor& x, const std::vector<Matrix>& ms, const Gemm& gemm, Workspace& w,
                   Workspace::Role role, at::ScalarType dtype) {
  int64_t cols = 0;
  for (const Matrix& m : ms) cols += m.codes->size(0);
  at::Tensor y = w.get(role, {x.size(0), cols}, dtype);
  gemm_parts(x, ms, gemm, w, [&](int64_t c, const at::Tensor& part) { y.narrow(1, c, part.size(1)).copy_(part); });
  return y;
}

// x (N, K) float32 through one matrix -> (N, out) float32: the kernel's, or from `gemm.rows` rows the GEMM's
at::Tensor matmul_of(const at::Tensor& x, const Matrix& w, const Gemm& gemm) {
  if (x.size(0) < gemm.rows) return qmatmul(x, *w.codes, *w.d, *w.m, w.bits, w.zero);
  Workspace own;  // a call's own: its buffers outlive it only as the output
  return project(x, {w}, gemm, own, Workspace::YZ, at::kFloat);
}

// h += x through one matrix
void add_product(at::Tensor& h, const at::Tensor& x, const Matrix& m, const Gemm& gemm, Workspace& w) {
  if (x.size(0) < gemm.rows) {
    h.add_(matmul_of(x, m, gemm));
    return;
  }
  gemm_parts(x, {m}, gemm, w, [&](int64_t c, const at::Tensor& part) { h.narrow(1, c, part.size(1)).add_(part); });
}

// Outputs of matrices of one input, side by side
at::Tensor side_by_side(const at::Tensor& x, const std::vector<Matrix>& ws, const Gemm& gemm) {
  if (ws.size() == 1) return matmul_of(x, ws[0], gemm);
  std::vector<at::Tensor> outs;
  for (const Matrix& w : ws) outs.push_back(matmul_of(x, w, gemm));
  return at::cat(outs, 1);
}

// A prefill chunk's rows [n0, n1), which gather the same slots: its K/V gathered in float32 and attended by torch's
// SDPA with the rows' biases as the mask, as the Python prefill attends a chunk (kv.PrefillView.attention)
void attend_chunk(const Heads& a, int64_t n0, int64_t n1, const at::Tensor& q, const at::Tensor& pk,
                  const at::Tensor& pv, const at::Tensor& gather, const at::Tensor& bias, bool causal,
                  at::Tensor& att) {
  const int64_t r = n1 - n0, S = a.S, Hkv = a.Hkv, Hq = Hkv * a.G, D = a.D;
  const at::Tensor slots = gather.select(0, n0);
  auto heads = [&](const at::Tensor& pool) {
    return pool.index_select(0, slots).to(at::kFloat).view({1, S, Hkv, D}).transpose(1, 2);
  };
  const at::Tensor out = at::scaled_dot_product_attention(
      q.slice(0, n0, n1).view({1, r, Hq, D}).transpose(1, 2), heads(pk), heads(pv),
      causal ? std::optional<at::Tensor>() : std::optional<at::Tensor>(bias.slice(0, n0, n1).view({1, 1, r, S})), 0.0,
      causal, static_cast<double>(a.scale), true);
  att.slice(0, n0, n1).view({1, r, Hq, D}).copy_(out.transpose(1, 2));
}

// rows of a forward sharing row n's gathered slots, from n on (all of them where the rows are one row expanded)
int64_t chunk_end(const Heads& a, const int64_t* gp, int64_t n) {
  if (a.gs == 0) return a.N;
  int64_t e = n + 1;
  while (e < a.N && std::memcmp(gp + e * a.gs, gp + n * a.gs, a.S * sizeof(int64_t)) == 0) ++e;
  return e;
}

// Whether rows [n0, n1) of (N, S) biases see exactly the slots up to their own, from the first (a chunk from
// position 0): then SDPA's causal kernel, which skips the masked half, serves (at an offset: the biases as the mask)
bool causal_rows(const float* bp, int64_t n0, int64_t n1, int64_t S) {
  if (S != n1 - n0) return false;
  const float* b = bp + n0 * S;
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < S; ++j)
      if (b[i * S + j] != (j <= i ? 0.f : -INFINITY)) return false;
  return true;
}

// rows (N, W) at column stride `stride`: each row of W values x / sqrt(mean(x^2) + eps) * w, in place
// wide: the squares summed 8 lanes at a time (a prefill's rows); else in order, as the decode step was measured
void rms_norm_rows(float* x, int64_t rows, int64_t W, int64_t stride, const float* w, float eps, bool wide = false) {
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * stride;
    float ss = 0.f;
    int64_t i = 0;
    if (wide) {
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= W; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(v + i), acc);
      ss = hsum(acc);
    }
    for (; i < W; ++i) ss += v[i] * v[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(W) + eps);
    for (i = 0; i < W; ++i) v[i] = w[i] * (v[i] * inv);
  }
}

void rope_heads(float* x, int64_t heads, int64_t D, const float* cos, const float* sin, float mscale,
                bool traditional) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
      const float x1 = v[a] * mscale, x2 = v[b] * mscale;
      v[a] = x1 * cos[i] - x2 * sin[i];
      v[b] = x1 * sin[i] + x2 * cos[i];
    }
  }
}

inline void store_row(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
// to nearest, ties to even: as torch's .to(torch.float16)
inline void store_row(uint16_t* dst, const float* src, int64_t D) {
  int64_t j = 0;
  for (; j + 8 <= D; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
  for (; j < D; ++j) dst[j] = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
}

// The rows' K/V (in y, after rope) written to their slots
template <typename P>
void write_rows(const Heads& a, const float* yp, const int64_t* wp, P* pkp, P* pvp) {
  const int64_t kw = a.Hkv * a.D;
  for (int64_t n = 0; n < a.N; ++n) {
    store_row(pkp + wp[n] * kw, yp + n * a.yw + a.k_off, kw);
    store_row(pvp + wp[n] * kw, yp + n * a.yw + a.v_off, kw);
  }
}

// W x 8 values of out += w v over the slots, the sums in registers (v: a pool's rows at `at`, float32 or float16)
template <int W, typename P>
void weighted_rows(const float* w, const int64_t* g, int64_t S, const P* at, int64_t kw, float* out) {
  __m256 acc[W];
  for (int i = 0; i < W; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (w[s] == 0.f) continue;
    const __m256 wv = _mm256_set1_ps(w[s]);
    const P* v = at + g[s] * kw;
    for (int i = 0; i < W; ++i) acc[i] = _mm256_fmadd_ps(wv, load8(v + 8 * i), acc[i]);
  }
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

template <typename P>
void weighted_sum(const float* w, const int64_t* g, int64_t S, const P* at, int64_t kw, int64_t D, float* out) {
  for (int64_t j = 0; j < D; j += 64) {
    switch (std::min<int64_t>(64, D - j) / 8) {
      case 8: weighted_rows<8>(w, g, S, at + j, kw, out + j); break;
      case 7: weighted_rows<7>(w, g, S, at + j, kw, out + j); break;
      case 6: weighted_rows<6>(w, g, S, at + j, kw, out + j); break;
      case 5: weighted_rows<5>(w, g, S, at + j, kw, out + j); break;
      case 4: weighted_rows<4>(w, g, S, at + j, kw, out + j); break;
      case 3: weighted_rows<3>(w, g, S, at + j, kw, out + j); break;
      case 2: weighted_rows<2>(w, g, S, at + j, kw, out + j); break;
      default: weighted_rows<1>(w, g, S, at + j, kw, out + j); break;
    }
  }
}

// Rows [n0, n1): each row's q heads (qp) attending to the slots it gathers with its bias added to the scores,
// into ap (N, Hq * D); D a multiple of 8. Items are (row, K/V head) pairs, whose G query heads share the K/V rows
// as they stream through the caches, or each query head where there are too few pairs to share out among the
// threads (a decode step of one sequence over SmolLM2's 3 K/V heads: 3 for 2 threads). Scores 4 slots at a time
// (four independent sums), the weighted V rows summed in registers.
template <typename P>
void attend(const Heads& a, int64_t n0, int64_t n1, const float* qp, const int64_t* gp, const float* bp,
            const P* pkp, const P* pvp, float* ap) {
  const int64_t S = a.S, Hkv = a.Hkv, G = a.G, D = a.D, kw = Hkv * D, qw = Hkv * G * D;
  const float scale = a.scale;
  const int64_t pairs = (n1 - n0) * Hkv, split = pairs < 4 * at::get_num_threads() ? G : 1, Ge = G / split;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, Ge * S * D));
  at::parallel_for(0, pairs * split, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(Ge * S);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = n0 + r / (Hkv * split), kvh = r / split % Hkv, e0 = r % split * Ge;
      const int64_t* g = gp + n * a.gs;
      const float* bb = bp + n * S;
      const float* qv = qp + n * qw + (kvh * G + e0) * D;
      const P* kh = pkp + kvh * D;
      for (int64_t e = 0; e < Ge; ++e) {
        const float* q = qv + e * D;
        float* pe = p.data() + e * S;
        int64_t s = 0;
        for (; s + 4 <= S; s += 4) {
          const P *k0 = kh + g[s] * kw, *k1 = kh + g[s + 1] * kw, *k2 = kh + g[s + 2] * kw, *k3 = kh + g[s + 3] * kw;
          __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
          for (int64_t j = 0; j < D; j += 8) {
            const __m256 qj = _mm256_loadu_ps(q + j);
            c0 = _mm256_fmadd_ps(qj, load8(k0 + j), c0);
            c1 = _mm256_fmadd_ps(qj, load8(k1 + j), c1);
            c2 = _mm256_fmadd_ps(qj, load8(k2 + j), c2);
            c3 = _mm256_fmadd_ps(qj, load8(k3 + j), c3);
          }
          pe[s] = hsum(c0) * scale + bb[s];
          pe[s + 1] = hsum(c1) * scale + bb[s + 1];
          pe[s + 2] = hsum(c2) * scale + bb[s + 2];
          pe[s + 3] = hsum(c3) * scale + bb[s + 3];
        }
        for (; s < S; ++s) {
          const P* k = kh + g[s] * kw;
          __m256 c = _mm256_setzero_ps();
          for (int64_t j = 0; j < D; j += 8) c = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), c);
          pe[s] = hsum(c) * scale + bb[s];
        }
        float top = -INFINITY, total = 0.f;
        for (s = 0; s < S; ++s) top = std::max(top, pe[s]);
        for (s = 0; s < S; ++s) total += (pe[s] = std::exp(pe[s] - top));
        for (s = 0; s < S; ++s) pe[s] /= total;
        weighted_sum(pe, g, S, pvp + kvh * D, kw, D, ap + n * qw + (kvh * G + e0 + e) * D);
      }
    }
  });
}

// x (N, H) float32 contiguous, each row normalized in place, rows in parallel
void norm_rows(at::Tensor& x, const float* w, float eps, bool wide) {
  const int64_t H = x.size(1);
  float* p = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16,
                   [&](int64_t n0, int64_t n1) { rms_norm_rows(p + n0 * H, n1 - n0, H, H, w, eps, wide); });
}

at::Tensor forward_layers(const at::Tensor& h_in, at::TensorList ws, at::IntArrayRef meta, at::TensorList pool_k,
                          at::TensorList pool_v, at::TensorList writes, at::TensorList gathers, at::TensorList biases,
                          const at::Tensor& cos, const at::Tensor& sin, int64_t Hq, int64_t Hkv, int64_t D,
                          double eps_d, double scale_d, double mscale_d, bool traditional, int64_t gemm_rows,
                          int64_t gemm_slice, int64_t chunk_rows) {
  const int64_t N = h_in.size(0), H = h_in.size(1), L = pool_k.size();
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "forward_layers: h (N, hidden) float32");
  TORCH_CHECK(pool_v.size() == pool_k.size() && writes.size() == pool_k.size() && gathers.size() == pool_k.size() &&
                  biases.size() == pool_k.size(),
              "forward_layers: a K pool, V pool, write, gather and bias a layer");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.numel() == N * (D / 2) && sin.sizes() == cos.sizes(),
              "forward_layers: cos and sin (N, D / 2) float32");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && D % 8 == 0, "forward_layers: Hq a multiple of Hkv, D a multiple of 8");
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  const float mscale = static_cast<float>(mscale_d);
  const int64_t G = Hq / Hkv, qw = Hq * D, kw = Hkv * D;
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  TORCH_CHECK(gemm_rows >= 1 && gemm_slice >= 1 && chunk_rows >= 1,
              "forward_layers: gemm_rows, gemm_slice and chunk_rows >= 1");
  const Gemm gemm{gemm_rows, gemm_slice};
  // the last chunk's causal test: a prefill's layers share one bias tensor, so it runs once a forward
  struct {
    const float* bias = nullptr;
    int64_t n0 = -1, n1 = -1;
    bool causal = false;
  } causal_of;
  at::Tensor h = h_in.contiguous().clone();
  Workspace w;
  size_t t = 0, i = 0;
  auto tensor = [&]() -> const at::Tensor& {
    TORCH_CHECK(t < ws.size(), "forward_layers: fewer tensors than the layers' ints say");
    return ws[t++];
  };
  auto integer = [&]() {
    TORCH_CHECK(i < meta.size(), "forward_layers: fewer ints than the layers need");
    return meta[i++];
  };
  auto vec = [&](const at::Tensor& x, int64_t n, const char* what) -> const float* {
    if (x.numel() == 0) return nullptr;
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == n, "forward_layers: ", what,
                " float32 of ", n);
    return x.data_ptr<float>();
  };
  for (int64_t layer = 0; layer < L; ++layer) {
    const float* in_norm = vec(tensor(), H, "input norm");
    const float* post_norm = vec(tensor(), H, "post-attention norm");
    const float* q_norm = vec(tensor(), D, "q norm");
    const float* k_norm = vec(tensor(), D, "k norm");
    const float* q_bias = vec(tensor(), qw, "q bias");
    const float* k_bias = vec(tensor(), kw, "k bias");
    const float* v_bias = vec(tensor(), kw, "v bias");
    TORCH_CHECK(in_norm && post_norm, "forward_layers: layer ", layer, " without its norms");
    const int64_t n_qkv = integer(), n_gu = integer(), q_off = integer(), k_off = integer(), v_off = integer();
    const int64_t g_off = integer(), u_off = integer(), inter = integer();
    std::vector<Matrix> qkv, gu;
    auto matrix = [&]() {
      const at::Tensor &c = tensor(), &d = tensor(), &m = tensor();
      const int64_t bits = integer(), zero = integer();
      return Matrix{&c, &d, &m, bits, zero};
    };
    for (int64_t j = 0; j < n_qkv; ++j) qkv.push_back(matrix());
    const Matrix o = matrix();
    for (int64_t j = 0; j < n_gu; ++j) gu.push_back(matrix());
    const Matrix down = matrix();
    const at::Tensor& pk = pool_k[layer];
    const at::Tensor& pv = pool_v[layer];
    TORCH_CHECK((pk.scalar_type() == at::kFloat || pk.scalar_type() == at::kHalf) && pk.is_contiguous() &&
                    pk.dim() == 3 && pk.size(1) == Hkv && pk.size(2) == D && pv.sizes() == pk.sizes() &&
                    pv.scalar_type() == pk.scalar_type() && pv.is_contiguous(),
                "forward_layers: pools (slots, Hkv, D) float32 or float16, contiguous, layer ", layer);
    const int64_t slots = pk.size(0);
    const at::Tensor &write = writes[layer], &gather = gathers[layer], &bias = biases[layer];
    TORCH_CHECK(write.scalar_type() == at::kLong && write.is_contiguous() && write.numel() == N &&
                    gather.scalar_type() == at::kLong && gather.dim() == 2 && gather.size(0) == N &&
                    gather.stride(1) == 1 && (gather.stride(0) == gather.size(1) || gather.stride(0) == 0) &&
                    bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.sizes() == gather.sizes(),
                "forward_layers: write (N,) int64 and bias (N, S) float32 contiguous, gather (N, S) int64 row-major or "
                "one row expanded, layer ", layer);
    const int64_t S = gather.size(1), gs = gather.stride(0);
    const int64_t *wp = write.data_ptr<int64_t>(), *gp = gather.data_ptr<int64_t>();
    const float* bp = bias.data_ptr<float>();

    const bool wide = N >= gemm.rows && N >= chunk_rows;  // the GEMM path and SDPA: buffers in the workspace
    at::Tensor x = wide ? w.get(Workspace::F, {N, H}, at::kFloat).copy_(h) : h.clone();
    norm_rows(x, in_norm, eps, N >= chunk_rows);
    at::Tensor y = wide ? project(x, qkv, gemm, w, Workspace::YZ, at::kFloat) : side_by_side(x, qkv, gemm);
    TORCH_CHECK(y.size(1) >= std::max({q_off + qw, k_off + kw, v_off + kw}), "forward_layers: q/k/v columns");
    at::Tensor q = wide ? w.get(Workspace::Q, {N, qw}, at::kFloat) : at::empty({N, qw}, h.options());
    float *yp = y.data_ptr<float>(), *qp = q.data_ptr<float>();
    const int64_t yw = y.size(1);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        float* yr = yp + n * yw;
        float *qr = qp + n * qw, *kr = yr + k_off, *vr = yr + v_off;
        for (int64_t j = 0; j < qw; ++j) qr[j] = yr[q_off + j] + (q_bias ? q_bias[j] : 0.f);
        if (k_bias)
          for (int64_t j = 0; j < kw; ++j) kr[j] += k_bias[j];
        if (v_bias)
          for (int64_t j = 0; j < kw; ++j) vr[j] += v_bias[j];
        if (q_norm) rms_norm_rows(qr, Hq, D, D, q_norm, eps);
        if (k_norm) rms_norm_rows(kr, Hkv, D, D, k_norm, eps);
        rope_heads(qr, Hq, D, cp + n * (D / 2), sp + n * (D / 2), mscale, traditional);
        rope_heads(kr, Hkv, D, cp + n * (D / 2), sp + n * (D / 2), mscale, traditional);
      }
    });
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(wp[n] >= 0 && wp[n] < slots, "forward_layers: write slot ", wp[n], " outside the pool's ", slots);
    for (int64_t n = 0; n < (gs ? N : 1) * S; ++n)
      TORCH_CHECK(gp[n] >= 0 && gp[n] < slots, "forward_layers: gathered slot ", gp[n], " outside the pool's ", slots);
    at::Tensor att = wide ? w.get(Workspace::F, {N, qw}, at::kFloat) : at::empty({N, qw}, h.options());
    const Heads heads{N, S, gs, Hkv, G, D, yw, k_off, v_off, scale};
    const bool half = pk.scalar_type() == at::kHalf;
    auto* pk16 = static_cast<uint16_t*>(pk.data_ptr());
    auto* pv16 = static_cast<uint16_t*>(pv.data_ptr());
    if (half) write_rows(heads, yp, wp, pk16, pv16);
    else write_rows(heads, yp, wp, pk.data_ptr<float>(), pv.data_ptr<float>());
    // a prefill chunk's rows (chunk_rows or more sharing their slots) through SDPA, the others one by one
    for (int64_t n = 0; n < N;) {
      const int64_t e = chunk_end(heads, gp, n);
      if (e - n >= chunk_rows) {
        if (bp != causal_of.bias || n != causal_of.n0 || e != causal_of.n1)
          causal_of = {bp, n, e, causal_rows(bp, n, e, S)};
        attend_chunk(heads, n, e, q, pk, pv, gather, bias, causal_of.causal, att);
      }
      else if (half) attend(heads, n, e, qp, gp, bp, pk16, pv16, att.data_ptr<float>());
      else attend(heads, n, e, qp, gp, bp, pk.data_ptr<float>(), pv.data_ptr<float>(), att.data_ptr<float>());
      n = e;
    }
    add_product(h, att, o, gemm, w);
    x = wide ? w.get(Workspace::F, {N, H}, at::kFloat).copy_(h) : h.clone();
    norm_rows(x, post_norm, eps, N >= chunk_rows);
    at::Tensor z = wide ? project(x, gu, gemm, w, Workspace::YZ, at::kBFloat16) : side_by_side(x, gu, gemm);
    TORCH_CHECK(z.size(1) >= std::max(g_off, u_off) + inter, "forward_layers: gate/up columns");
    at::Tensor act;
    if (wide) {
      // torch's vectorized SiLU (the Python prefill's) on the gate's outputs made float32, times the up's. act's rows
      // are padded: a strided view, which torch's loops take a row at a time as they took the gate's columns of a
      // float32 z (the same vector and tail steps, so the same values bit for bit)
      act = w.get(Workspace::F, {N, inter + 16}, at::kFloat).narrow(1, 0, inter);
      act.copy_(z.slice(1, g_off, g_off + inter));
      at::silu_(act);
      act.mul_(z.slice(1, u_off, u_off + inter));
    } else {
      act = at::empty({N, inter}, h.options());
      const float* zp = z.data_ptr<float>();
      float* actp = act.data_ptr<float>();
      const int64_t zw = z.size(1);
      if (N >= chunk_rows)  // torch's vectorized SiLU (the Python prefill's)
        at::mul_out(act, at::silu(z.slice(1, g_off, g_off + inter)), z.slice(1, u_off, u_off + inter));
      else
        for (int64_t n = 0; n < N; ++n)
          for (int64_t j = 0; j < inter; ++j) {
            const float g = zp[n * zw + g_off + j];
            actp[n * inter + j] = g / (1.f + std::exp(-g)) * zp[n * zw + u_off + j];
          }
    }
    add_product(h, act, down, gemm, w);
  }
  TORCH_CHECK(t == ws.size() && i == meta.size(), "forward_layers: ", ws.size() - t, " tensors and ",
              meta.size() - i, " ints left after ", L, " layers");
  return h;
}

}  // namespace

TORCH_LIBRARY(roofline_cpu, lib) {
  lib.def("qmatmul(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, int zero=0) -> Tensor");
  lib.def("dequant(Tensor codes, Tensor d, Tensor m, int bits, int zero=0) -> Tensor");
  lib.def("head_logits(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, int zero, int top) -> Tensor");
  lib.def("forward_layers(Tensor h, Tensor[] ws, int[] meta, Tensor(a!)[] pool_k, Tensor(b!)[] pool_v, Tensor[] write, "
          "Tensor[] gather, Tensor[] bias, Tensor cos, Tensor sin, int Hq, int Hkv, int D, float eps, float scale, "
          "float mscale, bool traditional, int gemm_rows, int gemm_slice, int chunk_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(roofline_cpu, CPU, lib) {
  lib.impl("qmatmul", &qmatmul);
  lib.impl("dequant", &dequant);
  lib.impl("head_logits", &head_logits);
  lib.impl("forward_layers", &forward_layers);
}
