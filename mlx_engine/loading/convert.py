"""`roofline convert`: any model Roofline loads (a safetensors folder, a GGUF file, a repo id, an Ollama or LM
Studio ref) to an MLX-quantized folder in mlx-lm's own format, written by mlx-lm's own code.

Roofline's loader reads the source (GGUF tensors renamed to HF names, quantized ones dequantized); mlx-lm's model
class for the config takes the weights (its `sanitize`), `mlx_lm.utils.quantize_model` quantizes them and
`save_model` / `save_config` write them, so the folder is exactly what `mlx_lm.convert` writes: config.json with
its `quantization` keys, model.safetensors (+ index), and the tokenizer files beside them (copied from a folder,
or tokenizer.json and tokenizer_config.json with the chat template rebuilt from GGUF metadata). The folder is
written under a temporary name and renamed when whole.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_engine.api import ModelLoadError, RooflineError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


@dataclass(frozen=True)
class Converted:
    path: Path
    size_bytes: int
    bits_per_weight: float
    num_quantized: int  # layers quantized (others, whose rows do not split into groups, stay float)


def _dequantized(weights: dict[str, Any], quantization: dict[str, Any] | None) -> dict[str, Any]:
    """Every quantized matrix (`.weight` + `.scales` [+ `.biases`]) as a float one."""
    import mlx.core as mx

    if not quantization:
        return dict(weights)
    out = {k: v for k, v in weights.items() if not k.endswith((".scales", ".biases"))}
    for key in [k for k in weights if k.endswith(".scales")]:
        base = key.removesuffix(".scales")
        spec = quantization.get(base)
        spec = spec if isinstance(spec, dict) else quantization
        if "kquant" in spec:
            raise ModelLoadError(f"{base}: k-quant blocks cannot be converted here")
        out[f"{base}.weight"] = mx.dequantize(weights[f"{base}.weight"], weights[key], weights.get(f"{base}.biases"),
                                              int(spec.get("group_size", 64)), int(spec.get("bits", 4)),
                                              mode=spec.get("mode", "affine"))
    return out


def _mlx_lm_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    if "_rope_freq_factors" in config:
        raise ModelLoadError(f"{where}: its GGUF rope frequency factors (llama 3 rope scaling) have no config.json "
                             "form for mlx-lm; convert the model's safetensors instead")
    out = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("quantization", "quantization_config")}
    return out


def _write_tokenizer(ckpt: Any, out: Path) -> None:
    """The source folder's tokenizer files, or a GGUF's tokenizer as tokenizer.json + tokenizer_config.json."""
    if ckpt.source_format != "gguf":
        for name in TOKENIZER_FILES:
            if (ckpt.path / name).is_file():
                shutil.copy(ckpt.path / name, out / name)
        return
    tok = ckpt.tokenizer
    if tok is None or getattr(tok, "backend", None) is None:
        return
    tok.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(tok.add_bos_token),
                              "model_max_length": int(ckpt.config.get("max_position_embeddings") or 0) or None}
    for field in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if tok.special_tokens.get(field):
            config[field] = tok.special_tokens[field]
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def convert(src: str | None, out: str | Path, bits: int = 4, group_size: int = 64, dtype: str | None = None,
            progress: Callable[[str], None] | None = None) -> Converted:
    """Writes `src` quantized to `bits` in groups of `group_size` as an mlx-lm folder at `out` (which must not
    exist); float tensors (and the scales) in `dtype` (default: the checkpoint's; float16 for a GGUF).
    RooflineError, one line, for bad arguments or a source that cannot be converted."""
    import mlx.core as mx

    dtypes = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
    if dtype is not None and dtype not in dtypes:
        raise RooflineError(f"--dtype {dtype}: expected one of {', '.join(dtypes)}")
    say = progress or (lambda _: None)
    if bits not in BITS:
        raise RooflineError(f"--bits {bits}: expected one of {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        raise RooflineError(f"--group-size {group_size}: expected one of {', '.join(map(str, GROUP_SIZES))}")
    out = Path(out).expanduser()
    if out.exists():
        raise RooflineError(f"-o {out}: already exists; convert writes a new folder and never overwrites one "
                            "(remove it or choose another name)")
    if not out.parent.is_dir():
        raise RooflineError(f"-o {out}: its folder {out.parent} does not exist")

    from mlx_engine._mlx_lm import bare_package
    from mlx_engine.loading import load_checkpoint, resolve

    say(f"reading {resolve(src)[0]}")  # a ref that names nothing fails here, before a word of progress
    ckpt = load_checkpoint(src)
    config = _mlx_lm_config(ckpt.config, str(ckpt.path))
    weights = _dequantized(ckpt.weights, ckpt.quantization)
    target = dtypes.get(dtype or ckpt.checkpoint_dtype, mx.float16)
    weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    for key in ("torch_dtype", "dtype"):  # transformers 4 names it torch_dtype, 5 dtype
        if key in config or key == "torch_dtype":
            config[key] = str(target).removeprefix("mlx.core.")

    bare_package()
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        model.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{ckpt.path}: mlx-lm cannot build {config.get('model_type')!r} from it: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    del weights, ckpt.weights
    say(f"quantizing to {bits}-bit affine groups of {group_size}")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # mlx-lm prints its bits per weight
        model, config = quantize_model(model, config, group_size, bits)
    import mlx.nn as nn

    num_quantized = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    bpw = _bits_per_weight(log.getvalue())
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        say(f"writing {out}")
        save_model(tmp, model, donate_model=True)
        save_config(config, config_path=tmp / "config.json")
        _write_tokenizer(ckpt, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return Converted(out, size, bpw, num_quantized)


def _bits_per_weight(text: str) -> float:
    import re

    m = re.search(r"([\d.]+) bits per weight", text)
    return float(m.group(1)) if m else 0.0
