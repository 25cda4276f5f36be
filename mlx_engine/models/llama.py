"""The Llama family: llama (incl. llama3 rope scaling), and the shared block used by mistral, qwen2, qwen3.

Pure math: state (the KV cache) is passed in, one view per layer (`kv.protocol.MLXLayerView`): the view ropes
q and k at its positions and attends (writing k and v first), whatever cache it belongs to, so a layer never
asks what kind of cache it has. `Model.__call__` returns final hidden states; the engine applies `Model.logits`
only to the positions it samples from (prefill needs just the last one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_traditional: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v and o (llama's attention_bias)
    qkv_bias: bool = False  # bias on q, k, v only (qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (qwen3)
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention" (transformers 5)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention): `layer_types` where the config lists them, else
        `sliding_window` on every layer (mistral). The KV cache keeps one storage per kind (`kv.kinds`)."""
        n, w = self.num_hidden_layers, self.sliding_window
        if w is None:
            return [None] * n
        if self.layer_types:
            return [w if t == "sliding_attention" else None for t in self.layer_types[:n]]
        return [w] * n


class Attention(nn.Module):
    fused_qkv: Any = None  # set on MLX's CPU backend: x -> (q, k, v) in one host GEMM (backends.mlx.host_blas)

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.scale = hd**-0.5
        qkv_bias = args.attention_bias or args.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=args.attention_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = initialize_rope(
            hd, args.rope_theta, args.rope_traditional, args.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.fused_qkv(x) if self.fused_qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.reshape(B, L, self.n_heads, -1)  # (B, L, nh, hd)
        k = k.reshape(B, L, self.n_kv_heads, -1)  # (B, L, nkv, hd)
        v = v.reshape(B, L, self.n_kv_heads, -1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, nh, L, hd)
        q, k = cache.rope(self.rope, q, k)
        out = cache.attention(q, k, v, self.scale)  # (B, nh, L, hd)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    fused_gate_up: Any = None  # set on MLX's CPU backend: x -> (gate, up) in one host GEMM (backends.mlx.host_blas)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.fused_gate_up(x) if self.fused_gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(nn.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """inputs (B, L) token ids -> final hidden states (B, L, hidden). `cache`: a view per layer; None: a
        forward from position 0 that keeps nothing."""
        return self.model.norm(self.hidden(inputs, cache))

    def hidden(self, inputs: mx.array, cache: list[Any] | None = None, num_layers: int | None = None) -> mx.array:
        """inputs (B, L) -> the output of the first `num_layers` decoder layers (all: None), before the final
        norm (the self draft reads the target's early layers)."""
        h = self.model.embed_tokens(inputs)
        for layer, c in zip(self.layers[:num_layers], cache or self._uncached()):
            h = layer(h, c)
        return h

    def layer_outputs(self, inputs: mx.array) -> list[mx.array]:
        """[embedding output, output of decoder layer 0, ..., layer N-1], each (B, L, hidden), from position 0
        without a cache (`Engine.hidden_states`)."""
        out = [self.model.embed_tokens(inputs)]
        for layer, c in zip(self.layers, self._uncached()):
            out.append(layer(out[-1], c))
        return out

    def _uncached(self) -> list[Any]:
        from mlx_engine.kv.contiguous import Uncached

        return [Uncached(w) for w in self.args.layer_windows()]

    def logits(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


def make_args(config: dict[str, Any], **overrides: Any) -> ModelArgs:
    """Builds ModelArgs from a HF config.json dict, in either rope convention."""
    from mlx_engine.models.config import rope_settings

    theta, scaling = rope_settings(config)
    fields = set(ModelArgs.__dataclass_fields__)
    kwargs = {k: v for k, v in config.items() if k in fields and k not in ("rope_theta", "rope_scaling", "extra")}
    kwargs.update(rope_theta=theta, rope_scaling=scaling)
    kwargs.setdefault("max_position_embeddings", 4096)
    if kwargs.get("max_position_embeddings") is None:
        kwargs["max_position_embeddings"] = 4096
    kwargs.update(overrides)
    return ModelArgs(**kwargs)


def args_from_config(config: dict[str, Any]) -> ModelArgs:
    return make_args(config, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
