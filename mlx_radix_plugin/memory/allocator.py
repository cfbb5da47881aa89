"""Page allocator with reference counts, over pages that come and go in chunks (pure Python).

A page is referenced once by the radix tree when cached, and once by every live
request whose page table holds it. It returns to the free list when the last
reference goes, so a page shared by eight requests and the tree exists once.

Pages are numbered up to a ceiling and come in chunks of ``chunk_pages`` (the pool
allocates a chunk's storage when it brings the chunk online, and frees it when it takes
an empty chunk offline). Only online pages are handed out, the lowest free one first: a
pool that grew under load and shrank again keeps its pages in its low chunks, so that its
high chunks empty out and can be given back.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class OutOfPages(MemoryError):
    """The pool has fewer free pages than asked for, even after eviction."""


class PageAllocator:
    def __init__(self, num_pages: int, chunk_pages: int | None = None, online: bool = True):
        """``num_pages`` is the ceiling; ``online``: every chunk starts online (else none)."""
        if num_pages < 1:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        chunk_pages = chunk_pages or num_pages
        if not 1 <= chunk_pages <= num_pages:
            raise ValueError(f"chunk_pages must be in [1, {num_pages}], got {chunk_pages}")
        self.max_pages = num_pages
        self.chunk_pages = chunk_pages
        self.num_chunks = -(-num_pages // chunk_pages)
        # References of the pages in use only: a ceiling of millions of pages costs nothing.
        self._refs: dict[int, int] = {}
        self.total_refs = 0  # sum of every page's count, kept as it changes
        self._online = [False] * self.num_chunks
        self._used = [0] * self.num_chunks  # pages of each chunk with a reference
        self._free: list[int] = []  # a heap: the lowest free page goes first
        if online:
            for c in range(self.num_chunks):
                self.add_chunk(c)

    # -- chunks ------------------------------------------------------------------

    def chunk_range(self, chunk: int) -> range:
        return range(chunk * self.chunk_pages, min((chunk + 1) * self.chunk_pages, self.max_pages))

    def is_online(self, chunk: int) -> bool:
        return self._online[chunk]

    @property
    def online_chunks(self) -> list[int]:
        return [c for c in range(self.num_chunks) if self._online[c]]

    @property
    def next_chunk(self) -> int | None:
        """The lowest offline chunk: the one a growing pool brings online next."""
        return next((c for c in range(self.num_chunks) if not self._online[c]), None)

    def chunk_used(self, chunk: int) -> int:
        return self._used[chunk]

    def add_chunk(self, chunk: int) -> None:
        if self._online[chunk]:
            raise RuntimeError(f"chunk {chunk} is already online")
        self._online[chunk] = True
        for p in self.chunk_range(chunk):
            heapq.heappush(self._free, p)

    def remove_chunk(self, chunk: int) -> None:
        """Take an online chunk whose pages are all free offline."""
        if not self._online[chunk]:
            raise RuntimeError(f"chunk {chunk} is not online")
        if self._used[chunk]:
            raise RuntimeError(f"chunk {chunk} still has {self._used[chunk]} pages in use")
        self._online[chunk] = False
        gone = self.chunk_range(chunk)
        self._free = [p for p in self._free if p not in gone]
        heapq.heapify(self._free)

    # -- pages -------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Online pages."""
        return sum(len(self.chunk_range(c)) for c in self.online_chunks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return sum(self._used)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
            self._used[p // self.chunk_pages] += 1
        self.total_refs += n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        refs = self._refs
        for p in pages:
            if p not in refs:
                raise RuntimeError(f"incref of free page {p}")
            refs[p] += 1
            self.total_refs += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        refs = self._refs
        for p in pages:
            n = refs.get(p)
            if n is None:
                raise RuntimeError(f"decref of free page {p}")
            self.total_refs -= 1
            if n > 1:
                refs[p] = n - 1
                continue
            del refs[p]
            heapq.heappush(self._free, p)
            self._used[p // self.chunk_pages] -= 1
            freed.append(p)
        return freed
