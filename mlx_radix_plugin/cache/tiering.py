"""Pages between the pool and the disk tier: written through as they are committed, read
back where a prompt's match runs past what the pool holds.

Write-through, not write-back at eviction: an evicted page is reused by the very pass that
evicted it (eviction runs inside a write's ``alloc_pages``), so writing it back would mean
evaluating its rows there, mid-pass, behind the whole step. A page committed to the tree is
instead gathered behind the step that wrote it (``mx.async_eval``) and handed to the disk
tier's writer once a later step has been waited for (``pump``), when the gather has run:
nothing waits for it. Every committed page is then on disk unless its write was dropped,
which also makes a kill -9 lose only the writes still queued; a clean shutdown writes what
the tree holds and the disk lacks (``save_tree``).

Reads run on the generation thread, in the fetch: the pages are read, checked, written into
new pool pages and filed in the tree, and the request's match continues through them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import mlx.core as mx
import numpy as np

from ..memory.allocator import OutOfPages
from ..memory.disk_tier import DiskTier, chain_seed, page_hashes
from ..memory.pool import KVPool, page_slots
from ..memory.radix_tree import MatchResult, RadixTree

log = logging.getLogger("mlx_radix")

# The K/V dtype's name in safetensors; bfloat16's bits travel as uint16 (numpy has none).
TAGS = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}


def disk_dtype_supported(dtype: mx.Dtype) -> bool:
    return dtype in TAGS


class Tiering:
    def __init__(self, pool: KVPool, disk: DiskTier, model_key: Hashable = None):
        """Pages of ``pool`` to and from ``disk``; ``model_key`` is the server's key for the
        model, which a request's key extends (with its cache salt)."""
        self.pool = pool
        self.disk = disk
        self.model_key = model_key
        self.tag = TAGS[pool.dtype]
        self._seeds: dict[Hashable, bytes] = {}
        self._pending: list[tuple[int, list, list]] = []  # (pump, pages' metadata, arrays)
        self._pumps = 0

    # -- hashes ----------------------------------------------------------------------

    def seed(self, namespace: Hashable) -> bytes:
        seed = self._seeds.get(namespace)
        if seed is None:
            base = self.model_key
            extra = namespace
            if isinstance(base, tuple) and isinstance(namespace, tuple):
                if namespace[: len(base)] == base:
                    extra = namespace[len(base) :]  # the identity covers the model itself
            elif namespace == base:
                extra = ()
            seed = self._seeds[namespace] = chain_seed(extra)
        return seed

    def hashes(self, namespace: Hashable, tokens: Sequence[int], n_pages: int) -> list[str]:
        return page_hashes(self.seed(namespace), tokens, n_pages, self.pool.page_size)

    # -- writes ----------------------------------------------------------------------

    def save(
        self, namespace: Hashable, tokens: Sequence[int], pages: Sequence[int], first: int
    ) -> None:
        """Queue the whole pages ``first..`` of ``tokens`` (held in ``pages``) that the disk
        lacks: gathered now, behind the pass that wrote them, written later."""
        if not self.disk.enabled:
            return
        ps = self.pool.page_size
        n = min(len(tokens) // ps, len(pages))
        if n <= first:
            return
        keys = self.hashes(namespace, tokens, n)
        todo = [i for i in range(first, n) if keys[i] not in self.disk]
        if not todo:
            return
        meta = [
            (keys[i], keys[i - 1] if i else "", i, list(tokens[i * ps : (i + 1) * ps]))
            for i in todo
        ]
        slots = self.pool.slots(page_slots([pages[i] for i in todo], ps))
        arrays = []
        for layer in range(self.pool.num_layers):
            for rows in self.pool.rows(layer, slots):
                arrays.append(rows.view(mx.uint16) if self.tag == "BF16" else rows)
        mx.async_eval(arrays)
        # On a GPU the next write into the pool must wait for these reads (pool.settle).
        self.pool.reading()
        self._pending.append((self._pumps, meta, arrays))

    def pump(self, everything: bool = False) -> None:
        """Hand the gathers that have run to the writer: those queued before the step that
        mlx-lm last waited for (or all of them, waiting, with ``everything``)."""
        self._pumps += 1
        if not self._pending:
            return
        ready, waiting = [], []
        for p in self._pending:
            (ready if everything or p[0] <= self._pumps - 2 else waiting).append(p)
        self._pending = waiting
        ps = self.pool.page_size
        for _, meta, arrays in ready:
            mx.eval(arrays)  # a no-op unless ``everything``: they have run
            host = [np.asarray(a) for a in arrays]
            for j, (key, parent, depth, tokens) in enumerate(meta):
                tensors = {}
                for layer in range(self.pool.num_layers):
                    k, v = host[2 * layer], host[2 * layer + 1]
                    tensors[f"k.{layer}"] = (self.tag, k[j * ps : (j + 1) * ps])
                    tensors[f"v.{layer}"] = (self.tag, v[j * ps : (j + 1) * ps])
                self.disk.put(key, parent, depth, tokens, tensors)

    def save_tree(self, tree: RadixTree, deadline: float) -> int:
        """Queue every whole page of ``tree`` the disk lacks, then write them all, until
        ``deadline`` (``time.monotonic()``); returns the pages queued."""
        before = self.disk.counters.pages_written
        for namespace, tokens, pages in tree.sequences():
            if time.monotonic() > deadline:
                break
            self.save(namespace, tokens, pages, 0)
            self.pump(everything=True)
        self.disk.flush(max(0.0, deadline - time.monotonic()))
        return self.disk.counters.pages_written - before

    # -- reads -----------------------------------------------------------------------

    def restore(
        self, tree: RadixTree, namespace: Hashable, tokens: Sequence[int], match: MatchResult
    ) -> int:
        """Read the pages that continue ``match`` from disk into the pool and the tree;
        returns how many. ``tokens`` are the ones that may be matched."""
        if not self.disk.enabled:
            return 0
        ps = self.pool.page_size
        start, end = match.length // ps, len(tokens) // ps
        if end <= start:
            return 0
        keys = self.hashes(namespace, tokens, end)
        n = self.disk.stored(keys[start:])
        if not n:
            return 0
        began = time.perf_counter()
        read = []
        for i in range(start, start + n):
            page = self.disk.read(keys[i], keys[i - 1] if i else "", tokens[i * ps : (i + 1) * ps])
            if page is None or not self._fits(page):
                break
            read.append(page)
        if not read:
            return 0
        tree.lock(match.node)  # what the match found must not be evicted for the new pages
        try:
            pages = self.pool.alloc_pages(len(read))
        except OutOfPages:
            return 0
        finally:
            tree.unlock(match.node)
        self.pool.settle()
        slots = self.pool.slots(page_slots(pages, ps))
        for layer in range(self.pool.num_layers):
            k, v = (self._array([p[f"{w}.{layer}"][1] for p in read]) for w in "kv")
            self.pool.write_rows(layer, slots, k, v)
        mx.eval(self.pool.arrays)
        upto = (start + len(read)) * ps
        inserted = tree.insert(namespace, list(tokens[:upto]), match.pages + pages)
        self.pool.allocator.decref(inserted.dropped)
        c = self.disk.counters
        c.hits += 1
        c.pages_read += len(read)
        c.restore_seconds += time.perf_counter() - began
        return len(read)

    def _fits(self, page: dict) -> bool:
        """Whether a page read back has this pool's layers, shapes and dtype."""
        ps = self.pool.page_size
        for layer, s in enumerate(self.pool.specs):
            for w, dim in (("k", s.k_head_dim), ("v", s.v_head_dim)):
                entry = page.get(f"{w}.{layer}")
                if entry is None or entry[0] != self.tag or entry[1].shape != (ps, s.kv_heads, dim):
                    return False
        return True

    def _array(self, parts: list[np.ndarray]) -> mx.array:
        x = mx.array(np.concatenate(parts) if len(parts) > 1 else parts[0])
        return x.view(mx.bfloat16) if self.tag == "BF16" else x
