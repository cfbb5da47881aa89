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

What the layers of one forward pass share is built once, by its first layer, in a
``BatchedDecodeContext``: the slots of the new tokens, which of the batch's tokens
are real rather than padding, and the batch's new offsets. A decode pass stages
each layer's new K/V and writes them all after the last layer, one scatter per pool
array. On an H200 (Llama-3.2-1B's shape, bf16, 8 requests, in process against
mlx-lm's ``BatchGenerator``) that took the engine from 0.89x of stock, with two
scatters and an offset add per layer, to level: 0.97x and 1.22x in two runs of 4
rounds, 1.02x at one request, 1.11x on Llama-3-8B's shape at 8.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from ..memory.allocator import OutOfPages
from ..memory.cache_list import flat
from ..memory.pool import KVPool
from ..memory.slots import Slots
from .page_table import PageTable

log = logging.getLogger("mlx_radix")


class BatchedDecodeContext:
    """One forward pass of a batch: what its layers share, built by the first layer.

    - ``write_slots``/``take``: where the pass's new tokens go in the pool, and which
      of the flattened (batch x step) tokens are real rather than padding;
    - ``offset``: the batch's positions after the pass, one array for every layer
      (mlx-lm's ``BatchKVCache`` adds to each layer's offset separately);
    - a decode pass's new K/V, staged layer by layer and written to the pool after
      the last layer, one scatter per pool array (``KVPool.write_layers``).
    """

    def __init__(
        self,
        tables: list[PageTable],
        lengths: list[int],
        valid: list[int],
        step: int,
        staged: bool = False,
    ):
        """``staged``: a prompt pass's K/V are staged too, and written after its last layer
        (a pass that reads the pool: ``paged_batch.py``)."""
        self.step = step
        self.staged = staged or step == 1
        self.calls = 0  # layers that have run this pass
        self.pending_bytes = 0  # temporaries of its layers not yet evaluated (paged_batch.py)
        # A prompt pass's shape, path and pieces, where a working set measures it.
        self.report: dict | None = None
        self.offset: mx.array | None = None
        self.keys: dict[int, mx.array] = {}
        self.values: dict[int, mx.array] = {}
        self.valid = list(valid)  # tokens of each row written to the pool this pass
        slots, take = [], []
        ps = tables[0].pool.page_size if tables else 0
        if step == 1 and valid.count(1) == len(valid):
            # The usual decode step: each row's token in a page of its own that it holds
            # already (a released table holds none), its slot read inline. 32 rows on 2 CPU
            # cores: this setup 29 us of the host's time a step, 35 through the general loop
            # (a call a row to ``PageTable.slot``).
            for table, start in zip(tables, lengths):
                pages = table.pages
                if table.overflowed or not table.shared_tokens <= start < len(pages) * ps:
                    slots = None
                    break
                slots.append(pages[start // ps] * ps + start % ps)
            if slots is not None:
                self.any, self.take = bool(slots), None
                self.write_slots = tables[0].pool.slots(slots) if slots else None
                return
            slots = []
        for row, (table, start, n) in enumerate(zip(tables, lengths, valid)):
            if n == 0 or table.overflowed:
                self.valid[row] = 0
                continue
            # A decode step's token in a page of the row's own that it holds already (a
            # released table holds none) has nothing to prepare. The usual step, row by row:
            # 32 rows on 2 CPU cores took 0.11 ms of the host's time a step through
            # ``prepare_write`` (mean of 300 steps), 0.08 ms without it.
            owned = step == 1 and table.shared_tokens <= start < len(table.pages) * ps
            if not owned:
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
            if step == 1:
                slots.append(table.slot(start))
                take.append(row)
            else:
                slots.append(table.host_slots(start, start + n))
                take.extend(range(row * step, row * step + n))
        self.any = bool(slots)
        self.write_slots = None
        if slots:
            # Decode: one small array from Python ints, not a slice per row and a concat.
            host = slots if step == 1 else np.concatenate(slots)
            self.write_slots = tables[0].pool.slots(host)
        # Rows of the flattened (batch x step) tokens that are real; None when all are.
        self.take = None if len(take) == len(tables) * step else mx.array(take, dtype=mx.int32)

    def write(self, pool: KVPool, layer: int, keys: mx.array, values: mx.array) -> None:
        """This layer's new K/V into the pool: staged when decoding (or asked to), written
        now otherwise."""
        if self.staged:
            if self.step > 1:  # as (row, token) rows of (heads, dim), as write_layers reads
                keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
            self.keys[layer], self.values[layer] = keys, values
            return
        B, H, S, _ = keys.shape
        k, v = (x.transpose(0, 2, 1, 3).reshape(B * S, H, -1) for x in (keys, values))
        if self.take is not None:
            k, v = k[self.take], v[self.take]
        pool.write_rows(layer, self.write_slots, k, v)

    def flush(self, pool: KVPool, in_place: bool = False) -> None:
        """Write the staged K/V of every layer (``in_place``: see ``KVPool.write_layers``)."""
        if self.keys:
            pool.write_layers(
                self.write_slots, self.keys, self.values, rows=self.take, in_place=in_place
            )


def pass_bytes(
    pool: KVPool, layer: int, rows: int, queries: int, columns: int, fused: bool = False
) -> int:
    """A prompt pass's temporaries in ``layer`` beyond its K/V's layout (``rows`` x
    ``queries`` over ``columns``): its attention's, and the tokens' activations and staged
    K/V (``KVPool.prefill_token_bytes``).

    The attention holds two float32 copies of the scores (within the attention's share
    where it has one: engine/prompt_attention.py), or, through cuDNN's causal call
    (``fused``: a pass over the pool, ``KVPool.prompt_attention_fused``), no scores but the
    rows' K/V copied twice at most (``rolled``). Counting the share there split an H100's
    passes of 8 agents' 1,089-token turns over 28,000-30,000 columns in two (``query_step``):
    turns 3-6 took 0.88-1.25 s a pass, 0.77-0.83 s whole (docs/benchmarking.md, "Prompt
    attention in blocks")."""
    if fused:
        attention = 2 * rows * columns * pool.specs[layer].bytes_per_token(pool.dtype)
    else:
        heads = pool.query_heads or pool.specs[layer].kv_heads
        attention = 2 * rows * heads * queries * columns * 4
        if pool.attention_bound is not None:
            attention = min(attention, pool.attention_bound)
    return attention + rows * queries * pool.prefill_token_bytes


_SERIALS = itertools.count()


class BatchRows:
    """The requests of one batch, in batch order; shared by every layer's batch cache."""

    def __init__(self, pool: KVPool, tables: list[PageTable], lengths: list[int]):
        self.pool = pool
        self.tables = tables
        self._join(tables)
        self.lengths = lengths  # tokens of each row whose K/V are in the pool
        self.prompt_lengths: list[int] | None = None  # real tokens in a right-padded prompt
        self.processed = 0
        self.num_layers = pool.num_layers
        self.ctx: BatchedDecodeContext | None = None  # of the forward pass under way
        self.merged: list = []  # layers merged so far, while mlx-lm merges layer by layer
        self._aligned: tuple[tuple, Slots] | None = None
        self._op_calls = 0
        # Shared-prefix decode (shared_batch.py): its groups and own slots, kept until rows
        # join or leave, and the pass under way.
        self.shared = None
        self.shared_pass = None
        self.grouped_pass = None  # a prompt pass whose rows share a prefix (grouped_prefill.py)
        self.causal_mask = None  # the last plain causal mask a paged prompt pass made
        self.version = 0  # bumped when rows join or leave
        self.committed = -1  # the version whose rows have all committed their prompts
        self.serial = next(_SERIALS)  # this batch's, never reused (an id() can be)
        self.resized = 0  # bumped when a layer's batch buffer is replaced (grown, trimmed)
        # (left padding array, whether a row is padded), as the first layer's mask last read it
        self.padded: tuple[mx.array, bool] | None = None

    def aligned_slots(self, lengths: list[int], width: int) -> Slots:
        """Slots of each row's first ``lengths`` tokens, right-aligned in ``width`` columns:
        the batch buffer's layout, its padding on the left. Built once for a layout (a
        copy-in's, or a pass's: every layer reads it).

        Padding names a slot of the batch (the left-padding mask hides it), so that it
        touches no chunk the rows do not."""
        # Rows that join or leave (``version``) can leave the same lengths with other pages.
        key = (self.version, tuple(lengths), width, tuple(t.changes for t in self.tables))
        if self._aligned is None or self._aligned[0] != key:
            parts = [t.host_slots(0, n) for t, n in zip(self.tables, lengths)]
            pad = next((p[0] for p in parts if p.size), 0)
            host = np.concatenate(
                [np.concatenate([np.full(width - p.size, pad), p]) for p in parts]
            )
            self._aligned = (key, self.pool.slots(host))
        return self._aligned[1]

    def begin(self, step: int, staged: bool = False) -> BatchedDecodeContext:
        """The context of a forward pass of ``step`` tokens per row; its first layer calls this."""
        if self.prompt_lengths is None:
            valid = [step] * len(self.tables)
        else:
            valid = [max(0, min(step, n - self.processed)) for n in self.prompt_lengths]
        self.ctx = BatchedDecodeContext(self.tables, self.lengths, valid, step, staged)
        return self.ctx

    def end(self, in_place: bool = False) -> None:
        """After the pass's last layer: the staged writes (``in_place``: a shared decode
        pass's, whose launch takes them), then who holds what."""
        ctx, self.ctx = self.ctx, None
        if ctx.any:
            ctx.flush(self.pool, in_place)
        self.lengths = [n + v for n, v in zip(self.lengths, ctx.valid)]
        for table, n in zip(self.tables, self.lengths):
            table.written = n
        if self.prompt_lengths is not None:
            self.processed += ctx.step

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
        self.shared = None
        self.version += 1

    def extend(self, other: BatchRows) -> None:
        self.tables = self.tables + other.tables
        self.lengths = self.lengths + other.lengths
        self._join(other.tables)
        self.shared = None
        self.version += 1

    def _join(self, tables: list[PageTable]) -> None:
        for t in tables:
            t.batches.add(self)

    def __deepcopy__(self, memo) -> BatchRows:
        # mlx-lm copies a prompt batch to split it; the copy addresses the same pages.
        rows = BatchRows(self.pool, list(self.tables), list(self.lengths))
        rows.prompt_lengths = None if self.prompt_lengths is None else list(self.prompt_lengths)
        rows.processed = self.processed
        return rows


def rows_of(caches: list) -> BatchRows | None:
    """The rows behind a batch's caches, if they are the pool's (either kind of batch);
    a hybrid model's recurrent layers come first in some models, and have none."""
    for c in flat(caches):
        rows = getattr(c, "rows", None)
        if rows is not None:
            return rows if isinstance(rows, BatchRows) else None
    return None


# Layers of one merge share one BatchRows: mlx-lm merges a batch layer by layer.
_merging: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _rows_for(caches: list) -> BatchRows:
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
    def from_pool_caches(cls, caches: list):
        # Copy-in: the batch buffer gets each request's cached K/V once, at admission.
        batch = cls.__new__(cls)
        rows = _rows_for(caches)
        batch.__dict__.update(cls._merged(caches, rows).__dict__)
        batch.layer = caches[0].layer
        batch.rows = rows
        # What extract() hands back: the view type merged here (pool_backed.py imports
        # this module, so it is not imported back).
        batch.view = type(caches[0])
        # Evaluated when the last layer is merged, all layers together: one sync per
        # admission, not one per layer (on an H200, a 4,096-token hit on Llama-3-8B's
        # shape spends 7 ms here). It must run before the next write to the pool,
        # which would otherwise copy a whole pool array to keep the gather's input.
        rows.pool.hold_outside(batch)
        rows.merged.append(batch)
        if len(rows.merged) == rows.num_layers:
            rows.pool.settle()
            mx.eval([c.state for c in rows.merged])
            rows.merged = []
        return batch

    def __setstate__(self, state):
        # mlx-lm splits a prompt batch by deep-copying it: the copy has a buffer of its own.
        self.__dict__.update(state)
        self.rows.pool.hold_outside(self)

    @property
    def buffer_nbytes(self) -> int:
        """The batch buffer: a copy of every row's K/V, outside the pool."""
        return self.nbytes

    def update_and_fetch(self, keys, values):
        rows = self.rows
        ctx = rows.ctx
        if ctx is None:
            ctx = rows.begin(keys.shape[2])
            if ctx.step > 1 and rows.pool.working_set is not None:
                self._begin_pass(ctx)
        if ctx.any:
            ctx.write(rows.pool, self.layer, keys, values)
        fetched = self._update(keys, values, ctx)
        ctx.calls += 1
        if ctx.calls == rows.num_layers:
            rows.end()
        return fetched

    def _update(self, keys, values, ctx: BatchedDecodeContext):
        before = self.keys
        fetched = super().update_and_fetch(keys, values)
        if self.keys is not before:  # a new buffer: grown, or (rotating) trimmed
            self.rows.resized += 1
        return fetched

    def _begin_pass(self, ctx: BatchedDecodeContext) -> None:
        """A prompt pass over the buffer, measured as the pool's passes are (paged_batch.py):
        its estimate is its scores' and tokens', the buffer being held already."""
        rows, pool = len(self.rows.tables), self.rows.pool
        columns = self._idx + ctx.step
        ctx.report = {
            "path": "buffer",
            "rows": rows,
            "queries": ctx.step,
            "columns": columns,
            "layer_bytes": pass_bytes(pool, self.layer, rows, ctx.step, columns),
            "evaluations": 0,
        }
        pool.working_set.begin_pass(ctx.report)

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
        return self.view(self.rows.tables[idx], self.layer, offset=self.rows.lengths[idx])

    @classmethod
    def _merged(cls, caches: list, rows: BatchRows):
        return cls.stock.merge([c.to_mlx_cache() for c in caches])


class PoolBatchKVCache(_PoolWrites, BatchKVCache):
    stock = BatchKVCache

    def _update(self, keys, values, ctx: BatchedDecodeContext):
        """mlx-lm's ``BatchKVCache.update_and_fetch``, with the batch's offsets added once
        per pass and shared by every layer, instead of once per layer."""
        prev, S = self._idx, keys.shape[2]
        if self.keys is None or prev + S > self.keys.shape[2]:
            fetched = BatchKVCache.update_and_fetch(self, keys, values)  # grows the buffer
            self.rows.resized += 1
            if ctx.offset is None:
                ctx.offset = self.offset
            self.offset = ctx.offset
            return fetched
        if ctx.offset is None:
            ctx.offset = self.offset + S
        self.offset = ctx.offset
        self._idx = prev + S
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """Stock's mask; or none, where ``decode.attention`` allows, for one new token a row
        when no row is padded: each row then attends to every key, which stock's mask (all
        true) says at the cost of building it and of attending with it. On CUDA an array
        mask takes MLX's composed attention (two matmuls, a softmax, a select), where one
        query with no mask is one kernel; on the CPU both are the composed one, bitwise."""
        if (
            N == 1
            and not return_array
            and kwargs.get("window_size") is None
            and self.rows.pool.unmasked_decode
            and not self._padded()
        ):
            return None
        return super().make_mask(N, return_array=return_array, **kwargs)

    def _padded(self) -> bool:
        """Whether a row has left padding: read once for each padding array (rows joining,
        leaving or prefilling make a new one)."""
        padding, seen = self.left_padding, self.rows.padded
        if seen is None or seen[0] is not padding:
            seen = self.rows.padded = (padding, padding.max().item() > 0)
        return seen[1]

    @classmethod
    def _merged(cls, caches: list, rows: BatchRows) -> BatchKVCache:
        """mlx-lm's left-padded batch layout, gathered from the pages in one go per layer.

        (Stock ``merge`` of per-request copies costs three passes over the K/V; this
        is one.) The buffer already has the room mlx-lm would grow it to for the rest of
        the rows' prompts (or their first decode step): growing it there concatenates a
        new buffer to the old one, a second copy of every row's context at once (in a
        burst of 7 requests on a cached 1,024-token prefix, SmolLM2's shape, 330 MB).
        """
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        if longest == 0:
            return BatchKVCache([0] * len(caches))
        pad = [longest - n for n in lengths]
        slots = rows.aligned_slots(lengths, longest)
        pool, layer = caches[0].table.pool, caches[0].layer
        B, H = len(caches), pool.specs[layer].kv_heads
        batch = BatchKVCache(pad)
        rest = max(1, max(len(c.table.tokens or ()) - c.offset for c in caches))
        capacity = longest + -(-rest // batch.step) * batch.step

        def layout(x):
            room = mx.zeros((B, H, capacity - longest, x.shape[-1]), x.dtype)
            return mx.concatenate([x.reshape(B, longest, H, -1).transpose(0, 2, 1, 3), room], 2)

        batch.keys, batch.values = (layout(x) for x in pool.rows(layer, slots))
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch


class PoolBatchRotatingKVCache(_PoolWrites, BatchRotatingKVCache):
    stock = BatchRotatingKVCache
