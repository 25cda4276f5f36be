"""The Llama family (llama, mistral, qwen2, qwen3) in PyTorch: the same math as `mlx_engine.models.llama`.

Pure math: state lives in the cache views passed in (`kv.py`). A view gives the positions of the new
tokens (`positions(B, L)`) and does attention (`attention(q, k, v, scale)`, writing k/v to its storage).
A weight is a float tensor or a packed one with a matmul and a row lookup of its own (`PackedWeight`):
how each format is held, and the checkpoint's arrays converted, is `weights.py`'s; the int8 draft's
weights are `draft_int8.py`'s. The layers run eagerly here; the other ways to run them (Roofline's kernel in one
call, torch.compile graphs) are `paths`', which imports this module and never the other way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from mlx_engine.backends.torch import triton_kernels as tk

if TYPE_CHECKING:
    from mlx_engine.backends.torch.draft_int8 import FusedInt8

class PackedWeight(Protocol):
    """A weight held in a format of its own (`weights.QuantizedWeight` on CUDA, `cpu_packed`'s on the CPU,
    `draft_int8.Int8Weight`), read by its own matmul rather than as a float tensor."""

    @property
    def nbytes(self) -> int: ...

    @property
    def num_parameters(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x @ W.T (..., out)."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup): ids (...) -> (..., in)."""
        ...


Weight = torch.Tensor | PackedWeight


@runtime_checkable
class PagedRowsView(Protocol):
    """A layer's cache view that a compiled forward attends in its graph (`paged_attention`): the views of
    `kv.py`. Any other view runs the forward eagerly."""

    def has_paged_rows(self, batch: int) -> bool:
        """Whether `paged_rows` serves a forward of `batch` sequences here."""
        ...

    def paged_rows(self, n: int, kv_shape: tuple[int, int], dtype: torch.dtype) -> PagedRows:
        """The slots a forward of n new rows writes and reads (kv_shape: (Hkv, D), dtype: the K/V's); the view
        counts the rows as written, as `attention` would."""
        ...


def weight_nbytes(w: Weight | None) -> int:
    if w is None:
        return 0
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


class Linear:
    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.linear(x, self.weight, self.bias)
        y = self.weight.matmul(x)
        return y + self.bias if self.bias is not None else y


class FusedLinear:
    """Projections of one input (q/k/v, gate/up) held packed as one matrix (`cpu_packed.fuse`): one kernel
    call, split after, each part with its bias."""

    def __init__(self, weight: PackedWeight, widths: list[int], linears: tuple[Linear, ...]):
        self.weight, self.widths = weight, widths  # each part's columns in the output, its padding included
        self.sizes = [lin.weight.out_features for lin in linears]
        self.biases = [lin.bias for lin in linears]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = self.weight.matmul(x).split(self.widths, dim=-1)
        outs = [y if y.shape[-1] == n else y[..., :n] for y, n in zip(outs, self.sizes)]
        return [y + b if b is not None else y for y, b in zip(outs, self.biases)]


class Embedding:
    def __init__(self, weight: Weight):
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L) -> (B, L, hidden)."""
        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight)
        return self.weight.rows(ids)

    def as_linear(self, h: torch.Tensor) -> torch.Tensor:
        """The tied head: h (..., hidden) -> logits (..., vocab)."""
        return Linear(self.weight)(h)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (tk.rms_norm if tk.FUSED else tk.rms_norm_ref)(x, self.weight, self.eps)


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
        return (tk.rope if tk.FUSED else tk.rope_ref)(x, cos, sin, self.mscale, self.traditional)


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


@dataclass(frozen=True)
class PagedRows:
    """What a compiled forward's attention (`paged_attention`) reads of one layer's cache, for the forward's rows
    (1, N) of new tokens: row n's K/V goes to slot `write[n]` of the token-major pools (slots, Hkv, D), then row n
    attends to slots `gather[n]` with `bias[n]` added to its scores (0 where it sees the key, -inf where not)."""

    pool_k: torch.Tensor  # (slots, Hkv, D)
    pool_v: torch.Tensor
    write: torch.Tensor  # (N,) int64
    gather: torch.Tensor  # (N, S) int64, S >= 2 (dynamo specializes a dim of 1: `rows_of`)
    bias: torch.Tensor  # (N, S) float32


def row_major(t: torch.Tensor, *shape: int) -> torch.Tensor:
    """`t` as `shape` (default its own) with row-major strides, every dim's included (a copy only if `t` is not
    contiguous): the compiled graphs assume their compile's strides and, once warm, nothing checks them."""
    return t.reshape(-1).view(shape or t.shape)


# Rows up to which a forward runs compiled, reading `PagedRows` row-major (decode steps of up to this many
# sequences, speculative verifications): below the rows where the packed matmuls switch to dequantizing (a guard
# inside the graph otherwise). The native step takes more where nothing is compiled.
GRAPH_ROWS = 47


