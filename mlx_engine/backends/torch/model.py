"""The Llama family (llama, mistral, qwen2, qwen3) in PyTorch: the same math as `mlx_engine.models.llama`.

Pure math: state lives in the cache views passed in (`kv.py`). A view gives the positions of the new
tokens (`positions(B, L)`) and does attention (`attention(q, k, v, scale)`, writing k/v to its storage).
Weights come from the checkpoint's MLX arrays through numpy. MLX affine-quantized weights (uint32 words
packed low bits first, per-group scales and biases) stay packed on CUDA, where `triton_kernels.dequant_matmul`
reads them (bit widths and group sizes it supports; others are dequantized at load), and on an x86-64 CPU
with AVX2, where torch's int4 and int8 CPU kernels read them (`cpu_packed`). GGUF k-quants arrive as raw
blocks (`kquant_weight`): packed as affine groups on CUDA and on the CPU. Elsewhere (a CPU without AVX2)
quantized weights are dequantized once at load, to float32: the portable path.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mlx_engine.api import ModelLoadError
from mlx_engine.backends.torch import cpu_packed
from mlx_engine.backends.torch import triton_kernels as tk

# The norms, rope and the MLP's gate as one Triton kernel each on CUDA (their torch references, op for op the
# code they replace, elsewhere). ROOFLINE_TORCH_UNFUSED=1 runs the references everywhere: the A/B of
# bench/device_check.sh, read when this module is imported.
FUSED = os.environ.get("ROOFLINE_TORCH_UNFUSED", "0") in ("", "0")


@dataclass
class QuantizedWeight:
    packed: torch.Tensor  # (out, in * bits / 32) int32
    scales: torch.Tensor  # (out, in / group_size)
    biases: torch.Tensor
    bits: int
    group_size: int
    act_dtype: torch.dtype | None = None  # rows' dtype when the scales are wider (k-quants: float32)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x @ W.T (..., out) through the Triton kernel (CUDA)."""
        x2 = x.reshape(-1, x.shape[-1])
        y = tk.dequant_matmul(x2, self.packed, self.scales, self.biases, self.bits, self.group_size)
        return y.reshape(*x.shape[:-1], -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup): ids (...) -> (..., in)."""
        flat = ids.reshape(-1)
        w = tk.dequantize_ref(self.packed[flat], self.scales[flat], self.biases[flat], self.bits, self.group_size)
        return w.reshape(*ids.shape, -1).to(self.act_dtype or w.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))

    @property
    def num_parameters(self) -> int:
        return self.packed.numel() * 32 // self.bits


# Rows a call sends through the int8 matmul one by one; more are multiplied by the dequantized weight. A draft's
# catch-up (the tokens prompt lookup copied or plain steps took since its last proposal) of n rows costs about
# 11 + 4n ms row by row and 90 + 2.5n ms through the dequantized weight. SmolLM2, one thread of the build VM:
# 5 rows 34 ms row by row, 97 ms dequantized; 32 rows 138 ms row by row; 33 and 48 rows dequantized 165, 193 ms
INT8_MAX_ROW_CALLS = 32


class Int8Weight:
    """A CPU projection as int8, one scale per output row (`draft_bits=8` on the torch CPU backend): packed for
    the CPU's dynamic-quantized matmul (fbgemm or oneDNN on x86, qnnpack on ARM: each call's activations
    quantized to 8 bits on the fly, int32 accumulation), and plain, to dequantize.

    A row (a draft's decode step) goes through the int8 matmul: a quarter of float32's bytes, and SmolLM2's
    projections at one row cost 11 ms against float32's 50 ms on one thread of the build VM (AVX-512 VNNI).
    Up to INT8_MAX_ROW_CALLS rows (a catch-up) make one call each: the op takes one activation scale for all the
    rows of a call, so one token's outlier channels would coarsen every other token's (SmolLM2's top-1 agreement with
    float32 over a 400-token call fell to 0.55, against 0.83 row by row). More rows (a prefill) multiply the
    dequantized weight in float32, which is bound by compute, not by the weight's bytes (dequantizing all of
    SmolLM2's projections: 27 ms)."""

    def __init__(self, weight: torch.Tensor):
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"int8 weights are made from float32 CPU weights, not {weight.dtype} on "
                             f"{weight.device.type}")
        scale = (weight.abs().amax(1) / 127).clamp_min(1e-12)
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.10+ marks its quantized tensors deprecated; the ops remain
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(weight.contiguous(), scale.double(), zero, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.q8, self.scale = q.int_repr(), scale  # (out, in) int8, (out,) float32
        self.reduce_range = int8_reduce_range()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x @ W.T (..., out) float32."""
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            return torch.ops.quantized.linear_dynamic.default(x.reshape(1, -1), self.packed, self.reduce_range
                                                              ).reshape(*x.shape[:-1], -1)
        if rows <= INT8_MAX_ROW_CALLS:
            x2 = x.reshape(rows, -1)
            return torch.cat([torch.ops.quantized.linear_dynamic.default(x2[i : i + 1], self.packed,
                                                                         self.reduce_range)
                              for i in range(rows)]).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.dequantized())

    def dequantized(self) -> torch.Tensor:
        return self.q8.float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup): ids (...) -> (..., in) float32."""
        return self.q8[ids].float() * self.scale[ids][..., None]

    @property
    def nbytes(self) -> int:
        return 2 * self.q8.numel() + self.scale.numel() * 4 * 2  # packed and plain


@functools.cache
def int8_reduce_range() -> bool:
    """Whether activations must be quantized to 7 bits rather than 8: on x86 without VNNI, fbgemm multiplies
    pairs of unsigned 8-bit activations and signed 8-bit weights into 16-bit sums, which full-range
    activations can overflow (torch's own default for fbgemm is 7 bits). With VNNI (or AMX) the products
    accumulate in 32 bits, and ARM's qnnpack needs no reduction. On SmolLM2, 7-bit activations took a draft's
    top-1 agreement with float32 from 0.83 to 0.75."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to read the flags here, so the safe width
        return True
    return re.search(r"\b(avx512_vnni|avx_vnni|amx_int8)\b", flags) is None


class FusedInt8:
    """Projections of one input (q/k/v, gate/up) as one Int8Weight: one int8 matmul instead of three or two
    (a draft step of SmolLM2: 10.0 -> 7.7 ms in the matmuls), split after, each with its bias."""

    def __init__(self, linears: tuple[Linear, ...]):
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self.biases = [lin.bias for lin in linears]
        self.weight = Int8Weight(torch.cat([lin.weight for lin in linears]))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = self.weight.matmul(x).split(self.sizes, dim=-1)
        return [y + b if b is not None else y for y, b in zip(outs, self.biases)]


def quantize_int8(model: Model) -> None:
    """A float32 CPU model held as int8 (`draft_bits=8` on the torch CPU backend), its float projections
    dropped: q/k/v and gate/up fused (`FusedInt8`), o and down as Int8Weight, the head as an Int8Weight whose
    rows are also the embedding lookup (tied) or beside an int8 embedding (untied). The norms stay float."""
    try:
        for block in model.layers:
            a, m = block.self_attn, block.mlp
            a.qkv, m.gate_up = FusedInt8((a.q_proj, a.k_proj, a.v_proj)), FusedInt8((m.gate_proj, m.up_proj))
            a.q_proj = a.k_proj = a.v_proj = m.gate_proj = m.up_proj = None
            a.o_proj.weight, m.down_proj.weight = Int8Weight(a.o_proj.weight), Int8Weight(m.down_proj.weight)
        head = Int8Weight(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
        embed = head if model.lm_head is None else Int8Weight(model.embed_tokens.weight)
        model.lm_head, model.embed_tokens = Linear(head), Embedding(embed)
    except (RuntimeError, NotImplementedError, AttributeError) as e:  # a torch without its quantized CPU ops
        raise ModelLoadError(f"8-bit weights need torch's quantized CPU matmul (quantized engine "
                             f"{torch.backends.quantized.engine!r}), which failed here: {e}") from None
    norms = [n for b in model.layers for n in (b.input_layernorm, b.post_attention_layernorm,
                                                b.self_attn.q_norm, b.self_attn.k_norm) if n is not None]
    model.weight_bytes = (sum(w.nbytes for b in model.layers for w in (b.self_attn.qkv.weight, b.mlp.gate_up.weight,
                                                                       b.self_attn.o_proj.weight,
                                                                       b.mlp.down_proj.weight))
                          + head.nbytes + (embed.nbytes if embed is not head else 0)
                          + sum(_nbytes(n.weight) for n in [*norms, model.norm]))
    model.embed_bytes = embed.nbytes


Weight = torch.Tensor | QuantizedWeight | Int8Weight | cpu_packed.Int4Weight | cpu_packed.Int8Weight
# weights with matmul(x) and rows(ids) of their own, rather than a float tensor
PACKED = (QuantizedWeight, Int8Weight, cpu_packed.Int4Weight, cpu_packed.Int8Weight)


def _nbytes(w: Weight | None) -> int:
    if w is None:
        return 0
    return w.nbytes if isinstance(w, PACKED) else w.numel() * w.element_size()


class Linear:
    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, PACKED):
            y = self.weight.matmul(x)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)


class FusedLinear:
    """Projections of one input (q/k/v, gate/up) held packed as one matrix (`cpu_packed.fuse`): one kernel
    call, split after, each part with its bias."""

    def __init__(self, weight: cpu_packed.CPUWeight, widths: list[int], linears: tuple[Linear, ...]):
        self.weight, self.widths = weight, widths  # each part's columns in the output, its padding included
        self.sizes = [lin.weight.out_features for lin in linears]
        self.biases = [lin.bias for lin in linears]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = self.weight.matmul(x).split(self.widths, dim=-1)
        outs = [y if y.shape[-1] == n else y[..., :n] for y, n in zip(outs, self.sizes)]
        return [y + b if b is not None else y for y, b in zip(outs, self.biases)]


def fuse_projections(model: Model) -> None:
    """q/k/v and gate/up as one packed matrix each, where they share a CPU format; the parts are dropped."""
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        for owner, names, fused_name in ((a, ("q_proj", "k_proj", "v_proj"), "qkv"), (m, ("gate_proj", "up_proj"),
                                                                                      "gate_up")):
            linears = tuple(getattr(owner, n) for n in names)
            if not all(isinstance(lin.weight, cpu_packed.CPUWeight) for lin in linears):
                continue
            fused = cpu_packed.fuse([lin.weight for lin in linears])
            if fused is not None:
                setattr(owner, fused_name, FusedLinear(*fused, linears))
                for n in names:
                    setattr(owner, n, None)


class Embedding:
    def __init__(self, weight: Weight):
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L) -> (B, L, hidden)."""
        if isinstance(self.weight, PACKED):
            return self.weight.rows(ids)
        return F.embedding(ids, self.weight)

    def as_linear(self, h: torch.Tensor) -> torch.Tensor:
        """The tied head: h (..., hidden) -> logits (..., vocab)."""
        return Linear(self.weight)(h)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (tk.rms_norm if FUSED else tk.rms_norm_ref)(x, self.weight, self.eps)


class RoPE:
    """Rotary embedding as mlx-lm's initialize_rope builds it for the llama family: inverse frequencies
    (default, linear, dynamic within the context, llama3, yarn, longrope, GGUF frequency factors) and an
    input scale (yarn's and longrope's mscale)."""

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None, max_positions: int,
                 traditional: bool = False, freq_factors: np.ndarray | None = None):
        self.dims, self.traditional, self.mscale = head_dim, traditional, 1.0
        exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
        freqs = (base ** exponents).astype(np.float32)  # periods / 2pi, as mx.fast.rope's `freqs`
        scale = 1.0
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "linear":
            scale = 1.0 / scaling["factor"]
        elif kind == "llama3":
            freqs = _llama3_freqs(freqs, scaling)
        elif kind == "yarn":
            freqs = self._yarn(freqs, base, scaling, head_dim)
        elif kind == "longrope":
            freqs = np.asarray(scaling["long_factor"], np.float32) * freqs
            factor = max_positions / scaling["original_max_position_embeddings"]
            if factor > 1.0:
                self.mscale = math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))
        # "dynamic" (NTK) changes the base only past max_position_embeddings, which the context never reaches
        if freq_factors is not None:
            freqs = freqs * np.asarray(freq_factors, np.float32)
        self.inv_freq = torch.from_numpy((scale / freqs).astype(np.float32))  # (D/2,)

    def _yarn(self, freqs: np.ndarray, base: float, s: dict[str, Any], dims: int) -> np.ndarray:
        factor = s["factor"]
        original = s.get("original_max_position_embeddings", 4096)
        beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

        def correction_dim(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dims - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        mask = 1.0 - ramp
        self.mscale = mscale(s.get("mscale", 1)) / mscale(s.get("mscale_all_dim", 0))
        inter = factor * freqs
        return ((inter * freqs) / (inter * mask + freqs * (1 - mask))).astype(np.float32)

    def to(self, device: torch.device) -> RoPE:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, L) -> cos, sin (B, 1, L, D/2) float32, shared by every layer of a forward."""
        a = positions.to(torch.float32)[..., None] * self.inv_freq  # (B, L, D/2)
        return a.cos()[:, None], a.sin()[:, None]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, H, L, D) -> rotated, in float32 then back to x's dtype."""
        return (tk.rope if FUSED else tk.rope_ref)(x, cos, sin, self.mscale, self.traditional)


