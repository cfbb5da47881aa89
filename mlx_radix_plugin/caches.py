"""Caches that speak mlx-lm 0.32.2's cache protocol.

- ``ContiguousKVCache``: one request's private K/V in a preallocated buffer,
  filled by slice assignment and grown by doubling.
- ``PoolBackedCache``: one layer's view of a request whose K/V live in the shared
  pool, handed out at admission without copying; new K/V are written once into pages
  the request owns. Merged into a batch, it is read through the batch buffer; run on
  its own, through a private copy of what it attends to, filled from the pages once.
  All layers of a request share one ``PageTable``.
- ``OffsetCache``: no data, only an offset and masks, for code paths where a model
  needs a cache object but its K/V are held elsewhere.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    _BaseCache,
    create_attention_mask,
)

from .allocator import OutOfPages
from .pool import KVPool

log = logging.getLogger("mlx_radix")


def window_mask(
    N: int, offset: int, key_start: int, window: int | None, return_array: bool
) -> mx.array | str | None:
    """The mask for ``N`` queries at ``offset..`` over keys ``key_start..offset+N``.

    Same values and shapes as mlx-lm's own caches produce, so that a model cannot
    tell our caches from its own: ``None`` for one query without a window, the
    string ``"causal"`` where that suffices, else a boolean array.
    """
    seen = offset - key_start  # keys already cached that the queries can see
    if window is None:
        if N == 1:
            return None
        if not return_array:
            return "causal"
    elif N == 1:
        if seen < window:
            return None
    elif seen + N <= window and not return_array:
        return "causal"
    q = mx.arange(offset, offset + N)[:, None]
    k = mx.arange(key_start, offset + N)[None]
    mask = q >= k
    if window is not None:
        mask = mask & (q < k + window)
    return mask


class _OffsetTrim(_BaseCache):
    """Trimming by moving the offset back: later writes overwrite what was cut."""

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


class ContiguousKVCache(_OffsetTrim):
    """Private K/V of one request in a buffer that doubles when full."""

    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.keys = None
        self.values = None
        self.offset = 0

    def _reserve(self, keys: mx.array, values: mx.array, end: int) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        size = self.keys.shape[2] if self.keys is not None else self.capacity
        while size < end:
            size *= 2
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, size, Dk), keys.dtype)
        new_v = mx.zeros((B, values.shape[1], size, values.shape[3]), values.dtype)
        if self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, end = self.offset, self.offset + keys.shape[2]
        self._reserve(keys, values, end)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v):
        if not v:
            self.keys = self.values = None
            self.offset = 0
        else:
            self.keys, self.values = v
            self.offset = self.keys.shape[2]
        self.capacity = max(self.offset, 1)

    def empty(self) -> bool:
        return self.keys is None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @classmethod
    def merge(cls, caches):
        # BatchKVCache.merge reads keys[..., :offset, :], size() and offset: all ours.
        return BatchKVCache.merge(caches)


class _Hold:
    """What a page table must give back: its page references and its tree lock."""

    def __init__(self, pool: KVPool, pages: list[int], unlock: Callable[[], None] | None):
        self.pool = pool
        self.pages = pages
        self.unlock = unlock
        self.released = False

    def __call__(self) -> None:
        if self.released:
            return
        self.released = True
        self.pool.release_pages(self.pages)
        self.pages.clear()
        if self.unlock is not None:
            self.unlock()


class PageTable:
    """One request's map from token positions to pool slots, shared by its layers.

    Page ``i`` holds tokens ``[i * page_size, (i + 1) * page_size)``. The first
    ``shared_tokens`` tokens sit in pages shared with the radix tree or other
    requests and are never written: a write below that point first copies the
    page it lands in (copy on write).
    """

    def __init__(
        self,
        pool: KVPool,
        pages: list[int] | None = None,
        shared_tokens: int = 0,
        unlock: Callable[[], None] | None = None,
    ):
        self.pool = pool
        self.pages = list(pages or [])
        self.shared_tokens = shared_tokens
        self.written = shared_tokens  # tokens whose K/V are in the pool, all layers
        self.batches: weakref.WeakSet = weakref.WeakSet()  # running batches holding a row
        # Set by RadixPromptCache.fetch_nearest_cache: whose prompt this is, how much of it
        # the tree has, and the admitted request whose pages it waits for, if any.
        self.model_key = None
        self.tokens: list[int] | None = None
        self.committed = 0
        self.prompt_committed = True  # no prompt to commit unless fetch says so
        self.overflowed = False  # the pool had no page for it: later tokens stay uncached
        self.depends: tuple | None = None
        self._hold = _Hold(pool, self.pages, unlock)
        # Dropped without release() (a disconnect, an error): give back on the owner's thread.
        self._finalizer = weakref.finalize(self, pool.defer, self._hold)
        self._slots: mx.array | None = None
        self._views: dict[tuple[int, int], mx.array] = {}

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    @property
    def released(self) -> bool:
        return self._hold.released

    @property
    def in_batch(self) -> bool:
        """Whether a running batch still decodes into this table."""
        return any(self in rows.tables for rows in self.batches)

    def adopt(self, start: int, pages: list[int]) -> None:
        """Address tokens from ``start`` through ``pages`` (another request's, now written)."""
        first = start // self.pool.page_size
        old = self.pages[first : first + len(pages)]
        if old != pages:
            with self.pool.lock:
                self.pool.allocator.incref(pages)
                self.pages[first : first + len(pages)] = pages
                self.pool.release_pages(old)
            self._changed()

    def relock(self, unlock: Callable[[], None]) -> None:
        """Swap the tree lock this table holds (its pages were committed further)."""
        old, self._hold.unlock = self._hold.unlock, unlock
        if old is not None:
            old()

    def _changed(self) -> None:
        self._slots = None
        self._views.clear()

    def slot(self, position: int) -> int:
        """The pool slot of the token at ``position``."""
        page, offset = divmod(position, self.pool.page_size)
        return self.pages[page] * self.pool.page_size + offset

    def slots(self, start: int, end: int) -> mx.array:
        """Slot ids of tokens ``[start, end)``; built once per span, read by every layer."""
        view = self._views.get((start, end))
        if view is None:
            if self._slots is None:
                self._slots = self.pool.slots_of(self.pages)
            if len(self._views) >= 8:
                self._views.clear()
            view = self._views[(start, end)] = self._slots[start:end]
        return view

    def prepare_write(self, start: int, end: int) -> None:
        """Make tokens ``[start, end)`` writable: copy a shared page, add pages."""
        if self.released:
            raise RuntimeError("write to a page table that was already released")
        ps = self.pool.page_size
        if start < self.shared_tokens:
            keep, partial = divmod(start, ps)
            dropped = self.pages[keep:]
            del self.pages[keep:]
            if partial:
                (page,) = self.pool.alloc_pages(1)
                src = dropped[0] * ps + mx.arange(partial, dtype=mx.int32)
                self.pool.copy(src, page * ps + mx.arange(partial, dtype=mx.int32))
                self.pages.append(page)
            self.pool.release_pages(dropped)
            self.shared_tokens = keep * ps
            self._changed()
        need = -(-end // ps) - len(self.pages)
        if need > 0:
            self.pages.extend(self.pool.alloc_pages(need))
            self._changed()

    def __deepcopy__(self, memo) -> PageTable:
        # A page table names pages of the one pool: copies of a batch share it.
        return self

    def release(self) -> None:
        """Give back every page reference and the tree lock; idempotent."""
        self._finalizer.detach()
        self._hold()
        self._changed()


class PoolBackedCache(_OffsetTrim):
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
            if self.offset:
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
    def state(self):
        """The K/V this layer can still attend to, as contiguous arrays (a copy)."""
        if self.offset == 0:
            return []
        return self._history()

    @state.setter
    def state(self, v):
        raise TypeError(
            "a PoolBackedCache is a view of pool pages and cannot be rebuilt from state; "
            "load the state into a ContiguousKVCache instead"
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

    @classmethod
    def merge(cls, caches):
        """One batch cache for mlx-lm's batch path: a buffer, plus writes into the pool."""
        from .batch_cache import PoolBatchKVCache, PoolBatchRotatingKVCache

        first = caches[0]
        if all(
            isinstance(c, PoolBackedCache) and c.table.pool is first.table.pool and c._own is None
            for c in caches
        ):
            batch = PoolBatchKVCache if first.window is None else PoolBatchRotatingKVCache
            return batch.from_pool_caches(caches)
        stock = [c.to_mlx_cache() if isinstance(c, PoolBackedCache) else c for c in caches]
        return type(stock[0]).merge(stock)


class OffsetCache(_BaseCache):
    """A position and masks but no K/V: the data lives elsewhere (the pool).

    ``offset`` is an int, or a ``(B,)`` array for a batch (``mx.fast.rope`` takes
    either). Whoever owns the K/V advances it.
    """

    def __init__(self, offset: int | mx.array = 0, window: int | None = None):
        self.offset = offset
        self.window = window

    def update_and_fetch(self, keys, values):
        raise RuntimeError(
            "OffsetCache holds no K/V; the attention layer using it must read and write "
            "its K/V through the pool"
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if not isinstance(self.offset, int):
            raise TypeError("a batched OffsetCache takes its mask from the batch context")
        start = 0 if self.window is None else max(0, self.offset - self.window + 1)
        return window_mask(N, self.offset, start, window_size, return_array)

    @property
    def state(self):
        return (self.offset, self.window)

    @state.setter
    def state(self, v):
        self.offset, self.window = v

    def size(self) -> int:
        return self.offset if isinstance(self.offset, int) else 0

    def empty(self) -> bool:
        return True

    def is_trimmable(self) -> bool:
        return isinstance(self.offset, int)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return 0
