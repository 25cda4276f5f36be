"""What models are on this machine, described from their headers alone (no weights read, no MLX).

Sources (`loading.sources`): the embedded model, the Hugging Face cache, Ollama's and LM Studio's stores, and
paths added by hand. A header costs a GGUF's whole metadata (its vocabulary is stepped over, not decoded) or a
safetensors file's JSON; each summary is kept in a small cache keyed by the file's size and mtime, so listing
fifty models reads fifty `stat`s. `check_fit` refuses, from the same headers, a model that cannot fit.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_engine.api import ModelLoadError
from mlx_engine.memory import (KVShape, MemoryLimit, WeightsHeader, available_memory, estimate_fit,
                                held_weight_bytes, kv_bytes, metal_working_set, state_bytes)
from mlx_engine.paths import cache_dir
from mlx_engine.switches import SKIP_MEMORY_CHECK
from quant.formats import MLX_AFFINE_BITS, MLX_GROUP

HEADER_CACHE_FILE = "model_headers.json"
HEADER_CACHE_FORMAT = 3  # 2: KV shapes with sliding layers and experts; 3: MLA latents, recurrent layers' state,
# per-layer head sizes
_FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass(frozen=True)
class ModelSummary:
    ref: str  # what `-m` takes ("" for the embedded model)
    name: str
    source: str  # "embedded", "hf-cache", "ollama", "lmstudio", "path"
    size_bytes: int  # on disk
    num_parameters: int
    quantization: str
    context_length: int
    model_type: str
    error: str | None = None  # set when the files could not be read
    format: str = ""  # "gguf", "safetensors", "mlx-quantized"
    path: str = ""
    fits: bool | None = None  # weights plus FIT_CONTEXT tokens of KV within what this machine can give
    need_bytes: int = 0  # what that fit counts

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Header:
    """What a model's headers say: its description, its weights as a loader holds them, and its KV shape."""

    format: str
    quantization: str
    num_parameters: int
    model_type: str
    weights: WeightsHeader
    kv: KVShape
    kv_error: str | None = None


# ---- reading headers -------------------------------------------------------------------------------------

def _gguf_kv_shape(g: Any, path: Path) -> KVShape:
    """As the loader reads the file (`gguf_arch.gguf_config`): sliding layers and experts included; an
    architecture Roofline does not run is sized from llama.cpp's generic keys."""
    from mlx_engine.loading.gguf_arch import gguf_config

    try:
        config = gguf_config(g)
    except ModelLoadError:
        config = _generic_gguf_config(g.metadata, path)
    return _config_kv_shape(config, path)


def _generic_gguf_config(m: dict[str, Any], path: Path) -> dict[str, Any]:
    arch = m.get("general.architecture", "")
    heads = int(m.get(f"{arch}.attention.head_count", 0) or 0)
    if not heads:
        raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.attention.head_count")
    hidden = int(m.get(f"{arch}.embedding_length", 0))
    kv_heads = m.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = int(max(kv_heads)) if hasattr(kv_heads, "__len__") else int(kv_heads)  # per-layer arrays
    return {"model_type": arch, "num_hidden_layers": int(m.get(f"{arch}.block_count", 0)),
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": int(m.get(f"{arch}.attention.key_length", hidden // heads)),
            "max_position_embeddings": int(m.get(f"{arch}.context_length", 0))}


def _gguf_header(path: Path) -> Header:
    from mlx_engine.loading.gguf_file import read_gguf

    g = read_gguf(path, strings=False)
    floats = fbytes = packed = groups = kq = kq_bytes = n_params = 0
    by_type: dict[str, int] = {}
    for t in g.tensors:
        n = 1
        for d in t.shape:
            n *= d
        n_params += n
        if len(t.shape) == 2:
            by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.nbytes
        if t.ggml_type in MLX_AFFINE_BITS:  # held packed once in MLX
            packed, groups = packed + n * MLX_AFFINE_BITS[t.ggml_type] // 8, groups + n // MLX_GROUP
        elif t.ggml_type in _FLOAT_DTYPES:
            floats, fbytes = floats + n, fbytes + t.nbytes
        else:
            kq, kq_bytes = kq + n, kq_bytes + t.nbytes
    weights = WeightsHeader(floats, fbytes, packed, groups, kq, kq_bytes, checkpoint_itemsize=2)
    quant = max(by_type, key=by_type.__getitem__) if by_type else "F32"
    try:
        kv, kv_error = _gguf_kv_shape(g, path), None
    except ModelLoadError as e:
        kv, kv_error = KVShape(0, 0, 0, 0), str(e)
    return Header("gguf", quant, n_params, g.architecture or "?", weights, kv, kv_error)


