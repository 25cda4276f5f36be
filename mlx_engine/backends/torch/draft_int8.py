"""The int8 draft on the torch CPU backend (`draft_bits=8`): a float32 model's projections quantized to int8 at
load for torch's dynamic-quantized CPU matmul (`quantize_int8`)."""

from __future__ import annotations

import functools
import platform
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from mlx_engine.api import ModelLoadError
from mlx_engine.backends.torch.model import Embedding, Linear, Model, weight_nbytes

# Rows a call sends through the int8 matmul one by one; more are multiplied by the dequantized weight. A draft's
# catch-up (the tokens prompt lookup copied or plain steps took since its last proposal) row by row costs a fixed
# part and a steeper one a row than through the dequantized weight, whose fixed part is larger; they cross near
# here (the readings: docs/benchmarks/torch-cpu.md, "Issue 27 follow-ups")
INT8_MAX_ROW_CALLS = 32


class Int8Weight:
    """A CPU projection as int8, one scale per output row (`draft_bits=8` on the torch CPU backend): packed for
    the CPU's dynamic-quantized matmul (fbgemm or oneDNN on x86, qnnpack on ARM: each call's activations
    quantized to 8 bits on the fly, int32 accumulation), and plain, to dequantize.

    A row (a draft's decode step) goes through the int8 matmul: a quarter of float32's bytes, several times
    faster than float32 at one row. Up to INT8_MAX_ROW_CALLS rows (a catch-up) make one call each: the op takes one
    activation scale for all the rows of a call, so one token's outlier channels would coarsen every other token's
    (the top-1 agreement with float32 falls). More rows (a prefill) multiply the dequantized weight in float32,
    which is bound by compute, not by the weight's bytes (dequantizing is cheap beside it)."""

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
    accumulate in 32 bits, and ARM's qnnpack needs no reduction. 7-bit activations cost a draft some of its
    top-1 agreement with float32, so they are used only where needed."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to read the flags here, so the safe width
        return True
    return re.search(r"\b(avx512_vnni|avx_vnni|amx_int8)\b", flags) is None


class FusedInt8:
    """Projections of one input (q/k/v, gate/up) as one Int8Weight: one int8 matmul instead of three or two
    (fewer calls, each over more rows), split after, each with its bias."""

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
        model.head_matmul = None  # a plain Linear over the int8 rows
    except (RuntimeError, NotImplementedError, AttributeError) as e:  # a torch without its quantized CPU ops
        raise ModelLoadError(f"8-bit weights need torch's quantized CPU matmul (quantized engine "
                             f"{torch.backends.quantized.engine!r}), which failed here: {e}") from None
    norms = [n for b in model.layers for n in (b.input_layernorm, b.post_attention_layernorm,
                                                b.self_attn.q_norm, b.self_attn.k_norm) if n is not None]
    model.weight_bytes = (sum(w.nbytes for b in model.layers for w in (b.self_attn.qkv.weight, b.mlp.gate_up.weight,
                                                                       b.self_attn.o_proj.weight,
                                                                       b.mlp.down_proj.weight))
                          + head.nbytes + (embed.nbytes if embed is not head else 0)
                          + sum(weight_nbytes(n.weight) for n in [*norms, model.norm]))
    model.embed_bytes = embed.nbytes
