"""A prompt pass whose rows share a prefix: every layer reads that prefix once for all of them.

The paged prompt batch (``paged_batch.py``) hands each layer's attention the buffer's
layout: every row's whole context, gathered from the pool and laid out row by row. When
``n`` rows follow one cached ``P``-token prefix (a burst's followers, agents on one system
prompt), that is ``n`` gathers and two ``n x P`` copies a layer of one physical copy. On
the H200 (Llama-3-8B shape, bf16), the followers' pass of a burst of 32 on a 2,048-token
prefix, 31 tokens a row, took 138-142 ms, about 100 ms of it device time for about 25 ms
of the model's own compute.

Here the pass's queries are stacked as one sequence over one set of key columns: each
group's prefix (``memory/prefix_groups.py``), then each row's cached tokens past it, then
the pass's new tokens, row after row. A mask gives each query its group's prefix, its
row's cached tokens and its row's new tokens up to its own: one gather and one attention
call per layer (``engine/attention.py``), an exact softmax per query. The cost is that each
row's queries also score the other rows' own and new columns (masked), which
``GroupedPass.plan`` weighs against the per-row read. The sums run in another order than
stock's, so the logits differ from the buffer's by rounding: ``FIDELITY_TOLERANCE``
(``engine/attention.py``) holds, and the switch ``prefill.shared_prefix`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..memory.pool import KVPool, page_slots
from ..memory.prefix_groups import PrefixGroup, group_rows
from ..memory.slots import HeadSlots


class GroupedPass:
    """What the layers of one grouped prompt pass read, built by its first layer: the pool
    slots each layer gathers once (``cached`` of them: each group's prefix, then each row's
    own cached tokens), and ``visible``, which of them and of the pass's new tokens each
    query sees."""

    def __init__(
        self, pool: KVPool, tables: list, lengths: list[int], step: int, groups: list[PrefixGroup]
    ):
        """``groups``: the rows' prefix groups (``group_rows``)."""
        self.pool = pool
        ps = pool.page_size
        B = len(tables)
        self.rows, self.step = B, step
        slots, col_group, col_row = [], [], []
        row_group = np.full(B, -2, dtype=np.int32)  # -2: a row without a prefix of its own
        starts = [0] * B
        for g, group in enumerate(groups):
            if not group.pages:
                continue
            prefix = page_slots(group.pages, ps)
            slots.append(prefix)
            col_group.append(np.full(prefix.size, g, dtype=np.int32))
            col_row.append(np.full(prefix.size, -1, dtype=np.int32))
            for r in group.rows:
                row_group[r], starts[r] = g, group.tokens(ps)
        for r, (table, start, n) in enumerate(zip(tables, starts, lengths)):
            if n > start:
                own = table.host_slots(start, n)
                slots.append(own)
                col_group.append(np.full(own.size, -1, dtype=np.int32))
                col_row.append(np.full(own.size, r, dtype=np.int32))
        host = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
        self.cached = host.size  # gathered columns
        self._host = host
        self._index: dict[int, HeadSlots] = {}  # by KV heads
        cg = np.concatenate(col_group) if col_group else np.zeros(0, dtype=np.int32)
        cr = np.concatenate(col_row) if col_row else np.zeros(0, dtype=np.int32)
        self._meta = (cg, cr, row_group)
        self._visible: mx.array | None = None

    @classmethod
    def plan(
        cls,
        pool: KVPool,
        tables: list,
        lengths: list[int],
        step: int,
        per_row_bytes: Callable[[], int],
    ) -> GroupedPass | None:
        """The pass grouped, or None where the per-row read is to be taken: ``off``, or no two
        rows share a prefix; ``auto`` also where the layers' temporaries here would pass the
        per-row read's (``per_row_bytes()``, summed over layers:
        ``PagedBatchKVCache._layer_bytes``, asked only then), as rows with long contexts of
        their own make them; ``on`` groups every pass with a shared prefix."""
        mode = pool.prefill_shared
        if mode == "off" or not tables:
            return None
        # Grouped first: a pass that shares nothing builds none of the columns.
        groups = group_rows([t.pages for t in tables], lengths, pool.page_size)
        if not any(len(g.rows) > 1 and g.pages for g in groups):
            return None
        grouped = cls(pool, tables, lengths, step, groups)
        if mode == "auto":
            mine = sum(grouped.layer_bytes(layer) for layer in range(pool.num_layers))
            if mine > per_row_bytes():
                return None
        return grouped

    def layer_bytes(self, layer: int) -> int:
        """One layer's temporaries: its columns gathered and joined to the new tokens' (K
        and V), the pass's mask, and two float32 copies of every query's scores over every
        column (the scores by hand hold the masked scores and their softmax at once; a
        fused call makes none), and its tokens' activations and staged K/V
        (``KVPool.prefill_token_bytes``)."""
        pool = self.pool
        spec = pool.specs[layer]
        heads = pool.query_heads or spec.kv_heads
        queries = self.rows * self.step
        columns = self.cached + queries
        kv = 2 * columns * spec.bytes_per_token(pool.dtype)
        scores = 2 * heads * queries * columns * 4
        return kv + queries * columns + scores + queries * pool.prefill_token_bytes

    def gather(self, layer: int, heads: int) -> tuple[mx.array | None, mx.array | None]:
        """Layer ``layer``'s K and V at the cached columns, ``(heads, columns, dim)``, in the
        gather's order (``visible`` follows it); None where nothing is cached."""
        if not self.cached:
            return None, None
        index = self._slots(heads)
        k_views, v_views = self.pool.flat_views(layer)
        return index.gather(k_views, ordered=False), index.gather(v_views, ordered=False)

    def _slots(self, heads: int) -> HeadSlots:
        """The cached columns as a gather of ``heads`` KV heads reads them, made once."""
        index = self._index.get(heads)
        if index is None:
            index = self._index[heads] = self.pool.head_slots(self._host, heads)
        return index

    @property
    def visible(self) -> mx.array:
        """``(queries, columns)``: a query of row ``r`` at new token ``i`` sees its group's
        prefix, row ``r``'s cached columns and row ``r``'s new tokens ``0..i``. Made on the
        device from per-column and per-query integers, once a pass."""
        if self._visible is None:
            cg, cr, row_group = self._meta
            # The gather reads the pool chunk by chunk (unordered): its column i is position
            # filled[i] of the cached columns, whatever the heads.
            filled = self._slots(self.pool.specs[0].kv_heads).filled if self.cached else None
            if filled is not None:
                cg, cr = cg[filled], cr[filled]
            B, S = self.rows, self.step
            new_row = np.repeat(np.arange(B, dtype=np.int32), S)
            new_pos = np.tile(np.arange(S, dtype=np.int32), B)
            col_group = mx.array(np.concatenate([cg, np.full(B * S, -1, dtype=np.int32)]))
            col_row = mx.array(np.concatenate([cr, new_row]))
            # A cached column precedes every query (position -1).
            col_pos = mx.array(np.concatenate([np.full(cg.size, -1, dtype=np.int32), new_pos]))
            q_group = mx.array(np.repeat(row_group, S))[:, None]
            q_row, q_pos = mx.array(new_row)[:, None], mx.array(new_pos)[:, None]
            self._visible = (col_group[None] == q_group) | (
                (col_row[None] == q_row) & (col_pos[None] <= q_pos)
            )
        return self._visible
