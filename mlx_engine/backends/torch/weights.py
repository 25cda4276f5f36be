"""The checkpoint's MLX arrays as the torch model's weights (`build_model`): float tensors, or quantized layers
held packed. MLX affine-quantized weights (uint32 words packed low bits first, per-group scales and biases)
stay packed on CUDA, where `triton_kernels.dequant_matmul` reads them (`QuantizedWeight`: bit widths and group
sizes it supports; others are dequantized at load), and on an x86-64 CPU with AVX2, where Roofline's own kernel
(`cpu_native`) or torch's int4 and int8 CPU kernels read them (`cpu_packed`). GGUF k-quants arrive as raw blocks
(`kquant_weight`): packed as affine groups on CUDA and on the CPU. Elsewhere (a CPU without AVX2) quantized weights are dequantized once at
load, to float32: the portable path.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mlx_engine.api import ModelLoadError
from mlx_engine.backends.torch import cpu_packed
from mlx_engine.backends.torch import triton_kernels as tk
from mlx_engine.backends.torch.cpu_features import CPUSupport
from mlx_engine.backends.torch.model import FusedLinear, Model, RoPE, Weight


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
        trim_heap()  # the parts' pages, before the next layer's copies


def _to_numpy(a: Any) -> np.ndarray:
    import mlx.core as mx

    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: through float32 (exact)
        a = a.astype(mx.float32)
    return np.array(a)


def convert_weights(weights: dict[str, Any], quantization: dict[str, Any] | None, dtype: torch.dtype,
                    device: torch.device, source: str, packed: bool,
                    cpu: CPUSupport | None = None) -> dict[str, Weight]:
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
    converted = 0  # source bytes converted since the heap was last trimmed
    for key in [k for k in weights if k.rpartition(".")[2] == "weight"] + [k for k in weights]:
        if key not in weights:
            continue
        value = scales = biases = None  # the last tensor's arrays freed before the next is read
        if converted >= TRIM_BYTES:
            trim_heap()
            converted = 0
        value = weights.pop(key)
        converted += value.nbytes
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
                out[key] = cpu_affine_weight(value, scales, biases, bits, group, cpu)
                continue
            value = mx.dequantize(value, scales.astype(mx.float32), biases.astype(mx.float32), group, bits)
        if not mx.issubdtype(value.dtype, mx.floating):
            raise ModelLoadError(f"{source}: tensor {key} has dtype {value.dtype} and is not a quantized weight")
        out[key] = torch.from_numpy(_to_numpy(value)).to(device=device, dtype=dtype)
    return out


def cpu_affine_weight(words: Any, scales: Any, biases: Any, bits: int, group: int,
                      cpu: CPUSupport) -> Weight:
    """An MLX affine-quantized matrix -> int4 planes (`cpu_packed.Int4Weight`; its codes read by
    mx.dequantize with unit scales and zero biases, exact in any of MLX's bit layouts), or int8 rows for a
    group size the int4 kernel lacks."""
    import mlx.core as mx

    source_bytes = sum(a.nbytes for a in (words, scales, biases))
    n = words.shape[0]
    if group not in cpu_packed.INT4_GROUP_SIZES or bits > 8:
        def rows(lo: int, hi: int) -> torch.Tensor:
            return torch.from_numpy(np.array(mx.dequantize(words[lo:hi], scales[lo:hi].astype(mx.float32),
                                                           biases[lo:hi].astype(mx.float32), group, bits)))

        w8 = cpu_packed.int8_weight(rows, (n, words.shape[1] * 32 // bits), cpu, source_bytes)
        w8.source = f"{bits}-bit g{group}"
        return w8
    ones = mx.ones((1, scales.shape[1]), mx.float32)

    def codes(lo: int, hi: int) -> np.ndarray:  # rows [lo, hi)'s codes, as `from_affine_rows` packs them
        part = words[lo:hi]
        if bits in (4, 8):  # little-endian words: a byte is two codes, low nibble first, or one
            b = np.asarray(part).view(np.uint8)
            return b if bits == 8 else np.stack([b & 15, b >> 4], axis=-1).reshape(hi - lo, -1)
        unit, zero = mx.broadcast_to(ones, (hi - lo, ones.shape[1])), mx.zeros((hi - lo, ones.shape[1]))
        return np.array(mx.dequantize(part, unit, zero, group, bits)).astype(np.uint8)

    w = cpu_packed.affine_weight(codes, _to_numpy(scales).astype(np.float32), _to_numpy(biases).astype(np.float32),
                                 (n, words.shape[1] * 32 // bits), bits, group, cpu)
    w.source_bytes, w.source = source_bytes, f"{bits}-bit g{group}"
    return w


def kquant_weight(blocks: Any, ggml_type: str, dtype: torch.dtype, device: torch.device, packed: bool,
                  cpu: CPUSupport | None = None) -> Weight:
    """A GGUF k-quant matrix's raw blocks (`load_checkpoint(kquant_blocks=True)`, uint8 (out, in / 256 *
    bytes per block)) -> packed for `dequant_matmul` (its sub-blocks as affine groups of 16 or 32, float32
    scales: `quant.kquant.kquant_affine`); for the CPU kernels with `cpu` (Q4_K and Q5_K as 4- and
    5-bit codes with their scales in two levels for Roofline's kernel, else int4 planes of groups of 32; Q6_K as
    6-bit codes with its int8 scale per 16 for Roofline's kernel; Q2_K and Q3_K, and Q6_K elsewhere, whose groups
    are 16, as int8 rows); or, unpacked,
    dequantized and rounded to float16 as the MLX backend keeps them."""
    import mlx.core as mx

    from kernels_metal.reference import dequantize_kquant
    from quant.formats import KQUANT_CODE_BITS, TWO_LEVEL_SCALES, block_format
    from quant.kquant import kquant_affine, kquant_scales, q6k_scales
    from quant.mlx_layout import pack_codes

    raw = np.asarray(blocks)
    f = block_format(ggml_type)
    out_features, in_features = raw.shape[0], raw.shape[1] // f.block_bytes * f.block_weights
    if cpu is not None:  # a slice of rows at a time: no whole matrix of codes or floats (a head's: 400 MB at 1B)
        def codes(lo: int, hi: int) -> np.ndarray:
            return kquant_affine(raw[lo:hi], ggml_type, hi - lo, in_features)[0]

        if ggml_type in TWO_LEVEL_SCALES:
            w = cpu_packed.kquant_weight(codes, *kquant_scales(raw, ggml_type, out_features, in_features),
                                         (out_features, in_features), KQUANT_CODE_BITS[ggml_type], cpu)
        else:
            def rows(lo: int, hi: int) -> torch.Tensor:
                return torch.from_numpy(np.array(dequantize_kquant(blocks[lo:hi], ggml_type, hi - lo, in_features)))

            if ggml_type == "Q6_K":
                w = cpu_packed.q6k_weight(codes, *q6k_scales(raw, out_features), (out_features, in_features), rows,
                                          cpu)
            else:
                w = cpu_packed.int8_weight(rows, (out_features, in_features), cpu)
        w.source_bytes, w.source = blocks.nbytes, ggml_type
        return w
    if packed:
        q, scales, biases, bits, group = kquant_affine(raw, ggml_type, out_features, in_features)
        words = pack_codes(q, bits).view(np.int32)

        def t(a: Any) -> torch.Tensor:
            return torch.from_numpy(np.array(a)).to(device)

        return QuantizedWeight(t(words), t(scales), t(biases), bits, group, act_dtype=dtype)
    w = dequantize_kquant(blocks, ggml_type, out_features, in_features).astype(mx.float16)
    return torch.from_numpy(_to_numpy(w)).to(device=device, dtype=dtype)


def build_model(args: Any, weights: dict[str, Any], quantization: dict[str, Any] | None, dtype: torch.dtype,
                device: torch.device, source: str, freq_factors: Any = None, packed: bool = False,
                cpu: CPUSupport | None = None) -> Model:
    """`weights` is emptied as they convert (each source array freed once converted). `cpu`: quantized
    weights held for torch's CPU kernels (`cpu_packed`), q/k/v and gate/up fused where they share a format."""
    for k in [k for k in weights if "rotary_emb.inv_freq" in k or (args.tie_word_embeddings and k.startswith("lm_head."))]:
        del weights[k]
    with _no_mlx_cache():
        tensors = convert_weights(weights, quantization, dtype, device, source, packed, cpu)
    rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                args.rope_traditional, None if freq_factors is None else _to_numpy(freq_factors)).to(device)
    _check_names(args, set(tensors), source)
    model = Model(args, tensors, rope, device)
    del tensors  # the model holds them: fusing then frees each part as its fused copy is made
    model.dtype = dtype
    if isinstance(model.head(), cpu_packed.CPUWeight):
        model.head_matmul = cpu_packed.head_matmul
    if cpu is not None:
        trim_heap()
        fuse_projections(model)
    release_freed()
    return model


@contextlib.contextmanager
def _no_mlx_cache() -> Iterator[None]:
    """MLX's buffer cache off while the weights convert: each source array's buffers (a tensor's, read when taken)
    go back at once instead of staying cached for MLX arrays that never come (the ~100 MB an embedding's
    conversion left there: docs/benchmarks/torch-cpu.md, "Issue 27: the torch CPU load")."""
    import mlx.core as mx

    before = mx.set_cache_limit(0)
    try:
        yield
    finally:
        mx.set_cache_limit(before)


def release_freed() -> None:
    """The memory the conversion freed, handed back: MLX's buffer cache (the source arrays') and the heap's
    free pages (`trim_heap`)."""
    import mlx.core as mx

    mx.clear_cache()
    trim_heap()


# Source bytes converted between two `trim_heap` calls of the conversion (a trim takes well under a ms here)
TRIM_BYTES = 2**20


def trim_heap() -> None:
    """Under glibc, the heap's free pages handed back to the system, which malloc otherwise keeps for the process:
    the transients of converting one tensor, freed, would otherwise stay resident beside the next one's (the
    readings: docs/benchmarks/torch-cpu.md, "Issue 27 follow-ups" and "Issue 27: the torch CPU load")."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim


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