def rows_of(write: torch.Tensor, gather: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(write, gather, bias) of `PagedRows` from each row's slots (N, S) and a mask of those it sees (N, S),
    row-major (the compiled graphs assume their compile's strides), S padded to 2 with an unseen slot."""
    if gather.shape[1] < 2:
        gather = F.pad(gather, (0, 2 - gather.shape[1]))
        visible = F.pad(visible, (0, 2 - visible.shape[1]))
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, -math.inf)
    return write.contiguous(), row_major(gather), bias


def chunk_rows(write: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`rows_of` for a chunk of L new positions, the last L of the S slots (S,) it attends: row i sees the
    slots up to its own, S - L + i."""
    L, S = write.shape[0], slots.shape[0]
    visible = torch.arange(S, device=slots.device)[None, :] <= torch.arange(S - L, S, device=slots.device)[:, None]
    if L <= GRAPH_ROWS:
        return rows_of(write, slots[None].expand(L, S), visible)
    # a prefill chunk's: its slots one row expanded (the native step reads it so), not L copies of S int64
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=slots.device).masked_fill_(~visible, -math.inf)
    return write.contiguous(), slots[None].expand(L, S), bias


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: PagedRows, scale: float) -> torch.Tensor:
    """q (1, Hq, N, D), k, v (1, Hkv, N, D) after rope -> (1, Hq, N, D): the rows' K/V written to their slots,
    then each row's attention over the slots it gathers, in torch ops that inductor fuses into the compiled
    step (no eager write, gather and SDPA per layer)."""
    _, Hq, N, D = q.shape
    Hkv = k.shape[1]
    rows.pool_k.index_put_((rows.write,), k[0].transpose(0, 1).to(rows.pool_k.dtype))
    rows.pool_v.index_put_((rows.write,), v[0].transpose(0, 1).to(rows.pool_v.dtype))
    keys = rows.pool_k[rows.gather].float()  # (N, S, Hkv, D)
    values = rows.pool_v[rows.gather].float()
    qg = q[0].float().reshape(Hkv, Hq // Hkv, N, D).permute(2, 0, 1, 3)  # (N, Hkv, G, D)
    scores = torch.einsum("nhgd,nshd->nhgs", qg, keys) * scale + rows.bias[:, None, None, :]
    out = torch.einsum("nhgs,nshd->nhgd", torch.softmax(scores, dim=-1), values)  # (N, Hkv, G, D)
    return out.reshape(N, Hq, D).transpose(0, 1)[None].to(q.dtype)


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
        return self.down_proj((tk.silu_mul if tk.FUSED else tk.silu_mul_ref)(gate, up))


class TransformerBlock:
    def __init__(self, w: dict[str, Any], args: Any, rope: RoPE):
        self.self_attn = Attention(_under(w, "self_attn."), args, rope)
        self.mlp = MLP(_under(w, "mlp."))
        self.input_layernorm = RMSNorm(w["input_layernorm.weight"], args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(w["post_attention_layernorm.weight"], args.rms_norm_eps)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = attention_inputs(self, x, cos, sin)
        return attention_outputs(self, x, cache.attention(q, k, v, self.self_attn.scale))


# A block as the two halves around its attention: what `paths.compiled` compiles with `paged_attention`
# between them, one graph each for every layer (the block is an argument, its tensors the graph's inputs).


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
        self.weight_bytes = sum(weight_nbytes(w) for w in weights.values())
        self.num_parameters = sum(w.numel() if isinstance(w, torch.Tensor) else w.num_parameters
                                  for w in weights.values())
        self.embed_bytes = weight_nbytes(weights["model.embed_tokens.weight"])

    # The head's own matmul where its weight format has one (`cpu_packed.head_matmul`: the top logits recomputed in
    # float32 from exact rows), set by the loader (`weights.build_model`); else the head is a plain Linear
    head_matmul: Callable[[Weight, torch.Tensor], torch.Tensor] | None = None

    def layer_outputs(self, ids: torch.Tensor, caches: list[Any] | None = None, num_layers: int | None = None):
        """ids (B, L) -> the embedding output, then each layer's output (B, L, hidden), lazily as a generator."""
        B, L = ids.shape
        n = len(self.layers) if num_layers is None else num_layers
        caches = caches if caches is not None else [FreshAttention()] * n
        cos, sin = self.rope.angles(caches[0].positions(B, L, ids.device))  # (B, 1, L, D/2)
        h = self.embed_tokens(ids)
        yield h
        for layer, c in zip(self.layers[:n], caches):
            h = layer(h, cos, sin, c)
            yield h

    def __call__(self, ids: torch.Tensor, caches: list[Any] | None = None, num_layers: int | None = None) -> torch.Tensor:
        """ids (B, L) -> final hidden states (B, L, hidden), after the first `num_layers` layers (all: None), the
        layers run eagerly (the other ways to run them: `paths`)."""
        for h in self.layer_outputs(ids, caches, num_layers):
            pass
        return self.norm(h)

    def head(self) -> Weight:
        """The output head's weight (the embedding's, tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., hidden) -> logits (..., vocab)."""
        if self.head_matmul is not None:
            return self.head_matmul(self.head(), h)
        return self.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)
