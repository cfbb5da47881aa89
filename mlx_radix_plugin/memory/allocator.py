"""Page allocator with reference counts (pure Python, no MLX).

A page is referenced once by the radix tree when cached, and once by every live
request whose page table holds it. It returns to the free list when the last
reference goes, so a page shared by eight requests and the tree exists once.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(MemoryError):
    """The pool has fewer free pages than asked for, even after eviction."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self.total_refs = 0  # sum of every page's count, kept as it changes
        # Popping from the end hands out low page ids first: easier to read in tests.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.total_refs += n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._refs[p] += 1
            self.total_refs += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"decref of free page {p}")
            self._refs[p] -= 1
            self.total_refs -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed
