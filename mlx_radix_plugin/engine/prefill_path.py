"""How a prompt batch reads cached K/V: from the pool layer by layer, or from a batch buffer.

``prefill.from_pool``:
- ``on``: prompt batches over the pool hold no buffer (``cache/paged_batch.py``): each
  layer gathers its rows' context from the pool as it runs. Its attention gets the
  buffer's keys and values in the buffer's layout, so logits are stock's bitwise; what it
  changes is memory: a prefill holds one layer's context outside the pool, not every
  layer's. Models with a sliding-window layer keep the buffer (a rotating buffer's layout
  is its own).
- ``off``: mlx-lm's buffer, filled from the pool at admission (``cache/batch.py``).
- ``auto``: each prompt batch as ``reads_pool`` decides when it starts: from the pool where
  the buffer would hold a copy nothing else needs, else the buffer, which reads the
  history once where a pass over the pool gathers it at every pass (and the decode
  batch's buffer again after).

Either way the logits are stock's, bitwise: the two paths differ in copies and memory.

Rows that finish their prompt move to the decode batch through ``PoolPromptBatch.split``:
they get the caches of the decode path they join (``DecodePath.caches_for``), so the
prefix is not copied there either when they decode on the shared path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch, _right_pad_prompts

from ..cache.batch import rows_of
from ..cache.page_table import PageTable
from ..cache.paged_batch import PagedBatchKVCache
from ..memory.cache_list import flat, map_parts
from ..memory.pool import KVPool
from ..memory.prefix_groups import group_rows
from . import prompt_attention

log = logging.getLogger("mlx_radix")

MODES = ("auto", "on", "off")


def enable(
    mode: str,
    pool: KVPool,
    query_heads: int | None = None,
    shared: str = "off",
    attention_calls: int | None = None,
    activation_bytes: int = 0,
    attention: str = "auto",
) -> bool:
    """Set whether ``pool``'s prompt batches read it layer by layer; returns it.
    ``query_heads``: the model's, which size a layer's scores (``PagedBatchKVCache``);
    ``activation_bytes``: a token's activations through one layer, in the model's dtype.
    ``shared``: whether rows sharing a prefix read it once a layer (``prefill.shared_prefix``,
    ``cache/grouped_prefill.py``), which needs every attention call of a forward pass to
    reach the patched call site with its own layer's cache (``attention_calls``, one a
    layer: a layer attending with another's K/V would get only the pass's new ones).
    ``attention``: how a prompt pass attends (``prefill.attention``, prompt_attention.py)."""
    if mode not in MODES:
        raise ValueError(f"prefill.from_pool must be one of {', '.join(MODES)}, got {mode!r}")
    if attention not in prompt_attention.MODES:
        raise ValueError(
            f"prefill.attention must be one of {', '.join(prompt_attention.MODES)}, "
            f"got {attention!r}"
        )
    pool.prefill_attention = attention
    if shared not in MODES:
        raise ValueError(f"prefill.shared_prefix must be one of {', '.join(MODES)}, got {shared!r}")
    windowed = any(spec.window is not None for spec in pool.specs)
    if mode == "on" and windowed:
        log.info("prefill.from_pool: a sliding-window layer keeps the batch buffer")
    pool.prefill_from_pool = mode != "off" and not windowed
    pool.query_heads = query_heads
    # A pass's tokens hold their activations through a layer and, until the pass writes
    # them, every layer's new K/V: on the H200 (8B, 16 agents) a pass of 16 x 423 tokens held
    # 1.5 GB beyond its layer estimate of context and scores, about 0.9 GB of each.
    pool.prefill_token_bytes = activation_bytes + pool.bytes_per_token
    if shared == "auto" and mx.default_device() == mx.cpu:
        # On MLX's CPU backend a prefill is the model's compute, and gathers are cheap: 8
        # rows of 30 tokens on a cached 496-token prefix (SmolLM2-135M's shape, float32)
        # took 19.2-19.5 s grouped against 18.0-18.8 s each row reading its own.
        shared = "off"
    own_caches = attention_calls == pool.num_layers
    if shared != "off" and pool.prefill_from_pool and not own_caches:
        log.info(
            "prefill.shared_prefix off: this model attends outside mlx-lm's "
            "scaled_dot_product_attention, with another layer's K/V or with a mask of its own"
        )
    pool.prefill_shared = shared if pool.prefill_from_pool and own_caches else "off"
    return pool.prefill_from_pool


def reads_pool(
    pool: KVPool,
    tables: list[PageTable],
    lengths: list[int],
    decode_reads_pool: bool,
    awaited: bool,
) -> bool:
    """``auto``'s choice for a prompt batch of ``tables`` (rows ``lengths`` tokens long once
    prefilled): the pool where the rows decode on the shared path (``decode_reads_pool``,
    ``DecodePath.reads_pool``), which reads the pool, so a buffer would be made only to be
    dropped; where requests wait for these rows' pages (``awaited``: in-flight sharing),
    which they join as they are written, each with a copy of them in a buffer; where rows
    share a prefix that ``prefill.shared_prefix`` reads once a pass (only over the pool:
    ``cache/grouped_prefill.py``); or where the buffer, every layer's context at once, would
    pass the pool's working set. Else the buffer: the exact decode path, which CPUs and
    Metal take for rows of their own, holds one anyway, and a pass over the pool gathers the
    context at every pass and again for the decode batch's buffer.

    Measured through the server on 2 CPU cores, the same requests one at a time, median TTFT
    of a chat's later turns (2026-12-07, two runs each): 384 tokens over 24,000 of its own
    on ``tiny-long``, 0.668 / 0.700 s from the pool, 0.627 / 0.631 s with the buffer (stock
    0.644 / 0.782); 48 over 1,200 on SmolLM2-135M, 0.674 / 0.691 s against 0.669 / 0.657
    (stock 0.755 / 0.795). Rows sharing a cached prefix take the buffer there too (the CPU
    keeps ``prefill.shared_prefix`` off, and they decode exact): the medium bench's agent
    sessions (``tiny-long``, 2 sessions on a 24,000-token prompt) had TTFT mean 0.667 /
    0.655x stock's with those rows on the pool, 0.646 / 0.629x on buffers (seeds 0 / 1)."""
    if decode_reads_pool or awaited:
        return True
    if pool.prefill_shared != "off":
        groups = group_rows([t.pages for t in tables], lengths, pool.page_size)
        if any(len(g.rows) > 1 for g in groups):
            return True
    budget = pool.prefill_working_bytes
    return budget is not None and len(tables) * max(lengths) * pool.bytes_per_token > budget


