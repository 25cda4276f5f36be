"""Layer variants chosen per backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Rows (batch x tokens) from which dequantize-then-matmul beats MLX's CPU quantized matmul, whose cost
# grows linearly with rows (measured on the 2-core x86-64 box: 1536x576 4-bit, 36 rows: 110 ms vs 28 ms).
DEQUANT_MIN_ROWS = 8


class DequantPrefillLinear(nn.QuantizedLinear):
    """A QuantizedLinear that, for many rows (prefill), dequantizes its weight once and runs a dense matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows < DEQUANT_MIN_ROWS:
            return super().__call__(x)
        w = mx.dequantize(self.weight, self.scales, self.get("biases"), self.group_size, self.bits,
                          mode=self.mode).astype(x.dtype)  # (out, in)
        y = x @ w.T
        if "bias" in self:
            y = y + self.bias
        return y


def use_dequant_prefill(model: nn.Module) -> int:
    """Switches every affine QuantizedLinear to DequantPrefillLinear (for MLX's CPU backend); returns the count."""
    n = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and getattr(module, "mode", "affine") == "affine":
            module.__class__ = DequantPrefillLinear
            n += 1
    return n
