"""Radix tree: focused unit tests plus a hypothesis state machine against a naive model.

The reference model is, per namespace, a dict from every cached page-aligned token
prefix to the page id that holds that prefix's last page, plus the cached tails: a
prefix that ends mid-page, mapped to its page. Because a node is a run of whole pages
or a tail, the tree is just a compressed form of that dict; every check below reduces
to "the tree and the dict hold the same prefixes".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mlx_radix_plugin.memory.radix_tree import EVICTION_POLICIES, RadixTree, TreeNode

NS = "model"


def path_pages(node: TreeNode) -> list[int]:
    """Pages from the root down to ``node``: what a lock on ``node`` protects."""
    chunks: list[list[int]] = []
    while node.parent is not None:
        chunks.append(node.pages)
        node = node.parent
    return [p for chunk in reversed(chunks) for p in chunk]


def leaves(tree: RadixTree) -> list[TreeNode]:
    return [n for n in tree.nodes() if not n.children]


# -- construction ---------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, -1, 2.5])
def test_bad_page_size_raises_naming_value(page_size: object) -> None:
    with pytest.raises(ValueError, match=f"page_size.*{page_size}"):
        RadixTree(page_size=page_size)  # type: ignore[arg-type]


def test_bad_policy_raises_naming_value() -> None:
    with pytest.raises(ValueError, match="'fifo'"):
        RadixTree(page_size=4, policy="fifo")


# -- match / insert ---------------------------------------------------------------


def test_match_on_empty_tree() -> None:
    tree = RadixTree(page_size=4)
    for tokens in ([], [1, 2], [1, 2, 3, 4, 5]):
        r = tree.match_prefix(NS, tokens)
        assert r.pages == []
        assert r.length == 0
        assert r.node.is_root
        assert (r.partial_page, r.partial_len) == (None, 0)
    assert tree.total_pages == 0
    assert tree.num_sequences == 0
    assert tree.all_pages() == []


def test_insert_then_match_full_partial_and_misaligned() -> None:
    tree = RadixTree(page_size=4)
    tokens = list(range(12))
    assert tree.insert(NS, tokens, [10, 11, 12]).cached == 0
    assert tree.num_sequences == 1
    assert tree.evictable_pages == 3

    full = tree.match_prefix(NS, tokens)
    assert (full.pages, full.length) == ([10, 11, 12], 12)
    assert path_pages(full.node) == [10, 11, 12]

    # Longer query: the extra tokens are simply not cached.
    longer = tree.match_prefix(NS, tokens + [99, 98, 97, 96, 95])
    assert (longer.pages, longer.length) == ([10, 11, 12], 12)

    part = tree.match_prefix(NS, tokens[:8])
    assert (part.pages, part.length) == ([10, 11], 8)
    assert path_pages(part.node) == [10, 11]

    # 6 tokens = one whole page + 2 tokens of the next: only whole pages are matched,
    # the next page is offered as a partial copy source.
    odd = tree.match_prefix(NS, tokens[:6])
    assert (odd.pages, odd.length) == ([10], 4)
    assert (odd.partial_page, odd.partial_len) == (11, 2)

    # Matching never changes what is cached, only how it is cut into nodes.
    assert sorted(tree.all_pages()) == [10, 11, 12]
    assert tree.num_sequences == 1
    assert tree.total_pages == 3


def test_split_on_partial_match_keeps_pages_and_lock_counts() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1, 2, 2, 3, 3], [7, 8, 9])
    full = tree.match_prefix(NS, [1, 1, 2, 2, 3, 3])
    tree.lock(full.node)
    assert (tree.protected_pages, tree.evictable_pages) == (3, 0)

    upper = tree.match_prefix(NS, [1, 1, 5]).node  # stops after the first page: a split
    lower = full.node
    assert upper.pages == [7] and upper.tokens == (1, 1)
    # The node the caller locked keeps its identity and becomes the lower half.
    assert lower.pages == [8, 9] and lower.tokens == (2, 2, 3, 3)
    assert lower.parent is upper
    assert upper.children == {(2, 2): lower}
    assert upper.parent is not None and upper.parent.is_root
    # The lock on the lower half also ran through what is now the upper half.
    assert upper.lock_ref == lower.lock_ref == 1
    assert (tree.protected_pages, tree.evictable_pages) == (3, 0)
    assert tree.num_sequences == 1

    tree.unlock(lower)
    assert upper.lock_ref == lower.lock_ref == 0
    assert (tree.protected_pages, tree.evictable_pages) == (0, 3)


def test_insert_returns_matched_length_and_leaves_duplicates_to_caller() -> None:
    tree = RadixTree(page_size=4)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    assert tree.insert(NS, a + b, [1, 2]).cached == 0
    # Shares page ``a``: the caller's page 3 duplicates page 1 and is not stored.
    assert tree.insert(NS, a + c, [3, 4]).cached == 4
    assert sorted(tree.all_pages()) == [1, 2, 4]
    assert tree.num_sequences == 2
    # Fully cached (as a whole sequence or as a prefix of one): nothing stored.
    assert tree.insert(NS, a + b, [5, 6]).cached == 8
    assert tree.insert(NS, a, [7]).cached == 4
    assert sorted(tree.all_pages()) == [1, 2, 4]
    assert tree.total_pages == tree.evictable_pages == 3
    assert tree.num_sequences == 2
    assert tree.match_prefix(NS, a + c).pages == [1, 4]


def test_insert_extending_a_leaf_keeps_sequence_count() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1], [1])
    assert tree.insert(NS, [1, 1, 2, 2], [9, 2]).cached == 2
    assert tree.num_sequences == 1
    assert tree.match_prefix(NS, [1, 1, 2, 2]).pages == [1, 2]


def test_insert_mismatched_lengths_raises() -> None:
    tree = RadixTree(page_size=4)
    with pytest.raises(ValueError, match="needs 1 pages, got 2"):
        tree.insert(NS, [1, 2, 3, 4], [1, 2])
    with pytest.raises(ValueError, match="needs 2 pages, got 1"):
        tree.insert(NS, [1, 2, 3, 4, 5], [1])
    assert tree.all_pages() == []
    assert tree.total_pages == 0


# -- tails ------------------------------------------------------------------------


def test_tail_is_cached_and_offered_as_partial() -> None:
    tree = RadixTree(page_size=4)
    # A 6-token sequence: one whole page and a tail of two tokens in page 11.
    assert tree.insert(NS, [1, 2, 3, 4, 5, 6], [10, 11]) == (0, [])
    assert tree.total_pages == tree.evictable_pages == 2
    assert tree.num_sequences == 1
    (tail,) = [n for n in tree.nodes() if tree.is_tail(n)]
    assert (tail.tokens, tail.pages, tail.children) == ((5, 6), [11], {})

    # The repeat of a 7-token prompt ending in those six: pages + a partial of 2 tokens.
    r = tree.match_prefix(NS, [1, 2, 3, 4, 5, 6, 7])
    assert (r.pages, r.length) == ([10], 4)
    assert (r.partial_page, r.partial_len, r.partial_node) == (11, 2, tail)
    # A tail is never matched as a whole page, nor locked with the match.
    tree.lock(r.node)
    assert tail.lock_ref == 0
    tree.unlock(r.node)

    # A short sequence is a tail of the root.
    assert tree.insert(NS, [7, 8], [12]).cached == 0
    r = tree.match_prefix(NS, [7, 8, 9])
    assert (r.pages, r.partial_page, r.partial_len) == ([], 12, 2)
    assert tree.num_sequences == 2


def test_tail_covered_by_what_is_cached_is_not_stored() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(NS, [1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    # Its tail is the start of page 11, and a shorter tail is the start of that one.
    assert tree.insert(NS, [1, 2, 3, 4, 5, 6], [20, 21]) == (6, [])
    tree.insert(NS, [9, 9, 9], [30])
    assert tree.insert(NS, [9, 9], [31]) == (2, [])
    assert sorted(tree.all_pages()) == [10, 11, 30]
    assert tree.num_sequences == 2


def test_longer_tail_or_page_supersedes_a_tail() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(NS, [1, 2, 3, 4, 5], [10, 11])
    # A longer tail that starts with it: the old tail's page comes back to the caller.
    assert tree.insert(NS, [1, 2, 3, 4, 5, 6, 7], [10, 12]) == (4, [11])
    # A different tail beside it stays.
    assert tree.insert(NS, [1, 2, 3, 4, 9], [10, 13]) == (4, [])
    assert tree.num_sequences == 2
    # A whole page covering the first tail: that tail goes, the other stays.
    assert tree.insert(NS, [1, 2, 3, 4, 5, 6, 7, 8], [10, 14]) == (4, [12])
    assert sorted(tree.all_pages()) == [10, 13, 14]
    assert tree.num_sequences == 2
    assert tree.total_pages == tree.evictable_pages == 3
    # The same page handed back and inserted again (a request that filled its tail page
    # in place) is dropped and stored once: the caller's references net out.
    tree.insert(NS, [5, 5], [40])
    assert tree.insert(NS, [5, 5, 5, 5], [40]) == (0, [40])
    assert tree.all_pages().count(40) == 1


def test_remove_leaf_takes_a_tail_out() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(NS, [1, 2, 3, 4, 5, 6], [10, 11])
    r = tree.match_prefix(NS, [1, 2, 3, 4, 5, 6, 7])
    assert tree.remove_leaf(r.partial_node) == [11]
    assert tree.all_pages() == [10]
    assert tree.num_sequences == 1 and tree.evictable_pages == 1
    assert tree.match_prefix(NS, [1, 2, 3, 4, 5, 6, 7]).partial_len == 0
    # Only an unlocked leaf can be taken.
    tree.insert(NS, [1, 2, 3, 4, 5, 6, 7, 8], [10, 12])
    inner = tree.match_prefix(NS, [1, 2, 3, 4]).node
    with pytest.raises(ValueError, match="not an unlocked leaf"):
        tree.remove_leaf(inner)
    leaf = tree.match_prefix(NS, [1, 2, 3, 4, 5, 6, 7, 8]).node
    tree.lock(leaf)
    with pytest.raises(ValueError, match="not an unlocked leaf"):
        tree.remove_leaf(leaf)
    tree.unlock(leaf)
    assert tree.remove_leaf(leaf) == [12]
    assert tree.num_sequences == 1


def test_evict_takes_tails_as_leaves() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(NS, [1, 2, 3, 4, 5, 6], [10, 11])
    assert tree.evict(1) == [11]
    assert tree.num_sequences == 1
    assert tree.evict(1) == [10]
    assert tree.num_sequences == 0 and tree.total_pages == 0


def test_partial_page_for_mid_page_divergence() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(NS, [1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    tree.insert(NS, [1, 2, 3, 4, 5, 9, 9, 9], [12, 13])

    # Diverges at the 3rd token of the second page: page 11 shares 2 tokens, 13 only 1.
    r = tree.match_prefix(NS, [1, 2, 3, 4, 5, 6, 0, 0])
    assert (r.pages, r.length) == ([10], 4)
    assert (r.partial_page, r.partial_len) == (11, 2)

    # Divergence inside the very first page: partial at the root.
    r = tree.match_prefix(NS, [1, 2, 9, 9])
    assert (r.pages, r.length) == ([], 0)
    assert (r.partial_page, r.partial_len) == (10, 2)

    # Diverges at the first token of the page: nothing to copy.
    r = tree.match_prefix(NS, [1, 2, 3, 4, 0, 6, 7, 8])
    assert (r.pages, r.length) == ([10], 4)
    assert (r.partial_page, r.partial_len) == (None, 0)


def test_partial_page_for_short_tail() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(NS, [1, 2, 3, 4, 5, 6, 7, 8], [10, 11])

    # Before any split the node holds [10, 11]: the partial is its *first* page.
    r = tree.match_prefix(NS, [1, 2, 3])
    assert (r.pages, r.length) == ([], 0)
    assert (r.partial_page, r.partial_len) == (10, 3)

    r = tree.match_prefix(NS, [1, 2, 3, 4, 5])
    assert (r.pages, r.length) == ([10], 4)
    assert (r.partial_page, r.partial_len) == (11, 1)

    r = tree.match_prefix(NS, [1, 2, 3, 4, 9])
    assert (r.partial_page, r.partial_len) == (None, 0)

    # Page-aligned end: no tail, so no partial.
    r = tree.match_prefix(NS, [1, 2, 3, 4])
    assert (r.pages, r.partial_page, r.partial_len) == ([10], None, 0)


def test_namespaces_never_match_each_other() -> None:
    tree = RadixTree(page_size=2)
    tokens = [1, 2, 3, 4]
    other = ("draft", "adapter-x")
    assert tree.insert("base", tokens, [1, 2]).cached == 0
    assert tree.match_prefix(other, tokens).pages == []
    assert tree.match_prefix(other, tokens[:3]).partial_page is None
    # Same tokens elsewhere are a fresh insert, not a duplicate.
    assert tree.insert(other, tokens, [3, 4]).cached == 0
    assert tree.match_prefix("base", tokens).pages == [1, 2]
    assert tree.match_prefix(other, tokens).pages == [3, 4]
    assert tree.num_sequences == 2
    assert sorted(tree.all_pages()) == [1, 2, 3, 4]


# -- lock / evict ---------------------------------------------------------------


def test_lock_protects_from_evict_and_unlock_makes_evictable() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1, 2, 2], [1, 2])
    node = tree.match_prefix(NS, [1, 1, 2, 2]).node
    tree.lock(node)
    tree.lock(node)  # two requests sharing the same prefix
    assert (tree.protected_pages, tree.evictable_pages) == (2, 0)
    assert tree.evict(10) == []
    assert sorted(tree.all_pages()) == [1, 2]

    tree.unlock(node)
    assert tree.evict(10) == []  # one holder is still left
    tree.unlock(node)
    assert (tree.protected_pages, tree.evictable_pages) == (0, 2)
    assert sorted(tree.evict(10)) == [1, 2]
    assert tree.total_pages == 0
    assert tree.num_sequences == 0


def test_lock_on_prefix_leaves_suffix_evictable() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1, 2, 2, 3, 3], [1, 2, 3])
    prefix = tree.match_prefix(NS, [1, 1]).node
    tree.lock(prefix)
    assert (tree.protected_pages, tree.evictable_pages) == (1, 2)
    assert tree.evict(10) == [2, 3]
    assert tree.all_pages() == [1]
    # The locked prefix is now a leaf of its own: still one sequence.
    assert tree.num_sequences == 1
    tree.unlock(prefix)
    assert tree.evict(10) == [1]


def test_unlock_of_unlocked_node_raises() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1], [1])
    node = tree.match_prefix(NS, [1, 1]).node
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(node)
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(node)
    # The failed unlocks changed nothing.
    assert node.lock_ref == 0
    assert (tree.protected_pages, tree.evictable_pages) == (0, 1)


def test_evict_frees_whole_nodes_and_zero_is_a_no_op() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1, 2, 2, 3, 3], [1, 2, 3])
    assert tree.evict(0) == []
    # One page asked for, but a node is dropped whole.
    assert tree.evict(1) == [1, 2, 3]
    assert tree.total_pages == 0


def _three_branches(policy: str) -> RadixTree:
    tree = RadixTree(page_size=2, policy=policy)
    for first, page in ((1, 1), (2, 2), (3, 3)):
        tree.insert(NS, [first, first], [page])
    return tree


def _touch(tree: RadixTree, first: int, times: int) -> None:
    for _ in range(times):
        assert tree.match_prefix(NS, [first, first]).pages == [first]


def test_lru_evicts_least_recently_matched_first() -> None:
    tree = _three_branches("lru")
    _touch(tree, 3, 1)
    _touch(tree, 1, 1)
    # Page 2 was touched last at its insert, before 3 and 1 were matched.
    assert [tree.evict(1) for _ in range(3)] == [[2], [3], [1]]


@pytest.mark.parametrize(
    ("policy", "order"),
    # Same history: 1 is hot but old, 2 is cold but fresh. The policies must disagree.
    [("lru", [[1], [3], [2]]), ("lfu", [[2], [3], [1]])],
)
def test_policy_order(policy: str, order: list[list[int]]) -> None:
    tree = _three_branches(policy)
    _touch(tree, 1, 3)
    _touch(tree, 3, 2)
    _touch(tree, 2, 1)
    assert [tree.evict(1) for _ in range(3)] == order


def test_evicting_leaves_makes_parent_evictable_in_same_call() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1, 2, 2], [1, 2])
    tree.insert(NS, [1, 1, 3, 3], [1, 3])  # splits off [1, 1] as a shared parent
    assert tree.num_sequences == 2
    freed = tree.evict(3)
    assert sorted(freed) == [1, 2, 3]
    # The parent can only go once both children are gone.
    assert freed[-1] == 1
    assert tree.total_pages == tree.evictable_pages == 0
    assert tree.num_sequences == 0
    assert list(tree.nodes()) == []


def test_locked_parent_stays_when_children_are_evicted() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(NS, [1, 1, 2, 2], [1, 2])
    tree.insert(NS, [1, 1, 3, 3], [1, 3])
    parent = tree.match_prefix(NS, [1, 1]).node
    tree.lock(parent)
    assert sorted(tree.evict(3)) == [2, 3]
    assert tree.all_pages() == [1]
    assert tree.num_sequences == 1
    assert (tree.protected_pages, tree.evictable_pages) == (1, 0)


def test_page_size_one() -> None:
    tree = RadixTree(page_size=1)
    assert tree.insert(NS, [5, 6, 7], [1, 2, 3]).cached == 0
    assert tree.insert(NS, [5, 6, 8], [9, 9, 4]).cached == 2
    r = tree.match_prefix(NS, [5, 6, 8, 0])
    assert (r.pages, r.length) == ([1, 2, 4], 3)
    # With one-token pages a continuation is always a whole page: never a partial.
    assert (r.partial_page, r.partial_len) == (None, 0)
    assert tree.num_sequences == 2
    assert sorted(tree.evict(2)) == [3, 4]
    assert tree.num_sequences == 1
    assert tree.match_prefix(NS, [5, 6, 7]).pages == [1, 2]


# -- state machine ----------------------------------------------------------------


NAMESPACES: tuple[Hashable, ...] = ("model-a", ("model-b", "adapter"))
TOKENS = st.integers(0, 3)
MAX_PAGES = 6


class RadixTreeMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against a dict of cached prefixes."""

    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(page_size=self.PAGE_SIZE)
        # Per namespace: page-aligned prefix -> page id holding its last page.
        self.ref: dict[Hashable, dict[tuple[int, ...], int]] = {ns: {} for ns in NAMESPACES}
        self.next_page = 0
        # Outstanding locks: the locked node and the pages its match returned.
        self.held: list[tuple[TreeNode, tuple[int, ...]]] = []
        self.evicted: set[int] = set()
        # Token sequences seen so far, reused as prefixes so that queries collide.
        self.known: list[tuple[int, ...]] = []

    @initialize(policy=st.sampled_from(EVICTION_POLICIES))
    def choose_policy(self, policy: str) -> None:
        self.tree = RadixTree(page_size=self.PAGE_SIZE, policy=policy)

    # -- helpers ------------------------------------------------------------------

    def _draw_tokens(self, data: st.DataObject, aligned: bool) -> list[int]:
        ps = self.PAGE_SIZE
        tokens: list[int] = []
        if self.known and data.draw(st.booleans(), label="extend known"):
            seq = data.draw(st.sampled_from(self.known), label="known")
            tokens = list(seq[: data.draw(st.integers(0, len(seq)), label="cut")])
        tokens += data.draw(st.lists(TOKENS, max_size=2 * ps + 1), label="suffix")
        tokens = tokens[: MAX_PAGES * ps]
        if aligned:
            tokens = tokens[: len(tokens) // ps * ps]
        return tokens

    def _remember(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.known.append(tuple(tokens))
            del self.known[:-16]

    def _ref_match(self, ns: Hashable, tokens: Sequence[int]) -> list[int]:
        ps, ref, pages = self.PAGE_SIZE, self.ref[ns], []
        while (len(pages) + 1) * ps <= len(tokens):
            page = ref.get(tuple(tokens[: (len(pages) + 1) * ps]))
            if page is None:
                break
            pages.append(page)
        return pages

    def _tree_content(self, ns: Hashable) -> dict[tuple[int, ...], int]:
        namespace = self.tree._namespaces.get(ns)
        if namespace is None:
            return {}
        ps, out = self.PAGE_SIZE, {}
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(namespace.root, ())]
        while stack:
            node, prefix = stack.pop()
            for i, page in enumerate(node.pages):
                out[prefix + node.tokens[: (i + 1) * ps]] = page  # a tail: all its tokens
            stack.extend((child, prefix + node.tokens) for child in node.children.values())
        return out

    # -- rules ----------------------------------------------------------------------

    def _children(self, ns: Hashable, prefix: tuple[int, ...]) -> dict[tuple[int, ...], int]:
        """Cached entries one page or a tail past the page-aligned ``prefix``."""
        ps, n = self.PAGE_SIZE, len(prefix)
        return {
            k: v
            for k, v in self.ref[ns].items()
            if n < len(k) <= n + ps and k[:n] == prefix and (len(k) == n + ps or len(k) % ps)
        }

    def _kept(self, ns: Hashable, prefix: tuple[int, ...]) -> bool:
        """Whether a tail stays when an entry covers it (the snapshot machine's hold states)."""
        return False

    def _drop_tails(self, ns: Hashable, prefix: tuple[int, ...], start: tuple[int, ...]) -> set:
        ps, dropped = self.PAGE_SIZE, set()
        for k, v in self._children(ns, prefix).items():
            if (
                len(k) % ps
                and start[: len(k) - len(prefix)] == k[len(prefix) :]
                and not self._kept(ns, k)
            ):
                del self.ref[ns][k]
                dropped.add(v)
        return dropped

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), tail=st.booleans())
    def insert(self, data: st.DataObject, ns: Hashable, tail: bool) -> None:
        ps = self.PAGE_SIZE
        tokens = self._draw_tokens(data, aligned=not tail)
        full, rest = divmod(len(tokens), ps)
        n = full + bool(rest)
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        matched = len(self._ref_match(ns, tokens)) * ps
        expected, dropped = matched, set()
        if matched < full * ps:
            prefix = tuple(tokens[:matched])
            dropped |= self._drop_tails(ns, prefix, tuple(tokens[matched : matched + ps]))
        # Pages for the matched span are the caller's duplicates: freed, never stored.
        for i in range(matched // ps, full):
            self.ref[ns][tuple(tokens[: (i + 1) * ps])] = pages[i]
        if rest:
            prefix, tail_tokens = tuple(tokens[: full * ps]), tuple(tokens[full * ps :])
            children = self._children(ns, prefix)
            if any(k[full * ps : len(tokens)] == tail_tokens for k in children):
                expected = len(tokens)
            else:
                dropped |= self._drop_tails(ns, prefix, tail_tokens)
                self.ref[ns][tuple(tokens)] = pages[full]
        result = self.tree.insert(ns, tokens, pages)
        assert result.cached == expected
        assert set(result.dropped) == dropped and len(result.dropped) == len(dropped)
        self.evicted.update(dropped)
        self._remember(tokens)

    @precondition(lambda self: any(self.tree.is_tail(n) for n in self.tree.nodes()))
    @rule(data=st.data())
    def take_tail(self, data: st.DataObject) -> None:
        tails = sorted(
            (n for n in self.tree.nodes() if self.tree.is_tail(n)), key=lambda n: n.pages[0]
        )
        node = data.draw(st.sampled_from(tails), label="tail")
        (page,) = node.pages
        assert self.tree.remove_leaf(node) == [page]
        for ns in NAMESPACES:
            self.ref[ns] = {k: v for k, v in self.ref[ns].items() if v != page}
        self.evicted.add(page)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), lock=st.booleans())
    def match(self, data: st.DataObject, ns: Hashable, lock: bool) -> None:
        ps = self.PAGE_SIZE
        tokens = self._draw_tokens(data, aligned=False)
        r = self.tree.match_prefix(ns, tokens)
        expected = self._ref_match(ns, tokens)
        assert r.pages == expected
        assert r.length == len(expected) * ps
        assert path_pages(r.node) == r.pages

        # Partial: among cached pages and tails that continue the matched prefix, the one
        # whose tokens share the longest start with the unmatched tail.
        pos, tail = r.length, tuple(tokens[r.length : r.length + ps])
        best, best_pages = 0, set()
        for prefix, page in self._children(ns, tuple(tokens[:pos])).items():
            common = 0
            for a, b in zip(prefix[pos:], tail):
                if a != b:
                    break
                common += 1
            if common > best:
                best, best_pages = common, {page}
            elif common == best:
                best_pages.add(page)
        assert r.partial_len == best
        if best == 0:
            assert r.partial_page is None
        else:
            assert r.partial_page in best_pages
            assert r.partial_node is not None and r.partial_node.pages[0] == r.partial_page
            assert best < ps

        if lock:
            self.tree.lock(r.node)
            self.held.append((r.node, tuple(r.pages)))
        self._remember(tokens)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def cached_pages(self, data: st.DataObject, ns: Hashable) -> None:
        # The disk tier's lookup: all of a sequence's whole pages or nothing, changing nothing.
        tokens = self._draw_tokens(data, aligned=False)
        before = self._tree_content(ns)
        expected = self._ref_match(ns, tokens)
        whole = len(tokens) // self.PAGE_SIZE
        got = self.tree.cached_pages(ns, tokens)
        assert got == (expected if len(expected) == whole else None)
        assert self.tree.cached_pages(ns, tokens, whole=False) == expected
        assert self._tree_content(ns) == before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1), label="lock index")
        node, _ = self.held.pop(i)
        self.tree.unlock(node)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        locked = {p for _, pages in self.held for p in pages}
        cached = {p for ref in self.ref.values() for p in ref.values()}
        evictable = self.tree.evictable_pages
        freed = self.tree.evict(n)
        assert len(freed) == len(set(freed))
        assert not set(freed) & locked, "evict returned a locked page"
        assert set(freed) <= cached
        # Every unlocked node sits in an unlocked subtree, so all evictable pages are
        # reachable by leaf-first eviction: a short result means nothing was left.
        assert len(freed) >= min(n, evictable)
        if len(freed) < n:
            assert self.tree.evictable_pages == 0
        self.evicted.update(freed)
        gone = set(freed)
        for ns in NAMESPACES:
            self.ref[ns] = {k: v for k, v in self.ref[ns].items() if v not in gone}

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def page_accounting(self) -> None:
        tree = self.tree
        pages = tree.all_pages()
        assert len(pages) == len(set(pages)), "a page id sits in two places"
        assert tree.evictable_pages + tree.protected_pages == tree.total_pages == len(pages)
        assert tree.evictable_pages >= 0 and tree.protected_pages >= 0
        protected = sum(len(n.pages) for n in tree.nodes() if n.lock_ref > 0)
        assert tree.protected_pages == protected
        assert not self.evicted & set(pages), "an evicted page is still cached"

    @invariant()
    def content_matches_reference(self) -> None:
        ps = self.PAGE_SIZE
        for ns in NAMESPACES:
            ref = self.ref[ns]
            assert self._tree_content(ns) == ref
            # Eviction takes leaves only, so what is cached stays closed under prefixes.
            for prefix in ref:
                aligned = (len(prefix) - 1) // ps * ps
                assert aligned == 0 or prefix[:aligned] in ref
            # No tail is the start of another entry beside it (it would be superseded), but
            # one kept for its state.
            for prefix in ref:
                if len(prefix) % ps and not self._kept(ns, prefix):
                    parent = prefix[: len(prefix) // ps * ps]
                    for k in self._children(ns, parent):
                        assert k == prefix or k[: len(prefix)] != prefix

    @invariant()
    def locks_match_holders(self) -> None:
        expected: dict[int, int] = {}
        for node, pages in self.held:
            # The locked node may have been split since; its path still covers exactly
            # the pages the match returned.
            assert path_pages(node) == list(pages)
            n: TreeNode | None = node
            while n is not None and n.parent is not None:
                expected[id(n)] = expected.get(id(n), 0) + 1
                n = n.parent
        for n in self.tree.nodes():
            assert n.lock_ref == expected.get(id(n), 0)
        assert self.tree.locks == len(self.held)

    @invariant()
    def structure(self) -> None:
        ps = self.PAGE_SIZE
        total_leaves = 0
        for ns, namespace in self.tree._namespaces.items():
            root = namespace.root
            assert root.parent is None and root.pages == [] and root.tokens == ()
            assert root.lock_ref == 0
            ns_leaves = 0
            stack = [root]
            while stack:
                node = stack.pop()
                if node is not root and self.tree.is_tail(node):
                    assert len(node.pages) == 1 and 0 < len(node.tokens) < ps
                    assert not node.children and node.lock_ref == 0
                    ns_leaves += 1
                elif node is not root:
                    assert len(node.pages) >= 1
                    assert len(node.tokens) == len(node.pages) * ps
                    ns_leaves += not node.children
                for key, child in node.children.items():
                    assert key == child.tokens[:ps]
                    assert child.parent is node
                    stack.append(child)
            assert namespace.leaves == ns_leaves, f"leaf count drifted in {ns!r}"
            # Leaves are exactly the cached prefixes that nothing extends, and the tails kept.
            ref = self.ref[ns]
            maximal = [
                p
                for p in ref
                if self._kept(ns, p) or not any(len(q) > len(p) and q[: len(p)] == p for q in ref)
            ]
            assert ns_leaves == len(maximal)
            total_leaves += ns_leaves
        assert self.tree.num_sequences == total_leaves == len(leaves(self.tree))


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


class PageSizeOneMachine(RadixTreeMachine):
    PAGE_SIZE = 1


class PageSizeThreeMachine(RadixTreeMachine):
    PAGE_SIZE = 3


TestRadixTreeMachinePageSize1 = PageSizeOneMachine.TestCase
TestRadixTreeMachinePageSize1.settings = MACHINE_SETTINGS
TestRadixTreeMachinePageSize3 = PageSizeThreeMachine.TestCase
TestRadixTreeMachinePageSize3.settings = MACHINE_SETTINGS
