// Roofline's CPU kernel library for quantized weights on an x86-64 CPU with AVX2 (cpu_native.py builds it and
// loads it). torch's int4 kernel widens every weight to float32 and FMAs it: on AVX2 about 2.5 weights a cycle, a
// third of a core's memory bandwidth. Here, as in llama.cpp's q4_0 x q8_0 dot products, the activations are rounded
// to int8 per block of 32 (scale max|x| / 127) and each block's products are summed in integers (vpmaddubsw and
// vpmaddwd, or VNNI's vpdpbusd where the build has it), 32 weights in a few instructions.
//
// One translation unit of the parts, each layer on the ones before it (as ggml-cpu keeps its layouts, its ISA code
// and its graph apart):
//   formats.h    the block layouts of the codes and scales
//   isa_x86.h    the ISA's primitives (AVX2; AVX-512 and VNNI where the build has them)
//   quants.h     the activations' int8 rounding, each format's block of codes and its dot product
//   matvec.h     the matrix-vector kernel: a tile of output rows against a few activation rows, over the threads
//   dequant.h    a matrix's rows as bfloat16 or float32
//   qmatmul.h    the ops over one matrix: qmatmul, head_logits
//   gemm.h       a forward's projections: qmatmul, or from a prefill's rows the dequantizing bfloat16 GEMM
//   attention.h  the K/V written to the paged pools and attended
//   norm_rope.h  RMSNorm and rope
//   layers.h     the layer loop (forward_layers)
// cpu_reference.py holds their numpy twins, tests/test_torch_cpu_reference.py a test of each against its twin.

#include <torch/library.h>

#include "layers.h"

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
