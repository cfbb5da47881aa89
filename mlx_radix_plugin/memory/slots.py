"""Pool slots as the host knows them, and the index arrays that read and write them.

The pool's storage comes in chunks (``pool.py``), each its own arrays, so a set of slots
is read as one gather per chunk it touches, and the parts put back in the asked order.
Every slot id comes from a page table the host holds, so which chunks a read touches is
known before any graph is built: the plan is made once, from host integers, and read by
every layer of a pass. A read inside one chunk (the usual case: pages are handed out
lowest first) is one gather, as it was before chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

Piece = tuple[int, mx.array, mx.array | None]  # chunk, index there, positions it fills


def _split(
    host: np.ndarray, chunk_slots: int, index
) -> tuple[list[Piece], mx.array | None, np.ndarray | None]:
    """One piece per chunk ``host`` touches (``index`` turns its local slots into the
    gather's index); the take that puts the concatenated pieces back in order (None: they
    are in order); and which position of ``host`` each concatenated row holds."""
    chunks = host // chunk_slots
    if host.size == 0 or (chunks == chunks[0]).all():
        c = int(chunks[0]) if host.size else 0
        return [(c, index(host - c * chunk_slots), None)], None, None
    pieces, filled = [], []
    for c in np.unique(chunks):
        at = np.flatnonzero(chunks == c)
        pieces.append((int(c), index(host[at] - c * chunk_slots), mx.array(at, dtype=mx.int32)))
        filled.append(at)
    filled = np.concatenate(filled)
    if (filled == np.arange(filled.size)).all():
        return pieces, None, filled
    return pieces, mx.array(np.argsort(filled), dtype=mx.int32), filled


def as_host(slots: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(slots, dtype=np.int64).reshape(-1)


class Slots:
    """Slots in one order, for row reads and writes (``(n, heads, dim)`` per layer)."""

    __slots__ = ("_host", "pieces", "order")

    def __init__(self, slots: Sequence[int] | np.ndarray, chunk_slots: int):
        c = _one_chunk(slots, chunk_slots) if type(slots) is list else None
        if c is not None:
            # A decode step's slots, a row's token each: Python ints in one chunk (the usual
            # case) make one index without numpy's per-call costs: 32 rows on 2 CPU cores,
            # 2.6 us against 5.9 through ``_split`` (in a step, after its launch: 13 against
            # 77 us).
            local = [s - c * chunk_slots for s in slots] if c else slots
            self._host, self.order = slots, None
            self.pieces = [(c, mx.array(local, mx.int32), None)]
            return
        self._host = as_host(slots)
        self.pieces, self.order, _ = _split(
            self._host, chunk_slots, lambda local: mx.array(local, dtype=mx.int32)
        )

    @property
    def host(self) -> np.ndarray:
        """The slot ids, as host integers."""
        if type(self._host) is list:
            self._host = as_host(self._host)
        return self._host

    def __len__(self) -> int:
        return len(self._host)


def _one_chunk(slots: list[int], chunk_slots: int) -> int | None:
    """The chunk all of ``slots`` lie in, if one does."""
    if not slots:
        return None
    c = slots[0] // chunk_slots
    return c if all(s // chunk_slots == c for s in slots) else None


class HeadSlots:
    """Slots of any shape, read from a layer's ``(slots * heads, dim)`` view so that one
    gather lays them out with the KV heads at ``axis``, as attention reads them."""

    __slots__ = ("shape", "axis", "heads", "pieces", "order", "filled")

    def __init__(self, slots: np.ndarray, chunk_slots: int, heads: int, axis: int = 0):
        slots = np.asarray(slots, dtype=np.int64)
        self.shape, self.axis, self.heads = slots.shape, axis, heads
        h = np.arange(heads, dtype=np.int64)
        whole = (slots // chunk_slots).reshape(-1)
        if slots.size and not (whole == whole[0]).all():
            # Several chunks: each piece is (heads, its tokens), laid out after the gather.
            self.pieces, self.order, self.filled = _split(
                slots.reshape(-1),
                chunk_slots,
                lambda local: mx.array(local[None, :] * heads + h[:, None], dtype=mx.int32),
            )
            return
        c = int(whole[0]) if slots.size else 0
        local = np.expand_dims(slots - c * chunk_slots, axis)
        shape = [1] * local.ndim
        shape[axis] = heads
        index = local * heads + h.reshape(shape)
        self.pieces, self.order, self.filled = (
            [(c, mx.array(index, dtype=mx.int32), None)],
            None,
            None,
        )

    def gather(self, views, ordered: bool = True) -> mx.array:
        """The rows at these slots from ``views``, a layer's flat view in each chunk
        (``views[chunk]``, ``pool.FlatViews``).

        ``ordered=False`` (1-D slots only) leaves the rows in chunk order, position
        ``filled[i]`` at row ``i``: for a reader that sums over them in any order and can
        permute its mask once instead of the rows every layer."""
        if len(self.pieces) == 1 and self.pieces[0][2] is None:
            c, index, _ = self.pieces[0]
            return views[c][index]
        x = mx.concatenate([views[c][index] for c, index, _ in self.pieces], axis=1)
        if not ordered:
            return x
        if self.order is not None:
            x = x[:, self.order]
        x = x.reshape(self.heads, *self.shape, x.shape[-1])
        return mx.moveaxis(x, 0, self.axis) if self.axis else x