def _llama3_freqs(freqs: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor = s["factor"]
    low_ff, high_ff = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    wavelens = 2 * np.pi * freqs
    out = np.where(wavelens > old / low_ff, freqs * factor, freqs)
    medium = (wavelens > old / high_ff) & (wavelens < old / low_ff)
    smooth = (old / wavelens - low_ff) / (high_ff - low_ff)
    return np.where(medium, out / ((1 - smooth) / factor + smooth), out).astype(np.float32)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """q (B, Hq, L, D) at positions offset..offset+L-1; k, v (B, Hkv, S, D) with S = offset + L -> (B, Hq, L, D).
    Query i sees keys j <= offset + i (the last L keys are the queries' own)."""
    L, S = q.shape[2], k.shape[2]
    if L == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if S == L:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - L, S, device=q.device)[:, None]  # (L, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class FreshAttention:
    """No cache: one sequence from position 0 (forward_logits, hidden_states)."""

    def positions(self, B: int, L: int, device: torch.device) -> torch.Tensor:
        return torch.arange(L, device=device).expand(B, L)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return causal_attention(q, k, v, 0, scale)


class Attention:
    def __init__(self, w: dict[str, Any], args: Any, rope: RoPE):
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            Linear(w[f"{n}.weight"], w.get(f"{n}.bias")) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.q_norm = RMSNorm(w["q_norm.weight"], args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(w["k_norm.weight"], args.rms_norm_eps) if args.qk_norm else None
        self.rope = rope
        self.qkv: FusedInt8 | FusedLinear | None = None  # q/k/v as one matmul (quantize_int8, fuse_projections)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, L, hidden) -> q (B, nh, L, hd), k, v (B, nkv, L, hd), q and k roped."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(B, L, self.n_heads, self.head_dim)  # (B, L, nh, hd)
        k = k.view(B, L, self.n_kv_heads, self.head_dim)  # (B, L, nkv, hd)
        v = v.view(B, L, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, L, hd)
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output (B, nh, L, hd) -> (B, L, hidden)."""
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(cache.attention(q, k, v, self.scale))  # the cache writes k/v first


class MLP:
    def __init__(self, w: dict[str, Any]):
        self.gate_proj, self.up_proj, self.down_proj = (
            Linear(w[f"{n}.weight"], w.get(f"{n}.bias")) for n in ("gate_proj", "up_proj", "down_proj"))
        self.gate_up: FusedInt8 | FusedLinear | None = None  # gate and up as one matmul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj((tk.silu_mul if FUSED else tk.silu_mul_ref)(gate, up))


class TransformerBlock:
    def __init__(self, w: dict[str, Any], args: Any, rope: RoPE):
        self.self_attn = Attention(_under(w, "self_attn."), args, rope)
        self.mlp = MLP(_under(w, "mlp."))
        self.input_layernorm = RMSNorm(w["input_layernorm.weight"], args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(w["post_attention_layernorm.weight"], args.rms_norm_eps)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = attention_inputs(self, x, cos, sin)
        return attention_outputs(self, x, cache.attention(q, k, v, self.self_attn.scale))


# A block as the two halves around its attention (the cache's, eager): what `Model.compile_decode` compiles,
# one graph each for every layer (the block is an argument, its tensors the graph's inputs).


def attention_inputs(block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return block.self_attn.project(block.input_layernorm(x), cos, sin)


def attention_outputs(block: TransformerBlock, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    h = x + block.self_attn.output(out)
    return h + block.mlp(block.post_attention_layernorm(h))


def _under(w: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}


class Model:
    """Token ids in, final hidden states out; `logits` applies the head to the rows that are sampled."""

    def __init__(self, args: Any, weights: dict[str, Weight], rope: RoPE, device: torch.device):
        self.args, self.device, self.dtype = args, device, None
        self.embed_tokens = Embedding(weights["model.embed_tokens.weight"])
        self.layers = [TransformerBlock(_under(weights, f"model.layers.{i}."), args, rope)
                       for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(weights["model.norm.weight"], args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else Linear(weights["lm_head.weight"])
        self.rope = rope
        self.weight_bytes = sum(_nbytes(w) for w in weights.values())
        self.num_parameters = sum(w.num_parameters if isinstance(w, PACKED) else w.numel() for w in weights.values())
        self.embed_bytes = _nbytes(weights["model.embed_tokens.weight"])

    def layer_outputs(self, ids: torch.Tensor, caches: list[Any] | None = None, num_layers: int | None = None):
        """ids (B, L) -> the embedding output, then each layer's output (B, L, hidden), lazily as a generator."""
        B, L = ids.shape
        n = len(self.layers) if num_layers is None else num_layers
        caches = caches if caches is not None else [FreshAttention()] * n
        cos, sin = self.rope.angles(caches[0].positions(B, L, ids.device))  # (B, 1, L, D/2)
        h = self.embed_tokens(ids)
        yield h
        compiled = self.compiled if self.compiled is not None and B * L <= self.compiled.max_rows else None
        if compiled is None:
            for layer, c in zip(self.layers[:n], caches):
                h = layer(h, cos, sin, c)
                yield h
            return
        N = B * L  # the graphs see one row per token, (1, N, hidden): N = 1 and N > 1 are their two shapes
        h, cos, sin = h.reshape(1, N, -1), cos.reshape(1, 1, N, -1), sin.reshape(1, 1, N, -1)
        layers = self.layers[:n]
        with compiled.stance():
            yield from self._compiled_layers(compiled, layers, caches, h, cos, sin, B, L)

    def _compiled_layers(self, compiled: Any, layers: list[TransformerBlock], caches: list[Any],
                         h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, B: int, L: int):
        N = B * L
        q, k, v = compiled.run(0, N, layers[0], h, cos, sin)  # (1, heads, N, hd)
        for i, (layer, c) in enumerate(zip(layers, caches)):
            if B > 1:
                q, k, v = (t.reshape(t.shape[1], B, L, -1).transpose(0, 1) for t in (q, k, v))  # (B, heads, L, hd)
            out = c.attention(q, k, v, layer.self_attn.scale)  # the cache writes k/v first
            if B > 1:
                out = out.transpose(0, 1).reshape(1, out.shape[1], N, -1)
            if i + 1 < len(layers):  # this layer's output half and the next one's input half
                h, q, k, v = compiled.run(1, N, layer, layers[i + 1], h, out, cos, sin)
            else:
                h = compiled.run(2, N, layer, h, out)
            yield h.view(B, L, -1)

    compiled: Any = None  # compiled.CompiledHalves: the blocks' halves as torch.compile graphs (compile_decode)

    def compile_decode(self, max_rows: int) -> None:
        """Forwards of at most `max_rows` rows (decode steps, batched or not, short speculative verifications)
        run each block's halves around its attention as torch.compile graphs; longer ones stay eager."""
        from mlx_engine.backends.torch.compiled import CompiledHalves

        self.compiled = CompiledHalves(max_rows)

    def __call__(self, ids: torch.Tensor, caches: list[Any] | None = None, num_layers: int | None = None) -> torch.Tensor:
        """ids (B, L) -> final hidden states (B, L, hidden), after the first `num_layers` layers (all: None)."""
        h = None
        for h in self.layer_outputs(ids, caches, num_layers):
            pass
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if isinstance(head, cpu_packed.CPUWeight):
            return cpu_packed.head_matmul(head, h)
        return self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)


