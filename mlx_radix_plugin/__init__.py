"""mlx-radix: a shared, radix-indexed KV-cache pool for mlx_lm.server.

The folders are the architecture, each depending only on those above it:

- ``memory/``: pages and who holds them. The allocator and the radix tree (pure
  Python), the pool of K/V arrays, the byte budget.
- ``cache/``: caches that speak mlx-lm's cache protocol over the pool, one request's
  and a batch's, and ``RadixPromptCache``, the server's prompt cache.
- ``engine/``: the batch generator: admission, in-flight sharing, commits.
- ``server/``: the ``radix`` plugin for mlx_lm.server, its prompt cache per model,
  metrics.
- ``models/``: the GGUF converter, the default model, random-weight models.
- ``tools/``: the benchmark against stock mlx_lm.server, the soak, the GPU bench.

``config`` (the settings table) sits beside them; ``cli`` (the ``mlx-radix``
command) on top. The names below import lazily, so that importing a pure-Python
module of the package does not import MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "KVPool": "memory.pool",
    "LayerSpec": "memory.pool",
    "OffsetCache": "cache.offset",
    "PageTable": "cache.page_table",
    "PoolBackedCache": "cache.pool_backed",
    "RadixPromptCache": "cache.prompt_cache",
    "RadixTree": "memory.radix_tree",
    "UnsupportedModel": "memory.pool",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
