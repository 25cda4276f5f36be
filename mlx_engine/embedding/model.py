"""An embedding model's decoder, loaded from a sentence-transformers folder or a GGUF file: the weights of a bare
`Qwen3Model` (no `model.` prefix, no head, as Qwen3-Embedding ships) under the names our families load, no head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_engine.api import ModelLoadError
from mlx_engine.loading import Checkpoint

# families whose packed forward is the Llama block's (models.llama.Model): the views rope and attend, no softcap
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LoadedDecoder:
    model: Any  # models.llama.Model, float parameters in `dtype`
    checkpoint: Checkpoint
    context_length: int
    num_parameters: int
    weight_bytes: int
    dtype: str
    note: str = ""  # how the projections run here (backends.mlx.load.use_host_blas), for ModelInfo.notes


def check_family(model_type: str | None, source: str) -> None:
    if model_type not in DECODER_TYPES:
        raise ModelLoadError(f"{source}: embeddings run on decoders of the Llama family ({', '.join(DECODER_TYPES)}: "
                             f"Qwen3-Embedding, e5-mistral, gte-Qwen2), not {model_type!r} (bidirectional encoders "
                             "such as BERT, nomic-bert or EmbeddingGemma are not supported yet)")


def decoder_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The decoder's weights under `model.*`; a head (`lm_head.*`) dropped: the pooled hidden state is the output."""
    bare = not any(k.startswith("model.") for k in weights)
    return {(f"model.{k}" if bare else k): v for k, v in weights.items() if not k.startswith("lm_head.")}


def load_decoder(ref: str | None, dtype: str | None = None, max_context: int | None = None) -> LoadedDecoder:
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_engine.backends.mlx.load import pick_dtype, use_host_blas
    from mlx_engine.loading import load_checkpoint
    from mlx_engine.models import build_model, count_parameters

    ckpt = load_checkpoint(ref)
    check_family(ckpt.config.get("model_type"), str(ckpt.path))
    if ckpt.tokenizer is None:
        raise ModelLoadError(f"{ckpt.path}: no tokenizer.json beside the weights, so text cannot be embedded")
    act = pick_dtype(dtype, ckpt.checkpoint_dtype)
    config = {**ckpt.config, "tie_word_embeddings": True}  # no head is built: none is loaded
    built = build_model(config, decoder_weights(dict(ckpt.weights)), act, ckpt.quantization, str(ckpt.path))
    params = dict(nn.utils.tree_flatten(built.model.parameters()))
    mx.eval(params)
    weight_bytes = sum(v.nbytes for v in params.values())
    # MLX's Linux CPU wheel multiplies on the reference BLAS: projections go to numpy's (a no-op on Metal)
    _, _, note = use_host_blas(built.model, act)
    context = built.context_length
    if max_context is not None:
        if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
            raise ModelLoadError(f"invalid Engine.load option max_context={max_context!r}: expected an integer >= 1")
        context = min(context, max_context)
    return LoadedDecoder(model=built.model, checkpoint=ckpt, context_length=context,
                         num_parameters=count_parameters(built.model),
                         weight_bytes=weight_bytes, dtype=str(act).removeprefix("mlx.core."), note=note)
