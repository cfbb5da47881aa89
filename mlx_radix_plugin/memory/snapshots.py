"""Recurrent-state snapshots on radix-tree nodes, under a byte budget of their own.

A hybrid model's recurrent layers (mlx-lm's ``ArraysCache``: conv and SSM states) cannot
be rolled back, so their state is kept whole at chosen positions: a snapshot hangs on
the tree node that ends at its position (a page boundary, or a tail inside a page), and
a request resumes at the deepest matched node that holds one. A node keeps its end
through splits (``_split`` makes a new upper node), so a snapshot stays on the right
position for its life.

A snapshot is far larger than a page of K/V, so it has its own budget and LRU: it must
not crowd pages out, nor pages it. Dropping one leaves its node, whose K/V still serve
deeper snapshots (but for a tail kept only as its home: ``on_evict``); a node the tree
removes takes its snapshot with it (``forget``).

A request that resumes from a snapshot holds the snapshot's arrays itself (MLX arrays
are immutable and mlx-lm's recurrent layers assign new ones), so dropping a snapshot
while a request runs from it frees nothing yet but never changes that request's state:
no lock is needed for correctness, and none is taken.

Pure Python: the values are opaque here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .radix_tree import TreeNode


class SnapshotStore:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"snapshot budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._lru: OrderedDict[TreeNode, int] = OrderedDict()  # node -> its snapshot's bytes
        self.stored = 0
        self.hits = 0
        self.evictions = 0
        self.refused = 0  # larger than the whole budget
        # Told of each node whose snapshot the budget dropped (the prompt cache takes a
        # tail that was kept only for its snapshot out of the tree).
        self.on_evict: Callable[[TreeNode], None] | None = None

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._lru

    def put(self, node: TreeNode, value: Any, nbytes: int) -> bool:
        """Hang ``value`` on ``node``, replacing what it held, dropping the least recently
        used others until the budget holds it. False if it alone exceeds the budget."""
        if nbytes > self.budget_bytes:
            self.refused += 1
            return False
        self.forget(node)
        while self.nbytes + nbytes > self.budget_bytes:
            oldest = next(iter(self._lru))
            self.forget(oldest)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(oldest)
        node.snapshot = value
        self._lru[node] = nbytes
        self.nbytes += nbytes
        self.stored += 1
        return True

    def get(self, node: TreeNode) -> Any:
        """``node``'s snapshot (None if it holds none), marked as just used."""
        if node not in self._lru:
            return None
        self._lru.move_to_end(node)
        self.hits += 1
        return node.snapshot

    def forget(self, node: TreeNode) -> None:
        """Drop ``node``'s snapshot, if it holds one."""
        nbytes = self._lru.pop(node, None)
        if nbytes is not None:
            self.nbytes -= nbytes
        node.snapshot = None

    def nodes(self) -> list[TreeNode]:
        """Nodes holding a snapshot, least recently used first."""
        return list(self._lru)
