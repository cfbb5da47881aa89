"""What the caches here share with mlx-lm's own: its mask conventions and trimming by offset."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


def window_mask(
    N: int, offset: int, key_start: int, window: int | None, return_array: bool
) -> mx.array | str | None:
    """The mask for ``N`` queries at ``offset..`` over keys ``key_start..offset+N``.

    Same values and shapes as mlx-lm's own caches produce, so that a model cannot
    tell our caches from its own: ``None`` for one query without a window, the
    string ``"causal"`` where that suffices, else a boolean array.
    """
    seen = offset - key_start  # keys already cached that the queries can see
    if window is None:
        if N == 1:
            return None
        if not return_array:
            return "causal"
    elif N == 1:
        if seen < window:
            return None
    elif seen + N <= window and not return_array:
        return "causal"
    q = mx.arange(offset, offset + N)[:, None]
    k = mx.arange(key_start, offset + N)[None]
    mask = q >= k
    if window is not None:
        mask = mask & (q < k + window)
    return mask


class OffsetTrim(_BaseCache):
    """Trimming by moving the offset back: later writes overwrite what was cut."""

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n
