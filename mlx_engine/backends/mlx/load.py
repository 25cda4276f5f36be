"""The MLX runner's load-time choices: activation dtype, wired memory on Metal, the host-BLAS path on the CPU,
a draft held at fewer bits, and the shape that prices a decode step."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_engine.api import RooflineError

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def pick_dtype(requested: str | None, checkpoint_dtype: str) -> mx.Dtype:
    """On MLX's CPU backend activations stay float32: its quantized matvec is ~35x slower with float16
    activations and ~8x with bfloat16 (2-core x86-64, 4096x4096). On Metal the checkpoint's dtype."""
    if requested is not None:
        if requested not in _DTYPES:
            raise RooflineError(f"dtype={requested!r}: expected one of {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    if not mx.metal.is_available():
        return mx.float32
    return _DTYPES.get(checkpoint_dtype, mx.float16)


def wire_memory(weight_bytes: int) -> str:
    """On Metal, keeps up to the recommended working set resident (`mx.set_wired_limit`), as mlx-lm does for each
    of its generations: the weights and KV are not paged out between requests, so an idle chat's next reply or
    a server's next request runs at full speed. Process-wide, for as long as the process runs. Returns a note
    when the weights alone come near that limit (then generation may page and be slow), else ""."""
    if not mx.metal.is_available():
        return ""
    limit = int(mx.metal.device_info()["max_recommended_working_set_size"])
    mx.set_wired_limit(limit)
    if weight_bytes > 0.9 * limit:
        return (f"the weights take {weight_bytes / 2**30:.1f} GiB of the {limit / 2**30:.1f} GiB Metal keeps "
                "resident: generation may be slow (a smaller quantization would fit)")
    return ""


def use_host_blas(model: Any, act_dtype: mx.Dtype) -> tuple[int, int, str]:
    """On MLX's CPU backend, routes projections to numpy's BLAS (host_blas): with resident float32
    weights when they fit, else only prefill-sized ones. Returns (host bytes allocated, MLX bytes the
    host path stops reading, a note for ModelInfo)."""
    if mx.metal.is_available() or act_dtype != mx.float32:
        return 0, 0, ""
    from mlx_engine.kv.config import available_memory_bytes
    from mlx_engine.backends.mlx import host_blas

    fits, why = host_blas.host_weights_fit(host_blas.host_weights_bytes(model), available_memory_bytes(0))
    if not fits:
        host_blas.use_host_gemm_for_prefill(model)
        return 0, 0, f"CPU: quantized weights stay packed ({why}); decode uses MLX's quantized matvec"
    allocated, idle = host_blas.use_host_weights(model)
    return allocated, idle, (f"CPU: projections run on float32 copies of the weights in numpy's BLAS "
                             f"({allocated / 2**20:.0f} MiB, {why})")


DRAFT_GROUP_SIZE = 64


def quantize_weights(model: Any, bits: int, group_size: int = DRAFT_GROUP_SIZE) -> None:
    """Every linear layer and embedding of `model` as affine `bits`-bit groups of `group_size` (a draft held at
    lower precision than its target: `draft_bits`): quantized ones are dequantized and quantized again, float
    ones go through mlx.nn.quantize (those whose rows do not split into groups stay float)."""
    import mlx.nn as nn

    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits,
                              mode=getattr(m, "mode", "affine"))
            q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
            m.weight, m.scales, m.biases = q, scales.astype(w.dtype), biases.astype(w.dtype)
            m.group_size, m.bits, m.mode = group_size, bits, "affine"
    nn.quantize(model, group_size, bits, class_predicate=lambda _, m: type(m) in (nn.Linear, nn.Embedding)
                and m.weight.shape[-1] % group_size == 0)


def decode_shape(config: dict[str, Any], params: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, Any]:
    heads = int(config.get("num_attention_heads") or 1)
    embed = [v for k, v in params.items() if "embed_tokens" in k]
    return {
        "embed_bytes": sum(v.nbytes for v in embed),
        "tied": not any("lm_head" in k for k in params),
        "layers": int(config.get("num_hidden_layers") or 0),
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads),
        "kv_itemsize": dtype.size,
    }
