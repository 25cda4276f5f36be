"""GGUF tensors read here rather than by `mx.load`, for files that hold k-quants.

MLX's GGUF loader (0.32) cannot be trusted with k-quants: it fails on Q3_K and Q5_K ("gguf_tensor_to_f16
failed") and returns wrong values for Q4_K (max error 21 on weights of magnitude 30, against
`gguf.quants.dequantize`); its Q2_K and Q6_K are exact. So a file with any k-quant is read tensor by tensor
from the validated header's offsets (`gguf_file.read_gguf`):

- F32 / F16 / BF16: as stored.
- Q4_0 / Q4_1 / Q8_0: repacked, exactly, into MLX's affine quantization (group 32, as `mx.load` gives them:
  uint32 words packed low bits first, float16 scales and biases), so they stay quantized.
- k-quants (Q2_K..Q6_K): dequantized by `kernels_metal.reference.dequantize_kquant` (MLX ops, bit for bit
  `quant.dequantize`, gguf-py's numpy, and 1.1-3x as fast on a CPU), stored as float16. They run as dense float16
  weights: correct, at about 3.5x the bytes of their blocks. Or kept as their raw blocks
  (`load_checkpoint(kquant_blocks=True)`): on Metal for `models.kquant`'s layers, and for the torch backend, which
  packs them into affine groups for its kernels (`backends.torch.weights.kquant_weight`).
- Q5_0 / Q5_1: repacked, exactly, into MLX's affine 5-bit groups of 32.
- MXFP4 (gpt-oss's experts): repacked, exactly, into MLX's "mxfp4" mode (E8M0 scales, groups of 32).
- IQ4_NL / IQ4_XS: a codebook no MLX layout holds: dequantized at load (exact in float32) and stored as float16,
  as the k-quants are.
Expert tensors (E, out, in) are read as E * out rows of `in` weights; their k-quants are always dequantized
(no k-quant kernel takes an expert index). The layouts, their unpacking and MLX's packing are `quant`'s.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_engine.loading.gguf_file import GGUFFile, TensorInfo
from quant.affine import affine_from_gguf
from quant.codebook import dequantize_iq4, mxfp4_codes
from quant.formats import KQUANT_TYPES, MLX_AFFINE_BITS, MLX_GROUP
from quant.mlx_layout import pack_codes


def read_tensors(g: GGUFFile, kquant_blocks: dict[str, str] | None = None) -> dict[str, mx.array]:
    """Every tensor of `g` as `mx.load` names them (a quantized `X.weight` adds `X.scales`, `X.biases`; MXFP4 adds
    `X.scales` only, uint8 exponents). With a `kquant_blocks` dict, 2-D k-quants stay as their raw blocks (uint8,
    (out, in / 256 * bytes per block)), and the dict gets each one's name -> type."""
    data = np.memmap(g.path, dtype=np.uint8, mode="r")
    out: dict[str, mx.array] = {}
    for t in g.tensors:
        parts = tensor_parts(t, data[t.offset:t.offset + t.nbytes], kquant_blocks is not None)
        if kquant_blocks is not None and keeps_blocks(t):
            kquant_blocks[t.name] = t.ggml_type
        out.update(parts)
    return out


def keeps_blocks(t: TensorInfo) -> bool:
    """Whether `tensor_parts(t, keep_blocks=True)` gives `t` as its raw k-quant blocks."""
    return t.ggml_type in KQUANT_TYPES and len(t.shape) == 2


def part_names(t: TensorInfo) -> tuple[str, ...]:
    """The names `tensor_parts` gives `t`'s arrays, known without reading it."""
    stem = t.name.removesuffix(".weight")
    if t.ggml_type in MLX_AFFINE_BITS:
        return t.name, f"{stem}.scales", f"{stem}.biases"
    return (t.name, f"{stem}.scales") if t.ggml_type == "MXFP4" else (t.name,)


