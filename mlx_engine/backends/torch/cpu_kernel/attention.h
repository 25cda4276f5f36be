// A layer's attention over the paged pools: the new K/V written to their slots, then each row's heads over the
// slots it gathers (`attend`, in registers), or a prefill chunk's rows through torch's SDPA (`attend_chunk`).

#pragma once

#include <cmath>

#include "gemm.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

// A layer's attention: N rows over S gathered slots (row n's at gather + n * gs: gs S, or 0 where every row
// gathers the same), Hkv K/V heads of G query heads each, of D; the new K/V at k_off and v_off of q/k/v's yw columns
struct Heads {
  int64_t N, S, gs, Hkv, G, D, yw, k_off, v_off;
  float scale;
};

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

}  // namespace
