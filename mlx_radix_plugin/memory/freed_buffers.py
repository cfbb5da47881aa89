"""Room in MLX's cache of freed buffers, so that a decode step reuses its buffers.

MLX keeps a freed buffer for reuse only while its cache is under the limit (Metal's and
CUDA's allocators, ``free``); past it, the buffer goes back to the device
(``cudaFreeAsync``, a Metal buffer's release), and the next step allocates it again. Nothing
evicts older cached buffers to make room for it. So once something fills the cache to the
limit the server sets (memory/budget.py: a burst's prefill temporaries, a 32-row batch
buffer left by finished requests), every buffer of every later decode step, a thousand or so,
was freed and allocated again, at each step, until the cache emptied.

Each call of the engine therefore starts with room: where the cache is within ``room`` bytes of
its limit, the limit is lowered for a moment and a one-element array made, so that MLX
releases its oldest buffers down to ``2 * room`` under the limit (MLX documents that a cache
over its limit "will be reclaimed from the cache on the next allocation"; on the CPU
``set_cache_limit`` releases at once), and the limit is set back. The stale buffers are the
oldest, and what the steps use comes back to the cache's head each step, so only they go.
Nothing waits for the device: the release and the array are the host's.
"""

from __future__ import annotations

import mlx.core as mx

# A quarter of the limit: more than one decode step frees (a 32-row step's largest buffers
# are its logits, 32 x 128,256 float32 for Llama 3: 16 MB; the server's limit is at least
# 256 MiB, and 1.8 GB on an H200 with an 8B model), and a trim leaves half the limit to a
# prefill's next passes.
ROOM_FRACTION = 0.25


class FreedBuffers:
    """The server's limit on MLX's cache of freed buffers (``mx.set_cache_limit``), and the
    room a call starts with."""

    def __init__(self, limit: int, room_fraction: float = ROOM_FRACTION):
        if limit < 0:
            raise ValueError(f"a buffer cache limit is at least 0 bytes, got {limit!r}")
        self.limit = limit
        self.room = int(limit * room_fraction)
        self.trims = 0  # calls that found the cache too full and trimmed it

    def make_room(self) -> None:
        """Release the cache's oldest buffers if it has less than ``room`` left."""
        if mx.get_cache_memory() <= self.limit - self.room:
            return
        mx.set_cache_limit(self.limit - 2 * self.room)
        mx.array(0)  # an allocation: where MLX releases a cache over its limit
        mx.set_cache_limit(self.limit)
        self.trims += 1
