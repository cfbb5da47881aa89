"""Batch caches over the pool: mlx-lm's batch caches plus one write per token into pool pages.

Layout, chosen by measurement (DESIGN.md principle 2). On 2 CPU cores, for one
decode step of 8 requests x 600 tokens of context in a 30-layer, 3-KV-head model
(SmolLM2-135M's shape), float32:

- gather every request's K/V from its pages each step: 1.8 ms per layer (the
  gather is cheap, 0.3 ms; laying it out as (batch, heads, tokens, dim) for
  attention is not), 54 ms per step, as much again as the model's own compute;
- a persistent batch buffer, filled from the pages once when a request joins
  (mlx-lm's ``BatchKVCache``, whose join/leave copies measure 107 ms per 2,000
  tokens x 8 layers): nothing per step beyond the one-token writes.

So decode reads a batch buffer, exactly as stock mlx-lm does (same kernels, same
masks, same numerics), and each token's K/V is also written once, in the same
step, into the page of the pool that will hold it: the pool is the truth the
radix tree commits from, the buffer is a read copy of the running batch that is
never written back. Nothing is synchronised lazily.

The per-step derived tensors of the pool writes (slots of the new tokens, which
of the batch's tokens are real rather than padding) are built once per forward
pass in a ``BatchedDecodeContext`` and read by every layer.
"""

from __future__ import annotations

import logging
import weakref

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from .allocator import OutOfPages
from .caches import PageTable, PoolBackedCache
from .pool import KVPool

log = logging.getLogger("mlx_radix")


class BatchedDecodeContext:
    """What every layer needs to write one forward pass's new K/V into the pool."""

    built = 0  # how many were ever built: tests check it is one per forward, not per layer

    def __init__(self, tables: list[PageTable], lengths: list[int], valid: list[int], step: int):
        BatchedDecodeContext.built += 1
        self.step = step
        self.valid = list(valid)  # tokens of each row written to the pool this pass
        slots, take = [], []
        for row, (table, start, n) in enumerate(zip(tables, lengths, valid)):
            if n == 0 or table.overflowed:
                self.valid[row] = 0
                continue
            try:
                table.prepare_write(start, start + n)
            except OutOfPages:
                # Every page is held by running requests. This request goes on from the
                # batch buffer, which holds all it attends to; only the pool stops
                # receiving its tokens, so what is committed later is what was written.
                # (Raising here would end mlx_lm.server's generation thread.)
                log.warning("KV pool full: request stops caching at %d tokens", start)
                table.overflowed = True
                self.valid[row] = 0
                continue
            slots.append(table.slot(start) if step == 1 else table.slots(start, start + n))
            take.extend(range(row * step, row * step + n))
        self.any = bool(slots)
        if step == 1:
            # Decode: one small array from Python ints, not a slice per row and a concat.
            self.write_slots = mx.array(slots, dtype=mx.int32) if slots else None
        else:
            self.write_slots = mx.concatenate(slots) if len(slots) > 1 else (slots or [None])[0]
        # Rows of the flattened (batch x step) tokens that are real; None when all are.
        self.take = None if len(take) == len(tables) * step else mx.array(take, dtype=mx.int32)


