// RMSNorm and rotary embedding over rows of float32, in place, as the Python model's ops compute them.

#pragma once

#include <cmath>

#include "isa_x86.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

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

// x (N, H) float32 contiguous, each row normalized in place, rows in parallel
void norm_rows(at::Tensor& x, const float* w, float eps, bool wide) {
  const int64_t H = x.size(1);
  float* p = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16,
                   [&](int64_t n0, int64_t n1) { rms_norm_rows(p + n0 * H, n1 - n0, H, H, w, eps, wide); });
}

}  // namespace
