"""Page allocator: reference counts, free list, and a state machine against a dict model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_radix_plugin.memory.allocator import OutOfPages, PageAllocator


def test_pool_needs_a_page() -> None:
    with pytest.raises(ValueError, match="got 0"):
        PageAllocator(0)


def test_fresh_pool_is_all_free() -> None:
    a = PageAllocator(4)
    assert (a.num_free, a.num_used, a.num_pages) == (4, 0, 4)
    assert [a.refcount(p) for p in range(4)] == [0, 0, 0, 0]


def test_alloc_hands_out_distinct_pages_with_one_reference() -> None:
    a = PageAllocator(5)
    first = a.alloc(2)
    second = a.alloc(3)
    assert first == [0, 1]  # low ids first, as the allocator promises
    assert len(set(first + second)) == 5
    assert all(a.refcount(p) == 1 for p in first + second)
    assert (a.num_free, a.num_used) == (0, 5)
    assert a.alloc(0) == []


def test_out_of_pages_names_counts_and_changes_nothing() -> None:
    a = PageAllocator(4)
    held = a.alloc(3)
    with pytest.raises(OutOfPages, match=r"asked for 2 pages, 1 of 4 free"):
        a.alloc(2)
    # The failed request must not leak part of the pool.
    assert (a.num_free, a.num_used) == (1, 3)
    assert all(a.refcount(p) == 1 for p in held)
    assert len(a.alloc(1)) == 1


def test_out_of_pages_is_a_memory_error() -> None:
    # Callers that guard generic allocation failures catch it too.
    with pytest.raises(MemoryError):
        PageAllocator(1).alloc(2)


def test_page_freed_only_when_last_reference_goes() -> None:
    a = PageAllocator(2)
    (p,) = a.alloc(1)
    a.incref([p])
    a.incref([p])
    assert a.refcount(p) == 3
    assert a.decref([p]) == []
    assert a.decref([p]) == []
    assert (a.refcount(p), a.num_free) == (1, 1)
    assert a.decref([p]) == [p]
    assert (a.refcount(p), a.num_free, a.num_used) == (0, 2, 0)


def test_decref_reports_only_pages_that_became_free() -> None:
    a = PageAllocator(4)
    pages = a.alloc(3)
    a.incref(pages[1:2])
    assert a.decref(pages) == [pages[0], pages[2]]
    assert a.refcount(pages[1]) == 1
    # The same page twice in one call drops two references.
    a.incref([pages[1]])
    assert a.decref([pages[1], pages[1]]) == [pages[1]]
    assert a.num_free == 4


def test_freed_page_is_reusable() -> None:
    a = PageAllocator(1)
    (p,) = a.alloc(1)
    a.decref([p])
    assert a.alloc(1) == [p]
    assert a.refcount(p) == 1


def test_incref_and_decref_of_free_page_raise() -> None:
    a = PageAllocator(3)
    with pytest.raises(RuntimeError, match="incref of free page 2"):
        a.incref([2])
    with pytest.raises(RuntimeError, match="decref of free page 1"):
        a.decref([1])
    (p,) = a.alloc(1)
    a.decref([p])
    with pytest.raises(RuntimeError, match=f"decref of free page {p}"):
        a.decref([p])  # a double free
    assert (a.num_free, a.num_used) == (3, 0)
    assert a.refcount(p) == 0


def test_chunks_come_online_lowest_first_and_go_only_when_empty() -> None:
    a = PageAllocator(5, chunk_pages=2, online=False)
    assert (a.num_chunks, a.num_pages, a.num_free, a.next_chunk) == (3, 0, 0, 0)
    with pytest.raises(OutOfPages, match="asked for 1 pages, 0 of 0 free"):
        a.alloc(1)
    a.add_chunk(0)
    a.add_chunk(2)  # the last chunk holds the one page left over
    assert (a.num_pages, a.next_chunk, a.online_chunks) == (3, 1, [0, 2])
    assert a.alloc(3) == [0, 1, 4]
    with pytest.raises(RuntimeError, match="chunk 2 still has 1 pages in use"):
        a.remove_chunk(2)
    a.decref([4])
    a.remove_chunk(2)
    assert (a.num_pages, a.num_free, a.online_chunks) == (2, 0, [0])
    with pytest.raises(RuntimeError, match="chunk 2 is not online"):
        a.remove_chunk(2)
    with pytest.raises(RuntimeError, match="chunk 0 is already online"):
        a.add_chunk(0)
    with pytest.raises(ValueError, match=r"chunk_pages must be in \[1, 5\], got 6"):
        PageAllocator(5, chunk_pages=6)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc / incref / decref, chunks coming online and going, against a dict of
    live refcounts."""

    NUM_PAGES = 7
    CHUNK = 3  # chunks of 3, 3 and 1 pages

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES, self.CHUNK, online=False)
        self.refs: dict[int, int] = {}  # live pages only
        self.online: set[int] = set()  # chunks

    def _pages_online(self) -> set[int]:
        return {p for c in self.online for p in self.alloc.chunk_range(c)}

    def _live(self, data: st.DataObject) -> list[int]:
        # Duplicates allowed: a request may hold the same page twice in its table.
        return data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, max_size=4))

    @rule()
    def add_chunk(self) -> None:
        c = self.alloc.next_chunk
        if c is None:
            assert len(self.online) == self.alloc.num_chunks
            return
        assert c == min(set(range(self.alloc.num_chunks)) - self.online)
        self.alloc.add_chunk(c)
        self.online.add(c)

    @rule(chunk=st.integers(0, 2))
    def remove_chunk(self, chunk: int) -> None:
        if chunk not in self.online or any(p in self.refs for p in self.alloc.chunk_range(chunk)):
            with pytest.raises(RuntimeError):
                self.alloc.remove_chunk(chunk)
            return
        self.alloc.remove_chunk(chunk)
        self.online.discard(chunk)

    @rule(n=st.integers(0, 8))
    def allocate(self, n: int) -> None:
        free = sorted(self._pages_online() - set(self.refs))
        if n > len(free):
            with pytest.raises(OutOfPages):
                self.alloc.alloc(n)
            return
        pages = self.alloc.alloc(n)
        assert pages == free[:n]  # the lowest free pages, in order
        self.refs.update(dict.fromkeys(pages, 1))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        pages = self._live(data)
        self.alloc.incref(pages)
        for p in pages:
            self.refs[p] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        pages = self._live(data)
        # Each page may appear at most as often as it has references.
        pages = [p for i, p in enumerate(pages) if pages[: i + 1].count(p) <= self.refs[p]]
        expected_freed = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]
                expected_freed.append(p)
        assert self.alloc.decref(pages) == expected_freed

    @rule(page=st.integers(0, NUM_PAGES - 1))
    def touch_free_page(self, page: int) -> None:
        if page in self.refs:
            return
        with pytest.raises(RuntimeError):
            self.alloc.incref([page])
        with pytest.raises(RuntimeError):
            self.alloc.decref([page])

    @invariant()
    def counts_match_model(self) -> None:
        online = self._pages_online()
        assert self.alloc.online_chunks == sorted(self.online)
        assert self.alloc.num_pages == len(online)
        assert self.alloc.num_used == len(self.refs)
        assert self.alloc.num_free == len(online) - len(self.refs)
        for p in range(self.NUM_PAGES):
            assert self.alloc.refcount(p) == self.refs.get(p, 0)
        for c in range(self.alloc.num_chunks):
            used = sum(p in self.refs for p in self.alloc.chunk_range(c))
            assert self.alloc.chunk_used(c) == used
        assert self.alloc.total_refs == sum(self.refs.values())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
