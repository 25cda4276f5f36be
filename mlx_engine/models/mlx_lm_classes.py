"""mlx-lm's model classes for the families without a file here, and, where one departs from transformers,
a subclass that does not. Each fix says what it fixes; the golden checkpoints (tests/test_parity_golden.py) are
the reference:

- gemma2: mlx-lm attends to the whole context on every layer; transformers' sliding layers (`layer_types`, every
  other layer in older files) see the last `sliding_window` tokens. Logits differed by 1.2 past the window.
- gemma3_text: mlx-lm rounds the embedding scale sqrt(hidden) to bfloat16 whatever the activations' dtype;
  transformers rounds it to the weights' dtype (5.9e-4 in float32).
- starcoder2: mlx-lm uses erf GELU and full attention; transformers uses the config's `hidden_act` (tanh GELU,
  "gelu_pytorch_tanh", in every StarCoder2) and `sliding_window` on every layer (4.6e-4 within the window,
  2.4 past it).
- gpt_oss: mlx-lm reads the experts as OpenAI's MXFP4 release or its own converted layout, not transformers'
  dense one (`experts.gate_up_proj` (E, hidden, 2 * I), gate and up interleaved), and its YaRN always truncates
  the correction range, where gpt-oss's `truncate: false` does not.
- falcon_h1: mlx-lm folds the attention-input multiplier into q and k but not v, and never the key multiplier
  (logits off by 1.6 with key_multiplier 0.7).
- qwen3_5_text (a Qwen3.5 checkpoint's text_config, or a text-only one): mlx-lm runs it through its multimodal
  `qwen3_5` module, which takes a flat config as its text config; qwen3_5_moe_text likewise, its experts stacked
  where transformers 5 saved them one tensor each (mlx-lm reads only the fused `experts.gate_up_proj`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_engine.models.layer_types import sliding_layers


def fallback_classes(model_type: str) -> tuple[type, type] | None:
    """(Model, ModelArgs) for `model_type`: a fixed subclass of mlx-lm's where one is here, else mlx-lm's
    own; None when mlx-lm has no module for it."""
    if model_type in _FIXED:
        return _FIXED[model_type]()
    if model_type in _TEXT_ALIASES:
        return _text_of(_TEXT_ALIASES[model_type])
    name = model_type if _has_module(model_type) else _remapping().get(model_type, model_type)
    if not _has_module(name):
        return None
    module = importlib.import_module(f"mlx_lm.models.{name}")
    return module.Model, module.ModelArgs


def mlx_lm_has(model_type: str) -> bool:
    """Whether mlx-lm has a model class for `model_type` (without importing it)."""
    model_type = _TEXT_ALIASES.get(model_type, model_type)
    return model_type in _FIXED or _has_module(model_type) or _has_module(_remapping().get(model_type, model_type))


# text configs inside a multimodal checkpoint whose model class is the multimodal module's: given a flat config it
# builds just the language model (Qwen3.5's `ModelArgs.from_dict` wraps it as its text_config)
_TEXT_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def _text_of(name: str) -> tuple[type, type]:
    module = importlib.import_module(f"mlx_lm.models.{name}")

    @dataclass
    class ModelArgs(module.ModelArgs):
        text_config: dict | None = None  # absent: the flat config is the text config (module's from_dict)

    class Model(module.Model):
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            return super().sanitize(stack_experts(weights))

    return Model, ModelArgs


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts one tensor each (`mlp.experts.<e>.<proj>.weight`, as transformers 5 saves Qwen3.5-MoE) stacked into
    mlx-lm's SwitchGLU (`mlp.switch_mlp.<proj>.weight`, (E, out, in)); other weights as they are."""
    pattern = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    out = {}
    for k, v in weights.items():
        m = pattern.match(k)
        if m:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = v
        else:
            out[k] = v
    for (stem, proj), experts in groups.items():
        out[f"{stem}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False


def _remapping() -> dict[str, str]:
    """mlx-lm's MODEL_REMAPPING (model types that run on another type's module), read from mlx_lm/utils.py's
    source: importing that module imports transformers and torch (seconds), just to refuse an unknown type."""
    import ast

    spec = importlib.util.find_spec("mlx_lm.utils")
    try:
        tree = ast.parse(open(spec.origin, encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_REMAPPING" for t in node.targets):
                return dict(ast.literal_eval(node.value))
    except (OSError, SyntaxError, ValueError, AttributeError, TypeError):
        pass
    from mlx_lm.utils import MODEL_REMAPPING

    return dict(MODEL_REMAPPING)


def layer_masks(h: mx.array, cache: list[Any], sliding: list[bool], window: int | None,
                return_array: bool = False) -> list[Any]:
    """One attention mask per layer: causal for full layers, causal within `window` for sliding ones (each built
    once, from the first such layer's cache)."""
    from mlx_lm.models.base import create_attention_mask

    masks: dict[bool, Any] = {}
    for s, c in zip(sliding, cache):
        if s not in masks:
            masks[s] = create_attention_mask(h, c, window_size=window if s else None, return_array=return_array)
    return [masks[s] for s in sliding]


def layer_caches(sliding: list[bool], window: int | None) -> list[Any]:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return [RotatingKVCache(max_size=window) if s else KVCache() for s in sliding]


def _gemma2() -> tuple[type, type]:
    from mlx_lm.models import gemma2

    @dataclass
    class ModelArgs(gemma2.ModelArgs):
        sliding_window: int | None = None
        layer_types: list[str] | None = None

    class GemmaModel(gemma2.GemmaModel):
        def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
            h = self.embed_tokens(inputs) * (self.args.hidden_size**0.5)
            cache = cache or [None] * len(self.layers)
            for layer, c, mask in zip(self.layers, cache,
                                      layer_masks(h, cache, self.sliding, self.args.sliding_window, True)):
                h = layer(h, mask, c)
            return self.norm(h)

    class Model(gemma2.Model):
        def __init__(self, args: ModelArgs):
            super().__init__(args)
            self.model = GemmaModel(args)  # lazy parameters: the replaced ones are never computed
            self.model.sliding = sliding_layers(args.layer_types, args.num_hidden_layers, args.sliding_window,
                                                "alternate")

        def make_cache(self) -> list[Any]:
            return layer_caches(self.model.sliding, self.args.sliding_window)

    return Model, ModelArgs


def _gemma3_text() -> tuple[type, type]:
    from mlx_lm.models import gemma3_text

    class Gemma3Model(gemma3_text.Gemma3Model):
        def __call__(self, inputs: mx.array, cache: list[Any] | None = None,
                     input_embeddings: mx.array | None = None) -> mx.array:
            h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
            h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
            cache = cache or [None] * len(self.layers)
            p = self.sliding_window_pattern
            sliding = [i % p != p - 1 for i in range(len(self.layers))]
            for layer, c, mask in zip(self.layers, cache, layer_masks(h, cache, sliding, self.window_size)):
                h = layer(h, mask, c)
            return self.norm(h)

    class Model(gemma3_text.Model):
        def __init__(self, args: gemma3_text.ModelArgs):
            super().__init__(args)
            self.model = Gemma3Model(args)

    return Model, gemma3_text.ModelArgs


_ACTIVATIONS = {"gelu": nn.gelu, "gelu_pytorch_tanh": nn.gelu_approx, "gelu_new": nn.gelu_approx,
                "gelu_fast": nn.gelu_approx}


def _starcoder2() -> tuple[type, type]:
    from mlx_lm.models import starcoder2

    @dataclass
    class ModelArgs(starcoder2.ModelArgs):
        sliding_window: int | None = None
        hidden_act: str = "gelu_pytorch_tanh"

        def __post_init__(self) -> None:
            if self.hidden_act not in _ACTIVATIONS:
                raise ValueError(f"hidden_act={self.hidden_act!r} (supported: {', '.join(_ACTIVATIONS)})")

    class MLP(starcoder2.MLP):
        def __call__(self, x: mx.array) -> mx.array:
            return self.c_proj(_ACTIVATIONS[self.hidden_act](self.c_fc(x)))

    class Starcoder2Model(starcoder2.Starcoder2Model):
        def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
            h = self.embed_tokens(inputs)
            cache = cache or [None] * len(self.layers)
            for layer, c, mask in zip(self.layers, cache, layer_masks(h, cache, self.sliding, self.args.sliding_window)):
                h = layer(h, mask, c)
            return self.norm(h)

    class Model(starcoder2.Model):
        def __init__(self, args: ModelArgs):
            super().__init__(args)
            self.model = Starcoder2Model(args)
            self.model.sliding = sliding_layers(None, args.num_hidden_layers, args.sliding_window, "all")
            for layer in self.model.layers:
                layer.mlp = MLP(args.hidden_size, args.intermediate_size)
                layer.mlp.hidden_act = args.hidden_act

        def make_cache(self) -> list[Any]:
            return layer_caches(self.model.sliding, self.args.sliding_window)

    return Model, ModelArgs


def yarn_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """YaRN's per-pair wavelengths (mx.fast.rope's `freqs`), as transformers computes them, `truncate` included
    (False: the correction range keeps its fractional ends)."""
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings", 4096))

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(scaling.get("beta_fast", 32))), correction_dim(float(scaling.get("beta_slow", 1)))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: the pair keeps its frequency; 0: divided by the factor
    pos = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv = extrapolate / pos + (1 - extrapolate) / (factor * pos)
    return 1 / inv


def _gpt_oss() -> tuple[type, type]:
    from mlx_lm.models import gpt_oss
    from mlx_lm.models.rope_utils import YarnRoPE

    class Model(gpt_oss.Model):
        def __init__(self, args: gpt_oss.ModelArgs):
            super().__init__(args)
            scaling = args.rope_scaling or {}
            if scaling.get("rope_type", scaling.get("type")) == "yarn" and not scaling.get("truncate", True):
                for layer in self.model.layers:
                    rope = layer.self_attn.rope
                    if isinstance(rope, YarnRoPE):
                        rope._freqs = yarn_freqs(rope.dims, float(args.rope_theta), scaling)

        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            dense = [k for k in weights if k.endswith("experts.gate_up_proj")]
            if not dense:
                return super().sanitize(weights)
            out = {}
            for k, v in weights.items():
                # transformers' dense experts: x @ gate_up_proj (E, hidden, 2I), gate and up interleaved;
                # x @ down_proj (E, I, hidden). mlx-lm's SwitchGLU holds (E, out, in).
                if k.endswith("experts.gate_up_proj"):
                    stem = k.removesuffix("gate_up_proj")
                    out[stem + "gate_proj.weight"] = mx.contiguous(v[..., ::2].swapaxes(-1, -2))
                    out[stem + "up_proj.weight"] = mx.contiguous(v[..., 1::2].swapaxes(-1, -2))
                elif k.endswith("experts.gate_up_proj_bias"):
                    stem = k.removesuffix("gate_up_proj_bias")
                    out[stem + "gate_proj.bias"] = mx.contiguous(v[..., ::2])
                    out[stem + "up_proj.bias"] = mx.contiguous(v[..., 1::2])
                elif k.endswith("experts.down_proj"):
                    out[k + ".weight"] = mx.contiguous(v.swapaxes(-1, -2))
                elif k.endswith("experts.down_proj_bias"):
                    out[k.removesuffix("_bias") + ".bias"] = v
                else:
                    out[k] = v
            return out

    return Model, gpt_oss.ModelArgs


def _falcon_h1() -> tuple[type, type]:
    from mlx_lm.models import falcon_h1

    class Model(falcon_h1.Model):
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            c1d = weights["model.layers.0.mamba.conv1d.weight"]
            if c1d.shape[-1] <= c1d.shape[1]:  # mlx-lm's own layout: multipliers already folded in
                return weights
            # transformers scales the attention's input (q, k and v) and then the keys; mlx-lm folds the first
            # into q and k only and looks for the second under a name no checkpoint has (`key_proj`)
            args = self.args
            scale = {"v_proj.weight": args.attention_in_multiplier, "k_proj.weight": args.key_multiplier}
            for name in weights:
                factor = next((f for suffix, f in scale.items() if name.endswith(suffix)), None)
                if factor is not None:
                    weights[name] = weights[name] * factor
            return super().sanitize(weights)

    return Model, falcon_h1.ModelArgs


_FIXED = {"gemma2": _gemma2, "falcon_h1": _falcon_h1, "gemma3_text": _gemma3_text, "starcoder2": _starcoder2, "gpt_oss": _gpt_oss}
