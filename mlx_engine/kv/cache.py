"""The engine's KV cache for one running sequence at a time, in two forms with one interface.

`PagedCache`: the block pool (prefix caching across requests, quantized KV, a fixed memory budget).
`ContiguousCache`: mlx-lm's per-layer buffers, for models the paged path does not cover (mlx-lm
fallback classes, sliding-window attention); it reuses the previous request's prefix by trimming.

Both: `start(req_id, prompt_ids) -> cached tokens`, `prefill_layers(req_id, start, end)` before a
prefill forward over [start, end), `decode_layers(req_ids, known_ids)` before a decode step (the paged
cache batches several sequences), `record(req_id, known_ids)` once tokens are known, `finish(req_id, fed_ids)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_engine.api import RequestError, RooflineError
from mlx_engine.kv.block_pool import BlockPool
from mlx_engine.kv.manager import KVCacheManager, cdiv
from mlx_engine.kv.paged import (SUPPORTED_KV_BITS, PackedView, PagedDecodeView, PagedKVStorage, PagedPrefillView,
                                 bytes_per_block)

SUPPORTED_BLOCK_SIZES = (16, 32)  # what kernels_metal.paged_decode_attention is built and tested for
DEFAULT_MEMORY_FRACTION = 0.5
MAX_SLOT_RUNS = 8  # on the CPU, a sequence in at most this many runs of blocks is attended in place (`_slots`)


class KVBudgetError(RequestError):
    """A request whose KV cannot fit the pool."""


@dataclass(frozen=True)
class KVConfig:
    block_size: int = 16
    kv_bits: int | None = None
    kv_group_size: int = 64
    kv_budget_bytes: int | None = None  # None: sized from the context length, capped by free memory
    prefix_caching: bool = True
    kv_key_bits: int | None = None  # the keys' bits when they differ from kv_bits (None: kv_bits)
    # quantize keys per channel over each block's tokens (KIVI), not per token; None: for 4-bit keys when the block
    # size divides the head dim (`key_per_channel`)
    kv_key_per_channel: bool | None = None

    def key_per_channel(self, head_dim: int) -> bool:
        """Whether keys are quantized per channel: as set, or by default for 4-bit keys (per token they cost SmolLM2
        6-11% perplexity, per channel under 3%: docs/benchmarks.md, figure 4) when the block size divides the head
        dim; 8-bit keys stay per token (within 0.2% already)."""
        if self.kv_key_per_channel is not None:
            return self.kv_key_per_channel
        key_bits = self.kv_key_bits or self.kv_bits
        return key_bits == 4 and head_dim % self.block_size == 0

    def validate(self, head_dim: int) -> None:
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise RooflineError(f"block_size={self.block_size!r}: expected one of {SUPPORTED_BLOCK_SIZES} "
                                "(the paged attention kernel's block sizes)")
        if self.kv_bits is not None and self.kv_bits not in SUPPORTED_KV_BITS:
            raise RooflineError(f"kv_bits={self.kv_bits!r}: expected 4, 8 or None (unquantized KV)")
        if self.kv_key_bits is not None and self.kv_key_bits not in SUPPORTED_KV_BITS:
            raise RooflineError(f"kv_key_bits={self.kv_key_bits!r}: expected 4, 8 or None (the keys take kv_bits)")
        if self.kv_key_bits is not None and self.kv_bits is None:
            raise RooflineError(f"kv_key_bits={self.kv_key_bits!r}: only valid with kv_bits set (4 or 8): it sets "
                                "the keys' bits of a quantized KV cache; expected None without kv_bits")
        if self.kv_key_per_channel is not None and not isinstance(self.kv_key_per_channel, bool):
            raise RooflineError(f"kv_key_per_channel={self.kv_key_per_channel!r}: expected True, False or None (auto)")
        if self.kv_key_per_channel and self.kv_bits is None:
            raise RooflineError("kv_key_per_channel=True: only valid with kv_bits set (4 or 8): it sets how the keys "
                                "of a quantized KV cache are grouped")
        if self.kv_key_per_channel and head_dim % self.block_size:
            raise RooflineError(f"kv_key_per_channel=True: a block's per-channel key scales fill its slots, so the "
                                f"block size must divide the head dim {head_dim}; got block_size={self.block_size}")
        if self.kv_bits is not None and (self.kv_group_size not in (32, 64) or head_dim % self.kv_group_size):
            raise RooflineError(f"kv_group_size={self.kv_group_size!r}: expected 32 or 64, dividing the head "
                                f"dim {head_dim}")
        if self.kv_budget_bytes is not None and (not isinstance(self.kv_budget_bytes, int)
                                                 or self.kv_budget_bytes <= 0):
            raise RooflineError(f"kv_budget_bytes={self.kv_budget_bytes!r}: expected a positive integer")


def available_memory_bytes(weight_bytes: int) -> int:
    """Memory the KV pool may take: on a Mac the recommended working set minus the weights, elsewhere
    the RAM not in use."""
    if mx.metal.is_available():
        return int(mx.metal.device_info()["max_recommended_working_set_size"]) - weight_bytes
    from mlx_engine.memory import available_memory

    return available_memory().bytes  # within ulimit -v and a cgroup's limit too


def default_budget(context_length: int, block_size: int, per_block: int, weight_bytes: int) -> int:
    """One full context plus a quarter for cached prefixes, within half the free memory."""
    wanted = cdiv(context_length, block_size) * per_block * 5 // 4
    return min(wanted, int(available_memory_bytes(weight_bytes) * DEFAULT_MEMORY_FRACTION))


def blocks_in_budget(budget: int, per_block: int, block_size: int, num_layers: int) -> int:
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise RooflineError(f"kv_budget_bytes={budget}: smaller than one KV block ({per_block} bytes for "
                            f"{block_size} tokens across {num_layers} layers)")
    return num_blocks


def new_contiguous_layers(model: Any, native: bool) -> list[Any]:
    """Empty per-layer buffers: mlx-lm's KVCache for our models, its own cache objects for its classes."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return [KVCache() for _ in model.layers] if native else make_prompt_cache(model)


