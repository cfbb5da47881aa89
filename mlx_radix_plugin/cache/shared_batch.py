"""The decode batch of shared-prefix decode: no batch buffer, every read straight from the pool.

mlx-lm's batch caches (``batch.py``) keep a left-padded buffer holding each row's whole
context, so N requests on one P-token prefix hold N copies of it and every decode step
reads all N. Here the pool is the only copy. Each row is placed in a ``PrefixGroup``
(``memory/prefix_groups.py``): the rows of a group attend to their shared prefix through
one read of its pages for all of them, and each row to its own tokens (what follows its
group's prefix) and to the token of this step. The attention itself is in
``engine/attention.py``; this module keeps what every layer of a pass reads:

- ``SharedPrefixBatchCache``, one per layer, an ``OffsetCache``: it carries the rows'
  positions (for RoPE) and stages the step's new K/V for the pool, which is written after
  the pass's last read (see ``SharedPass``); it holds no K/V of its own.
- ``SharedRows``: the groups and each row's own slots, kept between passes and rebuilt
  only when rows join or leave (the own slots grow by one column a step).
- ``SharedPass``: what one pass's layers share, built by its first layer: the gather
  indices and masks. Every layer reads the pool before the pass writes to it (after its
  last attention call): the writes are not needed for the step's logits, and are
  evaluated with the next pass, once this one has finished reading (a write evaluated
  together with a read of the same array, or while a kernel still reads it, copies the
  whole array: ``memory/pool.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..memory.in_place import head
from ..memory.pool import page_slots
from ..memory.prefix_groups import PrefixGroup, group_rows
from ..memory.slots import HeadSlots, Slots
from .batch import BatchRows
from .offset import OffsetCache

# Columns of the masked variant's keys come in whole buckets of this many (see masked_layout).
MASKED_BUCKET = 1024


# The paged kernel's page tables come in widths of whole buckets of this many pages: its
# compiled calls are replayed for one width (engine/paged_attention.py), and a row takes a
# page every ``page_size`` steps.
PAGED_BUCKET = 32


def _padding(columns: int) -> int:
    """Columns that make ``columns`` whole buckets."""
    return -columns % MASKED_BUCKET


def pages_chunk(pages: list[list[int]], chunk_pages: int) -> int | None:
    """The chunk of the pool holding every row's ``pages``; None where they span chunks."""
    chunks = {p // chunk_pages for row in pages for p in row}
    return chunks.pop() if len(chunks) == 1 else None


def chunk_page_tables(
    pages: list[list[int]], chunk_pages: int, bucket: int = 1
) -> list[tuple[int, np.ndarray]]:
    """For each chunk of the pool holding some of the rows' ``pages``, in order: the chunk,
    and ``(rows, most pages)`` int32 the pages' numbers in it, -1 where a page lies in
    another chunk (0 past a row's own), its width rounded up to a multiple of ``bucket``."""
    width = max(map(len, pages), default=0)
    if not width:
        return []
    width = -(-width // bucket) * bucket
    table = np.zeros((len(pages), width), dtype=np.int64)
    for r, row in enumerate(pages):
        table[r, : len(row)] = row
    chunk = table // chunk_pages
    own = np.arange(width)[None, :] < np.array([len(row) for row in pages])[:, None]
    elsewhere = np.where(own, -1, 0)
    return [
        (int(c), np.where(chunk == c, table - c * chunk_pages, elsewhere).astype(np.int32))
        for c in np.unique(chunk[own])
    ]


class SharedRows:
    """A shared-prefix batch's groups and each row's own slots, kept between passes."""

    def __init__(self, rows: BatchRows):
        self.pool = pool = rows.pool
        ps = pool.page_size
        self.groups: list[PrefixGroup] = group_rows(
            [t.pages for t in rows.tables], rows.lengths, ps
        )
        B = len(rows.tables)
        starts = [0] * B
        for g in self.groups:
            for r in g.rows:
                starts[r] = g.tokens(ps)
        own = [n - s for n, s in zip(rows.lengths, starts)]
        width = max(own)
        self._prefix_slots = [page_slots(g.pages, ps) for g in self.groups if g.pages]
        # Padding names a slot the batch reads anyway (masked), so that it touches no
        # chunk of the pool the rows do not.
        pad = next(
            (t.slot(s) for t, s, n in zip(rows.tables, starts, own) if n),
            self._prefix_slots[0][0] if self._prefix_slots else 0,
        )
        # Right-aligned, so that a step appends one column for every row.
        self.own_slots = np.array(
            [
                [pad] * (width - n) + [t.slot(p) for p in range(s, s + n)]
                for t, s, n in zip(rows.tables, starts, own)
            ],
            dtype=np.int64,
        ).reshape(B, width)
        self.pad_slot = pad
        self.pad = mx.array([width - n for n in own], dtype=mx.int32)[:, None]
        self.positions = mx.array(rows.lengths, dtype=mx.int32)
        self.prefixed = [g for g in self.groups if g.pages]
        # Rows in the order the prefix parts are computed (each group's, then rows with
        # no prefix), and the take that puts them back in batch order (None: already).
        order = [r for g in self.prefixed for r in g.rows]
        order += sorted(set(range(B)) - set(order))
        self.unprefixed = B - sum(len(g.rows) for g in self.prefixed)
        self.restore = (
            None
            if order == list(range(B))
            else mx.array(sorted(range(B), key=order.__getitem__), dtype=mx.int32)
        )
        self.group_rows = [
            None if list(g.rows) == list(range(B)) else mx.array(g.rows, dtype=mx.int32)
            for g in self.prefixed
        ]
        self._prefix_index: dict[tuple[int, int], HeadSlots] = {}
        self._paged: tuple | None = None  # (pages a row, its paged_pages)

    def paged_pages(self, rows: BatchRows) -> list[tuple[int, mx.array]]:
        """``chunk_page_tables`` of the rows' pages, as the paged kernel reads them; made
        again only when a row has taken a page (each ``page_size`` steps) or a table changed
        its pages."""
        ps = self.pool.page_size
        used = tuple((-(-n // ps), t.changes) for t, n in zip(rows.tables, rows.lengths))
        if self._paged is None or self._paged[0] != used:
            held = [t.pages[:n] for t, (n, _) in zip(rows.tables, used)]
            tables = chunk_page_tables(held, self.pool.allocator.chunk_pages, PAGED_BUCKET)
            self._paged = (used, [(chunk, mx.array(table)) for chunk, table in tables])
        return self._paged[1]

    def prefix_slots(self, group: int) -> np.ndarray:
        return self._prefix_slots[group]

    def prefix_index(self, group: int, heads: int) -> HeadSlots:
        """Group ``group``'s prefix, read from a layer's flat views as ``(heads, tokens)``:
        one gather (a chunk) lays it out as attention reads it."""
        key = (group, heads)
        index = self._prefix_index.get(key)
        if index is None:
            index = self._prefix_index[key] = self.pool.head_slots(self._prefix_slots[group], heads)
        return index

    def advance(self, write_slots: Slots) -> None:
        """After a pass: each row's new token is one more of its own."""
        self.own_slots = np.concatenate([self.own_slots, write_slots.host[:, None]], axis=1)
        self.positions = self.positions + 1


class SharedPass:
    """What the layers of one shared-prefix decode pass read, built by its first layer."""

    def __init__(self, rows: BatchRows, shared: SharedRows):
        self.pool = rows.pool
        self.shared = shared
        self.positions = shared.positions
        self.lengths = list(rows.lengths)  # the same, as ints
        self.own_width = shared.own_slots.shape[1]
        self._own_index: dict[int, HeadSlots] = {}
        self._masks: dict[tuple, mx.array | str | None] = {}
        self._masked_columns: int | None = None
        self.calls = 0  # attention calls so far
        self.owned: list[int] = []  # ids of this pass's entries in _owners
        self._rows = rows
        self._paged: tuple | None = None  # paged_pages, asked once a pass
        self._heads: dict[int, tuple] = {}  # id of a pool array -> (it, its one-row view)

    def paged_pages(self) -> list[tuple[int, mx.array]] | None:
        """``SharedRows.paged_pages``, as the paged kernel reads them (None where no row has a
        page yet): worked out by the pass's first layer, read by every other."""
        if self._paged is None:
            self._paged = (self.shared.paged_pages(self._rows) or None,)
        return self._paged[0]

    def head(self, array: mx.array) -> mx.array:
        """``in_place.head`` of a pool array, made once a pass: every layer in a chunk reads
        the same arrays, and a view made for each was two graph nodes a layer more."""
        entry = self._heads.get(id(array))
        if entry is None or entry[0] is not array:
            entry = self._heads[id(array)] = (array, head(array))
        return entry[1]

    def own_index(self, heads: int) -> HeadSlots:
        """Each row's own tokens, read from a layer's flat views as ``(B, heads, width)``."""
        index = self._own_index.get(heads)
        if index is None:
            index = self.pool.head_slots(self.shared.own_slots, heads, axis=1)
            self._own_index[heads] = index
        return index

    def own_mask(self, window: int | None) -> mx.array:
        """``(B, 1, 1, width)``: which own columns a row's query sees (padding, window)."""
        key = ("own", window)
        mask = self._masks.get(key)
        if mask is None:
            width = self.own_width
            mask = mx.arange(width, dtype=mx.int32)[None, :] >= self.shared.pad  # (B, width)
            if window is not None:
                # Column j of row i holds position positions[i] - width + j.
                first = self.positions[:, None] - window + 1  # oldest position in the window
                pos = self.positions[:, None] - self.own_width + mx.arange(self.own_width)[None]
                mask = mask & (pos >= first)
            mask = self._masks[key] = mask[:, None, None, :]
        return mask

    def masked_columns(self) -> int:
        """Key columns of the masked variant in a layer that reads every prefix; counted
        once a pass (every layer's call asks)."""
        if self._masked_columns is None:
            shared = self.shared
            B, width = shared.own_slots.shape
            columns = sum(len(g.pages) for g in shared.prefixed) * self.pool.page_size
            columns += B * width + B
            self._masked_columns = columns + _padding(columns)
        return self._masked_columns

    def masked_layout(self, heads: int, window: int | None) -> tuple[HeadSlots, mx.array]:
        """The masked variant's keys and what each row sees of them: ``(heads, tokens)``
        rows of the flat views (each group's prefix the window has not left, then every
        row's own slots, row after row) and ``(rows, tokens + rows)`` booleans, the last
        ``rows`` columns being the step's own tokens."""
        key = ("masked", heads, window)
        layout = self._masks.get(key)
        if layout is not None:
            return layout
        shared = self.shared
        B, width = shared.own_slots.shape
        columns, seen = [], []
        for g in range(len(shared.prefixed)):
            visible = self.prefix_mask(g, window)
            if isinstance(visible, str):
                continue  # no row's window reaches this prefix: not read at all
            rows = shared.group_rows[g]
            prefix = shared.prefix_slots(g)
            if rows is None and visible is None:
                m = mx.ones((B, prefix.size), mx.bool_)
            else:
                m = mx.zeros((B, prefix.size), mx.bool_)
                m[mx.arange(B) if rows is None else rows] = True if visible is None else visible
            columns.append(prefix)
            seen.append(m)
        columns.append(shared.own_slots.reshape(-1))
        eye = mx.eye(B, dtype=mx.bool_)
        seen.append((eye[:, :, None] & self.own_mask(window)[:, 0]).reshape(B, B * width))
        # Padded to a whole bucket (never seen): the fused call's shapes then change once a
        # bucket, not every step (CUDA builds a cuDNN graph per shape, ~45 ms).
        pad = _padding(sum(c.size for c in columns) + B)
        if pad:
            columns.append(np.full(pad, shared.pad_slot))
            seen.append(mx.zeros((B, pad), mx.bool_))
        index = self.pool.head_slots(np.concatenate(columns), heads)
        seen = mx.concatenate(seen, axis=1)
        if index.filled is not None:  # read in chunk order (unordered gather): so is the mask
            seen = seen[:, mx.array(index.filled, dtype=mx.int32)]
        layout = (index, mx.concatenate([seen, eye], axis=1))
        self._masks[key] = layout
        return layout

    def prefix_mask(self, group: int, window: int | None) -> mx.array | str | None:
        """Which prefix positions each query row of group ``group`` sees in a layer with
        ``window``: None (all), ``"none"`` (the window has left the prefix for every row),
        or ``(rows, tokens)`` booleans."""
        if window is None:
            return None
        key = ("prefix", group, window)
        if key in self._masks:
            return self._masks[key]
        g = self.shared.prefixed[group]
        tokens = len(g.pages) * self.pool.page_size
        first = [self.lengths[r] - window + 1 for r in g.rows]
        if min(first) >= tokens:
            mask: mx.array | str | None = "none"
        elif max(first) <= 0:
            mask = None
        else:
            mask = mx.arange(tokens)[None, :] >= mx.array(first)[:, None]  # (rows, tokens)
        self._masks[key] = mask
        return mask


# The step's new K of every layer of the passes under way, by id (the array is kept, so the
# id stays its own until the pass ends): a layer that attends with another layer's K/V
# (gemma4's KV sharing) is handed that K and no cache, and is served through its owner.
_owners: dict[int, tuple[mx.array, SharedPrefixBatchCache]] = {}


def stage_pass(caches: list[SharedPrefixBatchCache], keys: list, values: list) -> None:
    """A pass whose every layer attended in one call (engine/compiled_pass.py): each layer's
    step K/V staged for the pool, as its ``update_and_fetch`` would, then the pass ended as
    its last ``attended`` would."""
    rows = caches[0].rows
    step = caches[0].begin_pass()
    if rows.ctx.any:
        for cache, k, v in zip(caches, keys, values):
            rows.ctx.write(rows.pool, cache.layer, k, v)
    caches[-1]._end_pass(step)


def owner_of(keys: mx.array) -> SharedPrefixBatchCache | None:
    """The shared-prefix cache whose ``update_and_fetch`` returned ``keys`` this pass."""
    entry = _owners.get(id(keys))
    return entry[1] if entry is not None and entry[0] is keys else None


class SharedPrefixBatchCache(OffsetCache):
    """One layer of a decode batch whose K/V are read from the pool by the patched attention."""

    def __init__(
        self, rows: BatchRows, layer: int, view: type, attention_calls: int, paged: bool = False
    ):
        self.rows = rows
        self.layer = layer
        self.window = rows.pool.specs[layer].window
        self.view = view  # what extract() hands back (a PoolBackedCache)
        # Attention calls in one forward pass: one a layer, and one more for each layer that
        # reuses another's K/V. The pass ends after the last (engine/attention.py counts).
        self.attention_calls = attention_calls
        self.paged = paged  # the attention may read the pages in place (a CUDA kernel)

    @property
    def offset(self) -> mx.array:
        """Each row's position for this step's token (``mx.fast.rope`` takes an array)."""
        return self._shared().positions

    def _shared(self) -> SharedRows:
        rows = self.rows
        if rows.shared is None:
            rows.shared = SharedRows(rows)
        return rows.shared

    @property
    def step(self) -> SharedPass:
        """The pass under way (set by its first layer)."""
        return self.rows.shared_pass

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Stage this step's K/V for the pool; hand them back for the attention to use."""
        if keys.shape[2] != 1:
            raise ValueError(
                f"a shared-prefix batch decodes one token a row, got {keys.shape[2]}; "
                "prompts are processed by the batch caches of batch.py"
            )
        rows = self.rows
        step = self.begin_pass()
        if rows.ctx.any:
            rows.ctx.write(rows.pool, self.layer, keys, values)
        _owners[id(keys)] = (keys, self)
        step.owned.append(id(keys))
        return keys, values

    def begin_pass(self) -> SharedPass:
        """The pass under way, begun here if none is (by its first layer)."""
        rows = self.rows
        if rows.ctx is None:
            rows.begin(1)
            rows.shared_pass = SharedPass(rows, self._shared())
        return rows.shared_pass

    def attended(self) -> None:
        """Called by the attention after its reads: the last call ends the pass, and the
        step's K/V go to the pool after every read of it (``SharedPass``)."""
        step = self.rows.shared_pass
        step.calls += 1
        if step.calls == self.attention_calls:
            self._end_pass(step)

    def _end_pass(self, step: SharedPass) -> None:
        rows = self.rows
        ctx = rows.ctx
        if len(ctx.valid) != sum(ctx.valid):
            raise RuntimeError(
                "a row of a shared-prefix batch had no page for its token: the engine "
                "reserves them before each step"
            )
        for key in step.owned:
            _owners.pop(key, None)
        write_slots = ctx.write_slots
        # Where the device allows, this pass's writes are stores in place, launched with
        # the pass (memory/in_place.py); no read of this pass touches the slots they write.
        rows.end(in_place=True)
        rows.shared_pass = None
        rows.shared.advance(write_slots)
        # mlx-lm evaluates this pass while the previous one may still run. Scatters into the
        # pool evaluated with it (this pass's writes without stores in place, a prefill's
        # left pending) update it in place only once nothing running reads the pool
        # (KVPool.settle): this pass waits for the previous one then, and only then. Without
        # stores in place, this pass's own writes wait for the next pass, or for the engine
        # after the step.
        rows.pool.settle_writes()
        rows.pool.reading()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # The patched attention builds its own masks from the pass.
        return None

    def filter(self, batch_indices) -> None:
        keep = list(batch_indices)
        self.rows.once(lambda: self.rows.filter(keep))

    def extend(self, other) -> None:
        """Take the rows of another batch (mlx-lm's, holding a buffer): no K/V copied."""
        self.rows.once(lambda: self.rows.extend(other.rows))
        other.rows = self.rows

    def extract(self, idx: int):
        return self.view(self.rows.tables[idx], self.layer, offset=self.rows.lengths[idx])

    @property
    def state(self):
        return ()

    def size(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return not self.rows.tables

    @property
    def nbytes(self) -> int:
        return 0