# --- weights: from the checkpoint's MLX arrays ---------------------------------------------------------


def _to_numpy(a: Any) -> np.ndarray:
    import mlx.core as mx

    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: through float32 (exact)
        a = a.astype(mx.float32)
    return np.array(a)


def convert_weights(weights: dict[str, Any], quantization: dict[str, Any] | None, dtype: torch.dtype,
                    device: torch.device, source: str, packed: bool,
                    cpu: cpu_packed.CPUSupport | None = None) -> dict[str, Weight]:
    """The checkpoint's MLX arrays -> torch: float tensors in `dtype` on `device`; each quantized layer
    (`<path>.weight/.scales/.biases`) as a QuantizedWeight when `packed` (the Triton kernel's bit widths and
    group sizes), held for torch's CPU kernels with `cpu` (`cpu_packed`), else dequantized to a float tensor by
    mx.dequantize. `weights` is emptied as it goes, so that each source array is freed once converted."""
    import mlx.core as mx

    quantization = quantization or {}
    if quantization.get("mode", "affine") != "affine":
        raise ModelLoadError(f"{source}: {quantization['mode']!r} quantization is not supported on the torch backend "
                             "(supported: MLX affine quantization, GGUF Q4_0/Q4_1/Q8_0)")
    out: dict[str, Weight] = {}
    paths = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    kquants = {p: spec["kquant"] for p, spec in quantization.items() if isinstance(spec, dict) and "kquant" in spec}
    for key in [k for k in weights if k.rpartition(".")[2] == "weight"] + [k for k in weights]:
        if key not in weights:
            continue
        value = weights.pop(key)
        path, _, leaf = key.rpartition(".")
        if path in kquants and leaf == "weight":
            out[key] = kquant_weight(value, kquants[path], dtype, device, packed, cpu)
            continue
        if path in paths and leaf == "weight":
            spec = quantization.get(path) if isinstance(quantization.get(path), dict) else {}
            bits = int(spec.get("bits", quantization.get("bits", 4)))
            group = int(spec.get("group_size", quantization.get("group_size", 64)))
            scales, biases = weights.pop(f"{path}.scales"), weights.pop(f"{path}.biases", None)
            if biases is None:
                raise ModelLoadError(f"{source}: {path} is quantized without biases (only affine quantization "
                                     "is supported on the torch backend)")
            if packed and bits in tk.SUPPORTED_BITS and group in tk.SUPPORTED_GROUP_SIZES:
                def t(a: Any) -> torch.Tensor:
                    return torch.from_numpy(_to_numpy(a)).to(device=device, dtype=dtype)

                words = torch.from_numpy(np.array(value).view(np.int32)).to(device)  # uint32 bits as int32
                out[key] = QuantizedWeight(words, t(scales), t(biases), bits, group)
                continue
            if cpu is not None:
                out[key] = cpu_affine_weight(value, scales, biases, bits, group, cpu.block_n)
                continue
            value = mx.dequantize(value, scales.astype(mx.float32), biases.astype(mx.float32), group, bits)
        if not mx.issubdtype(value.dtype, mx.floating):
            raise ModelLoadError(f"{source}: tensor {key} has dtype {value.dtype} and is not a quantized weight")
        out[key] = torch.from_numpy(_to_numpy(value)).to(device=device, dtype=dtype)
    return out


