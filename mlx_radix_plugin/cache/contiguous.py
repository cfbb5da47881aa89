"""``ContiguousKVCache``: one request's private K/V in a buffer that doubles when full."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, create_attention_mask

from .protocol import OffsetTrim


class ContiguousKVCache(OffsetTrim):
    """Private K/V of one request in a buffer that doubles when full."""

    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.keys = None
        self.values = None
        self.offset = 0

    def _reserve(self, keys: mx.array, values: mx.array, end: int) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        size = self.keys.shape[2] if self.keys is not None else self.capacity
        while size < end:
            size *= 2
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, size, Dk), keys.dtype)
        new_v = mx.zeros((B, values.shape[1], size, values.shape[3]), values.dtype)
        if self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, end = self.offset, self.offset + keys.shape[2]
        self._reserve(keys, values, end)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v):
        if not v:
            self.keys = self.values = None
            self.offset = 0
        else:
            self.keys, self.values = v
            self.offset = self.keys.shape[2]
        self.capacity = max(self.offset, 1)

    def empty(self) -> bool:
        return self.keys is None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @classmethod
    def merge(cls, caches):
        # BatchKVCache.merge reads keys[..., :offset, :], size() and offset: all ours.
        return BatchKVCache.merge(caches)
