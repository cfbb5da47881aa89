"""``PageTable``: one request's map from token positions to pool slots, shared by its layers."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

from ..memory.pool import KVPool, page_slots
from ..memory.slots import Slots


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
        self.changes = 0  # bumped whenever ``pages`` changes (readers keep derived copies)
        self.shared_tokens = shared_tokens
        self.written = shared_tokens  # tokens whose K/V are in the pool, all layers
        self.batches: weakref.WeakSet = weakref.WeakSet()  # running batches holding a row
        # Set by RadixPromptCache.fetch_nearest_cache: whose prompt this is, how much of it
        # the tree has, and the admitted request whose pages it waits for, if any.
        self.model_key = None
        self.fetch_number = -1  # its place in the fetch order (RadixPromptCache._inflight)
        self.tokens: list[int] | None = None
        self.committed = 0
        self.prompt_committed = True  # no prompt to commit unless fetch says so
        self.overflowed = False  # the pool had no page for it: later tokens stay uncached
        self.depends: tuple | None = None
        # A hybrid model's request: the recurrent states it snapshots (recurrent.py).
        self.recurrent = None
        self._hold = _Hold(pool, self.pages, unlock)
        # Dropped without release() (a disconnect, an error): give back on the owner's thread.
        self._finalizer = weakref.finalize(self, pool.defer, self._hold)
        self._slots: np.ndarray | None = None
        self._views: dict[tuple[int, int], Slots] = {}

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
        self.changes += 1
        self._slots = None
        self._views.clear()

    def slot(self, position: int) -> int:
        """The pool slot of the token at ``position``."""
        page, offset = divmod(position, self.pool.page_size)
        return self.pages[page] * self.pool.page_size + offset

    def host_slots(self, start: int, end: int) -> np.ndarray:
        """Slot ids of tokens ``[start, end)`` as host integers."""
        if self._slots is None:
            self._slots = page_slots(self.pages, self.pool.page_size)
        return self._slots[start:end]

    def slots(self, start: int, end: int) -> Slots:
        """Slots of tokens ``[start, end)`` as the pool reads them; built once per span,
        read by every layer."""
        view = self._views.get((start, end))
        if view is None:
            if len(self._views) >= 8:
                self._views.clear()
            view = self._views[(start, end)] = self.pool.slots(self.host_slots(start, end))
        return view

    def prepare_write(self, start: int, end: int) -> None:
        """Make tokens ``[start, end)`` writable: copy a shared page, add pages.

        All or nothing: every page it needs is allocated before the table changes, so an
        ``OutOfPages`` leaves the table, and every page reference, as they were.
        """
        if self.released:
            raise RuntimeError("write to a page table that was already released")
        ps = self.pool.page_size
        keep, partial = divmod(start, ps)
        rewrite = start < self.shared_tokens  # below the shared part: copy on write
        held = keep + bool(partial) if rewrite else len(self.pages)
        need = max(0, -(-end // ps) - held) + (rewrite and bool(partial))
        fresh = self.pool.alloc_pages(need) if need else []
        if rewrite:
            dropped = self.pages[keep:]
            del self.pages[keep:]
            if partial:
                page = fresh.pop(0)
                offsets = np.arange(partial)
                self.pool.copy(dropped[0] * ps + offsets, page * ps + offsets)
                self.pages.append(page)
            self.pool.release_pages(dropped)
            self.shared_tokens = keep * ps
        if rewrite or fresh:
            self.pages.extend(fresh)
            self._changed()

    def __deepcopy__(self, memo) -> PageTable:
        # A page table names pages of the one pool: copies of a batch share it.
        return self

    def release(self) -> None:
        """Give back every page reference and the tree lock; idempotent."""
        self._finalizer.detach()
        self._hold()
        self._changed()
