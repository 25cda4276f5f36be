"""GGUF k-quant layers for Metal: the weights stay in their super-blocks and decode reads them through
`kernels_metal.dequant_matmul_kquant` (the Metal kernel; its MLX-op reference elsewhere).

On Metal a k-quant model would otherwise run from float16 copies (`loading.gguf_tensors`): about 3.5x the
bytes of the blocks on every decode step, which is bandwidth-bound there. Up to `MAX_M` rows (decode,
short verifications) go through the kernel; wider inputs (prefill) dequantize the blocks and multiply.
MLX's CPU backend keeps the float16 copies (its own fast path reads float32 host weights,
`backends.mlx.host_blas`); `blocks_here()` says which.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels_metal import dequant_matmul_kquant
from kernels_metal.kquant import MAX_M
from kernels_metal.reference import dequantize_kquant
from quant.formats import row_bytes


def blocks_here() -> bool:
    """Whether k-quant matrices load as blocks for these layers: on Metal."""
    return mx.metal.is_available()


def _matmul(x: mx.array, blocks: mx.array, ggml_type: str, out_features: int, in_features: int) -> mx.array:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] <= MAX_M:
        y = dequant_matmul_kquant(x2, blocks, ggml_type, out_features, in_features)
    else:
        y = x2 @ dequantize_kquant(blocks, ggml_type, out_features, in_features).astype(x.dtype).T
    return y.astype(x.dtype).reshape(*lead, out_features)


class KQuantLinear(nn.Module):
    def __init__(self, ggml_type: str, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, out_features
        self.weight = mx.zeros((out_features, row_bytes(ggml_type, in_features)), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((out_features,))

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(x, self.weight, self.ggml_type, self.out_features, self.in_features)
        return y + self.bias if "bias" in self else y


class KQuantEmbedding(nn.Module):
    def __init__(self, ggml_type: str, num_embeddings: int, dims: int, dtype: mx.Dtype):
        super().__init__()
        self.ggml_type, self.num_embeddings, self.dims, self.dtype = ggml_type, num_embeddings, dims, dtype
        self.weight = mx.zeros((num_embeddings, row_bytes(ggml_type, dims)), dtype=mx.uint8)

    def __call__(self, ids: mx.array) -> mx.array:
        flat = ids.reshape(-1)
        rows = dequantize_kquant(self.weight[flat], self.ggml_type, flat.size, self.dims)
        return rows.astype(self.dtype).reshape(*ids.shape, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        return _matmul(x, self.weight, self.ggml_type, self.num_embeddings, self.dims)


def use_kquant_layers(model: nn.Module, quantization: dict[str, Any] | None, dtype: mx.Dtype) -> int:
    """Replaces each layer whose quantization entry is {"kquant": type} (`load_checkpoint(kquant_blocks=True)`)
    by its k-quant twin, before the weights load. Returns how many."""
    replaced = 0
    for path, spec in (quantization or {}).items():
        if not (isinstance(spec, dict) and "kquant" in spec):
            continue
        *parents, name = path.split(".")
        parent: Any = model
        for part in parents:
            parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
        old = getattr(parent, name)
        if isinstance(old, nn.Embedding):
            new: nn.Module = KQuantEmbedding(spec["kquant"], old.weight.shape[0], old.weight.shape[1], dtype)
        elif isinstance(old, nn.Linear):
            out_features, in_features = old.weight.shape
            new = KQuantLinear(spec["kquant"], in_features, out_features, "bias" in old)
        else:
            raise TypeError(f"{path}: a {type(old).__name__} cannot hold k-quant blocks")
        setattr(parent, name, new)
        replaced += 1
    return replaced
