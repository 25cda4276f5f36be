"""KV files: a conversation's cached full blocks saved to safetensors and restored into the prefix cache (the
MLX paged cache's `save` / `restore`)."""

from __future__ import annotations

import mlx.core as mx

from mlx_engine.api import RooflineError
from mlx_engine.kv.paged import PagedKVStorage
from mlx_engine.kv.tables import BlockTables, KVBudgetError

KV_FILE_FORMAT = "roofline-kv-1"


class KVRestoreError(RooflineError):
    """A saved KV file that cannot be used here (another model, another layout, corrupt)."""


def _rotation_name(storage: PagedKVStorage) -> str:
    """How stored values (and per-token keys) are rotated (files written before rotation existed say nothing:
    'none')."""
    return "none" if storage.key_rotation is None else "hadamard"


def _layout_meta(storage: PagedKVStorage) -> dict[str, str]:
    """How the stored K and V are transformed; a file must match this engine's to be read."""
    smoothing, per_channel = storage.smoothing, storage.key_per_channel
    return {"kv_key_grouping": "channel" if per_channel else "token",
            "key_rotation": "none" if per_channel else _rotation_name(storage),
            "value_rotation": _rotation_name(storage),
            # the per-model offsets and key scales (`kv.smoothing`), by fingerprint
            "kv_smoothing": smoothing.fingerprint() if smoothing is not None else "none"}


def save_blocks(tables: BlockTables, storage: PagedKVStorage, path: str, token_ids: list[int],
                fingerprint: bytes) -> int:
    """Writes the cached full blocks that cover the longest prefix of `token_ids` (K/V of every layer, the
    tokens and the model fingerprint) to a safetensors file. Returns the number of tokens saved."""
    import json

    mgr, bs = tables.manager, tables.block_size
    blocks = mgr.cached_prefix(token_ids, len(token_ids) // bs)
    n = len(blocks) * bs
    if n == 0:
        raise RooflineError("nothing to save: no full KV block of these tokens is in the cache")
    slots = mx.array([b.block_id * bs + i for b in blocks for i in range(bs)], dtype=mx.int32)
    st = storage
    arrays: dict[str, mx.array] = {}
    for name in ("k", "v", "k_scales", "k_biases", "v_scales", "v_biases"):
        per_layer = getattr(st, name)
        if per_layer is not None:
            for layer, a in enumerate(per_layer):
                arrays[f"{name}.{layer}"] = st.read_slots(a, slots)  # token-major in the file, any layout here
    meta = {"format": KV_FILE_FORMAT, "fingerprint": fingerprint.hex(), "block_size": str(bs),
            "kv_bits": str(st.bits or 0), "kv_key_bits": str(st.key_bits or 0), "kv_group_size": str(st.group_size),
            "dtype": str(st.dtype), **_layout_meta(st),
            "num_tokens": str(n), "tokens": json.dumps(token_ids[:n])}
    write_safetensors(path, arrays, meta)
    return n


def write_safetensors(path: str, arrays: dict[str, mx.array], meta: dict[str, str]) -> None:
    """`arrays` to `path` whole or not at all. MLX appends ".safetensors" to a name without it, and a write cut
    short must not leave a file at `path`: written beside it under that suffix, then renamed to the name asked for."""
    import os

    partial = f"{path}.partial.safetensors"
    try:
        mx.save_safetensors(partial, arrays, metadata=meta)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def restore_blocks(tables: BlockTables, storage: PagedKVStorage, path: str, fingerprint: bytes) -> list[int]:
    """Loads a file written by `save_blocks` into free blocks and registers them in the prefix cache, so
    the next request starting with those tokens prefills only the rest. Returns the restored tokens."""
    import json
    from pathlib import Path

    from mlx_engine.api import ModelLoadError
    from mlx_engine.loading.safetensors_file import validate_safetensors

    try:
        validate_safetensors(Path(path))
        arrays, meta = mx.load(path, format="safetensors", return_metadata=True)
    except ModelLoadError as e:
        raise KVRestoreError(f"saved KV refused: {e}") from None
    except (RuntimeError, ValueError, OSError) as e:
        raise KVRestoreError(f"saved KV refused: {path}: cannot read ({e})") from None
    if meta.get("format") != KV_FILE_FORMAT:
        raise KVRestoreError(f"saved KV refused: {path} is not a Roofline KV file (format {meta.get('format')!r})")
    if meta.get("fingerprint") != fingerprint.hex():
        raise KVRestoreError(f"saved KV refused: {path} was made by another model or dtype (fingerprint differs)")
    st = storage
    want = {"block_size": str(tables.block_size), "kv_bits": str(st.bits or 0), "kv_key_bits": str(st.key_bits or 0),
            "kv_group_size": str(st.group_size), **_layout_meta(st)}
    # fields older files lack: their keys were not rotated (nor their values, nor smoothed), and had the values' bits
    defaults = {"key_rotation": "none", "value_rotation": "none", "kv_smoothing": "none", "kv_key_grouping": "token",
                "kv_key_bits": meta.get("kv_bits")}
    for key, value in want.items():
        have = meta.get(key, defaults.get(key))
        if have != value:
            why = (" (the quantized KV's offsets and key scales, measured when the engine loads, differ: another "
                   "model build, MLX version or machine)") if key == "kv_smoothing" else ""
            raise KVRestoreError(f"saved KV refused: {path} has {key}={have}, this engine uses {value}{why}")
    try:
        tokens = [int(t) for t in json.loads(meta["tokens"])]
        n = int(meta["num_tokens"])
    except (KeyError, ValueError, TypeError) as e:
        raise KVRestoreError(f"saved KV refused: {path}: corrupt token list ({e})") from None
    names = [name for name in ("k", "v", "k_scales", "k_biases", "v_scales", "v_biases") if getattr(st, name)]
    for name in names:
        for layer, pool in enumerate(getattr(st, name)):
            a = arrays.get(f"{name}.{layer}")
            want = (n, st.num_kv_heads, pool.shape[-1])
            if a is None or a.shape != want or a.dtype != pool.dtype or len(tokens) != n:
                raise KVRestoreError(f"saved KV refused: {path}: tensor {name}.{layer} is missing or has the wrong "
                                     f"shape (expected {want} {pool.dtype})")
    tables.check_fits(n)
    req = f"restore-{id(arrays)}"
    try:
        tables.allocate(req, tokens, n)
    except KVBudgetError:
        raise KVRestoreError(f"saved KV refused: no free KV blocks for {n} tokens") from None
    slots = mx.array(tables.manager.slot_mapping(req, 0, n), dtype=mx.int32)
    for name in names:
        for layer in range(st.num_layers):
            st.write_slots(getattr(st, name), layer, slots, arrays[f"{name}.{layer}"])
    mx.eval(st.arrays())
    tables.free(req)
    return tokens
