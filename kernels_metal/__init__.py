"""Custom Metal kernels for the engine, each with an MLX-ops reference and a CPU interpreter path.

`paged_decode_attention`: decode attention through block tables (float or 4/8-bit KV).
`dequant_matmul_kquant`: small-M matmul against GGUF k-quant weights, dequantized on the fly.
"""

from kernels_metal.kquant import dequant_matmul_kquant
from kernels_metal.paged_attention import paged_decode_attention

__all__ = ["dequant_matmul_kquant", "paged_decode_attention"]
