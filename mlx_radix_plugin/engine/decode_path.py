"""Which way a decode batch reads its K/V: mlx-lm's batch buffer, or shared prefixes once.

``decode.shared_prefix``:
- ``off``: mlx-lm's batch caches over a buffer holding every row's context (the exact
  path: stock's kernels on the same data, bitwise stock logits);
- ``on``: every decode batch reads straight from the pool, shared prefixes once
  (``cache/shared_batch.py``, ``engine/attention.py``);
- ``auto``: the shared path where the rule below says it is faster, else the exact one
  (on CUDA, whose shared path may read the pages through a kernel of its own, a rule of its
  own).

The batch changes path between steps, when rows join or leave: to the shared path by
dropping the buffer (every token is already in the pool), back by filling a buffer from
the pool, as admission does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from ..cache.batch import BatchRows, rows_of
from ..cache.page_table import PageTable
from ..cache.pool_backed import PoolBackedCache
from ..cache.shared_batch import SharedPrefixBatchCache, pages_chunk
from ..memory.allocator import OutOfPages
from ..memory.pool import KVPool
from ..memory.prefix_groups import PrefixGroup, group_rows
from . import prefill_path

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SharedPrefixRule:
    """When ``auto`` takes the shared path: the token reads it saves per layer, per step.

    Stock reads ``rows x longest context`` tokens per layer (its buffer is padded to the
    longest row); the shared path reads each group's prefix once plus every row's own
    tokens, but runs more operations per layer, a fixed cost that saved reads must cover.
    """

    min_saved_tokens: int
    min_saved_fraction: float
    # A batch of at most this many rows takes the shared path whatever it saves: its
    # attention costs less than the exact path's there (CUDA's paged kernel).
    any_saving_up_to_rows: int = 0
    # Any batch whose pages lie in one chunk of the pool takes it: the paged kernel reads
    # them in place (CUDA, with stores in place). Across chunks it runs once a chunk, which
    # was not measured against the exact path: there the shared path is taken by what it saves.
    any_batch_in_one_chunk: bool = False

    def takes_shared(
        self,
        groups: list[PrefixGroup],
        lengths: list[int],
        page_size: int,
        one_chunk: bool = False,
    ) -> bool:
        """``one_chunk``: every page of the batch lies in one chunk of the pool."""
        if len(lengths) <= self.any_saving_up_to_rows or (
            one_chunk and self.any_batch_in_one_chunk
        ):
            return True
        stock = len(lengths) * max(lengths)
        shared = sum(g.tokens(page_size) for g in groups)
        starts = {r: g.tokens(page_size) for g in groups for r in g.rows}
        own = max(n - starts[r] for r, n in enumerate(lengths))
        shared += len(lengths) * own
        saved = stock - shared
        return saved >= self.min_saved_tokens and saved >= self.min_saved_fraction * stock


# Measured with tools/decode_calibration.py (in process, median ms of a decode step, rows
# sharing one cached prefix plus 32 own tokens each; stock mlx-lm's BatchGenerator against
# the shared path):
# - CPU (2 cores, OpenBLAS; SmolLM2-135M float32), 2026-11-30, shared/stock speed: 2x512
#   0.94, 4x512 0.99, 8x256 0.90, 8x512 1.00, 4x1024 0.95 (all saving < 4k token reads a
#   layer); 4x2048 1.39 (6.1k), 16x1024 1.43 (15k), 8x2048 1.95 (14k).
# - H200 (Llama-3-8B shape, bf16), 2026-11-30, with the variant engine/attention.py picks
#   there: 8x1024 0.90-1.50 (7k saved; stock's own step varied 8.6-15.9 ms between runs),
#   32x2048 1.53-1.58 (63k), 32x4096 2.33-2.66 (128k); with 288 own tokens a row, 32x2048
#   1.37 (55k) and 32x4096 2.26. Below ~10k saved the GPU's fixed costs decide, not reads.
# - CUDA, where the shared path's attention is the paged kernel (engine/paged_attention.py),
#   H200, Llama-3-8B shape bf16, 2026-12-02, two machines (their hosts differed by up to 2x),
#   ms a step, exact (off) / paged: short prompts, 1 row 9.1-13.9 / 6.0-6.4, 8 rows 15.7-20.0
#   / 9.9-12.5, but 32 rows 11.7-20.2 / 19.2-39.7 (not explained yet); on a shared prefix,
#   8x1024 15.5-17.6 / 13.4-13.7, 32x2048 26.2 / 12.5-12.8, 32x4096 49.6-50.0 / 17.4-21.6.
#   So up to 8 rows whatever the batch saves, and above that where the GPU rule above holds.
# - CUDA with stores in place (memory/in_place.py: no shared step waits for the one before,
#   and the kernels' one-row views end no command graph), H200, Llama-3-8B shape bf16,
#   2026-12-03, one machine (a slow host: stock mlx-lm in process at 1.43x the floor), short
#   prompts, ms a step exact / paged: in process with a 100,000-token pool, 1 row 12.2 / 6.4,
#   32 rows 12.7 / 9.9; through the server, 32 rows 20.7 / 15.6 (1,312 / 1,696 tokens/s).
#   So the shared path at every batch size the paged kernel reads (its pages in one chunk of
#   the pool); across chunks the shared path gathers, and the CUDA rule above holds.
# - CPU, one row on a long context (SmolLM2-135M float32, 1x8192, 2026-12-06): stock 127.6 ms
#   a step, exact 152.0, shared 239.5. One copy of the context (the shared path, no buffer)
#   costs 1.6x the exact path's step there, so the CPU rule keeps a lone row exact, holding
#   its context twice (pages and buffer). Metal's rule is not measured on Metal.
_CUDA = SharedPrefixRule(min_saved_tokens=32768, min_saved_fraction=0.5, any_saving_up_to_rows=8)
RULES = {
    "cpu": SharedPrefixRule(min_saved_tokens=5120, min_saved_fraction=0.5),
    "gpu": SharedPrefixRule(min_saved_tokens=32768, min_saved_fraction=0.5),
    "cuda": _CUDA,
    "cuda_in_place": replace(_CUDA, any_batch_in_one_chunk=True),
}


def rule_for(where: str, stores_in_place: bool) -> SharedPrefixRule:
    """The rule ``auto`` follows on ``where`` (``backend()``), with or without stores in
    place (``KVPool.writes_in_place``)."""
    return RULES["cuda_in_place"] if where == "cuda" and stores_in_place else RULES[where]


def backend() -> str:
    """Which of ``RULES`` holds on this device: ``cuda`` (the paged kernel), ``gpu`` (Metal)
    or ``cpu``."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "gpu"


