"""The server's batch generator when the radix plugin is on: mlx-lm's own, plus admission.

mlx-lm's ``BatchGenerator`` already does continuous batching, chunked prefill
interleaved with decode, per-request sampling, logits processors, logprobs, stop
sequences and removal; its batch caches become pool-backed through
``PoolBackedCache.merge`` (batch_cache.py). What this subclass adds:

- in-flight prefix sharing: requests admitted together that share a prefix not yet
  cached share the first one's reserved pages (``RadixPromptCache`` does that at
  admission); their prefills start once those pages are written, so the prefix is
  computed once and each prefills only its own suffix;
- prompt pages committed to the radix tree as soon as they are written, so a
  request arriving while this one still runs hits them.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from .batch_cache import BatchRows, _PoolWrites
from .caches import PageTable, PoolBackedCache
from .prompt_cache import RadixPromptCache


def _table(sequence) -> PageTable | None:
    cache = sequence[3]
    if cache and isinstance(cache[0], PoolBackedCache):
        return cache[0].table
    return None


class RadixBatchGenerator(BatchGenerator):
    def __init__(self, model, radix: RadixPromptCache, **kwargs):
        super().__init__(model, **kwargs)
        self.radix = radix
        radix.share_inflight = True

    def close(self):
        self.radix.share_inflight = False
        super().close()

    def _admissible(self, sequence) -> bool:
        """Whether a waiting request's shared prefix is written (or never will be)."""
        table = _table(sequence)
        if table is None or table.depends is None:
            return True
        producer_ref, start, upto = table.depends
        producer = producer_ref()
        if producer is not None and not producer.released and producer.written >= upto:
            # The producer may have moved to other pages (it recomputed a span itself).
            ps = table.pool.page_size
            table.adopt(start, producer.pages[start // ps : upto // ps])
            table.depends = None
            table.written = max(table.written, upto)
            return True
        if producer is None or producer.released or producer.overflowed:
            # It is gone, or the pool had no room for its pages: nothing to wait for.
            self._compute_own_prefix(sequence, table, upto)
            return True
        return False

    @staticmethod
    def _compute_own_prefix(sequence, table: PageTable, upto: int) -> None:
        """The request it waited for is gone: prefill the shared span itself.

        Its caches step back to what the tree held; writing there copies the shared
        pages first (``PageTable.prepare_write``), so nobody else's pages change.
        """
        uid, segments, max_tokens, cache, all_tokens, *rest = sequence
        start = table.written
        segments[0] = list(table.tokens[start:upto]) + list(segments[0])
        del all_tokens[start:]
        for c in cache:
            c.offset = start
        table.depends = None

    def _make_batch(self, n: int):
        # Only requests whose shared prefix is written may start their prefill; the
        # others keep their place in the queue.
        ready = [s for s in self._unprocessed_sequences if self._admissible(s)][:n]
        chosen = {id(s) for s in ready}
        waiting = [s for s in self._unprocessed_sequences if id(s) not in chosen]
        self._unprocessed_sequences = deque(ready + waiting)
        return super()._make_batch(len(ready))

    def _next(self):
        responses = super()._next()
        if responses[0]:
            # A prefill chunk ran: mlx-lm evaluated its batch buffers but not our page
            # writes. Evaluated later, inside graphs that also read the pool, those
            # writes stop updating in place and copy whole layers (2 s in a burst of 8
            # x 500 tokens on a 262k-token pool; 0.02 s when done here).
            mx.eval(self.radix.pool.keys, self.radix.pool.values)
        for batch in (self._prompt_batch, self._generation_batch):
            cache = batch.prompt_cache
            if cache and isinstance(cache[0], _PoolWrites):
                rows: BatchRows = cache[0].rows
                for table in rows.tables:
                    if not table.prompt_committed:
                        self.radix.commit_progress(table)
        return responses
