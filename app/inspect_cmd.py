"""The commands that look into a model without generating: `roofline tokens` (token pieces and ids), `logits` (one
forward's float32 logits, for parity), `kv` (the KV bytes a configuration needs, from its config alone)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from mlx_engine.api import RooflineError

from app.options import load_engine


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise RooflineError(f"--token-ids {text!r}: expected comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise RooflineError("--token-ids is empty: expected comma-separated integers, e.g. 1,2,3")
    return ids


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    ids = _parse_ids(args.token_ids)
    out = Path(args.output)
    if not out.parent.exists():
        raise RooflineError(f"--output {out}: folder {out.parent} does not exist")
    engine = load_engine(args.model)
    logits = engine.forward_logits(ids)
    np.save(out, logits.astype(np.float32))
    print(f"wrote {out} float32 {tuple(logits.shape)}", file=sys.stderr)
    return 0


def cmd_kv(args: argparse.Namespace) -> int:
    from mlx_engine.catalog import kv_shape
    from mlx_engine.memory import kv_bytes, state_bytes
    from mlx_engine.roofline import kv_dtype_here

    if args.context < 1 or args.batch < 1:
        raise RooflineError("--context and --batch must be positive integers")
    if args.kv_key_bits is not None and args.kv_bits is None:
        raise RooflineError(f"--kv-key-bits {args.kv_key_bits} needs --kv-bits (4 or 8): it sets the keys' bits of "
                            "a quantized KV cache")
    shape = kv_shape(args.model)
    dtype, why = (args.dtype, "--dtype") if args.dtype else kv_dtype_here()
    itemsize = 4 if dtype == "float32" else 2
    # as the engine stores them by default: 4-bit keys per channel over each block's tokens (KVConfig.key_per_channel)
    per_channel = (args.kv_key_bits or args.kv_bits) == 4 and shape.head_dim % args.block_size == 0
    key_group = args.block_size if per_channel else None
    total = kv_bytes(shape, args.context, args.batch, args.kv_bits, itemsize, key_bits=args.kv_key_bits,
                     key_group_size=key_group)
    per_token = kv_bytes(shape, 1, 1, args.kv_bits, itemsize, key_bits=args.kv_key_bits, key_group_size=key_group)
    keys = f", keys per channel over {args.block_size}-token blocks" if per_channel else ""
    kind = f"{args.kv_bits}-bit (g64{keys}, {dtype} scales)" if args.kv_bits else dtype
    if args.kv_key_bits not in (None, args.kv_bits):
        kind = f"{args.kv_key_bits}-bit keys, {args.kv_bits}-bit values (g64{keys}, {dtype} scales)"
    kind += f" ({why})" if not args.dtype else ""
    layers = shape.num_layers - shape.no_kv_layers
    what = (f"{layers} layers x one MLA latent of {shape.latent_dim}" if shape.latent_dim else
            f"{layers} layers x {shape.num_kv_heads} KV heads x head dim {shape.head_dim}"
            + (f" (V {shape.v_head_dim})" if shape.v_head_dim else "")
            + (f" ({shape.wide_layers} full-attention layers: {shape.wide_kv_heads or shape.num_kv_heads} x "
               f"{shape.wide_head_dim})" if shape.wide_layers else ""))
    print(f"{total / 1e9:.1f} GB ({total:,} bytes) of KV for {args.batch} x {args.context:,} tokens in {kind}: "
          f"{what}, {per_token:,} bytes per token")
    if shape.latent_dim:
        full = kv_bytes(dataclasses.replace(shape, latent_dim=0), 1, 1, args.kv_bits, itemsize)
        print(f"MLA: each layer keeps the latent (kv_lora_rank + the rope part) shared by all heads; K and V of "
              f"{shape.num_kv_heads} heads (K {shape.head_dim}, V {shape.v_head_dim or shape.head_dim}) would take "
              f"{full:,} bytes per token")
    if shape.no_kv_layers:
        print(f"{shape.no_kv_layers} of {shape.num_layers} layers keep no KV of their own (linear attention, Mamba and "
              "convolution layers hold a recurrent state of fixed size per sequence instead; MLP blocks nothing; "
              "Gemma 4's shared-KV layers read earlier layers')")
    state = state_bytes(shape, args.batch, itemsize)
    if state:
        print(f"recurrent state: {state:,} bytes for {args.batch} sequence{'s' if args.batch > 1 else ''} whatever "
              f"their length ({state // args.batch:,} each; convolution windows in {dtype}, Gated DeltaNet's state in "
              f"float32), {(total + state) / 1e9:.1f} GB with the KV")
    if shape.num_sliding_layers:
        w = shape.sliding_window
        past = (kv_bytes(shape, w + 1, 1, args.kv_bits, itemsize, key_bits=args.kv_key_bits, key_group_size=key_group)
                - kv_bytes(shape, w, 1, args.kv_bits, itemsize, key_bits=args.kv_key_bits, key_group_size=key_group))
        print(f"sliding window: {shape.num_sliding_layers} of {layers} layers attend to the last "
              f"{w:,} tokens and are counted at {min(args.context, w):,} tokens each; past the window a token adds "
              f"{past:,} bytes")
    if shape.num_experts:
        print(f"mixture of experts: {shape.num_experts} experts, {shape.num_experts_per_tok} per token "
              "(KV is the attention's: the experts add none)")
    if shape.context_length and args.context > shape.context_length:
        print(f"note: the model's own context is {shape.context_length:,} tokens", file=sys.stderr)
    if args.distributed is not None:
        _kv_per_rank(args, shape, lambda s: kv_bytes(s, args.context, args.batch, args.kv_bits, itemsize,
                                                     key_bits=args.kv_key_bits, key_group_size=key_group))
    return 0


def _kv_per_rank(args: argparse.Namespace, shape: Any, kv_of: Any) -> None:
    """`kv --distributed`: each rank's share on paper (the split a run makes, from the checkpoint's tensor sizes)."""
    from mlx_engine import distributed

    mode = distributed.check_mode(args.distributed)
    if args.ranks < 2:
        raise RooflineError(f"--ranks {args.ranks}: expected 2 or more")
    if mode == "tensor" and shape.num_kv_heads % args.ranks:
        raise RooflineError(f"tensor parallel over {args.ranks} ranks splits the KV heads, and this model's "
                            f"{shape.num_kv_heads} do not divide by {args.ranks}: use --distributed pipeline")
    shares = distributed.shares_on_paper(distributed.file_tensor_sizes(args.model), shape.num_layers,
                                         shape.num_kv_heads, mode, args.ranks)
    for r in shares:
        kv = kv_of(dataclasses.replace(shape, num_layers=r.num_layers, num_kv_heads=r.kv_heads))
        held = ", ".join(x for x, on in (("embedding", r.embed), ("head", r.head)) if on)
        print(f"rank {r.rank}: layers {r.layers[0]}-{r.layers[1] - 1} ({r.num_layers}) x {r.kv_heads} KV heads"
              f"{'; ' + held if held else ''}: weights {_size(r.weight_bytes)} as stored, KV {_size(kv)}")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def cmd_tokens(args: argparse.Namespace) -> int:
    from mlx_engine.loading import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    ids = tok.encode(args.text, add_special_tokens=False)
    if args.json:
        print(json.dumps({"ids": ids}))
        return 0
    for i in ids:
        print(f"{i:>8}  {tok.id_to_piece(i)!r}")
    print(f"{len(ids)} tokens", file=sys.stderr)
    return 0
