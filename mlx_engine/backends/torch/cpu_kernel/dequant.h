// A quantized matrix's rows as bfloat16 (`dequant`: a prefill's GEMM weights, cpu_gemm.native_slice) or float32
// (the head's exact rows), and the dispatch over the scales' types.

#pragma once

#include "matvec.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

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

}  // namespace
