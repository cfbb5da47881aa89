"""mlx-radix: a shared, radix-indexed KV-cache pool for mlx_lm.server."""

from .caches import ContiguousKVCache, OffsetCache, PageTable, PoolBackedCache
from .pool import KVPool, LayerSpec, UnsupportedModel
from .prompt_cache import RadixPromptCache
from .radix_tree import RadixTree

__version__ = "0.1.0"

__all__ = [
    "ContiguousKVCache",
    "KVPool",
    "LayerSpec",
    "OffsetCache",
    "PageTable",
    "PoolBackedCache",
    "RadixPromptCache",
    "RadixTree",
    "UnsupportedModel",
]