def read_raw(g: GGUFFile, t: TensorInfo) -> np.ndarray:
    """One tensor's bytes, read from the file into memory of their own (no mapping of the file, whose pages would
    stay resident while it is mapped)."""
    with open(g.path, "rb") as f:
        f.seek(t.offset)
        raw = np.fromfile(f, dtype=np.uint8, count=t.nbytes)
    if raw.nbytes != t.nbytes:
        raise ValueError(f"tensor {t.name!r}: the file ends {t.nbytes - raw.nbytes} bytes before its end")
    return raw


# Weights a step of `_affine_parts` unpacks at once: its codes widened to uint32 for packing are 4 bytes each, so
# 4 MiB (and up to as much for each of a few temporaries)
_AFFINE_STEP_WEIGHTS = 2**20


def _affine_parts(raw: np.ndarray, ggml_type: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray,
                                                                                   np.ndarray]:
    """Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 bytes -> (words uint32, scales, biases float16), rows (out, in) a slice
    of rows at a time, so that the unpacking's transients are a slice's, not the tensor's (an embedding's int32
    codes: 4 bytes a weight)."""
    bits, group = MLX_AFFINE_BITS[ggml_type], MLX_GROUP
    by_row = np.asarray(raw).reshape(rows, -1)
    words = np.empty((rows, cols * bits // 32), np.uint32)
    scales, biases = np.empty((rows, cols // group), np.float16), np.empty((rows, cols // group), np.float16)
    step = max(1, _AFFINE_STEP_WEIGHTS // cols)
    for lo in range(0, rows, step):
        part = by_row[lo:lo + step]
        n = part.shape[0]
        w, s, b, _ = affine_from_gguf(part, ggml_type, (n, cols))
        # exact in float16: fp16 d, -8d, -16d, -128d and fp16 m
        words[lo:lo + n], scales[lo:lo + n], biases[lo:lo + n] = w, s.astype(np.float16), b.astype(np.float16)
    return words, scales, biases


def tensor_parts(t: TensorInfo, raw: np.ndarray, keep_blocks: bool = False) -> dict[str, mx.array]:
    """One tensor from its bytes `raw`, as `read_tensors` gives it (its arrays under `part_names(t)`);
    `keep_blocks`: a 2-D k-quant as its raw blocks (`keeps_blocks`)."""
    from kernels_metal.reference import dequantize_kquant

    lead, in_features = t.shape[:-1], t.shape[-1]
    rows = int(np.prod(lead)) if lead else 1
    names = part_names(t)
    if t.ggml_type in ("F32", "F16"):
        return {t.name: mx.array(raw.view(np.float32 if t.ggml_type == "F32" else np.float16).reshape(t.shape))}
    if t.ggml_type == "BF16":
        return {t.name: mx.array(raw.view(np.uint16).reshape(t.shape)).view(mx.bfloat16)}
    if len(names) == 3:
        words, scales, biases = _affine_parts(raw, t.ggml_type, rows, in_features)
        return {name: mx.array(a.reshape(*lead, -1)) for name, a in zip(names, (words, scales, biases))}
    if t.ggml_type == "MXFP4":
        q, e = mxfp4_codes(raw, (rows, in_features))
        return {names[0]: mx.array(pack_codes(q, 4).reshape(*lead, -1)), names[1]: mx.array(e.reshape(*lead, -1))}
    if t.ggml_type in ("IQ4_NL", "IQ4_XS"):
        return {t.name: mx.array(dequantize_iq4(raw, t.ggml_type, (rows, in_features)).astype(np.float16)
                                 .reshape(t.shape))}
    if keep_blocks and keeps_blocks(t):  # a k-quant, kept as blocks
        return {t.name: mx.array(np.asarray(raw).reshape(t.shape[0], -1))}
    # a k-quant (check_tensor_types let nothing else through)
    w = dequantize_kquant(mx.array(np.asarray(raw)), t.ggml_type, rows, in_features).astype(mx.float16)
    w = w.reshape(t.shape)
    mx.eval(w)  # one tensor's float32 at a time
    return {t.name: w}