def _config_kv_shape(config: dict[str, Any], where: Path) -> KVShape:
    from mlx_engine.models.config import normalize_config, sliding_flags
    from mlx_engine.models.config_families import no_kv_layers, state_sizes

    try:
        config = normalize_config(config, str(where))
        heads = int(config["num_attention_heads"])
        sliding = sliding_flags(config)
        head_dim, latent, v_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads), 0, 0
        if config.get("kv_lora_rank"):  # MLA: each layer keeps the latent; head_dim and v_dim: the heads' K and V
            latent = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
            head_dim = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
            v_dim = int(config["v_head_dim"])
        n = int(config.get("num_hidden_layers") or len(config["layers_block_type"]))
        shared = int(config.get("num_kv_shared_layers") or 0)  # Gemma 4: the last ones reuse earlier layers' KV
        stores = [i < n - shared for i in range(n)]
        types = config.get("layer_types") or []
        wide = config.get("global_head_dim") if config.get("global_head_dim") != head_dim else None
        wide_layers = sum(1 for i, t in enumerate(types[:n]) if wide and t == "full_attention" and stores[i])
        return KVShape(n, int(config.get("num_key_value_heads") or heads), head_dim,
                       int(config.get("max_position_embeddings") or 0),
                       int(config["sliding_window"]) if any(sliding) else None,
                       sum(s and k for s, k in zip(sliding, stores)),
                       int(config.get("num_local_experts") or config.get("num_experts") or
                           config.get("n_routed_experts") or 0),
                       int(config.get("num_experts_per_tok") or 0), latent, v_dim,
                       no_kv_layers(config) + stores.count(False), wide_layers, int(wide or 0),
                       int(config.get("num_global_key_value_heads") or 0) if wide else 0, *state_sizes(config))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{where}: missing or bad field {e} for sizing the KV cache") from None


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder / 'config.json'}: cannot read ({e})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder / 'config.json'}: expected a JSON object")
    return config


def _folder_header(folder: Path) -> Header:
    config = _read_config(folder)
    quant = config.get("quantization")
    bits = int(quant.get("bits", 4)) if isinstance(quant, dict) else 0
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    label = f"{bits}-bit g{quant.get('group_size', 64)}" if bits else \
        {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
    floats = fbytes = packed = n_params = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100_000_000:
                raise ModelLoadError(f"{f}: implausible safetensors header size {size}")
            header = json.loads(fh.read(size))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= d
            begin, end = info["data_offsets"]
            if info["dtype"] in _FLOAT_DTYPES:
                floats, fbytes = floats + count, fbytes + end - begin
            else:
                packed += end - begin
            if not key.endswith((".scales", ".biases")):
                n_params += count * 32 // bits if bits and info["dtype"] == "U32" else count
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)
    weights = WeightsHeader(floats, fbytes, packed, 0, 0, 0, checkpoint_itemsize=itemsize)
    try:
        kv, kv_error = _config_kv_shape(config, folder / "config.json"), None
    except ModelLoadError as e:
        kv, kv_error = KVShape(0, 0, 0, 0), str(e)
    return Header("mlx-quantized" if bits else "safetensors", label, n_params, str(config.get("model_type", "?")),
                  weights, kv, kv_error)


def _header_key(path: Path) -> str | None:
    """Size and mtime of the file (a folder: of its config and weights) that a cached header holds for."""
    try:
        files = [path] if path.is_file() else [path / "config.json", *sorted(path.glob("*.safetensors"))]
        parts = [f"{f.name}:{(s := f.stat()).st_size}:{s.st_mtime_ns}" for f in files]
    except OSError:
        return None
    return "|".join(parts)


class _HeaderCache:
    """Headers kept between runs (ROOFLINE_CACHE_DIR, else the user cache dir), keyed by path."""

    def __init__(self) -> None:
        self.file = cache_dir() / HEADER_CACHE_FILE
        self.changed = False
        try:
            data = json.loads(self.file.read_text())
            self.entries = data["entries"] if data.get("format") == HEADER_CACHE_FORMAT else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.entries = {}

    def header(self, path: Path, kind: str) -> Header:
        key = _header_key(path)
        entry = self.entries.get(str(path))
        if key is not None and entry is not None and entry.get("key") == key:
            try:
                h = entry["header"]
                return Header(h["format"], h["quantization"], h["num_parameters"], h["model_type"],
                              WeightsHeader(**h["weights"]), KVShape(**h["kv"]), h.get("kv_error"))
            except (KeyError, TypeError):
                pass
        h = _gguf_header(path) if kind == "gguf" else _folder_header(path)
        if key is not None:
            self.entries[str(path)] = {"key": key, "header": asdict(h)}
            self.changed = True
        return h

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": HEADER_CACHE_FORMAT, "entries": self.entries}))
            os.replace(tmp, self.file)
        except OSError:
            pass  # a cache that cannot be written only costs the next listing its speed


