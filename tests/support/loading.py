"""Checkpoints the loading tests and the backends' tests share, and greedy decoding through the public API."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import load_file, save_file

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.support.tiny_models import GOLDEN, folder_with_weights


def greedy(engine: Engine, ids: list[int], n: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t for e in engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)) for t in e.token_ids]


def _quantized_folder(tmp_path: Path, bits: int, group_size: int, override: dict | None = None) -> tuple[Path, Path]:
    """An mlx-community style folder (quantization in config.json, per-layer override) and the matching
    folder of dequantized float32 weights."""
    src = GOLDEN / "llama"
    config = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    qdir, ddir = tmp_path / "q", tmp_path / "deq"
    qdir.mkdir()
    quantized, deq = {}, {}
    override = override or {}
    for name, value in weights.items():
        path = name.removesuffix(".weight")
        if value.ndim == 2 and name.endswith(".weight") and override.get(path) is not False:
            b = override.get(path, {}).get("bits", bits)
            g = override.get(path, {}).get("group_size", group_size)
            wq, s, bias = mx.quantize(mx.array(value), group_size=g, bits=b)
            quantized[name], quantized[f"{path}.scales"], quantized[f"{path}.biases"] = (np.array(wq), np.array(s),
                                                                                        np.array(bias))
            deq[name] = np.array(mx.dequantize(wq, s, bias, group_size=g, bits=b))
        else:
            quantized[name] = deq[name] = value
    config["quantization"] = {"group_size": group_size, "bits": bits, **override}
    (qdir / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(qdir / "model.safetensors"))
    return qdir, folder_with_weights(src, ddir, deq)
