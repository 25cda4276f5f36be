"""A forward's layers as one call of Roofline's CPU kernel library (`roofline_cpu::forward_layers`,
cpu_kernel/layers.h): the norms, q/k/v, rope, the K/V written to the paged pools and attended, the output projection, the MLP and the
residuals of every layer, in C++ around the same quantized matmuls (`NativeWeight`: the kernel's for decode-sized
forwards, the dequantizing bfloat16 GEMM from `cpu_features.DEQUANT_MIN_ROWS` rows, as `NativeWeight.matmul`), in
place of a compiled graph call a layer or the eager ops. A prefill chunk's rows attend through torch's SDPA. What
the graphs left on the host was most of a step: at 2 threads a decode step's engine thread spent 34% of its time
in the matmul kernels and 25% in Python, 14% in torch's dispatch (docs/benchmarks/torch-cpu.md, "Issue 27: the decode
step in one call").

`NativeStep.layout(model)` says whether a model can run so (every projection a `NativeWeight` without a bias past
q/k/v, float32 activations, a head_dim that is a multiple of 8), and why not where it cannot, and lays its layers'
tensors and ints out once, as the op reads them; a forward then hands it the rows' positions and each layer's pools
(`PagedRows`). A row of `paths.TABLE` (`forward`); its twin is the eager model."""

from __future__ import annotations

from typing import Any

import torch

from mlx_engine.backends.torch import cpu_features, cpu_gemm
from mlx_engine.backends.torch.cpu_native import NativeWeight
from mlx_engine.backends.torch.model import FusedLinear, Model

CHUNK_ROWS = 48  # rows of one sequence's chunk, at least, that attend through SDPA (fewer: the op's own loop)
NOTE = "decode steps' and prefills' layers in one call of Roofline's CPU kernel; KV cache in float16"
KV_DTYPE = torch.float16  # the pools' (the op reads float32 or float16): K/V rounded once, when written


class NativeStep:
    def __init__(self, tensors: list[torch.Tensor], ints: list[int], ends: list[tuple[int, int]], args: Any,
                 scale: float, mscale: float, traditional: bool):
        self.tensors, self.ints = tensors, ints
        self.ends = ends  # [n]: where the first n layers' tensors and ints end
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.eps, self.scale, self.mscale, self.traditional = float(args.rms_norm_eps), scale, mscale, traditional
        # rows from which the projections take the dequantizing GEMM (none where the CPU lacks bfloat16 products)
        self.gemm_rows = cpu_features.DEQUANT_MIN_ROWS if cpu_features.bf16_gemm() else 2**62

    @classmethod
    def layout(cls, model: Model) -> NativeStep | str:
        """The model's layers laid out for `forward_layers`, or why one of them cannot run there (a phrase)."""
        empty = torch.empty(0, dtype=torch.float32)
        tensors: list[torch.Tensor] = []
        ints: list[int] = []
        ends = [(0, 0)]
        args = model.args
        if args.head_dim % 8:  # the op's attention reads heads 8 values at a time
            return f"head_dim {args.head_dim} is not a multiple of 8"
        for i, block in enumerate(model.layers):
            attn, mlp = block.self_attn, block.mlp
            norms = [block.input_layernorm, block.post_attention_layernorm, attn.q_norm, attn.k_norm]
            if any(n is not None and (n.eps != args.rms_norm_eps or not _vector(n.weight)) for n in norms):
                return f"layer {i}'s norms are not float32 vectors of the model's eps"
            qkv = _group(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj))
            gate_up = _group(mlp.gate_up, (mlp.gate_proj, mlp.up_proj))
            if qkv is None or gate_up is None or not all(isinstance(w.weight, NativeWeight)
                                                         for w in (attn.o_proj, mlp.down_proj)):
                return f"layer {i}'s projections are not all held for Roofline's CPU kernel"
            (qkv_mats, (q_off, k_off, v_off), biases), (gu_mats, (g_off, u_off), gu_biases) = qkv, gate_up
            o, down = attn.o_proj, mlp.down_proj
            if any(b is not None for b in gu_biases) or o.bias is not None or down.bias is not None \
                    or any(b is not None and not _vector(b) for b in biases):
                return f"layer {i} has biases past q/k/v, or ones not float32 vectors"
            tensors += [n.weight if n is not None else empty for n in norms]
            tensors += [b if b is not None else empty for b in biases]
            ints += [len(qkv_mats), len(gu_mats), q_off, k_off, v_off, g_off, u_off, mlp.down_proj.weight.in_features]
            for w in (*qkv_mats, o.weight, *gu_mats, down.weight):
                tensors += [w.codes, w.d, w.m]
                ints += [w.bits, w.zero]
            ends.append((len(tensors), len(ints)))
        first = model.layers[0].self_attn
        return cls(tensors, ints, ends, args, first.scale, first.rope.mscale, first.rope.traditional)

    def __call__(self, h: torch.Tensor, rows: list[Any], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h (N, hidden) float32, the first len(rows) layers' `PagedRows`, cos and sin (N, head_dim / 2) -> the
        output (N, hidden) of those layers."""
        n = len(rows)
        return torch.ops.roofline_cpu.forward_layers(
            h, self.tensors[:self.ends[n][0]], self.ints[:self.ends[n][1]], [r.pool_k for r in rows],
            [r.pool_v for r in rows], [r.write for r in rows], [r.gather for r in rows], [r.bias for r in rows], cos,
            sin, self.heads, self.kv_heads, self.head_dim, self.eps, self.scale, self.mscale, self.traditional,
            self.gemm_rows, cpu_gemm.SLICE_ELEMENTS, CHUNK_ROWS)


def _vector(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous()


def _group(fused: Any, linears: tuple[Any, ...]) -> tuple[list[NativeWeight], list[int], list[Any]] | None:
    """Projections of one input as the op reads them: their matrices (one fused, or each its own), the column
    where each part starts in those matrices' outputs side by side, and each part's bias."""
    if fused is not None:
        if not isinstance(fused, FusedLinear) or not isinstance(fused.weight, NativeWeight):
            return None
        starts = [sum(fused.widths[:i]) for i in range(len(fused.widths))]
        return [fused.weight], starts, list(fused.biases)
    if not all(isinstance(lin.weight, NativeWeight) for lin in linears):
        return None
    widths = [lin.weight.out_features for lin in linears]
    return [lin.weight for lin in linears], [sum(widths[:i]) for i in range(len(widths))], [lin.bias for lin in linears]


def forward(step: NativeStep, model: Model, ids: torch.Tensor, caches: list[Any], num_layers: int) -> torch.Tensor:
    """ids (B, L) -> the output (B, L, hidden) of the first `num_layers` layers through `step`, over paged views."""
    B, L = ids.shape
    N = B * L
    cos, sin = model.rope.angles(caches[0].positions(B, L, ids.device))  # (B, 1, L, D/2)
    h = model.embed_tokens(ids)
    kv_shape = (model.args.num_key_value_heads, model.args.head_dim)
    rows = [c.paged_rows(N, kv_shape, h.dtype) for c in caches[:num_layers]]
    return step(h.reshape(N, -1), rows, cos.reshape(N, -1), sin.reshape(N, -1)).view(B, L, -1)
