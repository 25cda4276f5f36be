// The ops over one quantized matrix: qmatmul (x (M, K) -> x W^T, the activations rounded to int8 per block) and
// head_logits (the output head, its top logits recomputed exactly).

#pragma once

#include "dequant.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

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

}  // namespace
