// A forward's projections: a matrix of the layer (Matrix), through qmatmul for a decode step's rows or, from
// Gemm::rows rows, dequantized a slice at a time into torch's bfloat16 GEMM (cpu_gemm.native_matmul's ops), into
// a workspace whose buffers the layers reuse.

#pragma once

#include "qmatmul.h"

// The anonymous namespace is cpu_native.cpp's: one translation unit includes every part
namespace {

struct Matrix {
  const at::Tensor *codes, *d, *m;
  int64_t bits, zero;
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

}  // namespace