def is_paged(caches: list) -> bool:
    return any(isinstance(c, PagedBatchKVCache) for c in flat(caches))


class PoolPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch, whose rows leave for decoding with the decode path's caches."""

    # Given the caches of rows that finished their prompts, the caches they decode with.
    caches_for: Callable[[list], list] | None = None

    def split(self, indices):
        batch = super().split(indices)
        if self.caches_for is not None and is_paged(batch.prompt_cache):
            batch.prompt_cache = self.caches_for(batch.prompt_cache)
        return batch

    def prompt(self, tokens):
        """mlx-lm's ``PromptProcessingBatch.prompt`` (the same passes, so the same logits),
        with two differences. Over the pool a pass takes fewer than ``prefill_step_size``
        queries where one layer's scores would pass the pool's working set
        (``PagedBatchKVCache.query_step``). And MLX's cache of freed buffers is not emptied
        after each pass where the server bounds it (``KVPool.freed_buffers``): the
        bound already keeps it from holding a prefill's temporaries, and on the H200 (8B,
        a burst of 32 on a new 2,048-token prefix) each emptying took 12-16 ms of a pass
        that the first token waited for, and the next pass allocated its buffers again."""
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        if not tokens:
            return
        for held, new in zip(self.tokens, tokens):
            held += new
        lengths = [len(p) for p in tokens]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if max(padding) > 0:
            tokens = _right_pad_prompts(tokens, max_length=longest)
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
        else:
            tokens = mx.array(tokens)
        paged = next((c for c in flat(self.prompt_cache) if isinstance(c, PagedBatchKVCache)), None)
        bounded = paged.query_step(longest) if paged else None
        step = min(self.prefill_step_size, bounded or self.prefill_step_size)
        rows = rows_of(self.prompt_cache)
        keep_freed = rows is not None and rows.pool.freed_buffers is not None
        while tokens.shape[1] > 0:
            n = min(step, tokens.shape[1])
            self.model(tokens[:, :n], cache=self.prompt_cache)
            mx.eval([c.state for c in self.prompt_cache])
            if not keep_freed:
                mx.clear_cache()
            tokens = tokens[:, n:]
        if max(padding) > 0:
            for c in self.prompt_cache:
                c.finalize()
            mx.eval([c.state for c in self.prompt_cache])
            if not keep_freed:
                mx.clear_cache()

    def extend(self, batch):
        # A batch that could not read the pool (a row the pool cannot hold) joins one that
        # does, or the other way: both take the buffer (all their tokens are in the pool).
        if self.prompt_cache and batch.prompt_cache:
            if is_paged(self.prompt_cache) and not is_paged(batch.prompt_cache):
                self.prompt_cache = buffered(self.prompt_cache)
            elif is_paged(batch.prompt_cache) and not is_paged(self.prompt_cache):
                batch.prompt_cache = buffered(batch.prompt_cache)
        super().extend(batch)


def buffered(caches: list) -> list:
    """The same rows over mlx-lm's batch buffer, as wide as it would have grown, filled from
    the pool (``PagedBatchKVCache.to_buffered``); evaluated together, before the pool is
    written again (a write evaluated with a pending read of its array copies it)."""
    out = map_parts(lambda c: c.to_buffered() if isinstance(c, PagedBatchKVCache) else c, caches)
    made = [c for c, old in zip(flat(out), flat(caches)) if c is not old]
    if made:
        made[0].rows.pool.settle()
        mx.eval([c.state for c in made])
    return out
