"""The snapshot store on the radix tree: a hypothesis state machine over the tree's
machine, plus its plain rules."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_radix_tree import MACHINE_SETTINGS, NAMESPACES, RadixTreeMachine

from mlx_radix_plugin.memory.radix_tree import EVICTION_POLICIES, RadixTree, TreeNode
from mlx_radix_plugin.memory.snapshots import SnapshotStore

BUDGET = 8


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def namespace_of(tree: RadixTree, node: TreeNode) -> Hashable | None:
    while node.parent is not None:
        node = node.parent
    return next((ns for ns, n in tree._namespaces.items() if n.root is node), None)


class SnapshotMachine(RadixTreeMachine):
    """The tree's machine, with snapshots hung on cached prefixes (whole pages or a tail,
    and tails of their own inside a cached page) under a byte budget, against an LRU of
    (namespace, prefix) -> bytes."""

    PAGE_SIZE = 2

    def __init__(self) -> None:
        super().__init__()
        self.store = SnapshotStore(BUDGET)
        self._wire()
        self.snaps: OrderedDict[tuple[Hashable, tuple[int, ...]], int] = OrderedDict()

    @initialize(policy=st.sampled_from(EVICTION_POLICIES))
    def choose_policy(self, policy: str) -> None:
        super().choose_policy(policy)
        self._wire()

    def _wire(self) -> None:
        self.tree.on_remove = self.store.forget
        self.store.on_evict = self._drop_kept_tail

    def _drop_kept_tail(self, node: TreeNode) -> None:
        # The prompt cache's rule: a tail kept only for its state leaves with it.
        if node.parent is not None and self.tree.is_covered(node):
            self.tree.remove_leaf(node)

    def _kept(self, ns: Hashable, prefix: tuple[int, ...]) -> bool:
        return bool(len(prefix) % self.PAGE_SIZE) and (ns, prefix) in self.snaps

    def _covered(self, ns: Hashable, prefix: tuple[int, ...]) -> bool:
        ps, n = self.PAGE_SIZE, len(prefix)
        return bool(n % ps) and any(
            k != prefix and k[:n] == prefix for k in self._children(ns, prefix[: n // ps * ps])
        )

    def _store(self, ns: Hashable, prefix: tuple[int, ...], node: TreeNode, nbytes: int) -> None:
        stored = self.store.put(node, (ns, prefix), nbytes)
        assert stored == (nbytes <= BUDGET)
        if not stored:
            return
        self.snaps.pop((ns, prefix), None)
        while sum(self.snaps.values()) + nbytes > BUDGET:
            (old_ns, old), _ = self.snaps.popitem(last=False)
            if self._covered(old_ns, old):
                self.evicted.add(self.ref[old_ns].pop(old))
        self.snaps[(ns, prefix)] = nbytes

    def _drop_uncached(self) -> None:
        # A snapshot goes with the node its position ends: when its last page is evicted.
        for key in list(self.snaps):
            ns, prefix = key
            if prefix not in self.ref[ns]:
                del self.snaps[key]

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), nbytes=st.integers(0, BUDGET + 1))
    def put(self, data: st.DataObject, ns: Hashable, nbytes: int) -> None:
        # Whole pages' ends and tails (a finished request's end inside a page) alike.
        cached = sorted(self.ref[ns])
        if not cached:
            return
        prefix = data.draw(st.sampled_from(cached), label="prefix")
        node = self.tree.node_ending_at(ns, list(prefix))
        assert node is not None and path_tokens(node) == prefix
        self._store(ns, prefix, node, nbytes)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), nbytes=st.integers(0, BUDGET))
    def put_tail(self, data: st.DataObject, ns: Hashable, nbytes: int) -> None:
        # A state inside a page (a segment end): a tail of its own, beside any entry that
        # holds those tokens, made where the whole pages before it are cached.
        ps = self.PAGE_SIZE
        tokens = self._draw_tokens(data, aligned=False)
        if not len(tokens) % ps:
            tokens.append(0)
        prefix, whole = tuple(tokens), len(tokens) // ps * ps
        page = self.next_page
        self.next_page += 1
        node = self.tree.add_tail(ns, tokens, page)
        if (whole and prefix[:whole] not in self.ref[ns]) or prefix in self.ref[ns]:
            assert node is None
            return
        assert node is not None and path_tokens(node) == prefix and node.pages == [page]
        self.ref[ns][prefix] = page
        self._store(ns, prefix, node, nbytes)
        self._remember(tokens)

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        self._drop_uncached()
        if not self.snaps:
            return
        ns, prefix = data.draw(st.sampled_from(sorted(self.snaps, key=repr)), label="snapshot")
        node = self.tree.node_ending_at(ns, list(prefix))
        assert self.store.get(node) == (ns, prefix)
        self.snaps.move_to_end((ns, prefix))

    @invariant()
    def snapshots_match_reference(self) -> None:
        self._drop_uncached()
        nodes = self.store.nodes()
        assert [(namespace_of(self.tree, n), path_tokens(n)) for n in nodes] == list(self.snaps)
        for n in nodes:
            # On a node of the tree (not a detached one), that ends at its position.
            assert namespace_of(self.tree, n) is not None and n.snapshot == (
                namespace_of(self.tree, n),
                path_tokens(n),
            )
        assert self.store.nbytes == sum(self.snaps.values()) <= BUDGET
        held = sum(1 for n in self.tree.nodes() if n.snapshot is not None)
        assert held == len(self.store)


TestSnapshotMachine = SnapshotMachine.TestCase
TestSnapshotMachine.settings = MACHINE_SETTINGS


def test_a_snapshot_larger_than_the_budget_is_refused():
    store = SnapshotStore(10)
    node = TreeNode((1, 2), [0], None)
    assert not store.put(node, "state", 11)
    assert store.refused == 1 and len(store) == 0 and node.snapshot is None


def test_a_split_keeps_a_snapshot_on_its_position():
    tree = RadixTree(page_size=2)
    store = SnapshotStore(100)
    tree.on_remove = store.forget
    tree.insert("m", [1, 2, 3, 4, 5, 6], [0, 1, 2])
    end = tree.node_ending_at("m", [1, 2, 3, 4, 5, 6])
    store.put(end, "at 6", 5)
    # Splitting the node at 4 makes a new upper node: the snapshot stays at 6.
    upper = tree.node_ending_at("m", [1, 2, 3, 4])
    assert upper is not end and upper.snapshot is None
    assert tree.node_ending_at("m", [1, 2, 3, 4, 5, 6]).snapshot == "at 6"
    # Eviction of the leaf takes its snapshot with it; the inner node's stays.
    store.put(upper, "at 4", 5)
    tree.evict(1)
    assert len(store) == 1 and store.nbytes == 5 and upper.snapshot == "at 4"


def test_bad_budget_names_the_value():
    with pytest.raises(ValueError, match="-1"):
        SnapshotStore(-1)


def test_a_state_inside_a_cached_page_keeps_a_tail_of_its_own():
    tree = RadixTree(page_size=2)
    store = SnapshotStore(10)
    tree.on_remove = store.forget
    tree.insert("m", [1, 2, 3, 4, 5, 6], [0, 1, 2])
    # A segment ended after token 3: its state gets a tail beside the page holding 3, 4.
    tail = tree.add_tail("m", [1, 2, 3], 7)
    assert tail is not None and tail.pages == [7] and tree.is_covered(tail)
    assert tree.node_ending_at("m", [1, 2, 3]) is tail
    assert tree.add_tail("m", [1, 2, 3], 8) is None  # held already
    assert tree.add_tail("m", [9, 9, 3], 8) is None  # the pages before it are not cached
    store.put(tail, "at 3", 6)
    # An entry covering it does not drop it while it holds the state...
    assert tree.insert("m", [1, 2, 3, 8], [0, 3]).dropped == []
    assert tree.node_ending_at("m", [1, 2, 3]) is tail
    # ...and once the budget drops the state, the prompt cache's rule takes it out.
    store.on_evict = lambda node: tree.is_covered(node) and tree.remove_leaf(node)
    store.put(tree.node_ending_at("m", [1, 2, 3, 4]), "at 4", 6)
    assert tail.parent is None and tree.node_ending_at("m", [1, 2, 3]) is None
    assert sorted(tree.all_pages()) == [0, 1, 2, 3]
