"""The KV cache: its contract (`protocol`), the block pool and manager (pure Python), the block bookkeeping they
share (`tables`), the MLX paged storage (`paged`), its views (`views`) and cache (`cache`), the contiguous cache
(`contiguous`), KV files (`files`) and the load options and budget (`config`)."""

from mlx_engine.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from mlx_engine.kv.manager import KVCacheManager
from mlx_engine.kv.protocol import KVCache, KVCapabilities, KVStorage, LayerView, MLXLayerView

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCache", "KVCacheBlock", "KVCacheManager", "KVCapabilities",
           "KVStorage", "LayerView", "MLXLayerView", "hash_block_tokens"]
