"""Pages between the pool and the disk tier: written as they are committed or when the
server is idle, read back where a prompt's match runs past what the pool holds.

Not written back at eviction: an evicted page is reused by the very pass that evicted it
(eviction runs inside a write's ``alloc_pages``), so writing it back would mean evaluating
its rows there, mid-pass, behind the whole step. Two ways instead (``write``):

- ``through``: a page committed to the tree is gathered behind the step that wrote it
  (``mx.async_eval``) and handed to the disk tier's writer once a later step has been waited
  for (``pump``), when the gather has run: nothing waits for it. Every committed page is then
  on disk unless its write was dropped (written later, as below), and a kill -9 loses only the
  writes still queued. On this CPU decode was level with the tier off (43.9 against 43.5
  tokens/s, 8 requests).
- ``idle``: a commit only remembers the prompt; its pages the tree still holds are gathered
  and written while the server is idle (``write_later``). Writing through cost an H200 a
  quarter of its decode (Llama-3.2-1B's shape in bfloat16, 32 requests: a median 1,643
  tokens/s over 5 runs against 2,342 over 4 with the tier off). Gathering the pages alone cost
  nothing measurable (2,367); making host arrays of them brought it to 2,057. Written when
  idle: 2,003 against 1,931 (docs/benchmarking.md, "Disk writes: through or when idle"). A
  page committed and evicted within one busy spell is not on disk.

Either way a clean shutdown writes what the tree holds and the disk lacks (``save_tree``).

Reads run on the generation thread, in the fetch: the pages are read (by several threads),
checked, written into new pool pages and filed in the tree, and the request's match continues
through them. Only where that is faster than computing them: on the H200, Llama-3-8B's shape
in bfloat16, reading back took 0.13-0.16 s a 1,000 tokens (0.23 s with one reader thread) and a
prefill 0.03 s, so a restart on the disk tier made a 2,048-token prompt's first token 5x later
(``tools/restore_calibration.py``; docs/benchmarking.md, "Disk restores where reading is
faster"), where on this CPU (SmolLM2 in float32) a
prefill of 1,000 tokens costs 13.9 s and a read 0.24 s. ``restore="auto"`` compares the two: the
prefill's rate measured at load (``prefill_seconds_per_token``), the read's on the pages
found on disk at load and on every restore since.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import astuple

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..memory.allocator import OutOfPages
from ..memory.cache_list import flat
from ..memory.disk_tier import FORMAT, DiskTier, chain_seed, page_hashes, state_key
from ..memory.fingerprint import model_fingerprint
from ..memory.pool import KVPool, page_slots
from ..memory.radix_tree import MatchResult, RadixTree
from ..memory.snapshots import SnapshotStore
from .recurrent import Snapshot

log = logging.getLogger("mlx_radix")

# The K/V dtype's name in safetensors; bfloat16's bits travel as uint16 (numpy has none).
TAGS = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}


def _host(a: mx.array) -> np.ndarray:
    """An evaluated array's bytes on the host (bfloat16 as its bits)."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def disk_dtype_supported(dtype: mx.Dtype) -> bool:
    return dtype in TAGS


def disk_identity(model: nn.Module, pool: KVPool) -> dict:
    """What pages on disk must have been computed by to be used with ``model`` in
    ``pool``: the model (weights and settings), the K/V's dtype, page size and layers, and
    the versions of mlx-lm and of the file format."""
    identity = {
        "model": model_fingerprint(model),
        "kv_dtype": str(pool.dtype),
        "page_size": pool.page_size,
        "layers": [list(astuple(s)) for s in pool.specs],
        "mlx_lm": mlx_lm.__version__,
        "format": FORMAT,
    }
    if pool.recurrent:
        # A hybrid's cache layout: which entries are recurrent, and their arrays.
        identity["recurrent"] = [[e, pool.state_sizes[e]] for e in pool.recurrent]
    return identity


