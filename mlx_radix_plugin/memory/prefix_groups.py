"""Which rows of a decode batch share a prefix, read off the pages they hold (pure Python).

Rows whose page tables begin with the same page ids attend to one physical copy of that
prefix's K/V. Shared-prefix decode reads such a prefix once for the whole group instead of
once per row, so a group of ``n`` rows on a ``P``-token prefix saves ``(n - 1) x P`` token
reads per layer. Pages are compared by id, not by content: two requests that computed the
same text separately hold two copies, and share nothing here.

Each row is placed where it saves the most: among the page-aligned prefixes of its full
pages, the one maximising ``(rows holding it - 1) x its pages``, deeper on ties. That puts
every row of a chat front-end under its system prompt, not under the few template tokens
that all prompts start with. Nested sharing is one level: rows that share more than their
group's prefix read the rest as their own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixGroup:
    """Batch rows (ascending) that read ``pages`` as one prefix; a lone row reads its own."""

    rows: tuple[int, ...]
    pages: tuple[int, ...]

    def tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size


class _Node:
    __slots__ = ("children", "rows")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.rows = 0


def group_rows(
    tables: Sequence[Sequence[int]], lengths: Sequence[int], page_size: int
) -> list[PrefixGroup]:
    """Partition rows by the prefix each reads from shared pages.

    ``tables[i]`` are row ``i``'s pages in token order and ``lengths[i]`` its tokens
    written; only whole written pages can be a prefix. Every row is in exactly one group;
    a row that shares nothing is a group of its own over all its whole pages, so that what
    it reads as its own tokens stays under a page.
    """
    if len(tables) != len(lengths):
        raise ValueError(f"{len(tables)} page tables for {len(lengths)} lengths")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    full = [list(t[: n // page_size]) for t, n in zip(tables, lengths)]
    root = _Node()
    for pages in full:
        node = root
        for page in pages:
            node = node.children.setdefault(page, _Node())
            node.rows += 1

    chosen: dict[tuple[int, int], list[int]] = {}  # (id of node, depth) -> rows
    for row, pages in enumerate(full):
        node, best, best_node = root, (0, 0), None
        for depth, page in enumerate(pages, start=1):
            node = node.children[page]
            saving = (node.rows - 1) * depth
            if saving > 0 and (saving, depth) >= best:
                best, best_node = (saving, depth), node
        key = (id(best_node), best[1]) if best_node is not None else (-1 - row, 0)
        chosen.setdefault(key, []).append(row)

    groups = []
    for (_, depth), rows in chosen.items():
        if len(rows) == 1:
            # Alone at its chosen prefix (the others chose elsewhere): it reads its own pages.
            depth = len(full[rows[0]])
        groups.append(PrefixGroup(tuple(rows), tuple(full[rows[0]][:depth])))
    return sorted(groups, key=lambda g: g.rows[0])
