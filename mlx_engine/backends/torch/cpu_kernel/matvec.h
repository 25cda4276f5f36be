// The quantized matrix times a few activation rows: rows_kernel (a tile of output rows against up to MB
// rows), tile and run (the tiles shared out among the threads), dispatch_offsets (a kernel per offsets kind),
// and check_weight (what the ops accept).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quants.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

constexpr int MB = 4;       // activation rows sharing one unpacking of a block's codes
// Bytes ahead whose codes a row's loop prefetches, into L2: a decode step streams each matrix once, and the
// hardware's prefetchers alone left one core at ~9 GB/s of codes (docs/benchmarks/torch-cpu.md,
// "Issue 27 on an AMX Xeon"). 16 rows ahead into L1 was tuned on SmolLM2's 288-byte rows; a 1.1B model's rows are
// 1-3 KB, where 16 KB ahead into L2 read 1.2-1.7x the bytes a second on an AMD EPYC (docs/benchmarks/torch-cpu.md,
// "Issue 27 at 1.1B")
constexpr int64_t PF_BYTES = 16384;
constexpr int64_t NT = 64;  // output rows a tile: their codes stay in L1/L2 across the activation rows

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

}  // namespace
