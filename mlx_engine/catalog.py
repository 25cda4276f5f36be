"""What models are on this machine, described from their headers alone (no weights read, no MLX)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.api import ModelLoadError


@dataclass(frozen=True)
class ModelSummary:
    ref: str  # what Engine.load takes: None-equivalent "" for the embedded model, a path, or a repo id
    name: str
    source: str  # "embedded", "gguf", "folder", "hf-cache"
    size_bytes: int  # on disk
    num_parameters: int
    quantization: str
    context_length: int
    model_type: str
    error: str | None = None  # set when the files could not be read


def _gguf_summary(path: Path, ref: str, name: str, source: str) -> ModelSummary:
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.loading.gguf_model import describe_quantization

    g = read_gguf(path)
    arch = g.architecture or "?"
    n = 0
    for t in g.tensors:
        count = 1
        for d in t.shape:
            count *= d
        n += count
    ctx = g.metadata.get(f"{arch}.context_length", 0)
    return ModelSummary(ref, name, source, path.stat().st_size, n, describe_quantization(g), int(ctx), arch)


def _safetensors_params(folder: Path, quant: dict | None) -> int:
    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for key, info in header.items():
            if key == "__metadata__" or key.endswith((".scales", ".biases")):
                continue
            count = 1
            for d in info["shape"]:
                count *= d
            if quant and info["dtype"] == "U32":
                count = count * 32 // int(quant.get("bits", 4))
            n += count
    return n


def _folder_summary(folder: Path, ref: str, name: str, source: str) -> ModelSummary:
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization")
    if quant:
        label = f"{quant.get('bits')}-bit g{quant.get('group_size', 64)}"
    else:
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        label = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return ModelSummary(ref, name, source, size, _safetensors_params(folder, quant), label,
                        int(config.get("max_position_embeddings") or 0), str(config.get("model_type", "?")))


def describe_model(ref: str | None) -> ModelSummary:
    """A summary of one model reference (as Engine.load takes it); raises ModelLoadError when unreadable."""
    from mlx_engine.loading import EMBEDDED_MODEL_NAME, resolve

    path, kind = resolve(ref)
    try:
        if ref is None:
            return _gguf_summary(path, "", EMBEDDED_MODEL_NAME, "embedded")
        if kind == "gguf":
            return _gguf_summary(path, str(path), path.name, "gguf")
        return _folder_summary(path, ref if kind == "hf-cache" else str(path), ref if kind == "hf-cache" else path.name,
                               kind)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot describe model: {e}") from None


def list_local_models() -> list[ModelSummary]:
    """The embedded model, then text models in the local Hugging Face cache (those with config.json and
    safetensors, or GGUF files). Unreadable entries are listed with `error` set, never raised."""
    out = [describe_model(None)]
    try:
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache, or an unreadable one: nothing to list
        return out
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        folder = Path(rev.snapshot_path)
        try:
            if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
                out.append(_folder_summary(folder, repo.repo_id, repo.repo_id, "hf-cache"))
            else:
                for g in sorted(folder.glob("*.gguf")):
                    out.append(_gguf_summary(g, str(g), f"{repo.repo_id}/{g.name}", "hf-cache"))
        except (OSError, ValueError, KeyError, struct.error, ModelLoadError) as e:
            out.append(ModelSummary(repo.repo_id, repo.repo_id, "hf-cache", repo.size_on_disk, 0, "?", 0, "?",
                                    error=str(e)))
    return out


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    sliding_window: int | None = None  # tokens a sliding layer attends to
    num_sliding_layers: int = 0  # of num_layers
    num_experts: int = 0  # MoE: experts per layer (0: dense)
    num_experts_per_tok: int = 0


def kv_shape(ref: str | None) -> KVShape:
    """The attention shape that sizes the KV cache, from config.json or GGUF metadata (no weights read), read as
    the model classes read them (`models.config.normalize_config`): sliding layers and experts included."""
    from mlx_engine.loading import resolve
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.models.config import normalize_config, sliding_flags

    path, kind = resolve(ref)
    where = path if kind == "gguf" else path / "config.json"
    if kind == "gguf":
        from mlx_engine.loading.gguf_arch import gguf_config

        g = read_gguf(path)
        try:
            config = gguf_config(g)
        except ModelLoadError:  # an architecture Roofline does not run: the generic llama.cpp keys
            config = _generic_gguf_config(g.metadata, path)
    else:
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{where}: cannot read ({e})") from None
    try:
        config = normalize_config(config, str(where))
        heads = int(config["num_attention_heads"])
        sliding = sliding_flags(config)
        return KVShape(int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or heads),
                       int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                       int(config.get("max_position_embeddings") or 0),
                       int(config["sliding_window"]) if any(sliding) else None, sum(sliding),
                       int(config.get("num_local_experts") or config.get("num_experts") or 0),
                       int(config.get("num_experts_per_tok") or 0))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: missing or bad field {e} for sizing the KV cache") from None


def _generic_gguf_config(m: dict, path: Path) -> dict:
    arch = m.get("general.architecture", "")
    heads = int(m.get(f"{arch}.attention.head_count", 0))
    if not heads:
        raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.attention.head_count")
    hidden = int(m.get(f"{arch}.embedding_length", 0))
    return {"model_type": arch, "num_hidden_layers": int(m.get(f"{arch}.block_count", 0)),
            "num_attention_heads": heads, "num_key_value_heads": int(m.get(f"{arch}.attention.head_count_kv", heads)),
            "head_dim": int(m.get(f"{arch}.attention.key_length", hidden // heads)),
            "max_position_embeddings": int(m.get(f"{arch}.context_length", 0))}


def kv_bytes(shape: KVShape, context: int, batch: int = 1, kv_bits: int | None = None, itemsize: int = 2,
             group_size: int = 64, key_bits: int | None = None, key_group_size: int | None = None) -> int:
    """K and V of every layer for `batch` sequences of `context` tokens, a sliding layer's at most its window
    (quantized: packed values plus a scale and a bias per group, in the activation dtype). `key_bits`: the keys' bits when they differ
    from the values' `kv_bits` (None: the same). `key_group_size`: the keys' when it differs (per-channel
    keys: a scale and bias per channel and block of that many tokens costs what per-token groups of that
    many channels cost)."""

    def per_vector(bits: int | None, group: int) -> int:
        if bits is None:
            return shape.head_dim * itemsize
        return shape.head_dim * bits // 8 + 2 * -(-shape.head_dim // group) * itemsize

    k_bits = kv_bits if key_bits is None else key_bits
    per_token = per_vector(k_bits, key_group_size or group_size) + per_vector(kv_bits, group_size)
    # a sliding layer holds its window's tokens at most
    window = min(context, shape.sliding_window) if shape.sliding_window else context
    layer_tokens = (shape.num_layers - shape.num_sliding_layers) * context + shape.num_sliding_layers * window
    return per_token * layer_tokens * shape.num_kv_heads * batch