# ---- summaries -------------------------------------------------------------------------------------------

def _kv_itemsize(h: Header, metal: bool) -> int:
    return h.weights.checkpoint_itemsize if metal else 4  # activations (and KV): float32 on MLX's CPU backend


def _summary(ref: str, name: str, source: str, path: Path, kind: str, header: Header, size: int,
             available: MemoryLimit, metal: bool) -> ModelSummary:
    per_token = kv_bytes(header.kv, 1, itemsize=_kv_itemsize(header, metal)) if not header.kv_error else 0
    fit = estimate_fit(header.weights, per_token, header.kv.context_length, available=available, metal=metal)
    return ModelSummary(ref, name, source, size, header.num_parameters, header.quantization,
                        header.kv.context_length, header.model_type, None, header.format, str(path), fit.fits,
                        fit.need_bytes)


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _source_of(ref: str | None) -> str:
    from mlx_engine.loading.sources import LMSTUDIO, OLLAMA, is_embedded, parse_hf_ref

    if is_embedded(ref):
        return "embedded"
    if ref.startswith(OLLAMA):
        return "ollama"
    if ref.startswith(LMSTUDIO):
        return "lmstudio"
    return "hf-cache" if not Path(ref).expanduser().exists() and parse_hf_ref(ref) else "path"


def describe_model(ref: str | None, *, _cache: _HeaderCache | None = None,
                   _available: MemoryLimit | None = None) -> ModelSummary:
    """A summary of one model reference (as Engine.load takes it); raises ModelLoadError when unreadable.
    A repo id not in the cache is not pulled here."""
    from mlx_engine.loading import EMBEDDED_MODEL_NAME, embedded_model_path, resolve
    from mlx_engine.loading.sources import hf_offline, is_embedded, parse_hf_ref, resolve_hf_cached, resolve_store_ref

    source = _source_of(ref)
    if is_embedded(ref):
        path, kind, name = embedded_model_path(), "gguf", EMBEDDED_MODEL_NAME
    elif source == "hf-cache":
        found = resolve_hf_cached(*parse_hf_ref(ref))  # type: ignore[misc]
        if found is None:
            raise ModelLoadError(f"{ref!r} is not in the local Hugging Face cache (`roofline pull {ref}` fetches it)"
                                 + (" and HF_HUB_OFFLINE is set" if hf_offline() else ""))
        (path, kind), name = found, ref
    else:
        path, kind = resolve_store_ref(ref) or resolve(ref)
        name = ref.split(":", 1)[1] if source in ("ollama", "lmstudio") else path.name
    cache = _cache or _HeaderCache()
    try:
        header = cache.header(path, "gguf" if kind == "gguf" else "folder")
        size = _disk_size(path)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot describe model: {e}") from None
    finally:
        if _cache is None:
            cache.save()
    out_ref = "" if source == "embedded" else ref if source != "path" else str(path)

    return _summary(out_ref, name, source, path, kind, header, size, _available or available_memory(),
                    metal_working_set() is not None)


def scan_local_models(extra_refs: list[str] | tuple[str, ...] = ()) -> tuple[list[ModelSummary], list[str]]:
    """Every model on this machine (the embedded one, the HF cache, Ollama, LM Studio, then `extra_refs`),
    and one line for each entry that is not a whole model (an unfinished pull, a missing blob). Unreadable
    models are listed with `error` set, never raised."""
    from mlx_engine.loading.sources import list_hf_cache, list_lmstudio, list_ollama

    cache, available, metal = _HeaderCache(), available_memory(), metal_working_set() is not None
    hf, notes = list_hf_cache()
    ollama, ollama_notes = list_ollama()
    out = [describe_model(None, _cache=cache, _available=available)]
    for m in [*hf, *ollama, *list_lmstudio()]:
        try:
            header = cache.header(m.path, m.kind)
            size = m.size_bytes or _disk_size(m.path)
            out.append(_summary(m.ref, m.name, m.source, m.path, m.kind, header, size, available, metal))
        except (OSError, ValueError, KeyError, TypeError, struct.error, ModelLoadError) as e:
            out.append(ModelSummary(m.ref, m.name, m.source, 0, 0, "?", 0, "?", error=str(e), path=str(m.path)))
    seen = {m.ref for m in out}
    for ref in extra_refs:
        if ref in seen:
            continue
        try:
            out.append(describe_model(ref, _cache=cache, _available=available))
        except ModelLoadError as e:
            out.append(ModelSummary(ref, ref, "path", 0, 0, "?", 0, "?", error=str(e), path=ref))
        seen.add(ref)
    cache.save()
    return out, notes + ollama_notes


