"""The server's batch generator when the radix plugin is on: mlx-lm's own, plus admission.

mlx-lm's ``BatchGenerator`` already does continuous batching, chunked prefill
interleaved with decode, per-request sampling, logits processors, logprobs, stop
sequences and removal; its batch caches become pool-backed through
``PoolBackedCache.merge`` (batch_cache.py). What this subclass adds:

- in-flight prefix sharing: requests that arrive together sharing a prefix not yet
  cached depend on the first one (``RadixPromptCache`` records it at fetch); their
  prefills start once it has written those pages, and take them, so the prefix is
  computed once and each prefills only its own suffix;
- prompt pages committed to the radix tree as soon as they are written, so a
  request arriving while this one still runs hits them;
- admission by pool room: a request whose prompt pages cannot be reserved waits in the
  queue until running requests give pages back, letting at most ``MAX_PASSES`` later
  requests start before it; one that cannot fit even with nothing running is served
  uncached from the batch buffer;
- the decode path (``decode_path.py``), and decode steps that sample, bias and read their
  rows in bulk (``decode_step.py``);
- a row whose logits processors or sampler raise is failed alone (``row_faults.py``): the
  server hears of it through ``failed_rows``;
- a hybrid model's recurrent-state snapshots (``cache/recurrent.py``): the positions a
  request should leave a snapshot at become ends of its prefill segments, where the
  state is taken, and while it decodes, the state at the last page boundary it crossed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from functools import partial

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache
from mlx_lm_hooks.server import Overloaded, RowFailed

from ..cache.batch import rows_of
from ..cache.page_table import PageTable
from ..cache.pool_backed import PoolBackedCache
from ..cache.prompt_cache import RadixPromptCache
from ..cache.recurrent import Snapshot, cut_segments
from ..memory import ranks
from ..memory.allocator import OutOfPages
from ..memory.budget import activation_bytes_per_token
from ..memory.cache_list import flat
from . import attention, prefill_path
from .decode_path import DecodePath, backend, rule_for
from .decode_step import BulkGenerationBatch
from .prefill_path import PoolPromptBatch
from .row_faults import RowFaults
from .step_clock import StepClock

log = logging.getLogger("mlx_radix")

# How many later requests may start before one that waits for pool room (aging).
MAX_PASSES = 4
# What a request that waited out its queue time is told to wait before it tries again: the
# running requests it waited behind may run for minutes (an agent's turn asks for up to
# 128,000 tokens), so sooner would mostly meet the same queue.
RETRY_AFTER_S = 30


def _pool_cache(sequence) -> PoolBackedCache | None:
    """A request's first pool-backed layer (a hybrid's first layers may be recurrent)."""
    for c in flat(sequence[3] or ()):
        if isinstance(c, PoolBackedCache):
            return c
        if type(c) is not ArraysCache:
            return None
    return None


def _table(sequence) -> PageTable | None:
    cache = _pool_cache(sequence)
    return cache.table if cache is not None else None


# Whether requests that arrive together and share nothing prefill in one pass, as many as
# mlx-lm's pass budget (``--prompt-concurrency`` rows x ``--prefill-step-size`` tokens) holds,
# instead of ``--prompt-concurrency`` at a time. On the H200 (Llama-3-8B shape, bf16) 32
# requests of ~300 prompt tokens entered in 4 waves of 8, each a pass and a decode step that
# the rows already decoding waited for: the last row decoded 451-603 ms after the first was
# tokenized, for about 0.3 s of prefill compute (docs/benchmarking.md, "Admission in one pass
# on CUDA"). A CPU or an Apple GPU is compute-bound at 8 rows already: one pass of 32 would
# give the first rows their first tokens later and the last ones no sooner.
ADMITS_TOGETHER = {"cuda": True, "gpu": False, "cpu": False}


# Whether a joining row's first token is handed over in the call that computed it
# (decode_step.py, ``first_tokens``), not after the next step's forward pass. On MLX's CPU
# backend a decode step's launch (``mx.async_eval``) ran its graph before returning (the
# step clock, Qwen3.5-0.8B's shape, 2 rows, 2 cores: launch 280 ms a step, wait 0-6 ms),
# so the next step's pass came first: 1.03 s of prefill, 0.26 s of their first step, then
# 0.26 s of the next before the first token went out; in process, first tokens 0.2-0.4 s
# sooner with it. On a GPU the launch returns at once and the token is read right after
# it: nothing to gain there, and an early read would wait for the joining rows' step where
# the next launch now overlaps it.
FIRST_TOKENS_AT_ONCE = {"cuda": False, "gpu": False, "cpu": True}


class RadixBatchGenerator(BatchGenerator):
    def __init__(
        self,
        model,
        radix: RadixPromptCache,
        *,
        shared_prefix: str = "off",
        decode_attention: str = "auto",
        prefill_from_pool: str = "auto",
        prefill_shared: str = "off",
        prefill_attention: str = "auto",
        snapshot_every: int = 64,
        clock: StepClock | None = None,
        queue_timeout: float | None = None,
        **kwargs,
    ):
        """``shared_prefix``: ``auto``, ``on`` or ``off`` (engine/decode_path.py);
        ``decode_attention``: ``auto`` (a decode step whose rows hold no padding attends
        without a mask: cache/batch.py, ``PoolBatchKVCache.make_mask``) or ``off``;
        ``prefill_from_pool``: ``auto``, ``on`` or ``off`` (engine/prefill_path.py);
        ``prefill_shared``: the same, for rows of a prompt batch reading a prefix they share
        once (cache/grouped_prefill.py);
        ``prefill_attention``: ``auto`` or ``off`` (engine/prompt_attention.py);
        ``snapshot_every``: pages between a hybrid model's prefill snapshots (0: none);
        ``clock``: where its decode steps' time is counted (the server's, which outlives its
        engines; engine/step_clock.py);
        ``queue_timeout``: seconds a request may wait to start before it is refused with
        ``Overloaded`` (None: no limit)."""
        super().__init__(model, **kwargs)
        # Decode steps take every row's sampling and logit bias in bulk (decode_step.py).
        self._generation_batch = BulkGenerationBatch.empty(self.model, self.sampler)
        self.clock = self._generation_batch.clock = clock or StepClock()
        self.radix = radix
        self.snapshot_every = snapshot_every
        radix.share_inflight, radix.inflight_engine = True, id(self)
        self._ran = False
        self._passed_over: dict[int, int] = {}  # uid -> later requests started before it
        self.faults = RowFaults()
        self._failed_rows: dict[int, Exception] = {}
        self.queue_timeout = queue_timeout
        self._queued_at: dict[int, float] = {}  # uid -> when it was inserted, until it starts
        if decode_attention not in ("auto", "off"):
            raise ValueError(f"decode.attention must be auto or off, got {decode_attention!r}")
        radix.pool.unmasked_decode = decode_attention == "auto"
        if radix.recurrent and shared_prefix != "off":
            log.info("shared-prefix decode off: a hybrid model's batch holds recurrent states")
            shared_prefix = "off"
        wants_calls = shared_prefix != "off" or prefill_shared != "off"
        calls = attention.attention_calls(model, radix.pool) if wants_calls else 0
        if prefill_attention != "off":
            attention.install(model)  # a prompt pass's attention goes through its call site
        if calls is None and shared_prefix != "off":
            log.info(
                "shared-prefix decode off: this model attends outside mlx-lm's "
                "scaled_dot_product_attention or its layers' caches"
            )
            shared_prefix = "off"
        where = backend()
        rule = rule_for(where, radix.pool.writes_in_place)
        self.decode_path = DecodePath(shared_prefix, rule, calls or 0, where == "cuda")
        self.admit_together = ADMITS_TOGETHER[where]
        self.first_tokens_at_once = FIRST_TOKENS_AT_ONCE[where]
        # Prompt batches read cached K/V from the pool, and hand finished rows to the
        # decode path's caches (engine/prefill_path.py).
        heads = getattr(getattr(model, "args", None), "num_attention_heads", None)
        heads = heads if isinstance(heads, int) else None
        pool = radix.pool
        # The plan's bound is a float32 one; a pass's activations are in the model's dtype.
        activations = activation_bytes_per_token(model, pool.bytes_per_token)
        activations = activations * pool.dtype.size // 4
        # Whether prompt batches may read the pool; under ``auto``, each batch asks
        # ``prefill_path.reads_pool`` when it starts (``_make_batch``).
        from_pool = prefill_path.enable(
            prefill_from_pool, pool, heads, prefill_shared, calls, activations, prefill_attention
        )
        self._from_pool_auto = from_pool and prefill_from_pool == "auto"
        self._prompt_batch = PoolPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._prompt_batch.caches_for = self._decode_caches
        self.decode_stats = self.decode_path.stats(self._generation_batch, self._prompt_batch)

    def close(self):
        # Only the generator that serves from the cache now turns sharing off: mlx-lm's
        # generators close again when collected, and the server makes a new one after
        # draining a batch (a request with a seed, say), so an old one collected later
        # had turned sharing off for its successor (seen as batches that differed from run
        # to run with the garbage collector's timing).
        if self.radix.inflight_engine == id(self):
            self.radix.share_inflight, self.radix.inflight_engine = False, None
        super().close()

    def _admissible(self, sequence, others: bool = False) -> bool:
        """Whether a waiting request may start its prefill now.

        It waits while its prompt's pages cannot be reserved but running requests (or
        ``others`` admitted with it) will give pages back, and while the request whose
        pages it shares is still writing them.
        """
        table = _table(sequence)
        if table is None:
            return True
        if table.depends is not None and not self._shares(sequence, table):
            return False
        if not self._reserved(sequence, table):
            if others or self._ran or len(self._prompt_batch) or len(self._generation_batch):
                return False
            # Nothing runs that could free pages: this prompt cannot fit in the pool
            # (every other page is held by the tree's locked or waiting prefixes). It is
            # served from the batch buffer, uncached, rather than refused.
            log.warning(
                "KV pool too small for a %d-token prompt: served uncached", len(table.tokens)
            )
            table.overflowed = True
        return True

    def _shares(self, sequence, table: PageTable) -> bool:
        """Whether a request that shares another's prompt span may go on: it takes that
        span's pages once they are written, or computes the span itself if the other is
        gone. False while it waits."""
        producer_ref, start, upto = table.depends
        producer = producer_ref()
        ready = producer is not None and not producer.released and producer.written >= upto
        state = None
        if ready and table.recurrent is not None:
            # A hybrid's request takes the producer's recurrent state there too.
            state = self.radix.snapshot_of(producer, upto)
            ready = state is not None
        if ready:
            ps = table.pool.page_size
            table.adopt(start, producer.pages[start // ps : upto // ps])
            if state is not None:
                state.restore(sequence[3], self.radix.recurrent)
                table.recurrent.resumed = state  # for a request that waits on this one
            table.depends = None
            table.written = max(table.written, upto)
            return True
        gone = producer is None or producer.released or producer.overflowed
        if gone or producer.written >= upto:
            # It is gone, the pool had no room for its pages, or (a hybrid model) it passed
            # that point without leaving its recurrent state there: nothing to wait for.
            self._compute_own_prefix(sequence, table, upto)
            return True
        return False

    @staticmethod
    def _reserved(sequence, table: PageTable) -> bool:
        """Whether the prompt's pages are reserved; tries again (evicting) if not yet."""
        if table.overflowed or table.capacity >= len(table.tokens):
            return True
        try:
            table.prepare_write(_pool_cache(sequence).offset, len(table.tokens))
        except OutOfPages:
            return False
        return True

    @staticmethod
    def _compute_own_prefix(sequence, table: PageTable, upto: int) -> None:
        """The request it waited for is gone: prefill the shared span itself.

        Its caches step back to what the tree held; writing there copies the shared
        pages first (``PageTable.prepare_write``), so nobody else's pages change.
        """
        uid, segments, max_tokens, cache, all_tokens, *rest = sequence
        start = table.written
        span = list(table.tokens[start:upto])
        if len(segments) == 1:
            # mlx-lm generates from a last segment of exactly one token: keep it alone.
            segments.insert(0, span)
        else:
            segments[0] = span + list(segments[0])
        del all_tokens[start:]
        for c in flat(cache):
            if isinstance(c, PoolBackedCache):
                c.offset = start
        if table.recurrent is not None:
            table.recurrent.start = start  # its state is the one it was fetched with
        table.depends = None

    def insert_segments(
        self,
        segments,
        max_tokens=None,
        caches=None,
        all_tokens=None,
        samplers=None,
        logits_processors=None,
        stop_sequences=None,
    ):
        coming = list(range(self._uid_count, self._uid_count + len(segments)))
        samplers, logits_processors = self.faults.guard(coming, samplers, logits_processors)
        uids = super().insert_segments(
            segments, max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences
        )
        now = time.monotonic()
        self._queued_at.update((uid, now) for uid in uids)
        if self.radix.recurrent:
            for sequence in list(self._unprocessed_sequences)[-len(uids) :]:
                table = _table(sequence)
                if table is not None and table.recurrent is not None:
                    self._plan_snapshots(sequence, table)
        return uids

    def _plan_snapshots(self, sequence, table: PageTable) -> None:
        """Where a hybrid model's request leaves snapshots of its recurrent state, made
        into ends of its prefill segments: the server's segment ends (system prompt, the
        prompt but its last token), exactly, as stock's cache keeps them (and, for the disk
        tier, the page boundaries before them); every
        ``snapshot_every`` pages; and where its K/V match ended (``_fetch_hybrid``).
        The server's ends are segment ends already, so only the others add forward calls
        (one of a hybrid's costs a decode step at least: 217 ms for Qwen3.5-0.8B's shape
        on 2 CPU cores)."""
        segments, track = sequence[1], table.recurrent
        total = len(sequence[4]) + sum(len(s) for s in segments)
        every = self.snapshot_every * table.pool.page_size
        start = len(sequence[4])
        ends = list(itertools.accumulate((len(s) for s in segments), initial=start))[1:-1]
        wanted = set(ends) | set(range(every, total - 1, every) if every else ())
        if self.radix.tiering is not None:
            # The disk tier keeps states at page ends only (a state is an entry after its
            # page): the page boundary before each end too, so a restart resumes near it
            # (Qwen3.5-0.8B's shape, smoke restart: cached 0 of 136 tokens without).
            ps = table.pool.page_size
            wanted |= {e // ps * ps for e in ends}
        wanted |= track.wanted
        track.cut = partial(cut_segments, segments, total)
        track.wanted = set()
        for position in sorted(w for w in wanted if start < w < total):
            track.want(position)

    def failed_rows(self) -> dict[int, Exception]:
        """Requests refused or failed alone since the last call, ``uid -> the error`` their
        clients get (mlx_lm_hooks' ``RowFailed``: its own work failed in a step, and the row
        ends at its next step; ``Overloaded``: it waited ``queue_timeout`` without starting,
        and left the queue). The rest of the batch goes on."""
        failed, self._failed_rows = self._failed_rows, {}
        return failed

    def _expire_queued(self) -> None:
        """Requests that waited ``queue_timeout`` without starting leave the queue, refused.
        A prompt waits while its pages cannot be reserved and running requests hold them,
        and while the batch is full: requests that run long (an agent's turn asks for up to
        128,000 tokens) kept later ones waiting without end."""
        if self.queue_timeout is None or not self._queued_at:
            return
        since = time.monotonic() - self.queue_timeout
        # Arrival order: a step with nobody late reads one entry, not the whole queue.
        if next(iter(self._queued_at.values())) >= since:
            return
        late = [s[0] for s in self._unprocessed_sequences if self._queued_at.get(s[0], 0) < since]
        if not late:
            return
        self.remove(late)
        for uid in late:
            log.warning("request %d waited %g s without starting: refused", uid, self.queue_timeout)
            self._failed_rows[uid] = Overloaded(
                f"this request waited {self.queue_timeout:g} s (server.queue_timeout) for the "
                "requests before it to make room, and did not start: send it again later",
                RETRY_AFTER_S,
            )

    def remove(self, uids, return_prompt_caches=False):
        # mlx_lm.server keeps the last fetched cache in a local until its next request:
        # a removed request gives its pages and lock back now, not when that is replaced.
        tables = [] if return_prompt_caches else self._tables_of(uids)
        for uid in uids:
            self._passed_over.pop(uid, None)
            self._queued_at.pop(uid, None)
        caches = super().remove(uids, return_prompt_caches)
        for table in tables:
            self.radix.release(table)
        return caches

    def _tables_of(self, uids) -> list[PageTable]:
        tables = []
        for stage, idx in self._find_uids(uids).values():
            if stage == 0:
                table = _table(self._unprocessed_sequences[idx])
            else:
                batch = self._prompt_batch if stage == 1 else self._generation_batch
                rows = rows_of(batch.prompt_cache)
                table = rows.tables[idx] if rows is not None else None
            if table is not None:
                tables.append(table)
        return tables

    def _make_batch(self, n: int):
        # Only requests whose shared prefix is written may start their prefill; the
        # others keep their place in the queue. A request waiting for pool room lets later
        # ones that fit go first, but only MAX_PASSES of them: then nothing behind it starts
        # until running requests have given it room, so it starts within a bounded time.
        ready, waiting_for_room = [], []
        for s in self._unprocessed_sequences:
            if len(ready) == n:
                break
            if self._admissible(s, others=bool(ready)):
                ready.append(s)
                for uid in waiting_for_room:
                    self._passed_over[uid] = self._passed_over.get(uid, 0) + 1
                if any(self._passed_over[uid] >= MAX_PASSES for uid in waiting_for_room):
                    break  # several may start at once (_prefill_rows): no more pass it
                continue
            table = _table(s)
            if table is not None and table.depends is None:  # it waits for room
                if self._passed_over.get(s[0], 0) >= MAX_PASSES:
                    break
                waiting_for_room.append(s[0])
        for s in ready:
            self._passed_over.pop(s[0], None)
            self._queued_at.pop(s[0], None)
        chosen = {id(s) for s in ready}
        waiting = [s for s in self._unprocessed_sequences if id(s) not in chosen]
        self._unprocessed_sequences = deque(ready + waiting)
        if self._from_pool_auto and ready:
            # PoolBackedCache.merge reads the pool's flag as mlx-lm makes the batch.
            self.radix.pool.prefill_from_pool = self._reads_pool(ready)
        return super()._make_batch(len(ready))

    def _reads_pool(self, ready: list) -> bool:
        """Whether a prompt batch of ``ready`` reads the pool (``prefill_path.reads_pool``).
        Rows joining a prompt batch under way take its path: merging a buffered batch
        into one over the pool fills buffers for all of it (``PoolPromptBatch.extend``)."""
        if len(self._prompt_batch) and self._prompt_batch.prompt_cache:
            return prefill_path.is_paged(self._prompt_batch.prompt_cache)
        tables = [_table(s) for s in ready]
        if any(t is None for t in tables):
            return True  # rows outside the pool take the buffer in merge whatever is set
        lengths = [len(t.tokens or ()) for t in tables]
        ids = {id(t) for t in tables}
        awaited = any(
            t is not None and t.depends is not None and id(t.depends[0]()) in ids
            for t in map(_table, self._unprocessed_sequences)
        )
        shared = self.decode_path.reads_pool(self._generation_batch, tables, lengths)
        return prefill_path.reads_pool(self.radix.pool, tables, lengths, shared, awaited)

    def _decode_caches(self, caches: list) -> list:
        """The decode path's caches for rows leaving the prompt batch (prefill_path.py)."""
        return self.decode_path.caches_for(
            self._generation_batch, caches, self._expected(rows_of(caches))
        )

    def _expected(self, rows) -> list[tuple[list[int], int]]:
        """``(pages, length)`` of the requests that will join ``rows`` on their pages: those
        still prefilling on pages of theirs, and those waiting for them to be written (as
        the pages they will take)."""
        if rows is None or not (len(self._prompt_batch) or self._unprocessed_sequences):
            return []
        ps, leaving = rows.pool.page_size, {id(t) for t in rows.tables}
        held = {p for t in rows.tables for p in t.pages}
        expected = []
        prefilling = rows_of(self._prompt_batch.prompt_cache)
        for table in prefilling.tables if prefilling is not None else ():
            if table.pages and table.pages[0] in held:
                expected.append((table.pages, len(table.tokens or ())))
        for sequence in self._unprocessed_sequences:
            table = _table(sequence)
            if table is None or table.depends is None:
                continue
            producer, _, upto = table.depends
            producer = producer()
            if producer is not None and id(producer) in leaving:
                expected.append((producer.pages[: upto // ps], len(table.tokens or ())))
        return expected

    def _pool_arrays(self) -> list[mx.array]:
        # A pass whose path changed under it may have stored in place: its launch takes them.
        return self.radix.pool.arrays + self.radix.pool.take_marks()

    def _take_snapshots(self) -> None:
        """Take a hybrid model's recurrent state where its requests stand now: at the
        positions a prefill wanted, and at each page boundary a decode crosses (the latest
        replaces the one before: it is what the next turn of a chat resumes from)."""
        ps, entries = self.radix.pool.page_size, self.radix.recurrent
        taken = []
        for batch, decoding in ((self._prompt_batch, False), (self._generation_batch, True)):
            rows = rows_of(batch.prompt_cache)
            if rows is None:
                continue
            for i, table in enumerate(rows.tables):
                track, at = table.recurrent, table.written
                if track is None or table.overflowed or not at:
                    continue
                if decoding:
                    if at % ps or (track.decoded is not None and track.decoded[0] >= at):
                        continue
                    snapshot = Snapshot.capture(batch.prompt_cache, entries, i)
                    track.decoded = (at, snapshot)
                elif at in track.wanted and at not in track.captured:
                    snapshot = Snapshot.capture(batch.prompt_cache, entries, i)
                    track.captured[at] = snapshot
                else:
                    continue
                taken += snapshot.to_eval()
        if taken:
            # Evaluated behind the step that made them, so they hold no batch array alive.
            mx.async_eval(taken)

    def _prefill_rows(self) -> int:
        """How many requests may prefill together this step.

        mlx-lm starts ``prefill_batch_size`` (the server's ``--prompt-concurrency``) at a
        time, which bounds a prefill pass's tokens: its rows times their longest chunk, each
        row padded to it. Requests that follow another's prefix (in-flight sharing) have only
        their short suffixes left once it is written: they start together, up to
        ``completion_batch_size`` and that many tokens, where a burst's followers would
        otherwise start 8 at a time, each group a forward pass and a first decode step of
        its own. Where ``admit_together`` holds (``ADMITS_TOGETHER``), so do requests that
        share nothing, within the same budget.
        """
        configured, step = self.prefill_batch_size, self.prefill_step_size
        if not self._unprocessed_sequences and not self._currently_processing:
            return configured  # the usual decode step: nothing waits
        room = self.completion_batch_size - len(self._generation_batch)
        rows = len(self._currently_processing)
        longest = max(
            (min(sum(map(len, p[0])), step) for p in self._currently_processing), default=0
        )
        for sequence in self._unprocessed_sequences:
            table = _table(sequence)
            if table is None or (table.depends is None and not self.admit_together):
                continue
            longest = max(longest, min(sum(map(len, sequence[1])), step))
            if rows >= room or (rows + 1) * longest > configured * step:
                break
            rows += 1
        return max(configured, rows)

    def _joining(self) -> bool:
        """Whether rows of the prompt batch leave it for decoding in this call: mlx-lm keeps
        a prompt's last token for the row's first decode step."""
        return any(len(s[0]) == 1 and len(s[0][0]) == 1 for s in self._currently_processing)

    def _next(self):
        # Requests that finish in this call give their pages back when the server
        # commits them, after it: until then they still count as running.
        self._ran = bool(len(self._prompt_batch) or len(self._generation_batch))
        decoding = bool(len(self._generation_batch))
        # A decode step on the exact path launches its pool writes with its own graph: one
        # launch a step, not two. On the H200 (8B shape, 32 rows, through the server) the
        # separate launch took 0.84 ms a step, and each return from a launch is one more
        # wait for the GIL behind 32 handler threads (docs/benchmarking.md, "One launch a step").
        merged = decoding and not self.decode_path.is_shared(self._generation_batch)
        if merged:
            self.radix.pool.settle()
        # A shared step launches its stores in place, where the pool makes them (pool.py).
        pool = self.radix.pool
        self._generation_batch.launch_with = self._pool_arrays if merged else pool.take_marks
        self.clock.begin_call()
        self.decode_path.count_step(self._generation_batch)
        configured = self.prefill_batch_size
        # Rows finishing their prompts take their first step in this call and hand its
        # token over at its end (first_tokens): a prompt pass for new rows started here
        # would run before that, so new rows start in the next call. Measured on 2 CPU
        # cores (SmolLM2-135M, float32): a chat turn reaching an idle server 0.2 s before 7
        # others got its first token with theirs, 2.9-3.6 s (stock 0.5-0.6, whose 0.5 s
        # between looks at its queue let it through), now 0.47-0.57 s, the others 2.8-3.3 s
        # as before. The medium conversations (8 chats x 5 turns, medians of 3 rounds,
        # seeds 0 / 1): TTFT mean 0.61 / 0.71x stock's (1.08-1.14x before), wall 0.90 /
        # 0.99x, a request's whole time 9.04 s against stock's 9.81 (seed 0); the time a
        # token while a reply streams 1.18 / 1.19x (0.84-0.96x): the other turns' passes
        # now fall inside replies already streaming, not before their first tokens.
        if self.first_tokens_at_once and self._joining():
            self.prefill_batch_size = len(self._prompt_batch)  # no new rows in this call
        else:
            self.prefill_batch_size = self._prefill_rows()
        if pool.freed_buffers is not None:
            pool.freed_buffers.make_room()
        working = pool.working_set
        if working is not None:
            working.begin_call()
        # What finished in the last call gives its pages back before this one admits
        # (the server's commits may wait for it: RadixPromptCache.insert_cache), counted
        # in this call's time and working memory.
        self.radix.commit_finished()
        try:
            with self.clock.part("batch"):
                responses = super()._next()
        finally:
            self.prefill_batch_size = configured
        self._failed_rows.update(
            (
                uid,
                RowFailed(
                    f"this request failed in a generation step ({why}); the other "
                    "requests of its batch went on"
                ),
            )
            for uid, why in self.faults.take(self._generation_batch).items()
        )
        self._expire_queued()
        if self.first_tokens_at_once:
            prompt_responses, generation_responses = responses
            first = self._generation_batch.first_tokens()
            if first:
                responses = (prompt_responses, generation_responses + first)
        # The batch's path for its next step, chosen as soon as rows have joined or left:
        # a batch that goes shared drops its buffers now, not one step later.
        gen = self._generation_batch
        self.decode_path.prepare(gen, lambda: self._expected(rows_of(gen.prompt_cache)))
        # mlx-lm evaluates what the next tokens need, not our page writes: they are
        # scheduled here, behind the step that made them, without waiting for it.
        # Left pending, they pile up until something reads the pool and then run inside
        # that graph, where they stop updating in place and copy whole pool arrays (2 s
        # in a burst of 8 x 500 tokens on a 262k-token pool, 0.02 s when run here), and
        # every admission's synchronisation would wait for the pile. A batch that goes
        # on shared leaves them to its next pass, which evaluates them once this step has
        # stopped reading the pool (shared_batch.py).
        # A step launched with them leaves only a prefill's writes of this call, if any.
        if not self.decode_path.is_shared(self._generation_batch) and (not merged or responses[0]):
            with self.clock.part("pool"):
                self.radix.pool.settle()
                mx.async_eval(self.radix.pool.arrays)
        self.decode_stats = self.decode_path.stats(self._generation_batch, self._prompt_batch)
        if self.radix.recurrent:
            self._take_snapshots()
        if self.radix.tiering is not None:
            # Pages committed two steps ago have been gathered by now: to the disk's writer.
            self.radix.tiering.pump()
        for batch in (self._prompt_batch, self._generation_batch):
            rows = rows_of(batch.prompt_cache)
            if rows is not None and rows.committed != rows.version:
                done = True
                for table in rows.tables:
                    if not table.prompt_committed:
                        self.radix.commit_progress(table)
                        done = done and table.prompt_committed
                if done:  # a table's prompt stays committed: none to look at until rows join
                    rows.committed = rows.version
        ranks.stepped()
        if working is not None:
            working.end_call()
        self.clock.end_call(decoding)
        return responses