# The counts ``DecodePath.stats`` reports besides the mode and the path (``idle_stats`` shows
# them as 0; server/metrics.py exports them; tests hold a running batch's stats to these keys).
DECODE_STATS = (
    "decode_rows",
    "decode_groups",
    "decode_shared_tokens",
    "decode_buffer_bytes",
    "prefill_buffer_bytes",
    "decode_steps_shared",
    "decode_steps_exact",
)


def idle_stats(mode: str) -> dict:
    """``DecodePath.stats`` while nothing decodes."""
    return {
        "decode_shared_prefix": mode,
        "decode_path": None,
        "prefill_path": None,
        **dict.fromkeys(DECODE_STATS, 0),
    }


class DecodePath:
    """Puts a generation batch on the path ``mode`` asks for, between steps."""

    def __init__(
        self, mode: str, rule: SharedPrefixRule, attention_calls: int = 0, paged: bool = False
    ):
        """``attention_calls``: per forward pass (``attention.attention_calls``); ``paged``:
        the shared path's attention may be the paged kernel (CUDA)."""
        if mode not in MODES:
            raise ValueError(
                f"decode.shared_prefix must be one of {', '.join(MODES)}, got {mode!r}"
            )
        self.mode = mode
        self.rule = rule
        self.attention_calls = attention_calls
        self.paged = paged
        self.steps = {"shared": 0, "exact": 0}  # decode steps taken on each path
        self._decided: tuple[int, int, bool] | None = None  # (id of rows, version, shared)
        self._buffers: tuple[tuple | None, int] = (None, 0)  # (what they were summed at, bytes)

    def prepare(self, batch, expected: Callable[[], list] | None = None) -> None:
        """Between steps of ``batch`` (mlx-lm's GenerationBatch): switch path if it should,
        and on the shared path give every row a page slot for its next token.
        ``expected``: what ``caches_for`` takes, asked for only where a shared batch would
        go back to the exact path (it stays shared while others are about to join it)."""
        caches = batch.prompt_cache
        if self.mode == "off" or not caches:
            return
        rows = getattr(caches[0], "rows", None)
        if not isinstance(rows, BatchRows):
            return
        shared = isinstance(caches[0], SharedPrefixBatchCache)
        want = self._wants_shared(rows)
        if shared and not want and expected is not None:
            joining = expected()
            want = bool(joining) and self._joined_wants_shared(None, rows, joining)
        if want and not self._reserve_next(rows):
            want = False  # a row has no page for its next token: the exact path copes
        if want and not shared:
            rows.shared = None  # what an earlier shared spell kept is stale now
            batch.prompt_cache = self._shared_caches(rows, caches)
        elif shared and not want:
            batch.prompt_cache = self._exact_caches(rows, caches)

    def _wants_shared(self, rows: BatchRows) -> bool:
        """``_joined_wants_shared`` of ``rows`` alone, the rule's verdict kept until rows
        join or leave."""
        if self.mode == "on" or any(t.overflowed or t.released for t in rows.tables):
            return self._joined_wants_shared(None, rows)
        key = (id(rows), rows.version)
        if self._decided is None or self._decided[:2] != key:
            self._decided = (*key, self._joined_wants_shared(None, rows))
        return self._decided[2]

    @staticmethod
    def is_shared(batch) -> bool:
        """Whether ``batch`` has rows and steps next on the shared path."""
        caches = batch.prompt_cache
        return bool(len(batch) and caches) and isinstance(caches[0], SharedPrefixBatchCache)

    def count_step(self, batch) -> None:
        """Before ``batch`` steps: count the step on the path it takes."""
        if len(batch) and batch.prompt_cache:
            self.steps["shared" if self.is_shared(batch) else "exact"] += 1

    def stats(self, generation, prompt) -> dict:
        """What ``/v1/cache/stats`` shows of decoding: the path, the rows, the prefixes read
        once, and the K/V the batches hold outside the pool (mlx-lm's buffers)."""
        if generation is None:
            return {**idle_stats(self.mode), **self._step_counts()}
        caches = generation.prompt_cache
        rows = getattr(caches[0], "rows", None) if caches else None
        shared = isinstance(rows, BatchRows) and isinstance(caches[0], SharedPrefixBatchCache)
        groups = rows.shared.groups if shared and rows.shared is not None else []
        ps = rows.pool.page_size if isinstance(rows, BatchRows) else 0
        decode_bytes = self._buffer_bytes(caches, rows)
        prefill_bytes = sum(c.nbytes for c in prompt.prompt_cache)
        prefilling = bool(len(prompt) and prompt.prompt_cache)
        return {
            "decode_shared_prefix": self.mode,
            "decode_path": None if not caches else "shared" if shared else "exact",
            # A prompt batch under way reads cached K/V from the pool, or from a buffer.
            "prefill_path": None
            if not prefilling
            else "pool"
            if prefill_path.is_paged(prompt.prompt_cache)
            else "buffer",
            "decode_rows": len(generation),
            "decode_groups": sum(len(g.rows) > 1 for g in groups),
            "decode_shared_tokens": sum(g.tokens(ps) for g in groups if len(g.rows) > 1),
            # Of the pool's buffer_bytes: the decode batch holds its buffer while requests
            # decode; a prompt batch holds a copy of each cached prefix while it prefills.
            "decode_buffer_bytes": decode_bytes,
            "prefill_buffer_bytes": prefill_bytes,
            **self._step_counts(),
        }

    def _buffer_bytes(self, caches: list, rows) -> int:
        """The decode batch's buffers, summed over its layers again only where they may have
        changed: rows joined or left, a layer's buffer was replaced, the path switched. The
        stats are taken after every step, and the sum reads two arrays' sizes a layer."""
        key = None
        if isinstance(rows, BatchRows):
            key = (rows.serial, rows.version, rows.resized, len(caches), type(caches[0]))
        if key is None or key != self._buffers[0]:
            self._buffers = (key, sum(c.nbytes for c in caches))
        return self._buffers[1]

    def _step_counts(self) -> dict:
        return {f"decode_steps_{path}": n for path, n in self.steps.items()}

    @staticmethod
    def _reserve_next(rows: BatchRows) -> bool:
        """Make sure every row has a slot for the token this step writes."""
        try:
            for table, n in zip(rows.tables, rows.lengths):
                table.prepare_write(n, n + 1)
        except OutOfPages:
            return False
        return True

    def caches_for(self, generation, caches: list, expected: list | None = None) -> list:
        """The caches of rows that leave a prompt batch read from the pool (no buffer) to
        join ``generation``, so that their K/V are not copied on the way where the shared
        path can take them: they join a shared batch as its rows (as a buffered batch's
        rows would); an empty batch, on the path ``auto`` picks for them; a batch on the
        exact path, on the shared path if the joined batch takes it (that batch drops its
        buffer now, before a copy of theirs is made), else with mlx-lm's buffer filled
        from the pool. ``prepare`` picks the joined batch's path again after the step.

        ``expected``: ``(pages, length)`` of requests still prefilling on these rows' pages,
        which join them within a few steps: counted as if they had (so that the first of a
        burst does not decode alone on a buffer of its context while its followers prefill)."""
        rows = rows_of(caches)
        if self.mode == "off" or not self._reserve_next(rows):
            return prefill_path.buffered(caches)
        existing = rows_of(generation.prompt_cache) if len(generation) else None
        if existing is None:
            shared = self._joined_wants_shared(None, rows, expected or ())
        elif self.is_shared(generation):
            shared = True
        else:
            shared = self._joined_wants_shared(existing, rows, expected or ())
            shared = shared and self._reserve_next(existing)
            if shared:
                existing.shared = None  # what an earlier shared spell kept is stale now
                generation.prompt_cache = self._shared_caches(existing, generation.prompt_cache)
        return self._shared_caches(rows, caches) if shared else prefill_path.buffered(caches)

    def reads_pool(self, generation, tables: list[PageTable], lengths: list[int]) -> bool:
        """Whether rows of ``tables``, ``lengths`` tokens long once prefilled, would decode on
        the shared path on joining ``generation``: a batch on it, or one the rule sends
        there with them (``prefill_path.reads_pool`` asks before their prompts start)."""
        if self.mode == "off":
            return False
        if len(generation) and self.is_shared(generation):
            return True
        existing = rows_of(generation.prompt_cache) if len(generation) else None
        if existing is not None:
            tables, lengths = existing.tables + tables, existing.lengths + lengths
        return self._takes_shared(tables, lengths, tables[0].pool)

    def _joined_wants_shared(
        self, existing: BatchRows | None, rows: BatchRows, expected: list | tuple = ()
    ) -> bool:
        """``_wants_shared`` of the batch that ``rows`` joining ``existing`` makes (and the
        ``expected`` rows, ``(pages, length)`` each)."""
        tables = (existing.tables if existing is not None else []) + rows.tables
        lengths = (existing.lengths if existing is not None else []) + rows.lengths
        return self._takes_shared(tables, lengths, rows.pool, expected)

    def _takes_shared(
        self,
        tables: list[PageTable],
        lengths: list[int],
        pool: KVPool,
        expected: list | tuple = (),
    ) -> bool:
        if any(t.overflowed or t.released for t in tables):
            return False  # part of its K/V is only in a buffer
        if self.mode == "on" or len(lengths) + len(expected) <= self.rule.any_saving_up_to_rows:
            return True  # the rule's first test, before grouping every row's pages
        ps = pool.page_size
        pages = [t.pages for t in tables] + [p for p, _ in expected]
        lengths = lengths + [n for _, n in expected]
        groups = group_rows(pages, lengths, ps)
        one_chunk = self.rule.any_batch_in_one_chunk and (
            pages_chunk(pages, pool.allocator.chunk_pages) is not None
        )
        return self.rule.takes_shared(groups, lengths, ps, one_chunk)

    def _shared_caches(self, rows: BatchRows, caches: list) -> list:
        return [
            SharedPrefixBatchCache(rows, layer, c.view, self.attention_calls, self.paged)
            for layer, c in enumerate(caches)
        ]

    @staticmethod
    def _exact_caches(rows: BatchRows, caches: list) -> list:
        """mlx-lm's batch caches for these rows, their buffers filled from the pool."""
        views = [
            [c.view(t, layer, offset=n) for layer, c in enumerate(caches)]
            for t, n in zip(rows.tables, rows.lengths)
        ]
        return [PoolBackedCache.buffered([v[layer] for v in views]) for layer in range(len(caches))]
