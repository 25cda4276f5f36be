"""Each rank keeps only its shard of a built model, before its weights are read (`mx.eval`), so a lazily loaded
checkpoint never brings the other ranks' weights into memory.

Pipeline: the layer ranges of `plan.pipeline_split`, balanced by the parameters (`_weight`); rank 0 keeps the embedding,
the final norm and the head. Tensor: as mlx-lm's `shard` methods, with MLX's own sharding of the weights
(`mlx.nn.layers.distributed.shard_inplace`): q, k, v, gate and up split by output rows ("all-to-sharded"), o and down
by input columns ("sharded-to-all") and followed by one all-sum each. The projections stay plain (quantized) linear
layers, so the CPU backend's host-BLAS path (`backends.mlx.host_blas`) still takes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace

from mlx_engine.api import ModelLoadError
from mlx_engine.distributed.plan import pipeline_split, tensor_problem
from mlx_engine.models.kquant import KQuantLinear


class SumAcrossRanks(nn.Module):
    """A "sharded-to-all" projection: this rank's partial product, all-summed over the ranks, then the bias once."""

    def __init__(self, inner: nn.Module, group: Any):
        super().__init__()
        self.group = group
        if "bias" in inner:
            self.bias = inner.bias
            del inner["bias"]
        self.inner = inner

    progress: Any = None  # rank 0: its deadline's touch (each projection's input was evaluated by now on the CPU)

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.inner(x), group=self.group)
        if self.progress is not None:
            self.progress()
        return y + self.bias if "bias" in self else y


def _weight(module: nn.Module) -> int:
    """A module's share of the balance: its parameters unpacked. Proportional to its bytes on Metal (one
    quantization throughout) and on the CPU backend, where projections and a tied head get float32 copies
    (`host_blas`) and the packed bytes would leave rank 0 a third heavier (SmolLM2: 283 MB against 370 MB
    by packed bytes, a float32 head copy of 113 MB on rank 0)."""
    from mlx_engine.models import count_parameters

    return count_parameters(module)


def pipeline_shard(model: nn.Module, rank: int, size: int) -> tuple[int, int]:
    """Keeps this rank's layers (and, on rank 0, the embedding, final norm and head); returns its [start, end)."""
    inner = model.model
    layers = list(inner.layers)
    rank0_extra = _weight(inner.embed_tokens) + _weight(inner.norm) + (_weight(model.lm_head) if "lm_head" in model
                                                                         else 0)
    ranges = pipeline_split([_weight(layer) for layer in layers], rank0_extra, size)
    start, end = ranges[rank]
    inner.layers = layers[start:end]
    if rank != 0:
        for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
            if name in owner:
                del owner[name]
    model.args = dataclasses.replace(model.args, num_hidden_layers=end - start)
    return start, end


def tensor_shard(model: nn.Module, group: Any, name: str) -> None:
    """Splits every layer's heads and MLP columns over `group`; rank 0 alone keeps an untied head."""
    n, args = group.size(), model.args
    why = tensor_problem(args.num_attention_heads, args.num_key_value_heads, args.intermediate_size, n, name)
    if why:
        raise ModelLoadError(why)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.o_proj, mlp.down_proj):
            _check_columns(proj, n, name)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            shard_inplace(proj, "all-to-sharded", group=group)
        for proj in (attn.o_proj, mlp.down_proj):
            shard_inplace(proj, "sharded-to-all", group=group)
        attn.o_proj = SumAcrossRanks(attn.o_proj, group)
        mlp.down_proj = SumAcrossRanks(mlp.down_proj, group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
    if group.rank() != 0 and "lm_head" in model:
        del model["lm_head"]
    model.args = dataclasses.replace(args, num_attention_heads=args.num_attention_heads // n,
                                     num_key_value_heads=args.num_key_value_heads // n)


def _check_columns(proj: nn.Module, n: int, name: str) -> None:
    if isinstance(proj, KQuantLinear):
        raise ModelLoadError(f"tensor parallel cannot split {name}'s GGUF k-quant blocks: use --distributed pipeline")
    if isinstance(proj, nn.QuantizedLinear):
        columns = proj.scales.shape[-1]  # quantization groups per row
        if columns % n:
            raise ModelLoadError(f"tensor parallel over {n} ranks splits {name}'s quantized rows by input groups, "
                                 f"and its {columns} groups per row do not divide by {n}: use --distributed pipeline")


def check_shardable(built: Any, mode: str, name: str) -> None:
    """One line for a model this mode cannot split (before anything is shared with the other ranks)."""
    if not built.native:
        raise ModelLoadError(f"--distributed needs a natively implemented model; {name} ({built.model_type}) runs on "
                             "an mlx-lm class" + (f": {built.kv_note}" if built.kv_note else ""))
    if built.model.args.sliding_window is not None:
        raise ModelLoadError(f"--distributed needs the paged KV cache, which {name}'s sliding-window attention "
                             "does not use")
