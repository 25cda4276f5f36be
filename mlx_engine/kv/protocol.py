"""The KV-cache contract: what the scheduler, the runners and speculative decoding may ask of a cache, what a
model layer may ask of its view, and what the block bookkeeping asks of the arrays under it.

A cache declares what it can do (`KVCapabilities`); callers read the declaration, never probe the object. Every
cache, contiguous included, hands each model layer a view with `attention(q, k, v, scale)`, so model code never
asks what kind of cache it has (vLLM's `KVCacheBlocks` rule: the cache's insides stay behind its methods).

Masks are the views' too: causal order, and a sliding window (`kv.contiguous.ContiguousLayer.window`), which a
paged view gets the same way, per layer from its cache, with rows for it in the attention table
(`mlx_engine.attention.Case.window`). A model family whose attention module is mlx-lm's calls the same two view
methods through an adapter in place of mlx-lm's `update_and_fetch` and `scaled_dot_product_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class KVCapabilities:
    paged: bool  # block tables over one pool: admission reserves blocks (`blocks_for`, `num_free_blocks`)
    batching: bool  # `decode_layers` steps several sequences at once (else one at a time)
    packed: bool  # `packed_layers`: decode rows and prefill chunks of several sequences in one forward
    rollback: bool  # `trim` to any length (speculative decoding's rejected drafts)
    kv_files: bool  # `save` / `restore` a conversation's KV
    prefix_caching: bool  # full blocks shared across requests by their token prefix
    quantized: bool  # K/V stored in 4 or 8 bits (`calibrate` measures its smoothing)
    state_slots: int = 0  # recurrent-state slots (`kv.state`): the most sequences running at once (0: no state)


@runtime_checkable
class LayerView(Protocol):
    """What one model layer sees of the cache in one forward pass."""

    def attention(self, q: Any, k: Any, v: Any, scale: float) -> Any:
        """q (B, Hq, L, D), k/v (B, Hkv, L, D) after rope -> (B, Hq, L, D); writes the new k/v first."""
        ...


@runtime_checkable
class MLXLayerView(LayerView, Protocol):
    """An MLX model layer's view: rope at the view's positions, then attention. `offset` is the position of the
    first new token ((B,) positions for a batch of decoding sequences)."""

    offset: Any

    def rope(self, rope: Any, q: Any, k: Any) -> tuple[Any, Any]:
        """q, k (B, H, L, D) before rope -> after, each row at its own position (packed rows: per part)."""
        ...

    def attention(self, q: Any, k: Any, v: Any, scale: float, softcap: float | None = None,
                  sinks: Any = None) -> Any:
        """`LayerView.attention`; `softcap`: scores -> tanh(scores / softcap) * softcap before the mask (Gemma 2),
        `sinks` (Hq,): a logit per query head in each softmax's denominator (gpt-oss)."""
        ...


@runtime_checkable
class KVStorage(Protocol):
    """The arrays of a paged cache (MLX: `kv.paged.PagedKVStorage`, torch: `backends.torch.kv.TorchKVStorage`).
    `kv.tables.BlockTables` keeps the block tables and tells the storage what to grow and copy."""

    num_layers: int
    num_blocks: int  # the pool's blocks; `capacity` of them are allocated now
    block_size: int
    capacity: int

    def ensure_capacity(self, num_blocks: int) -> None:
        """Makes block ids < num_blocks addressable."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's slots, every layer, in list order."""
        ...

    def release(self, req_id: str | None) -> None:
        """Drops what the storage keeps for a request beyond its blocks (None: for every request)."""
        ...

    @property
    def nbytes(self) -> int: ...

    def format_stats(self) -> dict[str, Any]:
        """How K and V are stored, for `KVCache.stats`: kv_bits, kv_key_bits, kv_key_per_channel, bytes_staging."""
        ...


