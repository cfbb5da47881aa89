"""``RadixPromptCache``: what mlx_lm.server expects of its ``LRUPromptCache``, backed
by the radix tree and the KV pool.

Stock mlx-lm stores one private snapshot per prompt and deep-copies it on every
hit. Here a hit locks the cached pages and hands out ``PoolBackedCache`` views of
them: no K/V is copied, and a prefix shared by many prompts is stored once.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any

import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from ..memory import ranks
from ..memory.allocator import OutOfPages
from ..memory.cache_list import flat, nested
from ..memory.disk_tier import DISK_STATS
from ..memory.pool import KVPool, page_slots
from ..memory.radix_tree import MatchResult, RadixTree, TreeNode
from ..memory.snapshots import SnapshotStore
from .inflight import InflightPrompts
from .page_table import PageTable
from .pool_backed import PoolBackedCache
from .recurrent import RecurrentTrack, Snapshot
from .tiering import Tiering


def _locked(method):
    """Run under the pool's lock, after the releases that dropped caches queued."""

    @wraps(method)
    def run(self, *args, **kwargs):
        with self.pool.lock:
            self.pool.run_deferred()
            return method(self, *args, **kwargs)

    return run


def idle_stats(page_size: int, fallback: str | None) -> dict:
    """What ``RadixPromptCache.stats`` shows, for a server with no pool."""
    return {**dict.fromkeys(POOL_STATS, 0), "page_size": page_size, "fallback": fallback}


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0  # pages dropped from the tree to make room


