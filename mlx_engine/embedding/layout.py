"""What makes a checkpoint an embedding model, read without MLX: a sentence-transformers folder (`modules.json` with
a `Pooling` module, `1_Pooling/config.json`, an optional `Normalize`, `config_sentence_transformers.json`'s `prompts`)
or a GGUF file whose `<arch>.pooling_type` says how llama.cpp pools it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_engine.api import ModelLoadError

POOLING_MODES = ("lasttoken", "mean", "cls")
# llama.cpp's enum llama_pooling_type (UNSPECIFIED -1, NONE 0, MEAN 1, CLS 2, LAST 3, RANK 4)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
# sentence-transformers 2-5 wrote one flag per mode; 6 writes `pooling_mode` as one of these names
_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class EmbeddingLayout:
    """How an embedding model turns its decoder's last hidden states into one vector per input."""

    pooling: str  # one of POOLING_MODES
    normalize: bool  # L2-normalize the pooled vector (sentence-transformers' Normalize; llama.cpp's default)
    include_prompt: bool = True  # False: an instruction prefix's tokens are left out of mean pooling
    prompts: dict[str, str] = field(default_factory=dict)  # name -> instruction prefix
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # tokens per input the checkpoint was made for (sentence_bert_config.json)
    source: str = ""  # the file that declared the pooling, for messages


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def st_layout(folder: Path) -> EmbeddingLayout | None:
    """A sentence-transformers folder's layout; None when `folder` has no modules.json (a plain HF checkpoint)."""
    modules = _json(folder / "modules.json")
    if modules is None:
        return None
    where = folder / "modules.json"
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{where}: expected a list of modules ({{'idx', 'name', 'path', 'type'}} objects)")
    # "sentence_transformers.models.Pooling" (2-5) or "sentence_transformers.<...>.pooling.Pooling" (6)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    known = {"Transformer", "Pooling", "Normalize"}
    other = [k for k in kinds if k not in known]
    if other:
        raise ModelLoadError(f"{where}: module {other[0]!r} is not supported (Roofline runs a Transformer, its Pooling "
                             "and an optional Normalize)")
    if "Pooling" not in kinds:
        raise ModelLoadError(f"{where}: no sentence_transformers.models.Pooling module, so no way to pool the tokens")
    pooling_dir = folder / str(modules[kinds.index("Pooling")].get("path", "1_Pooling"))
    config = _json(pooling_dir / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{pooling_dir / 'config.json'}: missing or not a JSON object (the Pooling module's "
                             "settings)")
    mode = config.get("pooling_mode")
    on = [str(mode)] if isinstance(mode, str) else [m for flag, m in _POOLING_FLAGS.items() if config.get(flag)]
    if len(on) != 1 or on[0] not in POOLING_MODES:
        raise ModelLoadError(f"{pooling_dir / 'config.json'}: pooling {'+'.join(on) or 'none'} is not supported "
                             f"(one of: {', '.join(POOLING_MODES)})")
    st = _json(folder / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelLoadError(f"{folder / 'config_sentence_transformers.json'}: 'prompts' must map names to strings")
    bert = _json(folder / "sentence_bert_config.json") or {}
    return EmbeddingLayout(pooling=on[0], normalize="Normalize" in kinds,
                           include_prompt=bool(config.get("include_prompt", True)), prompts=dict(prompts),
                           default_prompt_name=st.get("default_prompt_name"),
                           max_seq_length=bert.get("max_seq_length"), source=str(pooling_dir / "config.json"))


def gguf_layout(metadata: dict[str, Any]) -> EmbeddingLayout | None:
    """A GGUF file's layout from `<arch>.pooling_type`; None where the key is absent or says none (a chat model)."""
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.pooling_type")
    if value is None or int(value) <= 0:
        return None
    if int(value) not in GGUF_POOLING:
        raise ModelLoadError(f"{arch}.pooling_type = {value} is not supported (1 mean, 2 cls, 3 last; 4 rank is a "
                             "reranker's)")
    # llama-server's /v1/embeddings L2-normalizes (embd_normalize 2) unless told otherwise
    return EmbeddingLayout(pooling=GGUF_POOLING[int(value)], normalize=True, source=f"{arch}.pooling_type")


def embedding_layout(ref: str | None) -> EmbeddingLayout | None:
    """The layout of the model `ref` names (any ref `Engine.load` takes), or None for a model without pooling."""
    from mlx_engine.loading import resolve

    if ref is None:
        return None
    path, kind = resolve(ref)
    if kind == "gguf":
        from mlx_engine.loading.gguf_file import read_gguf

        return gguf_layout(read_gguf(path, strings=False).metadata)
    return st_layout(path)
