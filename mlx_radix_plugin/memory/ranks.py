"""Agreement across the ranks of ``mlx.launch``: what every rank must decide alike.

Under ``mlx.launch`` each rank runs the prompt cache and the batch generator on its shard
of the model, and the model's collectives (tensor parallel's ``all_sum``, pipeline's
``send``/``recv``) pair up only if every rank runs the same passes over the same shapes.
So whatever changes which tokens a pass computes (a match, an eviction, an admission, a
chunk of the pool coming online or going) must come out the same on every rank. Decisions
made from tokens and pages do, given the same start; those made from bytes, memory or time
(each rank has its own device, shard and clock) go through these functions first.

Each of ``least``, ``all_agree``, ``same`` and ``gather`` is a collective: call it on the
generation thread, at a point every rank reaches in the same order (the decisions before it
having been agreed). In one process they return their input and cost nothing.

The garbage collector decides too: a page table in a reference cycle gives its pages and its
tree lock back when the collector frees it, and the pages free, the locks held and the weak
references alive are what matches, admissions and evictions read. The automatic collector
runs at a moment of its own on each rank (rank 0 also allocates on its HTTP threads), so
under ``mlx.launch`` it is off (``own_garbage_collection``) and the collector runs at points
every rank reaches alike: every ``COLLECT_EVERY`` engine steps (``stepped``) and when the
server goes idle after steps (``idle``).
"""

from __future__ import annotations

import gc
import logging
import zlib
from collections.abc import Sequence

import mlx.core as mx

# int32 on the wire, which every backend moves; counts here are pages, chunks and tokens, far
# below 2**31.
_MOST = 2**31 - 1

# Engine steps between two collections under mlx.launch: a full collection of a server's heap
# takes milliseconds, a decode step on a GPU a few.
COLLECT_EVERY = 64

log = logging.getLogger("mlx_radix")
# Steps since the last collection; None unless this process collects itself.
_steps: int | None = None


def size() -> int:
    """The number of ranks (1 outside ``mlx.launch``)."""
    return mx.distributed.init().size()


def least(values: Sequence[int]) -> list[int]:
    """Each of ``values``, as its least over all ranks."""
    if size() == 1:
        return list(values)
    # A gather, not all_min: every backend has it (ring, JACCL, NCCL, MPI).
    return [min(column) for column in zip(*gather(values))]


def all_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank."""
    return bool(least([int(ok)])[0])


def same(data: bytes) -> bool:
    """Whether every rank holds the same ``data`` (by CRC-32)."""
    if size() == 1:
        return True
    crc = zlib.crc32(data) & 0x7FFFFFFF
    return all(got == [crc] for got in gather([crc]))


def gather(values: Sequence[int]) -> list[list[int]]:
    """``values`` from every rank (each rank the same count), by rank."""
    if size() == 1:
        return [list(values)]
    x = mx.array([min(max(int(v), -_MOST), _MOST) for v in values], dtype=mx.int32)
    return mx.distributed.all_gather(x[None]).tolist()


def own_garbage_collection() -> None:
    """Under ``mlx.launch``, turn the automatic garbage collector off: ``stepped`` and
    ``idle`` run it at the same points on every rank."""
    global _steps
    if size() > 1 and gc.isenabled():
        gc.disable()
        _steps = 0
        log.info(
            "under mlx.launch (%d ranks) garbage is collected every %d steps and when idle, "
            "at the same point on every rank",
            size(),
            COLLECT_EVERY,
        )


def stepped() -> None:
    """An engine step ran: collect every ``COLLECT_EVERY`` of them, if collecting here."""
    global _steps
    if _steps is not None:
        _steps += 1
        if _steps >= COLLECT_EVERY:
            gc.collect()
            _steps = 0


def idle() -> None:
    """The server went idle: collect if steps ran since the last collection."""
    global _steps
    if _steps:
        gc.collect()
        _steps = 0