class RadixPromptCache:
    def __init__(self, pool: KVPool, *, eviction: str = "lru"):
        self.pool = pool
        self.tree = RadixTree(page_size=pool.page_size, policy=eviction)
        # A hybrid model's recurrent states (snapshots.py).
        self.recurrent = pool.recurrent
        self.snapshots = SnapshotStore(pool.snapshot_budget if self.recurrent else 0)
        self.tree.on_remove = self.snapshots.forget
        self.snapshots.on_evict = self._drop_kept_tail
        self.counters = CacheCounters()
        # Requests whose prompt pages are not all in the tree yet: later requests
        # with the same prefix share their pages instead of computing them again.
        # Only an engine that runs a prefill after the one it waits for may turn
        # this on (engine.RadixBatchGenerator does), and only it turns it off again.
        self.share_inflight = False
        self.inflight_engine: int | None = None  # id() of that engine
        self._inflight = InflightPrompts(pool.page_size)
        self._fetches = itertools.count()
        self._tables: weakref.WeakSet[PageTable] = weakref.WeakSet()  # every fetched table
        # The disk tier under the pool (tiering.py), when the server turns it on.
        self.tiering: Tiering | None = None
        # Pinned prefixes (server/pins.py): (model key, tokens) -> the node locked for them.
        self.pins: dict[tuple[Hashable, tuple[int, ...]], TreeNode] = {}
        pool.reclaim = self._evict
        # Whether a finished request's commit waits for ``commit_finished`` (the server
        # turns it on): see ``insert_cache``.
        self.defer_finished = False
        self._finished: list[tuple[Hashable, list[int], list[Any]]] = []

    # -- the LRUPromptCache interface ---------------------------------------------

    def __len__(self) -> int:
        return self.tree.num_sequences

    @property
    def nbytes(self) -> int:
        """Bytes of the pages the tree holds (each shared page once)."""
        return self.tree.total_pages * self.pool.bytes_per_page

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return {"radix": {"n_sequences": len(self), "n_bytes": self.nbytes}}

    @_locked
    def fetch_nearest_cache(
        self, model_key: Hashable, tokens: Sequence[int]
    ) -> tuple[list[PoolBackedCache], list[int]]:
        """Caches holding the longest cached prefix of ``tokens``, and the tokens left.

        At least one token is always left to prefill: the model must run on the
        last prompt token to produce the first output's logits (mlx-lm 0.32.2's own
        cache returns an empty remainder on an exact match and its batch path dies).
        """
        self._commit_finished()
        tokens = list(tokens)
        match = self.tree.match_prefix(model_key, tokens[:-1])
        if self.tiering is not None and self.tiering.restore(
            self.tree, model_key, tokens[:-1], match
        ):
            match = self.tree.match_prefix(model_key, tokens[:-1])
        if self.recurrent:
            return self._fetch_hybrid(model_key, tokens, match)
        table = self._held_table(model_key, tokens, match.node, match.pages, match.length)
        n = match.length
        producer, shared = None, n
        if self.share_inflight:
            producer, shared = self._inflight_match(model_key, tokens, n)
        if producer is not None:
            # Another request fetched before this one is to compute these tokens: the engine
            # runs this prefill after that one has written them, and hands it their pages then.
            table.depends = (weakref.ref(producer), n, shared)
            table.shared_tokens = n = shared
        elif match.partial_len:
            try:
                n = self._continue_partial(table, match)
                table.written = n
            except OutOfPages:
                pass  # the server's thread must not die on a fetch: recompute those tokens
        self._admit_table(table, n)
        caches = [PoolBackedCache(table, i, offset=n) for i in range(self.pool.num_layers)]
        return caches, tokens[n:]

    def _admit_table(self, table: PageTable, n: int) -> None:
        """Count a fetch that hands ``n`` cached tokens to ``table``."""
        # No page is reserved for the rest of the prompt yet: a queued request holds only
        # what it matched, and reserves when the engine admits it (or as its prefill goes).
        table.fetch_number = next(self._fetches)
        self._inflight.add(table.fetch_number, table)
        self._tables.add(table)
        c = self.counters
        c.prompt_tokens += len(table.tokens)
        c.cached_tokens += n
        if n:
            c.hits += 1
        else:
            c.misses += 1

    def _fetch_hybrid(
        self, model_key: Hashable, tokens: list[int], match: MatchResult
    ) -> tuple[list[Any], list[int]]:
        """A hybrid model's fetch: it resumes at the deepest snapshot of the recurrent
        layers its match runs through (on a matched node, or on a tail after one), with the
        K/V up to there; nothing in between."""
        node, n, tail = self._deepest_snapshot(match, tokens, tails=True)
        if self.tiering is not None and self.tiering.restore_state(
            # A state on disk deeper than any in memory (after a restart, say) is read back.
            self.tree,
            self.snapshots,
            model_key,
            tokens[:-1],
            match,
            deeper_than=n + (len(tail.tokens) if tail is not None else 0),
        ):
            node, n, tail = self._deepest_snapshot(match, tokens, tails=True)
        if tail is not None:
            # A tail holding a snapshot (a finished request's end, a segment end of the
            # server's): resume after it, its slots copied.
            table, resumed, snapshot = self._resume_at_tail(model_key, tokens, match, n, tail)
            if table is not None:
                return self._hybrid_caches(table, resumed, snapshot, match.length)
            node, n, _ = self._deepest_snapshot(match, tokens, tails=False)
        snapshot = self.snapshots.get(node) if not node.is_root else None
        pages = match.pages[: n // self.pool.page_size]
        table = self._held_table(model_key, tokens, node, pages, n)
        return self._hybrid_caches(table, n, snapshot, match.length)

    def _deepest_snapshot(
        self, match: MatchResult, tokens: list[int], *, tails: bool
    ) -> tuple[TreeNode, int, TreeNode | None]:
        """Walking up from the match's node: the first that holds a snapshot, or (with
        ``tails``) has a tail holding one that ``tokens`` run through, which lies deeper;
        that node, where it ends, and the tail. The root, 0 and None where none does."""
        node, n = match.node, match.length
        while not node.is_root:
            tail = self._snapshot_tail(node, tokens[n : len(tokens) - 1]) if tails else None
            if tail is not None or node in self.snapshots:
                return node, n, tail
            n -= len(node.tokens)
            node = node.parent
        return node, 0, self._snapshot_tail(node, tokens[: len(tokens) - 1]) if tails else None

    def _held_table(
        self, model_key: Hashable, tokens: list[int], node: TreeNode, pages: list[int], n: int
    ) -> PageTable:
        """A request's table over the tree's ``pages`` (``n`` tokens, ending at ``node``),
        holding a reference to each and a lock on ``node`` until it is released."""
        self.tree.lock(node)
        self.pool.allocator.incref(pages)
        table = PageTable(self.pool, pages, n, unlock=partial(self._unlock, node))
        table.model_key, table.tokens, table.committed = model_key, tokens, n
        table.prompt_committed = False
        return table

    def _snapshot_tail(self, node: TreeNode, rest: Sequence[int]) -> TreeNode | None:
        """The longest of ``node``'s tails that holds a snapshot and that ``rest`` (the
        tokens after ``node``) runs through."""
        rest, best = tuple(rest[: self.pool.page_size]), None
        for child in node.children.values():
            n = len(child.tokens)
            if (
                self.tree.is_tail(child)
                and rest[:n] == child.tokens
                and (best is None or n > len(best.tokens))
                and child in self.snapshots
            ):
                best = child
        return best

    def _resume_at_tail(
        self, model_key: Hashable, tokens: list[int], match: MatchResult, n: int, tail: TreeNode
    ) -> tuple[PageTable | None, int, Snapshot | None]:
        """A table holding the match's first ``n`` tokens (where ``tail`` hangs) and
        ``tail``'s slots, the tokens it holds, and the tail's snapshot; (None, 0, None)
        where no page is free for a copy of the tail."""
        snapshot = self.snapshots.get(tail)
        match = MatchResult(
            match.pages[: n // self.pool.page_size],
            tail.parent,
            n,
            partial_page=tail.pages[0],
            partial_len=len(tail.tokens),
            partial_node=tail,
        )
        table = self._held_table(model_key, tokens, match.node, match.pages, match.length)
        try:
            n = self._continue_partial(table, match)
        except OutOfPages:
            table.release()
            return None, 0, None
        table.written = n
        return table, n, snapshot

    def _hybrid_caches(
        self, table: PageTable, n: int, snapshot: Snapshot | None, matched: int
    ) -> tuple[list[Any], list[int]]:
        """A hybrid request's caches from ``n`` cached tokens (the recurrent layers from
        ``snapshot``), where its K/V match ran to ``matched``; and the tokens left."""
        model_key, tokens = table.model_key, table.tokens
        track = table.recurrent = RecurrentTrack()
        if matched > n:
            # The K/V match runs deeper than any snapshot: a snapshot where it ends lets
            # the next request on this branch resume there (the engine takes it).
            track.wanted.add(matched)
        if self.share_inflight and n % self.pool.page_size == 0:
            # (A request resuming inside its tail page computes the rest itself: another's
            # pages would replace that page, which holds tokens of its own.)
            producer, shared = self._inflight_match(model_key, tokens, n)
            # The producer must stop its prefill where this one takes over, and leave its
            # state there (the engine restores it then); one already past is not waited for.
            if producer is not None and producer.recurrent.want(shared):
                table.depends = (weakref.ref(producer), n, shared)
                table.shared_tokens = n = shared
        track.start = n
        caches: list[Any] = [None] * len(self.pool.layout)
        for e, layer in enumerate(self.pool.layout):
            if layer is not None:
                caches[e] = PoolBackedCache(table, layer, offset=n)
        for e in self.recurrent:
            caches[e] = ArraysCache(self.pool.state_sizes[e])
        if snapshot is not None:
            snapshot.restore(caches, self.recurrent)
            track.resumed = snapshot
        self._admit_table(table, n)
        return nested(caches, self.pool.cache_shape), tokens[n:]

    @_locked
    def insert_cache(
        self,
        model_key: Hashable,
        tokens: Sequence[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Commit the whole pages of ``prompt_cache`` under ``tokens``.

        Our own caches are committed without a copy; the request's references and
        lock are dropped, and pages that duplicate cached ones are freed. mlx-lm's
        ``KVCache`` (the stock batch path) is copied into pages once. ``cache_type``
        is accepted for interface parity: the tree treats all prefixes alike.

        With ``defer_finished``, a finished request's commit waits for the next fetch, the
        engine's next step or ``commit_finished`` (the server's idle time), whichever comes
        first. mlx_lm.server commits each finishing row right after answering it, before
        the next row is answered, and a hybrid's commit copies its tail page and files its
        final state (25 ms for Qwen3.5-0.8B's shape on 2 CPU cores): chats finishing in one
        step then sent their next turns that much apart, the first was admitted alone and
        the others waited for its prefill (turn 2 of the smoke multi-turn bench: 1.9-2.2 s
        against 1.6 s when they join).
        """
        if not prompt_cache:
            return
        kv = self._kv_caches(prompt_cache)
        first = kv[0] if kv else None
        if self.defer_finished and isinstance(first, PoolBackedCache) and not first.table.in_batch:
            self._finished.append((model_key, list(tokens), prompt_cache))
            return
        self._insert(model_key, tokens, prompt_cache)

    def commit_finished(self) -> int:
        """Commit the finished requests whose commits ``insert_cache`` deferred, and run
        the releases queued; returns how many commits there were."""
        # The engine asks at every step: with nothing to do, the lock is not taken.
        if not self._finished and not self.pool.has_deferred:
            return 0
        return self._commit_finished_locked()

    @_locked
    def _commit_finished_locked(self) -> int:
        return self._commit_finished()

    def _commit_finished(self) -> int:
        committed = len(self._finished)
        while self._finished:
            self._insert(*self._finished.pop(0))
        return committed

    def _insert(self, model_key: Hashable, tokens: Sequence[int], prompt_cache: list[Any]) -> None:
        kv = self._kv_caches(prompt_cache)
        first = kv[0] if kv else None
        if isinstance(first, PoolBackedCache) and first.table.pool is self.pool:
            table = first.table
            # Filed under the key the pages were fetched under: the server inserts with the
            # model's key, which a request's cache_salt extends (mlx_lm_hooks/salt.py).
            model_key = table.model_key if table.model_key is not None else model_key
            if table.released or any(getattr(c, "table", None) is not table for c in kv):
                return
            # Only what reached the pool: a request that ran out of pages went on privately.
            n = min(min(c.offset for c in kv), len(tokens), table.written)
            track = table.recurrent
            if track is not None and not table.in_batch and not table.overflowed:
                # A finished request's final state is a snapshot where it ends, on its tail
                # page when that is partial: the next turn of a chat resumes there, as from
                # stock's cache, not at the page boundary before it (_fetch_hybrid).
                final = Snapshot.of_request(prompt_cache, self.recurrent)
                if final is not None:
                    track.captured[n] = final
            prompt = table.tokens or []
            if list(tokens[: len(prompt)]) != prompt[: len(tokens)]:
                # Not the tokens this table's pages hold: committing would file K/V
                # under the wrong key. Give the pages back instead.
                self._inflight.pop(table.fetch_number)
                table.release()
                return
            if table.in_batch:
                # A segment boundary mid-request: the request keeps its pages.
                self._commit_running(model_key, tokens, table, n)
            else:
                self._commit(model_key, tokens, table, n)
                self._inflight.pop(table.fetch_number)
                table.release()
        elif self._ingestible(prompt_cache):
            self._ingest(model_key, tokens, prompt_cache)

    @_locked
    def snapshot_of(self, table: PageTable, position: int) -> Snapshot | None:
        """The recurrent state ``table``'s request left at ``position``, if it left one."""
        track = table.recurrent
        if track is None:
            return None
        if position in track.captured:
            return track.captured[position]
        if track.decoded is not None and track.decoded[0] == position:
            return track.decoded[1]
        if position == track.start and table.depends is None:
            return track.resumed
        node = self.tree.node_ending_at(table.model_key, table.tokens[:position])
        return self.snapshots.get(node) if node is not None else None

    def _kv_caches(self, prompt_cache: list[Any]) -> list[Any]:
        """The entries of a request's cache that hold K/V (all of them, but a hybrid's)."""
        if self.recurrent:
            parts = flat(prompt_cache)
            if len(parts) == len(self.pool.layout):
                return [c for c, layer in zip(parts, self.pool.layout) if layer is not None]
        return prompt_cache

    @_locked
    def release(self, table: PageTable) -> None:
        """Give back a request's pages and lock without caching anything more of it."""
        self._inflight.pop(table.fetch_number)
        table.release()

    @_locked
    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        if n_bytes is not None:
            keep = max(0, n_bytes) // self.pool.bytes_per_page
            # mlx_lm.server passes each rank's own byte count (``--prompt-cache-bytes`` less
            # what its batch holds), and a pipeline rank's page holds its own layers: the
            # ranks of mlx.launch keep the fewest pages any of them would, and evict alike.
            (keep,) = ranks.least([keep])
            if self.tree.total_pages > keep:
                self._evict(self.tree.total_pages - keep)
        if n_sequences is not None:
            while len(self) > max(0, n_sequences) and self._evict(1):
                pass

    @_locked
    def commit_progress(self, table: PageTable) -> None:
        """Commit the prompt pages a running request has written so far.

        A request arriving while this one still prefills or decodes then hits them.
        """
        prompt = getattr(table, "tokens", None)
        if prompt is None or table.released:
            table.prompt_committed = True
            return
        upto = min(table.written, len(prompt)) // self.pool.page_size * self.pool.page_size
        if upto > table.committed:
            self._commit_running(table.model_key, prompt, table, upto)
        if upto >= len(prompt) // self.pool.page_size * self.pool.page_size:
            table.prompt_committed = True
            self._inflight.pop(table.fetch_number)

    # -- pins ----------------------------------------------------------------------

    @_locked
    def pin(self, model_key: Hashable, tokens: Sequence[int]) -> int:
        """Keep the cached whole pages of ``tokens`` from eviction until ``unpin``; returns
        the tokens pinned (0: the tree does not hold them all)."""
        n = len(tokens) // self.pool.page_size * self.pool.page_size
        key = (model_key, tuple(tokens[:n]))
        if n == 0 or key in self.pins:
            return n if key in self.pins else 0
        node = self.tree.node_ending_at(model_key, list(key[1]))
        if node is None:
            return 0
        self.tree.lock(node)
        self.pins[key] = node
        return n

    @_locked
    def unpin(self, model_key: Hashable, tokens: Sequence[int]) -> bool:
        n = len(tokens) // self.pool.page_size * self.pool.page_size
        node = self.pins.pop((model_key, tuple(tokens[:n])), None)
        if node is not None:
            self.tree.unlock(node)
        return node is not None

    @_locked  # ``unpin`` runs on an HTTP thread
    def pinned_pages(self, extra: tuple[Hashable, Sequence[int]] | None = None) -> int:
        """Distinct pages the pins hold (pins share pages where their prompts do), with
        ``extra`` (a model key and tokens) pinned too: its pages the tree has, and one a
        whole page it lacks."""
        pages = {p for node in self.pins.values() for p in self.tree.path_pages(node)}
        if extra is None:
            return len(pages)
        model_key, tokens = extra
        have = self.tree.cached_pages(model_key, tokens, whole=False)
        return len(pages | set(have)) + len(tokens) // self.pool.page_size - len(have)

    # -- accounting ----------------------------------------------------------------

    @_locked
    def stats(self, keys: Iterable[str] | None = None) -> dict[str, int]:
        """``POOL_STATS`` (only ``keys`` if given) and the page size."""
        keys = POOL_STATS if keys is None else keys
        return {**{key: POOL_STATS[key](self) for key in keys}, "page_size": self.pool.page_size}

    # -- internals -----------------------------------------------------------------

    def _unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def _evict(self, num_pages: int) -> int:
        dropped = self.tree.evict(num_pages)
        self.counters.evictions += len(dropped)
        return len(self.pool.allocator.decref(dropped)) if dropped else 0

    def _continue_partial(self, table: PageTable, match: MatchResult) -> int:
        """Give the request the cached tokens that continue its match inside a page.

        A tail the request extends whole, which no one else holds, becomes the request's
        page and is completed in place; otherwise its first slots are copied (on write). A
        tail holding a snapshot stays: another branch may resume there.
        """
        node, page = match.partial_node, match.partial_page
        if (
            self.tree.is_tail(node)
            and match.partial_len == len(node.tokens)
            and self.pool.allocator.refcount(page) == 1
            and node.snapshot is None
        ):
            self.tree.remove_leaf(node)  # the tree's reference passes to the request
            table.pages.append(page)
            return match.length + match.partial_len
        table.pages.append(self._copy_slots(page, match.partial_len))
        return match.length + match.partial_len

    def _copy_slots(self, src_page: int, length: int) -> int:
        """A new page holding a copy of the first ``length`` slots of ``src_page``."""
        alloc = self.pool.allocator
        alloc.incref([src_page])  # eviction inside alloc_pages must not recycle it
        try:
            (page,) = self.pool.alloc_pages(1)
        finally:
            alloc.decref([src_page])
        ps = self.pool.page_size
        offsets = np.arange(length)
        self.pool.copy(src_page * ps + offsets, page * ps + offsets)
        return page

    def _inflight_match(
        self, model_key: Hashable, tokens: list[int], cached: int
    ) -> tuple[PageTable | None, int]:
        """The request not yet committed whose prompt covers most of ``tokens``."""
        return self._inflight.longest(model_key, tokens, cached)

    def _commit_running(
        self, model_key: Hashable, tokens: Sequence[int], table: PageTable, n: int
    ) -> None:
        """Commit ``n`` tokens of a request that goes on; it then locks all it committed.
        A hybrid's commits whole pages: a tail on the page it goes on writing would be
        covered by that very page later, and a tail holding a snapshot is not dropped then
        (its snapshot gets a tail of its own, ``_attach_snapshots``)."""
        states = n
        if table.recurrent is not None:
            n = n // self.pool.page_size * self.pool.page_size
        self._commit(model_key, tokens, table, n, states)
        node = self.tree.match_prefix(
            model_key, list(tokens[: n // self.pool.page_size * self.pool.page_size])
        ).node
        self.tree.lock(node)
        table.relock(partial(self._unlock, node))
        table.committed = max(getattr(table, "committed", 0), n)
        # The tree reads these tokens now: a rewrite below them must copy first.
        table.shared_tokens = max(table.shared_tokens, n)

    def _commit(
        self,
        model_key: Hashable,
        tokens: Sequence[int],
        table: PageTable,
        n: int,
        states: int | None = None,
    ) -> None:
        """File the first ``n`` tokens' pages under ``tokens``, the last one maybe a tail,
        and a hybrid's snapshots up to ``states`` (default ``n``)."""
        if n:
            pages = table.pages[: -(-n // self.pool.page_size)]
            cached, dropped = self.tree.insert(model_key, list(tokens[:n]), pages)
            # The tree takes its own reference to the pages it did not have, before it gives
            # back those of the tails it superseded (the same page, when one was completed).
            self.pool.allocator.incref(pages[-(-cached // self.pool.page_size) :])
            self.pool.allocator.decref(dropped)
            if self.tiering is not None:
                self.tiering.save(model_key, tokens[:n], pages, cached // self.pool.page_size)
        if table.recurrent is not None:
            self._attach_snapshots(model_key, tokens, table, n if states is None else states)
            tiering = self.tiering
            if tiering is not None and tiering.write_mode == "through":
                tiering.save_states(self.tree, self.snapshots)

    def _attach_snapshots(
        self, model_key: Hashable, tokens: Sequence[int], table: PageTable, n: int
    ) -> None:
        """Hang the snapshots a request took at or below ``n`` (now in the tree) on the
        nodes that end at their positions; one inside a page the tree has no tail for
        gets a tail of its own, a copy of the request's slots there."""
        track = table.recurrent
        taken = [(d, s) for d, s in track.captured.items() if d <= n]
        if track.decoded is not None and track.decoded[0] <= n:
            taken.append(track.decoded)
            track.decoded = None
        for d, snapshot in taken:
            track.captured.pop(d, None)
            node = self.tree.node_ending_at(model_key, list(tokens[:d]))
            if node is None and d % self.pool.page_size:
                node = self._snapshot_home(model_key, tokens[:d], table, snapshot)
            if node is not None and self.snapshots.put(node, snapshot, snapshot.nbytes):
                if self.tiering is not None:
                    self.tiering.states_due = True

    def _snapshot_home(
        self, model_key: Hashable, tokens: Sequence[int], table: PageTable, snapshot: Snapshot
    ) -> TreeNode | None:
        """A new tail ending after ``tokens``, a copy of ``table``'s slots there, for
        ``snapshot``; None where the tree lacks the pages before it or no page is free."""
        if snapshot.nbytes > self.snapshots.budget_bytes:
            return None  # a tail that no snapshot would hold
        ps = self.pool.page_size
        try:
            page = self._copy_slots(table.pages[len(tokens) // ps], len(tokens) % ps)
        except OutOfPages:
            return None
        node = self.tree.add_tail(model_key, list(tokens), page)
        if node is None:
            self.pool.allocator.decref([page])
        return node

    def _drop_kept_tail(self, node: TreeNode) -> None:
        """A tail kept only for the snapshot the budget just dropped leaves the tree."""
        if node.parent is not None and self.tree.is_covered(node):
            self.pool.allocator.decref(self.tree.remove_leaf(node))

    def _ingestible(self, prompt_cache: list[Any]) -> bool:
        return (
            len(prompt_cache) == self.pool.num_layers
            and all(s.window is None for s in self.pool.specs)
            and all(type(c) is KVCache for c in prompt_cache)
            and all(c.keys is not None and c.keys.shape[0] == 1 for c in prompt_cache)
        )

    def _ingest(self, model_key: Hashable, tokens: Sequence[int], prompt_cache: list[Any]) -> None:
        """Copy a stock cache's K/V into new pages for the part the tree lacks."""
        ps = self.pool.page_size
        n = min(min(c.offset for c in prompt_cache), len(tokens))
        match = self.tree.match_prefix(model_key, list(tokens[:n]))
        if match.length == n or match.partial_len == n - match.length:
            return
        self.tree.lock(match.node)
        try:
            pages = self.pool.alloc_pages(-(-n // ps) - match.length // ps)
        except OutOfPages:
            return  # nothing cached; the caller (the server's thread) must go on
        finally:
            self.tree.unlock(match.node)
        lo = match.length
        slots = self.pool.slots(page_slots(pages, ps)[: n - lo])
        for i, c in enumerate(prompt_cache):
            self.pool.write(i, slots, c.keys[..., lo:n, :], c.values[..., lo:n, :])
        # The new pages are the tree's references now; those of superseded tails come back.
        inserted = self.tree.insert(model_key, list(tokens[:n]), match.pages + pages)
        self.pool.allocator.decref(inserted.dropped)
        if self.tiering is not None:
            self.tiering.save(model_key, tokens[:n], match.pages + pages, lo // ps)


# Every count ``RadixPromptCache.stats`` reports, and how it is read: the one list of these
# keys (``idle_stats`` shows them as 0; server/metrics.py exports them under these names).
# Once no request runs, the last four show nobody holds a page but the pins: page_refs ==
# pages_cached, pages_locked == pinned_pages, tree_locks == pins, requests_holding_pages == 0.
POOL_STATS: dict[str, Callable[[RadixPromptCache], int]] = {
    "hits": lambda c: c.counters.hits,
    "misses": lambda c: c.counters.misses,
    "prompt_tokens": lambda c: c.counters.prompt_tokens,
    "cached_tokens": lambda c: c.counters.cached_tokens,
    "evictions": lambda c: c.counters.evictions,
    "pool_bytes_used": lambda c: c.pool.used_bytes,
    "pool_bytes_total": lambda c: c.pool.nbytes,
    "pool_bytes_max": lambda c: c.pool.max_nbytes,
    # K/V held outside the pool (batch buffers, private copies); beyond the plan's reserve
    # for it, it is taken from the pool's room.
    "buffer_bytes": lambda c: c.pool.buffer_bytes,
    "pool_chunks": lambda c: len(c.pool.allocator.online_chunks),
    "pages_total": lambda c: c.pool.allocator.num_pages,
    "pages_max": lambda c: c.pool.allocator.max_pages,
    "pages_free": lambda c: c.pool.allocator.num_free,
    "pages_locked": lambda c: c.pool.allocator.num_used - c.tree.evictable_pages,
    "pages_evictable": lambda c: c.tree.evictable_pages,
    "cached_sequences": lambda c: len(c),
    "pages_cached": lambda c: c.tree.total_pages,
    "page_refs": lambda c: c.pool.allocator.total_refs,
    "tree_locks": lambda c: c.tree.locks,
    # Fetched and not yet given back (releases queued by dropped caches have run: every
    # locked method runs them first).
    "requests_holding_pages": lambda c: sum(not t.released for t in c._tables),
    # Pinned prefixes (server/pins.py): each holds a tree lock on its pages while pinned.
    "pins": lambda c: len(c.pins),
    "pinned_pages": lambda c: c.pinned_pages(),
    # Prompt passes over the pool whose rows read a shared prefix once (grouped_prefill.py),
    # and those whose rows each read their own context.
    "prefill_passes_grouped": lambda c: c.pool.prefill_passes["grouped"],
    "prefill_passes_per_row": lambda c: c.pool.prefill_passes["per_row"],
    # A hybrid model's recurrent-state snapshots (memory/snapshots.py); 0 for the others.
    "snapshots": lambda c: len(c.snapshots),
    "snapshot_bytes": lambda c: c.snapshots.nbytes,
    "snapshot_bytes_max": lambda c: c.snapshots.budget_bytes,
    "snapshot_hits": lambda c: c.snapshots.hits,
    "snapshot_evictions": lambda c: c.snapshots.evictions,
    # The disk tier (memory/disk_tier.py); 0 when it is off.
    **{key: (lambda c, key=key: _disk_stat(c.tiering, key)) for key in DISK_STATS},
    # Fetches that computed pages the disk held: computing them was measured faster.
    "disk_restores_skipped": lambda c: _disk_stat(c.tiering, "skipped"),
}


def _disk_stat(tiering: Tiering | None, key: str) -> int | float:
    """A disk stat, 0 with no tier (read once: a shutdown or a new model drops it while the
    stats are read on an HTTP thread)."""
    if tiering is None:
        return 0
    return tiering.skipped if key == "skipped" else tiering.disk.stats()[key]
