"""The prompts of requests fetched but not yet committed to the tree, indexed by whole
pages, so that a new request finds the one it shares most with in time linear in its own
length.

A burst of 32 requests on one new 2,080-token prefix compared each prompt with every
earlier one's (``os.path.commonprefix`` on token lists): 3.6 ms a fetch on this CPU, about
115 ms of the generation thread's time before a burst's first forward pass. Here each
prompt's whole pages get chained keys once, and a fetch looks its own keys up.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Protocol


class Prompted(Protocol):
    """What the index reads of a request's table (``PageTable``)."""

    model_key: Hashable
    tokens: list[int]
    released: bool


def page_keys(model_key: Hashable, tokens: Sequence[int], page_size: int, pages: int) -> list[int]:
    """One key for each of the first ``pages`` whole pages of ``tokens``: a hash of the
    page's tokens and the key before it, so equal keys mean equal prefixes (a collision is
    caught by the caller's check of the tokens themselves)."""
    keys, key = [], hash(model_key)
    for start in range(0, pages * page_size, page_size):
        key = hash((key, *tokens[start : start + page_size]))
        keys.append(key)
    return keys


class InflightPrompts:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._tables: weakref.WeakValueDictionary[int, Prompted] = weakref.WeakValueDictionary()
        self._keys: dict[int, list[int]] = {}  # fetch number -> its page keys
        # Page key -> fetch numbers holding it, in fetch order: a tie goes to the first
        # fetched, the same request on every rank of mlx.launch.
        self._holders: dict[int, dict[int, None]] = {}

    def add(self, number: int, table: Prompted) -> None:
        """Index ``table`` (fetched as ``number``, larger than any before) until ``pop``
        or until it is collected."""
        ps = self.page_size
        keys = page_keys(table.model_key, table.tokens, ps, len(table.tokens) // ps)
        self._tables[number] = table
        self._keys[number] = keys
        for key in keys:
            self._holders.setdefault(key, {})[number] = None
        # A table dropped without a pop (a request failed between fetch and commit) leaves
        # the index with it.
        weakref.finalize(table, self.pop, number)

    def pop(self, number: int) -> None:
        self._tables.pop(number, None)
        for key in self._keys.pop(number, ()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(number, None)
                if not holders:
                    del self._holders[key]

    def __len__(self) -> int:
        return len(self._keys)

    def longest(
        self, model_key: Hashable, tokens: Sequence[int], than: int
    ) -> tuple[Prompted | None, int]:
        """The table, not released, whose prompt shares the most whole pages with
        ``tokens`` (all but its last token, which a request always computes), and how many
        tokens that is; (None, ``than``) where none shares more than ``than`` tokens."""
        ps = self.page_size
        keys = page_keys(model_key, tokens, ps, (len(tokens) - 1) // ps)
        # Holding page k implies holding pages 1..k-1 (keys are chained), so the deepest
        # page a live table holds is found by walking until nobody holds one.
        deepest, found = 0, None
        for k, key in enumerate(keys, 1):
            table = self._first_live(key)
            if table is None:
                break
            deepest, found = k, table
        n = deepest * ps
        if found is None or n <= than:
            return None, than
        if found.model_key != model_key or found.tokens[:n] != list(tokens[:n]):
            # Two prefixes with one key (a hash collision): this request computes its own
            # prefix, as it would with nobody to share with.
            return None, than
        return found, n

    def _first_live(self, key: int) -> Prompted | None:
        for number in self._holders.get(key, ()):
            table = self._tables.get(number)
            if table is not None and not table.released:
                return table
        return None
