"""``OffsetCache``: a position and masks but no K/V, for layers whose K/V are held elsewhere."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .protocol import window_mask


class OffsetCache(_BaseCache):
    """A position and masks but no K/V: the data lives elsewhere (the pool).

    ``offset`` is an int, or a ``(B,)`` array for a batch (``mx.fast.rope`` takes
    either). Whoever owns the K/V advances it.
    """

    # A pipelined model (``--pipeline``) ties its send to the last layer's cache,
    # ``cache[-1].keys = mx.depends(cache[-1].keys, h)``; holding no K/V, this keeps what it
    # is given. What the step evaluates depends on the send already (the pipeline's
    # all_gather of ``h``).
    keys: mx.array = mx.zeros((0,))

    def __init__(self, offset: int | mx.array = 0, window: int | None = None):
        self.offset = offset
        self.window = window

    def update_and_fetch(self, keys, values):
        raise RuntimeError(
            "OffsetCache holds no K/V; the attention layer using it must read and write "
            "its K/V through the pool"
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if not isinstance(self.offset, int):
            raise TypeError("a batched OffsetCache takes its mask from the batch context")
        start = 0 if self.window is None else max(0, self.offset - self.window + 1)
        return window_mask(N, self.offset, start, window_size, return_array)

    @property
    def state(self):
        return (self.offset, self.window)

    @state.setter
    def state(self, v):
        self.offset, self.window = v

    def size(self) -> int:
        return self.offset if isinstance(self.offset, int) else 0

    def empty(self) -> bool:
        return True

    def is_trimmable(self) -> bool:
        return isinstance(self.offset, int)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return 0
