// A forward's layers in one call (`forward_layers`): the layer loop around the parts it includes.

#pragma once

#include "attention.h"
#include "norm_rope.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

// --- a forward's layers (forward_layers) ---
// One call for every layer of a forward of N rows (one new token of each of N sequences, a verification's, a
// prefill chunk's): the norms, projections, rope, the K/V written to and read from the pools, attention, the SiLU
// gate and the residuals, as the Python model's ops (model.py's TransformerBlock) compute them in float32, with the
// projections through qmatmul (qmatmul.h), or from gemm_rows rows the prefill's dequantizing GEMM. Each layer's
// tensors and ints follow one another in `ws` and `meta` (paths/native_step.py's NativeStep writes them): tensors
// in_norm, post_norm, q_norm, k_norm, q_bias, k_bias, v_bias (empty where the model has none), then the matrices
// (codes, d, m each): the n_qkv of q/k/v, o, the n_gu of gate/up, down; ints n_qkv, n_gu, then the columns where q,
// k, v start in the q/k/v matrices' outputs side by side, where gate and up start in the gate/up ones', the MLP's
// width, then each matrix's bits and zero.


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