# The prefill probe at load: prompts of 16, 32, ... tokens until one takes this long (or
# PROBE_MOST_TOKENS): long enough for a GPU's rate at a real prompt, short on a CPU.
PROBE_SECONDS = 0.25
PROBE_MOST_TOKENS = 2048
# Tokens of the prompts remembered to be written when idle, at most (16 MiB as int32): a busy
# spell of long prompts (an agent's 30,000 tokens a turn) must not grow it without bound.
LATER_MOST_TOKENS = 1 << 22
# Weight of the newest restore in the read rate's moving average.
READ_RATE_WEIGHT = 0.3


def prefill_seconds_per_token(model) -> float:
    """Seconds a token of prefill takes ``model`` here, on prompts of growing length, each
    timed on its second run (the first compiles its kernels: 10 s on a fresh CUDA process)."""
    n = 16
    while True:
        for _ in range(2):
            cache = make_prompt_cache(model)
            began = time.perf_counter()
            out = model(mx.zeros((1, n), dtype=mx.int32), cache=cache)
            mx.eval(out[:, -1], [c.state for c in flat(cache)])
            took = time.perf_counter() - began
        if took >= PROBE_SECONDS or n >= PROBE_MOST_TOKENS:
            return took / n
        n *= 2


class Tiering:
    def __init__(
        self,
        pool: KVPool,
        disk: DiskTier,
        model_key: Hashable = None,
        restore: str = "on",
        prefill_rate: float | None = None,
        write: str = "through",
    ):
        """Pages of ``pool`` to and from ``disk``; ``model_key`` is the server's key for the
        model, which a request's key extends (with its cache salt). ``restore``: ``on`` (always),
        or ``auto``: only while reading a page back is measured faster than computing it
        (``prefill_rate``, seconds a token). ``write``: ``through`` (pages gathered as they
        are committed) or ``idle`` (committed prompts remembered, their pages gathered by
        ``write_later`` while the server is idle)."""
        self.pool = pool
        self.write_mode = write
        self.disk = disk
        self.model_key = model_key
        self.tag = TAGS[pool.dtype]
        self.restore_mode = restore
        self.prefill_rate = prefill_rate
        self.read_rate: float | None = None  # seconds a page, restores' moving average
        self.skipped = 0  # fetches that computed what the disk held, being faster
        # (pump, namespace, tokens, pages' metadata, their arrays): gathers not yet written
        self._pending: list[tuple[int, Hashable, tuple[int, ...], list, list]] = []
        self._pending_keys: set[str] = set()  # their pages' hashes
        self._pumps = 0
        # Prompts whose pages are to be written when the server is idle (``write_later``),
        # from the tree if it still holds them: writes the full queue dropped, and in
        # ``idle`` mode every commit. Keyed by namespace and tokens (int32 bytes), oldest
        # first, with their count of tokens.
        self._later: dict[tuple[Hashable, bytes], int] = {}
        self._later_tokens = 0
        # A hybrid model's recurrent states (``save_states``): gathered, not yet written, as
        # (pump, key, its page's key, the page's depth, arrays); the snapshots already
        # stored; and whether a snapshot hung on the tree since the last look.
        self._pending_states: list[tuple[int, str, str, int, list]] = []
        self._states_saved: weakref.WeakSet[Snapshot] = weakref.WeakSet()
        self.states_due = False

    # -- hashes ----------------------------------------------------------------------

    def seed(self, namespace: Hashable) -> bytes:
        # Not memoized: one namespace a cache salt, and salts may be one a user (a hash
        # costs about a microsecond).
        base, extra = self.model_key, namespace
        if isinstance(base, tuple) and isinstance(namespace, tuple):
            if namespace[: len(base)] == base:
                extra = namespace[len(base) :]  # the identity covers the model itself
        elif namespace == base:
            extra = ()
        return chain_seed(extra)

    def hashes(self, namespace: Hashable, tokens: Sequence[int], n_pages: int) -> list[str]:
        return page_hashes(self.seed(namespace), tokens, n_pages, self.pool.page_size)

    # -- writes ----------------------------------------------------------------------

    def save(
        self,
        namespace: Hashable,
        tokens: Sequence[int],
        pages: Sequence[int],
        first: int,
        later: bool = False,
    ) -> int:
        """Queue the whole pages ``first..`` of ``tokens`` (held in ``pages``) that the disk
        lacks: gathered now, behind the pass that wrote them, written later; returns how
        many. Pages before ``first`` (the pool's hit) are marked used on disk too.
        ``later``: a write remembered for later (``write_later``), now due."""
        if not self.disk.enabled:
            return 0
        ps, page_bytes = self.pool.page_size, self.pool.bytes_per_page
        # A chain longer than the budget would evict its own start as it is written, and be
        # written again at each idle write: its pages past the budget's half stay off disk.
        n = min(len(tokens) // ps, len(pages), self.disk.chain_pages(page_bytes))
        if self.write_mode == "idle" and not later:
            if first:
                self.disk.touch(self.hashes(namespace, tokens, min(first, n)))
            if n > first:
                self._remember(namespace, tokens[: n * ps])
            return 0
        keys = self.hashes(namespace, tokens, n)
        self.disk.touch(keys[:first])
        todo = [
            i
            for i in range(first, n)
            if keys[i] not in self._pending_keys and not self.disk.has(keys[i])
        ]
        # No more than the write queue takes: a gather is a copy in device memory, outside
        # the pool's plan, and what the queue cannot take it drops (one idle write of 992
        # pages once gathered them all to queue 8). The rest is written when idle. An empty
        # queue takes one page whatever its size.
        pending = sum(len(p[3]) for p in self._pending) * page_bytes
        room = self.disk.room() - pending
        most = max(0, room // page_bytes)
        if not pending and self.disk.queue_empty():
            most = max(most, 1)
        if len(todo) > most:
            if not later:
                self.disk.count_dropped(len(todo) - most)
            self._remember(namespace, tokens[: (todo[-1] + 1) * ps])
            todo = todo[:most]
        if not todo:
            return 0
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
        if mx.default_device() != mx.cpu:
            # On a GPU the next write into the pool must wait for these reads (pool.settle);
            # on the CPU a stream's ops run in order and the gather lets go of its input.
            self.pool.reading()
        self._pending.append((self._pumps, namespace, tuple(tokens[: n * ps]), meta, arrays))
        self._pending_keys.update(m[0] for m in meta)
        return len(todo)

    def pump(self, everything: bool = False) -> None:
        """Hand the gathers that have run to the writer: those queued before the step that
        mlx-lm last waited for (or all of them, waiting, with ``everything``)."""
        self._pumps += 1
        if not self._pending and not self._pending_states:
            return
        ready, self._pending = self._due(self._pending, everything)
        ps = self.pool.page_size
        for _, namespace, prefix, meta, arrays in ready:
            mx.eval(arrays)  # a no-op unless ``everything``: they have run
            host = [np.asarray(a) for a in arrays]
            dropped = 0
            for j, (key, parent, depth, tokens) in enumerate(meta):
                tensors = {}
                for layer in range(self.pool.num_layers):
                    k, v = host[2 * layer], host[2 * layer + 1]
                    tensors[f"k.{layer}"] = (self.tag, k[j * ps : (j + 1) * ps])
                    tensors[f"v.{layer}"] = (self.tag, v[j * ps : (j + 1) * ps])
                if not self.disk.put(key, parent, depth, tokens, tensors):
                    dropped = depth + 1
                self._pending_keys.discard(key)
            if dropped and self.disk.enabled:
                self._remember(namespace, prefix[: dropped * ps])
        # After the pages: a state whose page is neither stored nor queued is not written.
        ready, self._pending_states = self._due(self._pending_states, everything)
        for _, key, page, depth, arrays in ready:
            mx.eval([a for _, a in arrays])
            tensors = {name: (TAGS[a.dtype], _host(a)) for name, a in arrays}
            self.disk.put(key, page, depth + 1, (), tensors, state=True)

    def _due(self, pending: list, everything: bool) -> tuple[list, list]:
        """``pending`` gathers (each led by the pump it was queued at) split into those that
        have run (queued before the step mlx-lm last waited for; all with ``everything``)
        and the rest."""
        ready, waiting = [], []
        for p in pending:
            (ready if everything or p[0] <= self._pumps - 2 else waiting).append(p)
        return ready, waiting

    def save_states(
        self, tree: RadixTree, snapshots: SnapshotStore, everything: bool = False
    ) -> int:
        """Queue the recurrent states hanging on ``tree``'s nodes at page ends whose page
        the disk holds or is about to, and that are not stored yet (only when ``states_due``,
        set as a snapshot hangs, unless ``everything``); returns how many. Gathered behind the
        step, written at a later ``pump``, after the pages."""
        if not (self.states_due or everything) or not self.disk.enabled:
            return 0
        self.states_due = False
        ps, queued = self.pool.page_size, 0
        for node in snapshots.nodes():
            if node.snapshot is None or node.snapshot in self._states_saved or tree.is_tail(node):
                continue  # (a tail's, a finished request's exact end: the disk holds whole pages)
            namespace, tokens = tree.path_of(node)
            page = self.hashes(namespace, tokens, len(tokens) // ps)[-1]
            if page not in self._pending_keys and not self.disk.has(page):
                continue  # its page is not on disk (yet): looked at again when one hangs
            self._states_saved.add(node.snapshot)
            key = state_key(page)
            arrays = self._state_arrays(node.snapshot)
            if self.disk.has(key) or arrays is None:
                continue
            mx.async_eval([a for _, a in arrays])
            depth = len(tokens) // ps - 1
            self._pending_states.append((self._pumps, key, page, depth, arrays))
            queued += 1
        return queued

    def _state_arrays(self, snapshot: Snapshot) -> list[tuple[str, mx.array]] | None:
        """A snapshot's arrays by name (``s.ENTRY.INDEX``), bfloat16 as its bits; None if
        one has a dtype the disk does not store."""
        out = []
        for e, arrays in zip(self.pool.recurrent, snapshot.arrays):
            for j, a in enumerate(arrays):
                if a is None:
                    continue
                if a.dtype not in TAGS:
                    return None
                out.append((f"s.{e}.{j}", a))
        return out

    def restore_state(
        self,
        tree: RadixTree,
        snapshots: SnapshotStore,
        namespace: Hashable,
        tokens: Sequence[int],
        match: MatchResult,
        deeper_than: int,
    ) -> int:
        """Read the deepest recurrent state on disk at a page end of ``match``, deeper than
        ``deeper_than`` (the deepest snapshot in memory the match runs through), and hang
        it on its node; returns its position (0: none read). A hybrid's fetch then resumes
        there, not at an earlier snapshot."""
        if not self.disk.enabled or not self.pool.recurrent or not self.disk.has_states:
            return 0
        ps = self.pool.page_size
        have, end = deeper_than // ps, match.length // ps
        if end <= have or not self.worth_reading():
            return 0
        keys = self.hashes(namespace, tokens, end)
        for k in range(end, have, -1):
            key = state_key(keys[k - 1])
            if key not in self.disk:
                continue
            began = time.perf_counter()
            snapshot = self._snapshot(self.disk.read(key, keys[k - 1], ()))
            if snapshot is None:
                continue
            holder = tree.node_ending_at(namespace, tokens[: k * ps])
            if holder is None or not snapshots.put(holder, snapshot, snapshot.nbytes):
                return 0
            self._states_saved.add(snapshot)
            self.disk.counters.restore_seconds += time.perf_counter() - began
            return k * ps
        return 0

    def _snapshot(self, read: dict | None) -> Snapshot | None:
        """The snapshot a state read back holds; None if it is not one of this model's."""
        if read is None:
            return None
        arrays, nbytes = [], 0
        for e in self.pool.recurrent:
            entry = []
            for j in range(self.pool.state_sizes[e]):
                tensor = read.get(f"s.{e}.{j}")
                if tensor is None:
                    entry.append(None)
                    continue
                tag, host = tensor
                if tag not in TAGS.values():
                    return None
                entry.append(self._array([host], tag))
                nbytes += host.nbytes
            arrays.append(tuple(entry))
        if not nbytes:
            return None
        return Snapshot(tuple(arrays), nbytes)

    def _remember(self, namespace: Hashable, tokens: Sequence[int]) -> None:
        """Remember to write the pages up to the end of ``tokens`` when idle: one entry a
        request, to its deepest page (``write_later`` writes every page before it the disk
        lacks; an entry a page held a copy of the prompt each, 2 million tokens for one of
        4,000). Past ``LATER_MOST_TOKENS`` the oldest are forgotten."""
        key = (namespace, np.asarray(tokens, dtype="<i4").tobytes())
        if key in self._later:
            return
        self._later[key] = len(tokens)
        self._later_tokens += len(tokens)
        while self._later_tokens > LATER_MOST_TOKENS and len(self._later) > 1:
            self._later_tokens -= self._later.pop(next(iter(self._later)))

    def _recall(self) -> tuple[Hashable, list[int]]:
        """The oldest prompt remembered for later, forgotten: pages are written in the
        order of their use, which is the disk's LRU order."""
        key = next(iter(self._later))
        namespace, data = key
        self._later_tokens -= self._later.pop(key)
        return namespace, np.frombuffer(data, dtype="<i4").tolist()

    def _forget_later(self) -> bool:
        """Forget every prompt remembered for later; whether there was one."""
        had = bool(self._later)
        self._later.clear()
        self._later_tokens = 0
        return had

    def write_later(self, tree: RadixTree) -> bool:
        """Queue the pages remembered for later that the tree still holds, as far as the
        queue has room (on the generation thread, while idle); whether any are left."""
        while self._later and self.disk.has_room():
            namespace, tokens = self._recall()
            # As far as the tree still holds it: eviction takes a prompt's own tail first.
            pages = tree.cached_pages(namespace, tokens, whole=False)
            mark = self._later_tokens
            queued = self.save(namespace, tokens, pages, 0, later=True) if pages else 0
            self.pump(everything=True)
            if not queued and self._later_tokens > mark:
                break  # put back, no room for it yet
        return bool(self._later)

    def save_tree(
        self, tree: RadixTree, deadline: float, snapshots: SnapshotStore | None = None
    ) -> int:
        """Queue every whole page of ``tree`` the disk lacks, and the recurrent states of
        ``snapshots`` at their ends, then write them all, until ``deadline``
        (``time.monotonic()``); returns the pages queued."""
        before = self.disk.counters.pages_written
        self.pump(everything=True)
        self._forget_later()  # the walk below covers them
        for namespace, tokens, pages in tree.sequences():
            # A sequence longer than the queue takes goes in parts, each once the writer
            # has made room for it.
            while time.monotonic() < deadline and self.disk.wait_for_room(deadline):
                queued = self.save(namespace, tokens, pages, 0, later=True)
                self.pump(everything=True)
                if not self._forget_later():
                    break  # all of it queued or stored
                if not queued and not self.disk.flush(max(0.0, deadline - time.monotonic())):
                    break  # a page larger than the queue's room: once it is empty
            if time.monotonic() > deadline or not self.disk.enabled:
                break
        if snapshots is not None and self.save_states(tree, snapshots, everything=True):
            self.pump(everything=True)
        self.disk.flush(max(0.0, deadline - time.monotonic()))
        return self.disk.counters.pages_written - before

    # -- reads -----------------------------------------------------------------------

    def measure_reads(self, pages: int = 8) -> None:
        """Time reading back up to ``pages`` pages the disk holds (the read rate's first
        figure, before any restore)."""
        keys = self.disk.sample(pages)
        if keys:
            began = time.perf_counter()
            read = [self.disk.read(k, *self.disk.chain_of(k)) for k in keys]
            arrays = [self._array([p[n][1]]) for p in read if p is not None for n in p]
            mx.eval(arrays)
            if len(arrays) == len(keys) * 2 * self.pool.num_layers:
                self.read_rate = (time.perf_counter() - began) / len(keys)

    def worth_reading(self) -> bool:
        """Whether reading pages back is (measured) faster than computing them."""
        if self.restore_mode == "on" or self.read_rate is None or self.prefill_rate is None:
            return True
        return self.read_rate < self.pool.page_size * self.prefill_rate

    def preload(self, tree: RadixTree, namespace: Hashable, limit: int) -> int:
        """Read the most recently used sequences of ``namespace`` (requests without a cache
        salt) from disk into the pool and the tree, up to ``limit`` tokens; returns the
        tokens read. Where reading is not worth it, nothing."""
        ps, seed, loaded = self.pool.page_size, self.seed(namespace), 0
        for key in self.disk.recent_leaves():
            if loaded + ps > limit or not self.worth_reading():
                break
            tokens = self.disk.chain_tokens(key)
            if not tokens:
                continue
            tokens = tokens[: (limit - loaded) // ps * ps]
            keys = page_hashes(seed, tokens, len(tokens) // ps, ps)
            if not keys or not self.disk.has(keys[0]):
                continue  # another namespace's (a salt's) chain
            match = tree.match_prefix(namespace, tokens)
            loaded += self.restore(tree, namespace, tokens, match, hit=False) * ps
        return loaded

    def restore(
        self,
        tree: RadixTree,
        namespace: Hashable,
        tokens: Sequence[int],
        match: MatchResult,
        hit: bool = True,
    ) -> int:
        """Read the pages that continue ``match`` from disk into the pool and the tree;
        returns how many. ``tokens`` are the ones that may be matched; ``hit``: a request's
        (counted in ``disk_hits``), not a preload's."""
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
        if not self.worth_reading():
            self.skipped += 1
            return 0
        began = time.perf_counter()
        chain = range(start, start + n)
        read = self.disk.read_chain(
            [keys[i] for i in chain],
            [keys[i - 1] if i else "" for i in chain],
            [tokens[i * ps : (i + 1) * ps] for i in chain],
        )
        fits = next((i for i, page in enumerate(read) if not self._fits(page)), len(read))
        read = read[:fits]
        if not read:
            return 0
        # What the match found (its node, and the page it continues into) must not be
        # evicted for the new pages: the fetch goes on with it if they do not come.
        held = [n for n in (match.node, match.partial_node) if n is not None]
        for node in held:
            tree.lock(node)
        try:
            pages = self.pool.alloc_pages(len(read))
        except OutOfPages:
            return 0
        finally:
            for node in held:
                tree.unlock(node)
        self.pool.settle()
        slots = self.pool.slots(page_slots(pages, ps))
        for layer in range(self.pool.num_layers):
            k, v = (self._array([p[f"{w}.{layer}"][1] for p in read]) for w in "kv")
            self.pool.write_rows(layer, slots, k, v)
        mx.eval(self.pool.arrays)
        upto = (start + len(read)) * ps
        inserted = tree.insert(namespace, list(tokens[:upto]), match.pages + pages)
        self.pool.allocator.decref(inserted.dropped)
        took = time.perf_counter() - began
        c = self.disk.counters
        c.hits += hit
        c.pages_read += len(read)
        c.restore_seconds += took
        rate = took / len(read)
        w = READ_RATE_WEIGHT
        self.read_rate = rate if self.read_rate is None else (1 - w) * self.read_rate + w * rate
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

    def _array(self, parts: list[np.ndarray], tag: str | None = None) -> mx.array:
        """``parts`` read back as one array of dtype ``tag`` (default: the K/V's)."""
        x = mx.array(np.concatenate(parts) if len(parts) > 1 else parts[0])
        return x.view(mx.bfloat16) if (tag or self.tag) == "BF16" else x
