"""``PoolBackedCache``: one layer's view of a request whose K/V live in the shared pool.

It is handed out at admission without copying; new K/V are written once into pages
the request owns. Merged into a batch, it is read through the batch buffer
(``batch.py``); run on its own, through a private copy of what it attends to,
filled from the pages once. All layers of a request share one ``PageTable``.
"""

from __future__ import annotations

import copy
import logging

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..memory.allocator import OutOfPages
from .batch import PoolBatchKVCache, PoolBatchRotatingKVCache
from .page_table import PageTable
from .paged_batch import PagedBatchKVCache
from .protocol import OffsetTrim, window_mask

log = logging.getLogger("mlx_radix")


class PoolBackedCache(OffsetTrim):
    """Layer ``layer`` of a request whose K/V live in ``table``'s pool pages."""

    def __init__(self, table: PageTable, layer: int, offset: int = 0):
        self.table = table
        self.layer = layer
        self.window = table.pool.specs[layer].window
        self.offset = offset
        # What this layer attends to once it runs on its own (not in a batch): a private
        # copy, as mlx-lm's own cache would hold; its new K/V also go to the pages.
        self._own: KVCache | RotatingKVCache | None = None

    def _key_start(self, offset: int) -> int:
        # A sliding-window layer reads back only what its queries can still see.
        return 0 if self.window is None else max(0, offset - self.window + 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, end = self.offset, self.offset + keys.shape[2]
        if self._own is None:
            # The layer reads from its own copy of what it can see, filled from the pages
            # once and evaluated now: a pool array spans layers, so reading it between
            # two layers' writes would copy the whole array at every write (pool.py).
            self._own = self.to_mlx_cache()
            self.table.pool.hold_outside(self)
            if self.offset:
                self.table.pool.settle()
                mx.eval(self._own.state)
        table = self.table
        if not table.overflowed:
            try:
                table.prepare_write(start, end)
            except OutOfPages:
                # Raising would end this request with nothing sent but a 200 header.
                log.warning("KV pool full: request goes on uncached from %d tokens", start)
                table.overflowed = True
            else:
                table.pool.write(self.layer, table.slots(start, end), keys, values)
                if self.layer == table.pool.num_layers - 1:
                    table.written = end
        self.offset = end
        return self._own.update_and_fetch(keys, values)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self._own is not None:
            self._own.trim(n)
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if self._own is not None:
            return self._own.make_mask(N, return_array=return_array, window_size=window_size)
        return window_mask(N, self.offset, self._key_start(self.offset), window_size, return_array)

    def _history(self) -> tuple[mx.array, mx.array]:
        own = self._own
        if own is not None:
            if self.window is None:
                return own.keys[..., : own.offset, :], own.values[..., : own.offset, :]
            n = min(self.offset, self.window)
            return tuple(own._temporal_order(a)[..., -n:, :] for a in (own.keys, own.values))
        # A windowed layer keeps its last `window` tokens, as mlx-lm's RotatingKVCache does.
        start = 0 if self.window is None else max(0, self.offset - self.window)
        return self.table.pool.read(self.layer, self.table.slots(start, self.offset))

    @property
    def keys(self) -> mx.array | None:
        """The private copy's keys: a pipelined model (``--pipeline``) ties its send to the
        last layer's cache, ``cache[-1].keys = mx.depends(cache[-1].keys, h)``, and
        evaluating ``state`` then runs it."""
        return self._own.keys if self._own is not None else None

    @keys.setter
    def keys(self, v: mx.array) -> None:
        if self._own is not None:
            self._own.keys = v

    @property
    def state(self):
        """The K/V this layer can still attend to, as contiguous arrays (a copy)."""
        if self.offset == 0:
            return []
        return self._history()

    @state.setter
    def state(self, v):
        raise TypeError(
            "a PoolBackedCache is a view of pool pages and cannot be rebuilt from state; "
            "load the state into mlx-lm's KVCache instead"
        )

    def to_mlx_cache(self) -> KVCache | RotatingKVCache:
        """An equivalent stock mlx-lm cache holding a copy of this layer's K/V."""
        if self._own is not None:
            return copy.deepcopy(self._own)
        if self.window is None:
            c = KVCache()
        else:
            c = RotatingKVCache(max_size=self.window)
        if self.offset:
            c.keys, c.values = (mx.contiguous(a) for a in self._history())
            c.offset = self.offset
            if self.window is not None:
                c._idx = c.keys.shape[2]
        return c

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of K/V this layer addresses (shared pages included)."""
        spec = self.table.pool.specs[self.layer]
        return self.offset * spec.bytes_per_token(self.table.pool.dtype)

    @property
    def buffer_nbytes(self) -> int:
        """The private copy this layer reads when it runs on its own, outside the pool."""
        return self._own.nbytes if self._own is not None else 0

    @classmethod
    def merge(cls, caches):
        """One batch cache for mlx-lm's batch path: the pool read layer by layer where the
        pool allows it (``paged_batch.py``), else a buffer, plus writes into the pool."""
        first = caches[0]
        if all(
            isinstance(c, PoolBackedCache) and c.table.pool is first.table.pool and c._own is None
            for c in caches
        ):
            if first.table.pool.prefill_from_pool and not any(c.table.overflowed for c in caches):
                return PagedBatchKVCache.from_pool_caches(caches)
            return cls.buffered(caches)
        stock = [c.to_mlx_cache() if isinstance(c, PoolBackedCache) else c for c in caches]
        return type(stock[0]).merge(stock)

    @staticmethod
    def buffered(caches: list[PoolBackedCache]):
        """mlx-lm's batch cache over a buffer filled from the pages (the exact decode path)."""
        batch = PoolBatchKVCache if caches[0].window is None else PoolBatchRotatingKVCache
        return batch.from_pool_caches(caches)