def list_local_models(extra_refs: list[str] | tuple[str, ...] = ()) -> list[ModelSummary]:
    return scan_local_models(extra_refs)[0]


# ---- memory and KV ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelMemory:
    name: str
    weights: WeightsHeader
    kv_per_token: int
    context_length: int
    state_bytes: int = 0  # a hybrid's recurrent layers, one sequence


def model_memory(ref: str | None, kv_bits: int | None = None, key_bits: int | None = None,
                 itemsize: int | None = None, metal: bool = False) -> ModelMemory | None:
    """What `memory.check_fit` weighs for `ref`, from its header (resolving it, so pulling a missing repo);
    None when the header cannot be read or sized, which the loader then names better."""
    from mlx_engine.loading import EMBEDDED_MODEL_NAME, resolve
    from mlx_engine.loading.sources import display_name, is_embedded

    path, kind = resolve(ref)
    cache = _HeaderCache()
    try:
        header = cache.header(path, "gguf" if kind == "gguf" else "folder")
    except (OSError, ValueError, KeyError, TypeError, struct.error, ModelLoadError):
        return None
    cache.save()
    if header.kv_error:
        return None
    item = itemsize or _kv_itemsize(header, metal)
    per_token = kv_bytes(header.kv, 1, kv_bits=kv_bits, itemsize=item, key_bits=key_bits)
    name = EMBEDDED_MODEL_NAME if is_embedded(ref) else display_name(ref, path)
    return ModelMemory(name, header.weights, per_token, header.kv.context_length, state_bytes(header.kv, 1, item))


def model_header(ref: str | os.PathLike[str] | None) -> Header:
    """What `ref`'s headers say (resolving it as Engine.load does; no weights read), through the header cache."""
    from mlx_engine.loading import resolve

    path, kind = resolve(ref)
    cache = _HeaderCache()
    try:
        return cache.header(path, "gguf" if kind == "gguf" else "folder")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot read its header: {e}") from None
    finally:
        cache.save()


def kv_shape(ref: str | os.PathLike[str] | None) -> KVShape:
    """The attention shape that sizes the KV cache, from config.json or GGUF metadata (no weights read)."""
    from mlx_engine.loading import resolve

    path, kind = resolve(ref)
    if kind == "gguf":
        from mlx_engine.loading.gguf_file import read_gguf

        return _gguf_kv_shape(read_gguf(path, strings=False), path)
    return _config_kv_shape(_read_config(path), path / "config.json")


def check_fit(model: str | None, backend: str, options: dict[str, Any]) -> None:
    """Refuses (ModelLoadError, one line) a model whose weights and KV cannot fit, before any weight is read.
    `options`: Engine.load's (max_context, kv_bits, kv_key_bits, kv_budget_bytes, dtype, draft_model)."""
    if SKIP_MEMORY_CHECK.raw().lower() in ("1", "true", "yes"):
        return
    def option(name: str, allowed: tuple[int, ...] | None = None) -> int | None:  # bad values: the loader's error
        v = options.get(name)
        ok = isinstance(v, int) and not isinstance(v, bool) and v > 0 and (allowed is None or v in allowed)
        return v if ok else None

    metal = metal_working_set() is not None
    dtype = options.get("dtype")
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype if isinstance(dtype, str) else "", 0)
    mem = model_memory(model, kv_bits=option("kv_bits", (4, 8)), key_bits=option("kv_key_bits", (4, 8)),
                       itemsize=itemsize or None, metal=metal)
    if mem is None:
        return  # a header that cannot be read or sized: the loader says what is wrong with it
    extra = mem.state_bytes
    if isinstance(options.get("draft_model"), str) and options.get("draft_model") != model:
        try:
            draft = model_memory(options["draft_model"], metal=metal)
        except ModelLoadError:
            draft = None  # the loader says why (or, with draft_optional, warns and loads without it)
        extra += held_weight_bytes(draft.weights, backend, metal)[0] if draft else 0  # held beside the model
    fit = estimate_fit(mem.weights, mem.kv_per_token, mem.context_length, context=option("max_context"),
                       kv_budget_bytes=option("kv_budget_bytes"), backend=backend, extra_bytes=extra, metal=metal)
    if not fit.fits:
        raise ModelLoadError(fit.refusal(mem.name))
