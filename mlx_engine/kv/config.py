"""The KV cache's load options (`KVConfig`) and its memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_engine.api import RooflineError
from mlx_engine.kv.manager import cdiv

SUPPORTED_KV_BITS = (4, 8)  # quantized K/V (`kv.paged.PagedKVStorage`)
SUPPORTED_BLOCK_SIZES = (16, 32)  # what kernels_metal.paged_decode_attention is built and tested for
DEFAULT_MEMORY_FRACTION = 0.5


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
        6-11% perplexity, per channel under 3%: docs/benchmarks/kv-cache.md, figure 4) when the block size divides the
        head dim; 8-bit keys stay per token (within 0.2% already)."""
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
    from mlx_engine.memory import available_memory, metal_working_set

    working_set = metal_working_set()
    if working_set is not None:
        return working_set - weight_bytes
    return available_memory().bytes  # within ulimit -v and a cgroup's limit too


# the requests a default budget holds the sliding windows of (api.DEFAULT_MAX_SEQS)
WINDOWED_SEQUENCES = 16


def default_blocks(context_length: int, block_size: int, window_blocks: int | None = None) -> int:
    """The blocks a default budget wants for layers of one kind: one full context plus a quarter for cached
    prefixes; for sliding layers, whose request holds at most `window_blocks`, no more than the windows of
    WINDOWED_SEQUENCES requests (and a quarter): a long chat then never grows their pool past that."""
    full = cdiv(context_length, block_size)
    if window_blocks is not None:
        full = min(full, WINDOWED_SEQUENCES * window_blocks)
    return full * 5 // 4


def default_budget(context_length: int, block_size: int, per_block: int, weight_bytes: int,
                   window_blocks: int | None = None) -> int:
    """`default_blocks` of them, within half the free memory."""
    wanted = default_blocks(context_length, block_size, window_blocks) * per_block
    return min(wanted, int(available_memory_bytes(weight_bytes) * DEFAULT_MEMORY_FRACTION))


def blocks_in_budget(budget: int, per_block: int, block_size: int, num_layers: int) -> int:
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise RooflineError(f"kv_budget_bytes={budget}: smaller than one KV block ({per_block} bytes for "
                            f"{block_size} tokens across {num_layers} layers)")
    return num_blocks