class PagedCache:
    def __init__(self, storage: PagedKVStorage, manager: KVCacheManager, num_layers: int):
        self.storage, self.manager, self.num_layers = storage, manager, num_layers
        self.block_size = manager.block_size

    @classmethod
    def create(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype, context_length: int,
               weight_bytes: int, config: KVConfig, model_id: bytes) -> PagedCache:
        config.validate(head_dim)
        per_block = bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype.size,
                                    config.kv_bits, config.kv_group_size, config.kv_key_bits,
                                    config.key_per_channel(head_dim))
        budget = config.kv_budget_bytes
        if budget is None:
            budget = default_budget(context_length, config.block_size, per_block, weight_bytes)
        num_blocks = blocks_in_budget(budget, per_block, config.block_size, num_layers)
        storage = PagedKVStorage(num_layers, num_blocks, config.block_size, num_kv_heads, head_dim, dtype,
                                 config.kv_bits, config.kv_group_size, key_bits=config.kv_key_bits,
                                 key_per_channel=config.key_per_channel(head_dim))
        manager = KVCacheManager(BlockPool(num_blocks, enable_caching=config.prefix_caching), config.block_size,
                                 extra_key=model_id)
        cache = cls(storage, manager, num_layers)
        cache.bytes_per_block = per_block
        return cache

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        """Quantized KV only: measures the model's KV smoothing (`kv.smoothing`) on the built-in calibration
        text, one short forward, before anything is stored."""
        if self.storage.bits is None:
            return
        from mlx_engine.kv.smoothing import calibrate

        self.storage.set_smoothing(calibrate(model, tokenizer, vocab_size))

    @property
    def capacity_tokens(self) -> int:
        return self.storage.num_blocks * self.block_size

    def check_fits(self, num_tokens: int) -> None:
        need = cdiv(num_tokens, self.block_size)
        if need > self.storage.num_blocks:
            raise KVBudgetError(
                f"this request needs KV for {num_tokens} tokens ({need * self.bytes_per_block:,} bytes) but the KV "
                f"budget holds {self.capacity_tokens} tokens ({self.storage.num_blocks * self.bytes_per_block:,} "
                "bytes); raise kv_budget_bytes, use kv_bits=8, or shorten the prompt"
            )

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        """Allocates a new sequence's prompt blocks, the cached prefix's (prefix caching) shared unless
        `reuse` is False; returns the number of prompt tokens already cached."""
        computed, num_cached = self.manager.get_computed_blocks(prompt_ids) if reuse else ([], 0)
        if self.manager.allocate_slots(req_id, prompt_ids, len(prompt_ids) - num_cached, computed) is None:
            raise KVBudgetError(f"no free KV blocks for a {len(prompt_ids)}-token prompt")
        self._grow(req_id)
        self._copy_pending()
        return num_cached

    def _grow(self, req_id: str) -> None:
        table = self.manager.block_table(req_id)
        if table:
            self.storage.ensure_capacity(max(table) + 1)

    def _copy_pending(self) -> None:
        if self.manager.pending_copies:
            self.storage.ensure_capacity(max(max(p) for p in self.manager.pending_copies) + 1)
            self.storage.copy_blocks(self.manager.pending_copies)
            self.manager.pending_copies.clear()

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[PagedPrefillView]:
        """Views for a forward over positions [start, end) of a sequence whose slots `start` allocated."""
        slots = self.manager.slot_mapping(req_id, start, end)
        new_slots = mx.array(slots, dtype=mx.int32)
        all_slots = self._slots(req_id, end)
        plan = self.storage.plan_key_writes([(req_id, s) for s in slots])
        return [PagedPrefillView(self.storage, i, start, new_slots, all_slots, plan) for i in range(self.num_layers)]

    def _slots(self, req_id: str, n: int) -> mx.array | list[slice]:
        """The first n slots of a sequence for attention that reads them whole: on MLX's CPU backend, when its
        blocks form at most MAX_SLOT_RUNS runs of consecutive ids, one slice per run (read in place: a
        next turn's new blocks rarely follow its cached prefix's, and gathering 4K tokens' K/V every layer
        and step made paged decode 18% slower than contiguous); else their ids."""
        table = self.manager.block_table(req_id)[:-(-n // self.block_size)]
        if not mx.metal.is_available():
            starts = [i for i in range(len(table)) if i == 0 or table[i] != table[i - 1] + 1]
            if len(starts) <= MAX_SLOT_RUNS:
                bs = self.block_size
                ends = starts[1:] + [len(table)]
                return [slice(table[a] * bs, table[a] * bs + min(n, b * bs) - a * bs) for a, b in zip(starts, ends)]
        return mx.array(self.manager.slot_mapping(req_id, 0, n), dtype=mx.int32)

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[PagedDecodeView]:
        """Views for one decode step: sequence b's next token goes at position num_tokens(b) (allocated
        here; its value may still be unknown to the host, so `known_ids[b]` can stop short of it)."""
        mgr = self.manager
        positions = []
        for req, known in zip(req_ids, known_ids):
            pos = mgr.num_tokens(req)
            if mgr.allocate_slots(req, known, 1) is None:
                raise KVBudgetError(f"the KV pool is full ({self.storage.num_blocks} blocks of {self.block_size})")
            positions.append(pos)
            self._grow(req)
        self._copy_pending()
        tables = [mgr.block_table(r) for r in req_ids]
        width = max(len(t) for t in tables)
        block_tables = mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)  # (B, nb)
        slots = [mgr.slot_mapping(r, p, p + 1)[0] for r, p in zip(req_ids, positions)]
        new_slots = mx.array(slots, dtype=mx.int32)
        plan = self.storage.plan_key_writes(list(zip(req_ids, slots)))
        seq_lens = mx.array([p + 1 for p in positions], dtype=mx.int32)
        offset = mx.array(positions, dtype=mx.int32) if len(positions) > 1 else positions[0]
        all_slots = self._slots(req_ids[0], positions[0] + 1) if len(req_ids) == 1 and not mx.metal.is_available() \
            else None
        return [PagedDecodeView(self.storage, i, offset, new_slots, block_tables, seq_lens, max(positions) + 1,
                                all_slots, plan) for i in range(self.num_layers)]

    packed_view: type = PackedView  # the torch backend's cache packs its own views

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[PackedView]:
        """Views for one forward over packed rows: a decode step of `decode_ids` (as `decode_layers`, may be
        empty), then each (req_id, start, end) prefill chunk (as `prefill_layers`)."""
        decode = self.decode_layers(decode_ids, known_ids) if decode_ids else [None] * self.num_layers
        prefills = [self.prefill_layers(r, a, b) for r, a, b in chunks]
        lengths = [b - a for _, a, b in chunks]
        return [self.packed_view(decode[i], len(decode_ids), [p[i] for p in prefills], lengths)
                for i in range(self.num_layers)]

    def record(self, req_id: str, known_ids: list[int]) -> None:
        self.manager.cache_full_blocks(req_id, known_ids)

    def _release(self, req_id: str | None) -> None:
        """Per-channel keys: drop the request's (None: every) staged keys of blocks still being written."""
        if getattr(self.storage, "key_per_channel", False):  # the torch storage has none
            self.storage.release_key_stages(req_id)

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        self.manager.free(req_id)
        self._release(req_id)

    def drop(self) -> None:
        for req in list(self.manager.req_to_blocks):
            self.manager.free(req)
        self._release(None)

    def drop_request(self, req_id: str) -> None:
        """After a failed step: free the request's blocks and forget the prefix hashes they carried."""
        blocks = list(self.manager.req_to_blocks.get(req_id, []))
        self.manager.free(req_id)
        self._release(req_id)
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self.manager.pool._maybe_evict_cached_block(block)

    def stats(self) -> dict[str, Any]:
        s = self.manager.stats()
        s.update(kind="paged", bytes_per_block=self.bytes_per_block, bytes_total=self.storage.nbytes,
                 bytes_budget=self.storage.num_blocks * self.bytes_per_block,
                 bytes_used=s["used"] * self.bytes_per_block, kv_bits=self.storage.bits,
                 kv_key_bits=getattr(self.storage, "key_bits", self.storage.bits),  # torch storage: no key_bits
                 kv_key_per_channel=getattr(self.storage, "key_per_channel", False),
                 # per-channel keys: float copies of the blocks being written (one per running sequence), outside
                 # the budget
                 bytes_staging=sum(a.nbytes for a in getattr(self.storage, "key_stage", [])))
        return s


class ContiguousCache:
    def __init__(self, model: Any, native: bool):
        self.model, self.native = model, native
        self._layers: list[Any] | None = None
        self._tokens: list[int] = []  # the tokens whose K/V the buffers hold, in order
        self.num_queried = self.num_hit = 0

    def _new(self) -> list[Any]:
        return new_contiguous_layers(self.model, self.native)

    def _trim(self, n: int) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        return can_trim_prompt_cache(self._layers) and trim_prompt_cache(self._layers, n) == n

    def check_fits(self, num_tokens: int) -> None:
        pass

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        """Keeps the longest common prefix with what the buffers hold (at least the last prompt token
        is recomputed; none unless `reuse`); returns its length."""
        if self._layers is None:
            self._layers, self._tokens = self._new(), []
        n, limit = 0, min(len(prompt_ids) - 1, len(self._tokens)) if reuse else 0
        while n < limit and prompt_ids[n] == self._tokens[n]:
            n += 1
        extra = len(self._tokens) - n
        if extra:
            if self._trim(extra):
                del self._tokens[n:]
            else:
                self._layers, self._tokens, n = self._new(), [], 0
        self.num_queried += len(prompt_ids)
        self.num_hit += n
        return n

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[Any]:
        return self._layers

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[Any]:
        if len(req_ids) != 1:
            raise RooflineError("the contiguous KV cache runs one sequence at a time")
        return self._layers

    def record(self, req_id: str, known_ids: list[int]) -> None:
        pass

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        """The buffers may hold one step more than was fed (a pipelined step): trim to `fed_ids`."""
        offset = getattr(self._layers[0], "offset", len(fed_ids)) if self._layers else 0
        over = offset - len(fed_ids)
        if over > 0 and not self._trim(over):
            self._layers, self._tokens = None, []
            return
        self._tokens = list(fed_ids)

    def drop(self) -> None:
        self._layers, self._tokens = None, []

    def drop_request(self, req_id: str) -> None:
        self.drop()

    def stats(self) -> dict[str, Any]:
        return {"kind": "contiguous", "num_tokens": len(self._tokens), "num_queried_tokens": self.num_queried,
                "num_hit_tokens": self.num_hit,
                "hit_rate": self.num_hit / self.num_queried if self.num_queried else 0.0}


KV_FILE_FORMAT = "roofline-kv-1"


class KVRestoreError(RooflineError):
    """A saved KV file that cannot be used here (another model, another layout, corrupt)."""


def _rotation_name(storage: PagedKVStorage) -> str:
    """How stored values (and per-token keys) are rotated (files written before rotation existed say nothing:
    'none')."""
    return "none" if storage.key_rotation is None else "hadamard"


def _layout_meta(storage: PagedKVStorage) -> dict[str, str]:
    """How the stored K and V are transformed; a file must match this engine's to be read."""
    smoothing = getattr(storage, "smoothing", None)  # the torch storage has none
    per_channel = getattr(storage, "key_per_channel", False)
    return {"kv_key_grouping": "channel" if per_channel else "token",
            "key_rotation": "none" if per_channel else _rotation_name(storage), "value_rotation": _rotation_name(storage),
            # the per-model offsets and key scales (`kv.smoothing`), by fingerprint
            "kv_smoothing": smoothing.fingerprint() if smoothing is not None else "none"}


def save_blocks(cache: PagedCache, path: str, token_ids: list[int], fingerprint: bytes) -> int:
    """Writes the cached full blocks that cover the longest prefix of `token_ids` (K/V of every layer, the
    tokens and the model fingerprint) to a safetensors file. Returns the number of tokens saved."""
    import json

    mgr, bs = cache.manager, cache.block_size
    blocks = mgr.cached_prefix(token_ids, len(token_ids) // bs)
    n = len(blocks) * bs
    if n == 0:
        raise RooflineError("nothing to save: no full KV block of these tokens is in the cache")
    slots = mx.array([b.block_id * bs + i for b in blocks for i in range(bs)], dtype=mx.int32)
    st = cache.storage
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
    mx.save_safetensors(path, arrays, metadata=meta)
    return n


def restore_blocks(cache: PagedCache, path: str, fingerprint: bytes) -> list[int]:
    """Loads a file written by `save_blocks` into free blocks and registers them in the prefix cache, so
    the next request starting with those tokens prefills only the rest. Returns the restored tokens."""
    import json
    from pathlib import Path

    from mlx_engine.api import ModelLoadError
    from mlx_engine.loading.safetensors_file import validate_safetensors

    try:
        validate_safetensors(Path(path))
        arrays, meta = mx.load(path, return_metadata=True)
    except ModelLoadError as e:
        raise KVRestoreError(f"saved KV refused: {e}") from None
    except (RuntimeError, ValueError, OSError) as e:
        raise KVRestoreError(f"saved KV refused: {path}: cannot read ({e})") from None
    if meta.get("format") != KV_FILE_FORMAT:
        raise KVRestoreError(f"saved KV refused: {path} is not a Roofline KV file (format {meta.get('format')!r})")
    if meta.get("fingerprint") != fingerprint.hex():
        raise KVRestoreError(f"saved KV refused: {path} was made by another model or dtype (fingerprint differs)")
    st = cache.storage
    want = {"block_size": str(cache.block_size), "kv_bits": str(st.bits or 0), "kv_key_bits": str(st.key_bits or 0),
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
    cache.check_fits(n)
    req = f"restore-{id(arrays)}"
    mgr = cache.manager
    if mgr.allocate_slots(req, tokens, n) is None:
        raise KVRestoreError(f"saved KV refused: no free KV blocks for {n} tokens")
    cache._grow(req)
    cache._copy_pending()
    slots = mx.array(mgr.slot_mapping(req, 0, n), dtype=mx.int32)
    for name in names:
        for layer in range(st.num_layers):
            st._put(getattr(st, name), layer, slots, arrays[f"{name}.{layer}"])
    mx.eval(st.arrays())
    mgr.free(req)
    return tokens
