"""Paged KV cache: the block pool and manager (pure Python) and the MLX storage (`paged.py`)."""

from mlx_engine.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from mlx_engine.kv.manager import KVCacheManager

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager", "hash_block_tokens"]
