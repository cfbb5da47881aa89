"""A hybrid model's recurrent layers: their state taken from a batch and given back to a request.

mlx-lm keeps a recurrent layer's state (conv state, SSM state) in an ``ArraysCache``
that cannot be rolled back: the state after token ``n`` is only there at the end of a
forward call that stopped at ``n``. The engine makes the positions it wants into the
ends of prefill segments (``RecurrentTrack.wanted``), takes the state there, and the
prompt cache hangs it on the tree node that ends at that position (memory/snapshots.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..memory.cache_list import flat


@dataclass(frozen=True)
class Snapshot:
    """Every recurrent layer's arrays for one sequence at one position (batch size 1)."""

    arrays: tuple[tuple[mx.array | None, ...], ...]  # per recurrent entry of the model's cache
    nbytes: int

    @classmethod
    def capture(cls, caches: Sequence, entries: Sequence[int], row: int) -> Snapshot:
        """Row ``row`` of a batch's recurrent caches (``entries`` of the flat list,
        memory/cache_list.py), as arrays of its own: a gather, so a snapshot never keeps
        the batch's arrays alive."""
        caches = flat(caches)
        index = mx.array([row], dtype=mx.int32)
        arrays, nbytes = [], 0
        for e in entries:
            taken = []
            for a in caches[e].cache:
                if a is None:
                    taken.append(None)
                    continue
                taken.append(a[index])
                nbytes += a.nbytes // a.shape[0]
            arrays.append(tuple(taken))
        return cls(tuple(arrays), nbytes)

    @classmethod
    def of_request(cls, caches: Sequence, entries: Sequence[int]) -> Snapshot | None:
        """A lone request's recurrent caches (batch size 1), or None if they are not."""
        caches = flat(caches)
        if not all(type(caches[e]) is ArraysCache and caches[e].batch_size == 1 for e in entries):
            return None
        return cls.capture(caches, entries, 0)

    def restore(self, caches: Sequence, entries: Sequence[int]) -> None:
        """Put this state into a request's recurrent caches. The arrays are shared, never
        written: mlx-lm's layers assign new arrays to their cache."""
        caches = flat(caches)
        for e, arrays in zip(entries, self.arrays):
            caches[e].cache = list(arrays)

    def to_eval(self) -> list[mx.array]:
        return [a for arrays in self.arrays for a in arrays if a is not None]


@dataclass
class RecurrentTrack:
    """What a request of a hybrid model snapshots, and what it took not yet in the tree."""

    start: int = 0  # where the request's prefill starts: its state there comes with it
    wanted: set[int] = field(default_factory=set)  # positions to snapshot during prefill
    captured: dict[int, Snapshot] = field(default_factory=dict)
    decoded: tuple[int, Snapshot] | None = None  # the latest page boundary crossed decoding
    resumed: Snapshot | None = None  # the state at ``start``, once the request has it
    # Makes a position a prefill segment end, if the request has not passed it (engine).
    cut: Callable[[int], bool] | None = None

    def want(self, position: int) -> bool:
        """Snapshot at ``position`` too; False if that is no longer possible."""
        if position in self.captured or position in self.wanted or position == self.start:
            return True
        if self.cut is not None and not self.cut(position):
            return False
        # (Not in the engine yet: its plan cuts there when it is.)
        self.wanted.add(position)
        return True


def cut_segments(segments: list[list[int]], total: int, position: int) -> bool:
    """Make ``position`` (of a prompt of ``total`` tokens) the end of a segment of the
    ones still to prefill, in place; False if prefill has passed it or it is the end."""
    start = total - sum(len(s) for s in segments)
    if not start < position < total:
        return False
    at = start
    for i, s in enumerate(segments):
        if at + len(s) == position:
            return True
        if at < position < at + len(s):
            segments[i : i + 1] = [s[: position - at], s[position - at :]]
            return True
        at += len(s)
    return False
