"""GGUF checkpoints: config from metadata, tensors renamed to the model's names, llama.cpp's conversions undone
(`gguf_arch`: which architectures, through gguf-py's tables).

MLX reads F32/F16/BF16 tensors and maps Q4_0/Q4_1/Q8_0 to its affine quantization (group size 32), so
these run natively without dequantizing. A file with other types (k-quants, Q5_0/Q5_1, IQ4_NL/IQ4_XS, MXFP4)
or expert tensors is read by `gguf_tensors` instead (MLX's own loader gets some of them wrong), which repacks
what MLX can hold exactly and dequantizes the rest to float16 at load (k-quants: or keeps their blocks for
kernels that read them, Metal and CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_engine.api import ModelLoadError
from mlx_engine.loading.gguf_arch import ARCHITECTURES, NORM_SHIFTED, PERMUTED_QK, gguf_config  # noqa: F401
from mlx_engine.loading.gguf_file import GGUFFile, TensorInfo
from quant.formats import FORMATS, MLX_AFFINE_BITS, MLX_GROUP

LOADABLE_TYPES = ("F32", "F16", "BF16", *FORMATS)  # every block format `quant` knows
MLX_READS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # what `mx.load` reads right, in 2-D tensors
GGUF_ARCHITECTURES = ARCHITECTURES
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # phi3's LongRoPE, as tensors


def check_tensor_types(g: GGUFFile) -> None:
    bad = sorted({t.ggml_type for t in g.tensors} - set(LOADABLE_TYPES))
    if bad:
        example = next(t.name for t in g.tensors if t.ggml_type == bad[0])
        raise ModelLoadError(
            f"{g.path}: GGUF tensor type {', '.join(bad)} is not loadable yet (e.g. tensor {example!r}); "
            f"supported: {', '.join(LOADABLE_TYPES)}. Use a GGUF of those types, or the model's safetensors."
        )


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's convert permutation (HF half-split rope -> interleaved) on output rows."""
    # llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2); this is its inverse
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(g: GGUFFile, config: dict[str, Any], kquant_blocks: bool = False,
                 lazy: bool = False) -> tuple[MutableMapping[str, mx.array], dict[str, Any] | None]:
    """(weights under the model's names, quantization spec for build_model or None). `kquant_blocks`: k-quant
    matrices as their raw blocks, each path's quantization entry {"kquant": type} (`load_checkpoint`). `lazy`:
    the weights as a `GGUFTensors`, each tensor read from the file when first taken, so that a loader that
    converts and drops them one by one never holds the file's tensors all at once."""
    from mlx_engine.loading.gguf_arch import tensor_names
    from mlx_engine.loading.gguf_tensors import keeps_blocks, part_names, read_raw, read_tensors, tensor_parts
    from mlx_engine.models import parameter_names

    arch = g.architecture
    names = tensor_names(arch, config["num_hidden_layers"], parameter_names(config, str(g.path)))
    plan: dict[str, tuple[TensorInfo, str]] = {}  # model name -> (its GGUF tensor, the part's GGUF name)
    extra: dict[str, TensorInfo] = {}
    for t in g.tensors:
        if t.name == "rope_freqs.weight" or t.name in _ROPE_FACTORS:
            extra[t.name] = t
            continue
        for name in part_names(t):
            stem, _, leaf = name.rpartition(".")
            target = names.get(name) or names.get(f"{stem}.weight")
            if target is None:
                raise ModelLoadError(f"{g.path}: unexpected GGUF tensor {name!r} for a {arch!r} model")
            if not names.get(name):  # .scales / .biases of a quantized weight
                target = f"{target.rpartition('.')[0]}.{leaf}"
            plan[target] = (t, name)

    def read(t: TensorInfo) -> dict[str, mx.array]:
        try:
            return tensor_parts(t, read_raw(g, t), kquant_blocks)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{g.path}: could not read the GGUF tensor {t.name!r}: {e}") from None

    def restored(target: str, value: mx.array) -> mx.array:
        stem, _, leaf = plan[target][1].rpartition(".")
        return restore(arch, stem, leaf, value, config)

    weights: MutableMapping[str, mx.array]
    if lazy:
        weights = GGUFTensors(plan, read, restored)
    else:
        mlx_reads = g.tensor_types() <= set(MLX_READS) and all(len(t.shape) <= 2 for t in g.tensors)
        try:
            raw = (mx.load(str(g.path), format="gguf") if mlx_reads  # an Ollama blob has no .gguf suffix
                   else read_tensors(g, {} if kquant_blocks else None))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{g.path}: could not read the GGUF tensors: {e}") from None
        weights = {target: restored(target, raw.pop(name)) for target, (_, name) in plan.items()}
    if "rope_freqs.weight" in extra:
        config["_rope_freq_factors"] = read(extra.pop("rope_freqs.weight"))["rope_freqs.weight"]
    if extra:  # LongRoPE: per-frequency factors for short and long contexts
        config["rope_scaling"] = {"type": "longrope", "rope_type": "longrope",
                                  **{k.split("_")[2].split(".")[0] + "_factor": np.array(read(t)[k]).tolist()
                                     for k, t in extra.items()}}

    quantization: dict[str, Any] = {"group_size": MLX_GROUP, "bits": 4, "mode": "affine"}
    for target, (t, name) in plan.items():
        path = target.removesuffix(".weight")
        if name != t.name or path == target:
            continue
        if kquant_blocks and keeps_blocks(t):
            quantization[path] = {"kquant": t.ggml_type}
        elif t.ggml_type == "MXFP4":  # E8M0 exponents, no biases
            quantization[path] = {"group_size": MLX_GROUP, "bits": 4, "mode": "mxfp4"}
        elif t.ggml_type in MLX_AFFINE_BITS:
            quantization[path] = {"group_size": MLX_GROUP, "bits": MLX_AFFINE_BITS[t.ggml_type]}
    return weights, (quantization if len(quantization) > 3 else None)


