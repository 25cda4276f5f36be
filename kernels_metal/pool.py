"""`KVPool`: one layer's paged K and V as the decode-attention kernel and its reference read them."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class KVPool:
    """One layer's K and V pools, token-major and blocked: (num_blocks, block_size, Hkv, D) in float16, bfloat16
    or float32, or with `bits` 4 or 8 uint32 (.., D * bits / 32) packed by `mx.quantize` along D, with scales and
    biases (num_blocks, block_size, Hkv, D // group_size).

    `k_bits` (4 or 8): the keys' bits when they differ from the values' `bits` (k's last dim D * k_bits / 32);
    None: the keys take `bits`. `k_per_channel` (quantized KV only): the keys are quantized per channel over each
    block's tokens (KIVI); k_scales/k_biases are then (num_blocks, block_size, Hkv, D // block_size), entry
    (blk, i, h, g) the scale (bias) of channel g * block_size + i for every token of block blk
    (`reference.quantize_channels` writes them), so block_size must divide D."""

    k: mx.array
    v: mx.array
    k_scales: mx.array | None = None
    k_biases: mx.array | None = None
    v_scales: mx.array | None = None
    v_biases: mx.array | None = None
    bits: int | None = None
    group_size: int = 64
    k_bits: int | None = None
    k_per_channel: bool = False

    @property
    def key_bits(self) -> int | None:
        """The keys' bits (None: float keys)."""
        return self.bits if self.k_bits is None else self.k_bits

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def scales(self) -> dict[str, mx.array | None]:
        """The four scale and bias arrays by name (all None for float KV)."""
        return {"k_scales": self.k_scales, "k_biases": self.k_biases, "v_scales": self.v_scales,
                "v_biases": self.v_biases}