@runtime_checkable
class KVCache(Protocol):
    """The engine's KV cache: `kv.cache.PagedCache`, `kv.contiguous.ContiguousCache`,
    `backends.torch.kv.TorchPagedCache`. Requests are named by the scheduler's req_id."""

    capabilities: KVCapabilities

    def check_fits(self, num_tokens: int) -> None:
        """Raises KVBudgetError when a request of `num_tokens` could never fit."""
        ...

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` holds at its longest (0 without paging)."""
        ...

    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now, evictable cached blocks included (0 without paging)."""
        ...

    def num_blocks_held(self, req_id: str) -> int:
        """Blocks the request holds now (0 without paging)."""
        ...

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        """A new sequence: room for its prompt, a cached prefix reused unless `reuse` is False. Returns the
        number of prompt tokens already cached."""
        ...

    def allocate(self, req_id: str, token_ids: list[int], num_new_tokens: int) -> None:
        """Room for `num_new_tokens` more tokens of the request (`token_ids`: its tokens known so far, through
        the new ones where known). A request not started gets KV of its own (scoring). KVBudgetError when full."""
        ...

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Rolls the request back to its first `num_tokens` tokens (`capabilities.rollback`)."""
        ...

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[Any]:
        """Per-layer views for a forward over positions [start, end) of the request, already allocated."""
        ...

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[Any]:
        """Per-layer views for one decode step: sequence b's next token goes at its next position (allocated
        here); `known_ids[b]` may stop short of it (a pipelined step)."""
        ...

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[Any]:
        """Per-layer views for one forward over packed rows (`capabilities.packed`): a decode step of
        `decode_ids`, then each (req_id, start, end) prefill chunk."""
        ...

    def state(self, layers: list[Any]) -> list[Any]:
        """What to evaluate after a forward through `layers` that samples nothing (a prefill chunk)."""
        ...

    def record(self, req_id: str, known_ids: list[int]) -> None:
        """The request's tokens known so far, once read (registers its newly full blocks)."""
        ...

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        """A request that ended: its KV is given back, kept for reuse where the cache can."""
        ...

    def free(self, req_id: str) -> None:
        """A request's KV given back without recording it (scoring, restoring a file)."""
        ...

    def drop_request(self, req_id: str) -> None:
        """After a failed step: the request's KV given back and forgotten."""
        ...

    def drop(self) -> None:
        """Every request's KV given back (the engine is failing a step or closing)."""
        ...

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        """Quantized KV: measures its smoothing before anything is stored. A no-op otherwise."""
        ...

    def check_kernels(self) -> tuple[str, ...]:
        """Checks the device kernels its attention will launch on this machine (`attention.kernel_warnings`): a
        line for the user per kernel that failed, whose reference then runs instead."""
        ...

    def stats(self) -> dict[str, Any]:
        """Occupancy and format for `Engine.kv_stats`."""
        ...

    def save(self, path: str, token_ids: list[int], fingerprint: bytes) -> int:
        """Writes the cached full blocks of `token_ids`' longest prefix (`capabilities.kv_files`)."""
        ...

    def restore(self, path: str, fingerprint: bytes) -> list[int]:
        """Loads a file written by `save` into the prefix cache; returns its tokens (`capabilities.kv_files`)."""
        ...


@runtime_checkable
class StateKVCache(KVCache, Protocol):
    """A cache with recurrent-state slots (`KVCapabilities.state_slots` > 0: `kv.state.StateCache`). A state
    holds what it read at its last position only, so a `trim` below it restores the state at the start of the
    request's last prefill forward (a verification), and the caller feeds the kept tokens after it again."""

    def state_slot(self, req_id: str) -> int:
        """The slot holding the request's state (`StepPlan.state_slots`)."""
        ...

    def split_at(self, start: int, end: int) -> int | None:
        """Where a prefill forward over [start, end) should stop first: the last position strictly inside it at
        which the state is kept for prefix caching (None: nowhere). Chunks aligned there let a later prompt with
        this prefix start from the state at its end."""
        ...

    def replay(self, req_id: str) -> tuple[int, int] | None:
        """After a `trim` below what the state had read: the positions [start, end) to feed again through
        `prefill_layers` (once; None when the state is where the cache is)."""
        ...
