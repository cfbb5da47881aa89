"""A prompt batch that reads cached K/V from the pool, layer by layer: no batch buffer.

mlx-lm prefills a batch in a left-padded buffer holding every row's whole context, for
every layer at once: N requests admitted on one cached P-token prefix hold N copies of it
(``batch.py`` fills that buffer from the pool) until their prompts are done, and moving
them to the decode batch copies it again. Here a layer's attention gets the same keys and
values, in the same layout, gathered from the pool when the layer runs: one layer's
context at a time, freed once its attention has read it, so what a prefill holds outside
the pool is one layer's gather, not every layer's.

The attention's inputs are the buffer's at every column a real token's query sees (the
padding columns name a slot of the batch and are masked as stock masks them), laid out as
the buffer is: a view of the first columns of an array as wide as the buffer would have
grown (mlx-lm's growth rule, kept here as ``_capacity``). So its kernels give stock's
outputs bitwise; a contiguous array of only the columns in use did not, with OpenBLAS, whose
matrix products round by their operands' strides (one request of the bench's multi-turn
workload on a tiny model answered differently). A pass reads the pool
before it writes to it: each layer's new K/V are staged and written after the last layer
(a write evaluated while a read of the same array is pending copies the whole array:
``memory/pool.py``), and ``state``, which mlx-lm evaluates after every chunk, is the
staged K/V, so that evaluation runs the reads and leaves the writes to the next pass.

Only full-attention layers (a sliding window's rotating buffer has a layout of its own)
and rows whose prompt pages are reserved (an overflowed row's K/V are not all in the pool)
take this path (``engine/prefill_path.py`` decides). When rows move to decoding, the decode
path gives them its own caches (``engine/decode_path.py``).
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache

from .batch import BatchRows, PoolBatchKVCache, _rows_for, pass_bytes
from .grouped_prefill import GroupedPass

STEP = BatchKVCache.step  # columns the buffer grows by
# The fewest queries ``query_step`` lets a pass take, whatever the bound: each pass reads
# every weight once, and gathers every layer's context again.
MIN_QUERY_STEP = 64


class PagedBatchKVCache:
    """One layer of a prompt batch over the pool: mlx-lm's ``BatchKVCache`` bookkeeping
    (left padding, offsets, columns) without its buffer."""

    def __init__(self, rows: BatchRows, layer: int, view: type, left_padding: list[int]):
        self.rows = rows
        self.layer = layer
        self.view = view  # what extract() hands back (a PoolBackedCache)
        longest = max(rows.lengths, default=0)
        self._set_padding(list(left_padding))
        self.offset = mx.array([longest - p for p in left_padding])
        self._idx = longest  # stock's buffer columns in use
        # Its columns (``PoolBatchKVCache._merged``: room for the rest of the prompt).
        rest = max(1, max((len(t.tokens or ()) - n for t, n in zip(rows.tables, rows.lengths))))
        self._capacity = longest + -(-rest // STEP) * STEP if longest else 0
        self._right_padding: list[int] | None = None
        # This layer's K/V of the last pass, what ``state`` evaluates. A pipelined model
        # (``--pipeline``) ties its send to the last layer's cache, ``cache[-1].keys =
        # mx.depends(cache[-1].keys, h)``: evaluating ``state`` then runs it.
        self.keys: mx.array | None = None
        self._values: mx.array | None = None
        # In a pass whose rows share a prefix (``grouped_prefill.py``): the pass and this
        # layer's gathered columns, which the patched attention reads; None otherwise.
        self.grouped: tuple | None = None

    @classmethod
    def from_pool_caches(cls, caches: list) -> PagedBatchKVCache:
        rows = _rows_for(caches)
        longest = max(c.offset for c in caches)
        return cls(rows, caches[0].layer, type(caches[0]), [longest - c.offset for c in caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        rows = self.rows
        prev, S = self._idx, keys.shape[2]
        self._grow(prev + S)
        ctx = rows.ctx
        if ctx is None:
            ctx = rows.begin(S, staged=True)
            rows.grouped_pass = None
            if rows.pool.prefill_shared != "off":
                rows.grouped_pass = GroupedPass.plan(
                    rows.pool,
                    rows.tables,
                    rows.lengths,
                    S,
                    lambda: sum(self._layer_bytes(S, prev + S, i) for i in range(rows.num_layers)),
                )
        grouped = rows.grouped_pass
        if grouped is None:
            need = self._layer_bytes(S, prev + S)
        else:
            need = grouped.layer_bytes(self.layer)
        if ctx.calls == 0:
            path = "per_row" if grouped is None else "grouped"
            rows.pool.prefill_passes[path] += 1
            if rows.pool.working_set is not None:
                # What the working set reports of the pass, if it held the most.
                ctx.report = {
                    "path": path,
                    "rows": len(rows.tables),
                    "queries": S,
                    "columns": prev + S,
                    "layer_bytes": need,
                    "evaluations": 0,
                }
                rows.pool.working_set.begin_pass(ctx.report)
        self._idx = prev + S
        # The pool is read before this pass's writes are queued (see the module's notes).
        self._bound(ctx, keys, values, need)
        if grouped is not None:
            self.grouped = (grouped, grouped.gather(self.layer, keys.shape[1]))
            laid_out = (keys, values)
        else:
            self.grouped = None
            context = self._context(prev) if prev else (None, None)
            laid_out = [x[..., : prev + S, :] for x in self._laid_out(context, (keys, values))]
        if ctx.any:
            ctx.write(rows.pool, self.layer, keys, values)
        # The batch's offsets moved once a pass, shared by every layer (as PoolBatchKVCache).
        if ctx.offset is None:
            ctx.offset = self.offset + S
        self.offset = ctx.offset
        self.keys, self._values = keys, values
        ctx.calls += 1
        if ctx.calls == rows.num_layers:
            rows.end()
            rows.grouped_pass = None  # each layer's cache holds it until its attention ran
            # Its writes go to the pool once the reads are done (KVPool.settle).
            rows.pool.reading()
        return laid_out[0], laid_out[1]

    def _bound(self, ctx, keys: mx.array, values: mx.array, need: int) -> None:
        """Evaluate the layers before this one when their temporaries and this layer's would
        pass the pool's ``prefill_working_bytes``.

        A backend that runs a graph asynchronously (CUDA, Metal) frees a layer's
        temporaries only once the work holding them has run, so a pass evaluated whole
        holds several layers' at once: on the H200, 8 rows on a cached 1,024-token prefix
        of a 12-layer tiny model peaked at 47 MB over the pool, about 7 layers' gathers
        and scores, where the CPU, which frees each as it goes, held one (6.4 MB). This
        layer's new K/V depend on every layer before it: evaluating them runs those."""
        budget = self.rows.pool.prefill_working_bytes
        if budget is None:
            return
        if ctx.pending_bytes and ctx.pending_bytes + need > budget:
            mx.eval(keys, values)
            ctx.pending_bytes = 0
            if ctx.report is not None:
                ctx.report["evaluations"] += 1
        ctx.pending_bytes += need

    def query_step(self, longest: int) -> int | None:
        """The most queries a pass may take so that one layer's temporaries (``_bound``'s
        estimate) stay under the pool's ``prefill_working_bytes``, for a prompt whose rows
        add at most ``longest`` tokens; None where no bound applies or all fit.

        ``_bound`` can evaluate the layers before one, not split it: a single layer's
        float32 scores grow with rows x queries x columns. On the H200 (8B), a pass of 32
        rows' 1,024-token suffixes over 9,000-14,000 cached tokens held 26.5 GB of live
        arrays beyond the model and the pool, against an 8.6 GB working set."""
        budget = self.rows.pool.prefill_working_bytes
        if budget is None or not longest:
            return None
        columns = max(self._capacity, self._idx + longest)
        pool, rows = self.rows.pool, len(self.rows.tables)
        fused = all(pool.prompt_attention_fused.get(i, False) for i in range(pool.num_layers))
        if pool.attention_bound is not None and not fused:
            # Attention within its share whatever the queries: they cost their tokens only.
            fixed = self._layer_bytes(0, columns) + pool.attention_bound
            step = (budget - fixed) // max(1, rows * pool.prefill_token_bytes)
        else:
            fixed = self._layer_bytes(0, columns)
            step = (budget - fixed) // (self._layer_bytes(1, columns) - fixed)
        if step >= longest:
            return None
        return max(MIN_QUERY_STEP, step)

    def _layer_bytes(self, queries: int, columns: int, layer: int | None = None) -> int:
        """One layer's temporaries (``layer``, this one by default) in a pass of ``queries``
        over ``columns``: its rows' context gathered and laid out (two copies as wide as the
        buffer), its attention's temporaries and its tokens' activations and staged K/V
        (``pass_bytes``).

        A batch's mask is an array, with which MLX's attention computes the scores whole on
        CUDA and the CPU (cuDNN takes no boolean mask) and holds them with their masked copy
        and softmax. On the H200 (8B, an agent loop of 16 clients) a pass of 16 rows x 577
        queries over 6,343 columns, evaluated a layer at a time, held 15.1 GB of working
        memory where one float32 copy (this estimate's before) came to 8.35 GB."""
        pool, rows = self.rows.pool, len(self.rows.tables)
        layer = self.layer if layer is None else layer
        laid_out = rows * self._capacity * pool.specs[layer].bytes_per_token(pool.dtype)
        fused = pool.prompt_attention_fused.get(layer, False)
        return 2 * laid_out + pass_bytes(pool, layer, rows, queries, columns, fused)

    def _context(self, width: int) -> tuple[mx.array, mx.array]:
        """The pool's K and V rows of every row's tokens, right-aligned in ``width``."""
        rows = self.rows
        return rows.pool.rows(self.layer, rows.aligned_slots(rows.lengths, width))

    def _laid_out(self, context, new=None) -> list[mx.array]:
        """K and V as the buffer holds them: ``context`` (the pool's rows of every row's
        tokens, right-aligned in ``_idx`` columns) then ``new`` (this pass's), in an array
        ``_capacity`` columns wide."""
        B, H = len(self.rows.tables), self.rows.pool.specs[self.layer].kv_heads
        prev = self._idx - (0 if new is None else new[0].shape[2])
        out = []
        for i, old in enumerate(context):
            dim = old.shape[-1] if old is not None else new[i].shape[-1]
            dtype = old.dtype if old is not None else new[i].dtype
            x = mx.zeros((B, H, self._capacity, dim), dtype)
            if prev:
                x[..., :prev, :] = old.reshape(B, prev, H, -1).transpose(0, 2, 1, 3)
            if new is not None:
                x[..., prev : self._idx, :] = new[i]
            out.append(x)
        return out

    def to_buffered(self) -> PoolBatchKVCache:
        """The same rows over mlx-lm's buffer, as wide as it would have grown here, filled
        from the pool: the decode batch that rows leaving this prompt batch would get from
        a buffered one (its strides too, which some BLAS round by)."""
        batch = PoolBatchKVCache.__new__(PoolBatchKVCache)
        BatchKVCache.__init__(batch, [])
        batch.keys, batch.values = self._laid_out(self._context(self._idx))
        batch.offset, batch.left_padding, batch._idx = self.offset, self.left_padding, self._idx
        batch.layer, batch.rows, batch.view = self.layer, self.rows, self.view
        self.rows.pool.hold_outside(batch)
        return batch

    def _grow(self, columns: int) -> None:
        """The buffer's width once it holds ``columns``, as ``BatchKVCache`` grows it."""
        if columns > self._capacity:
            steps = -(-(columns - self._idx) // STEP) * STEP
            kept = self._capacity if self._idx % STEP == 0 else self._idx
            self._capacity = (kept if self._capacity else 0) + steps

    def _set_padding(self, padding: list[int]) -> None:
        """Each row's left padding, kept on the host and copied to the device: a split
        filters every layer's rows, and reading the device's copy there waited for the device
        once a layer (on the H200, 8B: 24 ms of a burst's first decode step, 64 reads as 32
        rows left their prompt batch)."""
        self._padding = padding
        self.left_padding = mx.array(padding, dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        # The pass's plain causal mask (no window), which a causal kernel may take the place
        # of (engine/prompt_attention.py); a mask the model makes itself is not this one.
        self.rows.causal_mask = None if kwargs.get("window_size") else mask
        return mask

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            raise ValueError("left padding is set when a paged prompt batch is made")
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)
            self.rows.prepare(lengths)

    def finalize(self):
        # Stock rolls its buffer so that a short row's padding moves to the left; the pool
        # holds only real tokens, and the next pass lays them out right-aligned anyway.
        if self._right_padding is not None:
            self.offset = self.offset - mx.array(self._right_padding)
            self._set_padding([p + r for p, r in zip(self._padding, self._right_padding)])
            self._right_padding = None
        self.rows.finalize()

    def filter(self, batch_indices):
        keep = list(batch_indices)
        self.offset = self.offset[mx.array(keep)] if keep else self.offset[:0]
        self.rows.once(lambda: self.rows.filter(keep))
        # Drop columns every row pads, as stock shifts its buffer.
        shift = min((self._padding[i] for i in keep), default=0)
        self._set_padding([self._padding[i] - shift for i in keep])
        self._idx -= shift
        self._capacity -= shift

    def extend(self, other: PagedBatchKVCache):
        longest = max(self._idx, other._idx)
        self._set_padding(
            [p + longest - self._idx for p in self._padding]
            + [p + longest - other._idx for p in other._padding]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = longest
        if self._capacity or other._capacity:
            self._capacity = max(self._capacity, other._capacity)
        self.rows.once(lambda: self.rows.extend(other.rows))
        other.rows = self.rows

    def extract(self, idx: int):
        """The request's caches as views of its pages: committed without a copy."""
        return self.view(self.rows.tables[idx], self.layer, offset=self.rows.lengths[idx])

    def __deepcopy__(self, memo) -> PagedBatchKVCache:
        # mlx-lm copies a prompt batch to split it; every layer's copy shares one copy of
        # the rows (``memo``), which address the same pages.
        new = PagedBatchKVCache.__new__(PagedBatchKVCache)
        new.__dict__.update(self.__dict__)
        new.rows = copy.deepcopy(self.rows, memo)
        return new

    @property
    def state(self):
        return () if self.keys is None else (self.keys, self._values)

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return not self.rows.tables

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return 0

    buffer_nbytes = nbytes