class BatchRows:
    """The requests of one batch, in batch order; shared by every layer's batch cache."""

    def __init__(self, pool: KVPool, tables: list[PageTable], lengths: list[int]):
        self.pool = pool
        self.tables = tables
        self._join(tables)
        self.lengths = lengths  # tokens of each row whose K/V are in the pool
        self.prompt_lengths: list[int] | None = None  # real tokens in a right-padded prompt
        self.processed = 0
        self._ctx: BatchedDecodeContext | None = None
        self._copy_in: tuple[tuple[int, ...], mx.array] | None = None
        self._calls = 0
        self._op_calls = 0

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    def copy_in_slots(self, lengths: list[int]) -> mx.array:
        """Slots of every row's cached tokens, left-padded to the longest; built once.

        Padding points at slot 0: the left-padding mask hides it.
        """
        key = tuple(lengths)
        if self._copy_in is None or self._copy_in[0] != key:
            longest = max(lengths)
            parts = []
            for table, n in zip(self.tables, lengths):
                if longest - n:
                    parts.append(mx.zeros((longest - n,), mx.int32))
                parts.append(table.slots(0, n))
            self._copy_in = (key, mx.concatenate(parts))
        return self._copy_in[1]

    def context(self, step: int) -> BatchedDecodeContext:
        """This forward pass's context: built by its first layer, dropped after its last."""
        if self._ctx is None:
            if self.prompt_lengths is None:
                valid = [step] * len(self.tables)
            else:
                valid = [max(0, min(step, n - self.processed)) for n in self.prompt_lengths]
            self._ctx = BatchedDecodeContext(self.tables, self.lengths, valid, step)
        ctx = self._ctx
        self._calls += 1
        if self._calls == self.num_layers:
            for i, n in enumerate(ctx.valid):
                self.lengths[i] += n
                self.tables[i].written = self.lengths[i]
            if self.prompt_lengths is not None:
                self.processed += step
            self._ctx, self._calls = None, 0
        return ctx

    def once(self, fn) -> None:
        """Run ``fn`` for the first of the per-layer calls of one batch operation."""
        if self._op_calls == 0:
            fn()
        self._op_calls = (self._op_calls + 1) % self.num_layers

    def prepare(self, lengths) -> None:
        self.prompt_lengths, self.processed = list(lengths), 0

    def finalize(self) -> None:
        self.prompt_lengths, self.processed = None, 0

    def filter(self, keep: list[int]) -> None:
        self.tables = [self.tables[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]

    def extend(self, other: BatchRows) -> None:
        self.tables = self.tables + other.tables
        self.lengths = self.lengths + other.lengths
        self._join(other.tables)

    def _join(self, tables: list[PageTable]) -> None:
        for t in tables:
            t.batches.add(self)

    def __deepcopy__(self, memo) -> BatchRows:
        # mlx-lm copies a prompt batch to split it; the copy addresses the same pages.
        rows = BatchRows(self.pool, list(self.tables), list(self.lengths))
        rows.prompt_lengths = None if self.prompt_lengths is None else list(self.prompt_lengths)
        rows.processed = self.processed
        return rows


# Layers of one merge share one BatchRows: mlx-lm merges a batch layer by layer.
_merging: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _rows_for(caches: list[PoolBackedCache]) -> BatchRows:
    key = tuple(id(c.table) for c in caches)
    rows = _merging.get(key)
    if rows is None or rows.tables != [c.table for c in caches]:
        rows = BatchRows(
            caches[0].table.pool, [c.table for c in caches], [c.offset for c in caches]
        )
        _merging[key] = rows
    return rows


class _PoolWrites:
    """Mixed into mlx-lm's batch caches: every new token is also written to its page."""

    rows: BatchRows
    layer: int
    stock: type  # the mlx-lm batch cache this extends

    @classmethod
    def from_pool_caches(cls, caches: list[PoolBackedCache]):
        # Copy-in: the batch buffer gets each request's cached K/V once, at admission.
        batch = cls.__new__(cls)
        rows = _rows_for(caches)
        batch.__dict__.update(cls._merged(caches, rows).__dict__)
        batch.layer = caches[0].layer
        batch.rows = rows
        # Left lazy: the engine evaluates every layer's copy-in in one go right after
        # the merge (RadixBatchGenerator._make_batch), before any write to the pool.
        return batch

    def update_and_fetch(self, keys, values):
        ctx = self.rows.context(keys.shape[2])
        if ctx.any:
            B, H, S, _ = keys.shape
            if S == 1:  # decode: (B, H, 1, D) is already (B, H, D) in memory
                k, v = keys.reshape(B, H, -1), values.reshape(B, H, -1)
            else:
                k, v = (x.transpose(0, 2, 1, 3).reshape(B * S, H, -1) for x in (keys, values))
            if ctx.take is not None:
                k, v = k[ctx.take], v[ctx.take]
            pool = self.rows.pool
            pool.keys[self.layer][ctx.write_slots] = k
            pool.values[self.layer][ctx.write_slots] = v
        return super().update_and_fetch(keys, values)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if right_padding is not None and max(right_padding) > 0:
            self.rows.prepare(lengths)

    def finalize(self):
        super().finalize()
        self.rows.finalize()

    def filter(self, batch_indices):
        super().filter(batch_indices)
        keep = list(batch_indices)
        self.rows.once(lambda: self.rows.filter(keep))

    def extend(self, other):
        super().extend(other)
        self.rows.once(lambda: self.rows.extend(other.rows))
        other.rows = self.rows

    def extract(self, idx):
        """The request's caches as views of its pages: committed without a copy."""
        return PoolBackedCache(self.rows.tables[idx], self.layer, offset=self.rows.lengths[idx])

    @classmethod
    def _merged(cls, caches: list[PoolBackedCache], rows: BatchRows):
        return cls.stock.merge([c.to_mlx_cache() for c in caches])


class PoolBatchKVCache(_PoolWrites, BatchKVCache):
    stock = BatchKVCache

    @classmethod
    def _merged(cls, caches: list[PoolBackedCache], rows: BatchRows) -> BatchKVCache:
        """mlx-lm's left-padded batch layout, gathered from the pages in one go per layer.

        (Stock ``merge`` of per-request copies costs three passes over the K/V; this
        is one.)
        """
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        if longest == 0:
            return BatchKVCache([0] * len(caches))
        pad = [longest - n for n in lengths]
        slots = rows.copy_in_slots(lengths)
        pool, layer = caches[0].table.pool, caches[0].layer
        B, H = len(caches), pool.specs[layer].kv_heads

        def gather(arr):
            rows = arr[slots].reshape(B, longest, H, -1)
            return mx.contiguous(rows.transpose(0, 2, 1, 3))

        batch = BatchKVCache(pad)
        batch.keys, batch.values = gather(pool.keys[layer]), gather(pool.values[layer])
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch


class PoolBatchRotatingKVCache(_PoolWrites, BatchRotatingKVCache):
    stock = BatchRotatingKVCache
