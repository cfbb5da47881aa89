"""Radix tree over token pages: prefix -> KV page ids, with lock refs and eviction.

Pure Python on purpose (no MLX import): it is the part with the most invariants,
so it is tested in isolation with a hypothesis state machine.

Keys are token ids cut into pages of ``page_size`` tokens; each node holds a run of
whole pages, except a *tail*: a leaf of one page holding fewer than ``page_size``
tokens, the end of a sequence that does not fill its last page (a short chat turn is
mostly tail). A tail is never split, locked or extended in the tree: a request that
continues it copies its slots, or takes the page over (``remove_leaf``), and commits
the continuation as whole pages and a new tail. A tail that another entry's first
tokens cover is dropped as it is superseded, unless it holds a hybrid model's recurrent
state (``snapshot``): then it is where a request resumes (``add_tail`` makes one on a
page of its own beside the entry that holds those tokens). No page is in two nodes.

Every namespace (one per model key: model path, adapter, draft) has its own root, so a
model never matches another model's prefixes. The tree owns no memory itself: ``evict``
and ``insert`` hand the page ids they dropped back to the caller.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

EVICTION_POLICIES = ("lru", "lfu")


class TreeNode:
    """A run of whole pages, or a tail (one page, fewer than ``page_size`` tokens)."""

    __slots__ = (
        "tokens",
        "pages",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "hits",
        "snapshot",
    )

    def __init__(self, tokens: tuple[int, ...], pages: list[int], parent: TreeNode | None):
        self.tokens = tokens
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        # A hybrid model's recurrent state at this node's end (snapshots.py); None if none.
        self.snapshot = None

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
    ``partial_node`` is the child of ``node`` that page begins.
    """

    pages: list[int]
    node: TreeNode
    length: int
    partial_page: int | None = None
    partial_len: int = 0
    partial_node: TreeNode | None = None


