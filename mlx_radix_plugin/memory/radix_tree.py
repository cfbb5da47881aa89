"""Radix tree over token pages: prefix -> KV page ids, with lock refs and eviction.

Pure Python on purpose (no MLX import): it is the part with the most invariants,
so it is tested in isolation with a hypothesis state machine.

Keys are token ids cut into pages of ``page_size`` tokens; each node holds a run of
whole pages. Every namespace (one per model key: model path, adapter, draft) has its
own root, so a model never matches another model's prefixes. The tree owns no
memory itself: ``evict`` hands the page ids it dropped back to the caller.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

EVICTION_POLICIES = ("lru", "lfu")


class TreeNode:
    __slots__ = ("tokens", "pages", "children", "parent", "lock_ref", "last_access", "hits")

    def __init__(self, tokens: tuple[int, ...], pages: list[int], parent: TreeNode | None):
        self.tokens = tokens
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"TreeNode(pages={self.pages}, lock_ref={self.lock_ref}, children={len(self.children)})"
        )


@dataclass
class MatchResult:
    """What ``match_prefix`` found.

    ``pages`` cover ``length`` tokens (a multiple of the page size) ending at ``node``.
    ``partial_page``/``partial_len``: a cached page whose first ``partial_len`` tokens
    continue the match; the caller may copy those slots instead of recomputing them.
    """

    pages: list[int]
    node: TreeNode
    length: int
    partial_page: int | None = None
    partial_len: int = 0


@dataclass
class _Namespace:
    root: TreeNode
    leaves: int = 0


@dataclass
class RadixTree:
    page_size: int = 16
    policy: str = "lru"
    _namespaces: dict[Hashable, _Namespace] = field(default_factory=dict, repr=False)
    _clock: itertools.count = field(default_factory=itertools.count, repr=False)
    evictable_pages: int = 0
    protected_pages: int = 0
    locks: int = 0  # lock() calls not yet undone: one per request holding a prefix

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction policy {self.policy!r} is not one of {', '.join(EVICTION_POLICIES)}"
            )

    # -- sizes -------------------------------------------------------------------

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    @property
    def num_sequences(self) -> int:
        """Distinct cached sequences: the leaves of every namespace."""
        return sum(ns.leaves for ns in self._namespaces.values())

    # -- lookup ------------------------------------------------------------------

    def _root(self, namespace: Hashable) -> TreeNode:
        ns = self._namespaces.get(namespace)
        if ns is None:
            ns = self._namespaces[namespace] = _Namespace(TreeNode((), [], None))
        return ns.root

    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _common_pages(self, node: TreeNode, tokens: Sequence[int], start: int) -> int:
        """Whole pages of ``node`` that equal ``tokens[start:]``."""
        ps = self.page_size
        n = min(len(node.pages), (len(tokens) - start) // ps)
        key = node.tokens
        for i in range(n):
            a, b = i * ps, start + i * ps
            if tuple(tokens[b : b + ps]) != key[a : a + ps]:
                return i
        return n

    def match_prefix(self, namespace: Hashable, tokens: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens``; splits a node matched in part."""
        node = self._root(namespace)
        pages: list[int] = []
        pos = 0
        ps = self.page_size
        now = next(self._clock)
        while len(tokens) - pos >= ps:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            k = self._common_pages(child, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = now
            child.hits += 1
            pages.extend(child.pages)
            pos += k * ps
            node = child
        partial_page, partial_len = self._partial(node, tokens, pos)
        return MatchResult(pages, node, pos, partial_page, partial_len)

    def _partial(self, node: TreeNode, tokens: Sequence[int], pos: int) -> tuple[int | None, int]:
        tail = tuple(tokens[pos : pos + self.page_size])
        best_page, best = None, 0
        if not tail:
            return None, 0
        for first, child in node.children.items():
            n = 0
            for a, b in zip(first, tail):
                if a != b:
                    break
                n += 1
            if n > best:
                best_page, best = child.pages[0], n
        return best_page, best

    # -- mutation ----------------------------------------------------------------

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child`` after ``k`` pages; returns the new upper node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < k < len(child.pages)
        upper = TreeNode(child.tokens[: k * ps], child.pages[:k], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hits = child.hits
        parent.children[child.tokens[:ps]] = upper
        child.tokens = child.tokens[k * ps :]
        child.pages = child.pages[k:]
        child.parent = upper
        upper.children[child.tokens[:ps]] = child
        return upper

    def insert(self, namespace: Hashable, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Store ``pages`` for ``tokens`` (whole pages only).

        Returns how many leading tokens were already cached: the caller's pages for
        that span are duplicates (or the very same pages) and stay the caller's to free.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(
                f"insert needs {len(pages)} x {ps} = {len(pages) * ps} tokens, got {len(tokens)}"
            )
        node = self._root(namespace)
        pos = 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                was_leaf = not node.children and not node.is_root
                new = TreeNode(tuple(tokens[pos:]), list(pages[pos // ps :]), node)
                new.last_access = now
                node.children[new.tokens[:ps]] = new
                self.evictable_pages += len(new.pages)
                if not was_leaf:
                    self._namespaces[namespace].leaves += 1
                # A locked ancestor protects only the pages it had; the new leaf starts free.
                return pos
            k = self._common_pages(child, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = now
            pos += k * ps
            node = child
        return pos

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        self.locks += 1
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        self.locks -= 1
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node = node.parent

    def _priority(self, node: TreeNode) -> tuple[int, int]:
        if self.policy == "lfu":
            return (node.hits, node.last_access)
        return (node.last_access, 0)

    def evict(self, num_pages: int) -> list[int]:
        """Drop unlocked leaves, least valuable first, until ``num_pages`` pages are freed."""
        heap = []
        tiebreak = itertools.count()
        for ns in self._namespaces.values():
            stack = [ns.root]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if not n.children and not n.is_root and n.lock_ref == 0:
                    heap.append((self._priority(n), next(tiebreak), n))
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens[: self.page_size]]
            freed.extend(node.pages)
            self.evictable_pages -= len(node.pages)
            node.parent = None
            ns = self._namespace_of(parent)
            if parent.is_root or parent.children:
                ns.leaves -= 1
            elif parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), next(tiebreak), parent))
        return freed

    def _namespace_of(self, node: TreeNode) -> _Namespace:
        while node.parent is not None:
            node = node.parent
        for ns in self._namespaces.values():
            if ns.root is node:
                return ns
        raise RuntimeError("node is detached from every namespace")

    # -- inspection (tests, stats) -----------------------------------------------

    def nodes(self):
        """Every non-root node, all namespaces."""
        for ns in self._namespaces.values():
            stack = list(ns.root.children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                yield n

    def all_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.pages]