def cpu_affine_weight(words: Any, scales: Any, biases: Any, bits: int, group: int, block_n: int) -> Weight:
    """An MLX affine-quantized matrix -> int4 planes (`cpu_packed.Int4Weight`; its codes read by
    mx.dequantize with unit scales and zero biases, exact in any of MLX's bit layouts), or int8 rows for a
    group size the int4 kernel lacks."""
    import mlx.core as mx

    source_bytes = sum(a.nbytes for a in (words, scales, biases))
    if group not in cpu_packed.INT4_GROUP_SIZES or bits > 8:
        w = mx.dequantize(words, scales.astype(mx.float32), biases.astype(mx.float32), group, bits)
        w8 = cpu_packed.Int8Weight(torch.from_numpy(np.array(w)), source_bytes)
        w8.source = f"{bits}-bit g{group}"
        return w8
    n = words.shape[0]
    if bits in (4, 8):  # little-endian words: a byte is two codes, low nibble first, or one
        b = np.array(words).view(np.uint8)
        codes = b if bits == 8 else np.stack([b & 15, b >> 4], axis=-1).reshape(n, -1)
    else:
        codes = np.empty((n, words.shape[1] * 32 // bits), np.uint8)
        ones = mx.ones((1, scales.shape[1]), mx.float32)
        step = max(1, 2**22 // codes.shape[1])  # rows a float32 transient of 16 MiB holds
        for lo in range(0, n, step):
            part = words[lo:lo + step]
            unit, zero = mx.broadcast_to(ones, (part.shape[0], ones.shape[1])), mx.zeros((part.shape[0], ones.shape[1]))
            codes[lo:lo + step] = np.array(mx.dequantize(part, unit, zero, group, bits))
    w = cpu_packed.Int4Weight.from_affine(codes, _to_numpy(scales).astype(np.float32),
                                          _to_numpy(biases).astype(np.float32), bits, group, block_n)
    w.source_bytes, w.source = source_bytes, f"{bits}-bit g{group}"
    return w


# The bits of a k-quant's codes in `kquant_affine`'s affine form (which widens Q5_K to 8 for the Triton kernel)
KQUANT_CODE_BITS = {"Q4_K": 4, "Q5_K": 5}


def kquant_weight(blocks: Any, ggml_type: str, dtype: torch.dtype, device: torch.device, packed: bool,
                  cpu: cpu_packed.CPUSupport | None = None) -> Weight:
    """A GGUF k-quant matrix's raw blocks (`load_checkpoint(kquant_blocks=True)`, uint8 (out, in / 256 *
    bytes per block)) -> packed for `dequant_matmul` (its sub-blocks as affine groups of 16 or 32, float32
    scales: `kernels_metal.reference.kquant_affine`); for torch's CPU kernels with `cpu` (Q4_K and Q5_K as
    int4 planes of groups of 32, Q2_K, Q3_K and Q6_K, whose groups are 16, as int8 rows); or, unpacked,
    dequantized and rounded to float16 as the MLX backend keeps them."""
    import mlx.core as mx

    from kernels_metal.reference import KQUANT_BLOCK_BYTES, dequantize_kquant, kquant_affine
    from mlx_engine.loading.gguf_tensors import pack_words

    out_features, in_features = blocks.shape[0], blocks.shape[1] // KQUANT_BLOCK_BYTES[ggml_type] * 256
    if cpu is not None:
        if ggml_type in KQUANT_CODE_BITS:
            q, scales, biases, _, group = kquant_affine(blocks, ggml_type, out_features, in_features)
            w = cpu_packed.Int4Weight.from_affine(np.array(q), np.array(scales), np.array(biases),
                                                  KQUANT_CODE_BITS[ggml_type], group, cpu.block_n)
        else:
            w = cpu_packed.Int8Weight(torch.from_numpy(np.array(dequantize_kquant(blocks, ggml_type, out_features,
                                                                                  in_features))))
        w.source_bytes, w.source = blocks.nbytes, ggml_type
        return w
    if packed:
        q, scales, biases, bits, group = kquant_affine(blocks, ggml_type, out_features, in_features)
        words = pack_words(np.array(q), bits).view(np.int32)

        def t(a: Any) -> torch.Tensor:
            return torch.from_numpy(np.array(a)).to(device)

        return QuantizedWeight(t(words), t(scales), t(biases), bits, group, act_dtype=dtype)
    w = dequantize_kquant(blocks, ggml_type, out_features, in_features).astype(mx.float16)
    return torch.from_numpy(_to_numpy(w)).to(device=device, dtype=dtype)


def build_model(args: Any, weights: dict[str, Any], quantization: dict[str, Any] | None, dtype: torch.dtype,
                device: torch.device, source: str, freq_factors: Any = None, packed: bool = False,
                cpu: cpu_packed.CPUSupport | None = None) -> Model:
    """`weights` is emptied as they convert (each source array freed once converted). `cpu`: quantized
    weights held for torch's CPU kernels (`cpu_packed`), q/k/v and gate/up fused where they share a format."""
    for k in [k for k in weights if "rotary_emb.inv_freq" in k or (args.tie_word_embeddings and k.startswith("lm_head."))]:
        del weights[k]
    tensors = convert_weights(weights, quantization, dtype, device, source, packed, cpu)
    rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                args.rope_traditional, None if freq_factors is None else _to_numpy(freq_factors)).to(device)
    _check_names(args, set(tensors), source)
    model = Model(args, tensors, rope, device)
    model.dtype = dtype
    if cpu is not None:
        fuse_projections(model)
    return model


def _check_names(args: Any, names: set[str], source: str) -> None:
    """The checkpoint's tensors are exactly the architecture's (biases where the config allows them)."""
    required = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if args.tie_word_embeddings
                                                                      else {"lm_head.weight"})
    optional = set()
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        required |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            required.add(f"{p}self_attn.{name}.weight")
            optional.add(f"{p}self_attn.{name}.bias")
        for name in ("gate_proj", "up_proj", "down_proj"):
            required.add(f"{p}mlp.{name}.weight")
            optional.add(f"{p}mlp.{name}.bias")
        if args.qk_norm:
            required |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    missing, unexpected = sorted(required - names), sorted(names - required - optional)
    if missing or unexpected:
        detail = "; ".join(f"{what} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                           for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise ModelLoadError(f"{source}: weights do not match the {args.model_type!r} architecture: {detail}")