class Inserted(NamedTuple):
    """What ``insert`` did: the caller's pages covering the first ``cached`` tokens
    duplicate the tree's (or are its own); ``dropped`` are pages of tails the insert
    superseded, whose references the tree gives back to the caller."""

    cached: int
    dropped: list[int]


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
    # Told of every node taken out of the tree (the snapshot store forgets its snapshot).
    on_remove: Callable[[TreeNode], None] | None = field(default=None, repr=False)

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
        result = MatchResult(pages, node, pos)
        partial, result.partial_len = self._partial(node, tokens, pos)
        if partial is not None:
            partial.last_access = now
            partial.hits += 1
            result.partial_node, result.partial_page = partial, partial.pages[0]
        return result

    def _partial(
        self, node: TreeNode, tokens: Sequence[int], pos: int
    ) -> tuple[TreeNode | None, int]:
        tail = tuple(tokens[pos : pos + self.page_size])
        best_node, best = None, 0
        if not tail:
            return None, 0
        for first, child in node.children.items():
            n = 0
            for a, b in zip(first, tail):
                if a != b:
                    break
                n += 1
            if n > best:
                best_node, best = child, n
        return best_node, best

    def node_ending_at(self, namespace: Hashable, tokens: Sequence[int]) -> TreeNode | None:
        """The node that ends after ``tokens``, split there if need be: after whole pages,
        or the tail holding exactly the rest of them; None if the tree does not hold them
        all. Touches no access count: it finds, not uses."""
        ps = self.page_size
        if not tokens:
            return None
        whole = len(tokens) // ps * ps
        node, pos = self._root(namespace), 0
        while pos < whole:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None or self.is_tail(child):
                return None
            k = self._common_pages(child, tokens, pos)
            if k == 0:
                return None
            if k < len(child.pages):
                if whole < len(tokens):
                    return None  # a tail hangs off a node's end, not inside one
                child = self._split(child, k)
            pos += k * ps
            node = child
        if whole == len(tokens):
            return node
        tail = node.children.get(self._page_key(tokens, whole))
        return tail if tail is not None and self.is_tail(tail) else None

    def add_tail(self, namespace: Hashable, tokens: Sequence[int], page: int) -> TreeNode | None:
        """A new tail ending after ``tokens`` (which end inside a page) on ``page``, which
        holds their last slots: the home of a snapshot there, beside any entry that holds
        those tokens too. None if the tree lacks the whole pages before them or holds that
        tail already (``node_ending_at`` finds it); the page stays the caller's then."""
        whole, rest = divmod(len(tokens), self.page_size)
        if not rest:
            raise ValueError(f"a tail ends inside a page; {len(tokens)} tokens fill {whole}")
        whole *= self.page_size
        node = self.node_ending_at(namespace, tokens[:whole]) if whole else self._root(namespace)
        tail = tuple(tokens[whole:])
        if node is None or tail in node.children:
            return None
        new = self._add_child(self._namespace_of(node), node, tail, [page])
        new.last_access = next(self._clock)
        return new

    def cached_pages(
        self, namespace: Hashable, tokens: Sequence[int], whole: bool = True
    ) -> list[int] | None:
        """The pages holding ``tokens`` (whole pages), or None if the tree lacks any (with
        ``whole=False``: those of the longest cached start); changes nothing (no split, no
        access count)."""
        ps = self.page_size
        node, pos, pages = self._root(namespace), 0, []
        end = len(tokens) // ps * ps
        while pos < end:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None or self.is_tail(child):
                break
            k = self._common_pages(child, tokens, pos)
            pages.extend(child.pages[:k])
            pos += k * ps
            if k < len(child.pages):
                break
            node = child
        return pages if pos >= end or not whole else None

    def is_tail(self, node: TreeNode) -> bool:
        return len(node.tokens) < self.page_size and not node.is_root

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

    def insert(self, namespace: Hashable, tokens: Sequence[int], pages: Sequence[int]) -> Inserted:
        """Store ``pages`` for ``tokens``: whole pages, then a tail if ``tokens`` end mid-page.

        The caller's pages for the span already cached are duplicates (or the very same
        pages) and stay the caller's to free; so are the ``dropped`` tails' pages.
        """
        ps = self.page_size
        full, rest = divmod(len(tokens), ps)
        if len(pages) != full + bool(rest):
            raise ValueError(
                f"insert of {len(tokens)} tokens in pages of {ps} needs"
                f" {full + bool(rest)} pages, got {len(pages)}"
            )
        node = self._root(namespace)
        ns = self._namespaces[namespace]
        pos = 0
        dropped: list[int] = []
        now = next(self._clock)
        while pos < full * ps:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                dropped += self._drop_tails(ns, node, tokens[pos : pos + ps])
                new = self._add_child(ns, node, tokens[pos : full * ps], pages[pos // ps : full])
                new.last_access = now
                cached, node, pos = pos, new, full * ps
                break
            k = self._common_pages(child, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = now
            pos += k * ps
            node = child
        else:
            cached = pos
        if rest:
            tail = tuple(tokens[pos:])
            for child in node.children.values():
                if child.tokens[:rest] == tail:
                    child.last_access = now  # already cached, as a tail or a page's start
                    return Inserted(len(tokens), dropped)
            dropped += self._drop_tails(ns, node, tail)
            self._add_child(ns, node, tail, pages[full:]).last_access = now
        return Inserted(cached, dropped)

    def _add_child(
        self, ns: _Namespace, node: TreeNode, tokens: Sequence[int], pages: Sequence[int]
    ) -> TreeNode:
        was_leaf = not node.children and not node.is_root
        new = TreeNode(tuple(tokens), list(pages), node)
        node.children[new.tokens[: self.page_size]] = new
        # A locked ancestor protects only the pages it had; the new node starts free.
        self.evictable_pages += len(new.pages)
        if not was_leaf:
            ns.leaves += 1
        return new

    def _drop_tails(self, ns: _Namespace, node: TreeNode, tokens: Sequence[int]) -> list[int]:
        """Remove ``node``'s tails that ``tokens`` begin with: what is inserted covers them
        (but for those holding a snapshot)."""
        tokens = tuple(tokens)
        dropped: list[int] = []
        for child in list(node.children.values()):
            if (
                self.is_tail(child)
                and child.snapshot is None
                and tokens[: len(child.tokens)] == child.tokens
            ):
                dropped += self._remove_leaf(ns, child)
        return dropped

    def is_covered(self, node: TreeNode) -> bool:
        """Whether ``node`` is a tail another entry beside it begins with."""
        parent = node.parent
        if parent is None or not self.is_tail(node):
            return False
        n = len(node.tokens)
        return any(c is not node and c.tokens[:n] == node.tokens for c in parent.children.values())

    def remove_leaf(self, node: TreeNode) -> list[int]:
        """Take an unlocked leaf out of the tree; its pages' references go to the caller."""
        if node.children or node.lock_ref or node.is_root or node.parent is None:
            raise ValueError(f"{node!r} is not an unlocked leaf of the tree")
        return self._remove_leaf(self._namespace_of(node), node)

    def _remove_leaf(self, ns: _Namespace, node: TreeNode) -> list[int]:
        parent = node.parent
        del parent.children[node.tokens[: self.page_size]]
        self.evictable_pages -= len(node.pages)
        node.parent = None
        if parent.is_root or parent.children:
            ns.leaves -= 1  # else the parent is a leaf now, in its place
        if self.on_remove is not None:
            self.on_remove(node)
        return node.pages

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
            freed.extend(self._remove_leaf(self._namespace_of(parent), node))
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
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

    def sequences(self):
        """``(namespace, tokens, pages)`` of every node's whole pages, from its root: the
        tokens up to the node's end and the pages holding them (tails left out)."""
        for key, ns in self._namespaces.items():
            stack = [(child, ()) for child in ns.root.children.values()]
            while stack:
                node, before = stack.pop()
                if self.is_tail(node):
                    continue
                tokens = before + node.tokens
                yield key, tokens, self.path_pages(node)
                stack.extend((child, tokens) for child in node.children.values())

    def path_of(self, node: TreeNode) -> tuple[Hashable, list[int]]:
        """The namespace ``node`` is in and the tokens from its root to ``node``'s end."""
        runs, top = [], node
        while not top.is_root:
            runs.append(top.tokens)
            top = top.parent
        for key, ns in self._namespaces.items():
            if ns.root is top:
                return key, [t for run in reversed(runs) for t in run]
        raise ValueError("the node is in no namespace of this tree (it was removed)")

    def path_pages(self, node: TreeNode) -> list[int]:
        """The pages from the root to the end of ``node``."""
        runs = []
        while not node.is_root:
            runs.append(node.pages)
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    def all_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.pages]