class GGUFTensors(MutableMapping[str, mx.array]):
    """A GGUF file's tensors under the model's names (`gguf_weights(lazy=True)`), each read when first asked for:
    asking for one part of a quantized tensor (`X.weight`) reads its other parts (`X.scales`, `X.biases`) too,
    held until they are taken. `del` or `pop` drops a name (unread, or its array)."""

    def __init__(self, plan: dict[str, tuple[TensorInfo, str]], read: Any, restored: Any):
        self._plan, self._read, self._restored = dict(plan), read, restored
        self._parts: dict[str, list[str]] = {}  # GGUF tensor name -> the model's names of its parts
        for target, (t, _) in plan.items():
            self._parts.setdefault(t.name, []).append(target)
        self._ready: dict[str, mx.array] = {}

    @property
    def held(self) -> int:
        """How many of the file's tensors have arrays read and not yet taken."""
        return len({self._plan[k][0].name for k in self._ready if k in self._plan})

    def read(self, t: TensorInfo) -> None:
        """Reads tensor `t` from the file: each of its parts under the model's name, until taken."""
        parts = self._read(t)
        for target in self._parts[t.name]:
            if target in self._plan:
                self._ready[target] = self._restored(target, parts[self._plan[target][1]])

    def __getitem__(self, key: str) -> mx.array:
        if key not in self._ready:
            self.read(self._plan[key][0])
        return self._ready[key]

    def __contains__(self, key: object) -> bool:
        return key in self._plan

    def __setitem__(self, key: str, value: mx.array) -> None:
        raise TypeError("GGUFTensors is read from its file: a tensor cannot be replaced")

    def __delitem__(self, key: str) -> None:
        del self._plan[key]
        self._ready.pop(key, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._plan))

    def __len__(self) -> int:
        return len(self._plan)


def restore(arch: str, stem: str, leaf: str, value: mx.array, config: dict[str, Any]) -> mx.array:
    """Undoes what llama.cpp's converter did to one tensor (`gguf_arch`)."""
    part = stem.rsplit(".", 1)[-1]
    if arch in PERMUTED_QK and part in ("attn_q", "attn_k"):
        n = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
        return _unpermute_rows(value, n)
    if arch in NORM_SHIFTED and part.endswith("norm") and leaf == "weight":
        return value - 1
    return value


class FreqFactorRoPE(nn.Module):
    """RoPE with llama.cpp's per-frequency divisors (`rope_freqs.weight`, written for llama3 scaling)."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def apply_freq_factors(model: nn.Module, config: dict[str, Any]) -> None:
    factors = config.pop("_rope_freq_factors", None)
    if factors is None:
        return
    for layer in model.layers:
        attn = layer.self_attn
        attn.rope = FreqFactorRoPE(attn.head_dim, config["rope_theta"], factors)


def describe_quantization(g: GGUFFile) -> str:
    counts: dict[str, int] = {}
    for t in g.tensors:
        if len(t.shape) >= 2:  # matrices and stacked experts
            counts[t.ggml_type] = counts.get(t.ggml_type, 0) + t.nbytes
    return max(counts, key=counts.__getitem__) if counts else "F32"

