"""Custom Metal kernels for the engine, each with an MLX-ops reference and a CPU interpreter path.

`paged_decode_attention`: decode attention through block tables over a `KVPool` (float or 4/8-bit KV).
`dequant_matmul_kquant`: small-M matmul against GGUF k-quant weights, dequantized on the fly.
"""

from kernels_metal.kquant import dequant_matmul_kquant
from kernels_metal.paged_attention import paged_decode_attention
from kernels_metal.pool import KVPool

__all__ = ["KVPool", "dequant_matmul_kquant", "paged_decode_attention"]
