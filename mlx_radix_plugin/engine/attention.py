"""Decode attention that reads each shared prefix once: the patched call site and its math.

mlx-lm's attention modules call ``scaled_dot_product_attention`` from ``models/base.py``,
imported by name into each model's module. ``install`` replaces that name in the modules
of a loaded model with ``scaled_dot_product_attention`` below, which sends a
``SharedPrefixBatchCache`` to ``shared_prefix_attention`` and passes every other call to
mlx-lm's own function unchanged (same arguments, same kernel: the exact path stays bitwise
stock). mlx-lm's files are not touched.

The math, per layer, for one decode step (each row: one query token, ``G`` query heads per
KV head). A group of ``n`` rows shares a ``P``-token prefix: their ``n x G`` queries per KV
head are one matrix against one gather of the prefix (a GEMM, where stock runs one
matrix-vector product per row and head over its own copy). Each row also attends to its
own tokens (what follows its group's prefix, gathered from its pages, padded to the
longest) and to the token of this step. The two parts keep their own running max and sum
and are merged as one softmax: ``(o_p e^(m_p-M) + o_o e^(m_o-M)) / (l_p e^(m_p-M) +
l_o e^(m_o-M) [+ e^(sink-M)])``, so an attention sink (gpt-oss) enters the softmax once.
A sliding-window layer masks what left its window, and skips a group's prefix part when
the window has left the prefix for all its rows.

That is the ``split`` variant. The ``masked`` one computes the same step as one fused
attention call over all rows at once (``masked_attention``): fewer operations, more
products; ``variant`` picks by device and sizes, from measurements. On CUDA a third, the
``paged`` one, is a kernel of its own that reads each row's pages in place
(``paged_attention.py``): one or two operations a layer where the others take dozens.

Summing in another order than stock changes float32 logits by rounding only:
``FIDELITY_TOLERANCE`` is what the tests hold every step of every architecture to.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from ..cache.batch import PoolBatchKVCache
from ..cache.grouped_prefill import GroupedPass
from ..cache.offset import OffsetCache
from ..cache.paged_batch import PagedBatchKVCache
from ..cache.shared_batch import SharedPass, SharedPrefixBatchCache, owner_of
from ..memory.pool import FlatViews, KVPool
from ..memory.slots import HeadSlots
from . import paged_attention
from .prompt_attention import prompt_attention

# Max |logit - stock's logit| <= FIDELITY_TOLERANCE x max |stock's logit|, float32, at every
# step; greedy tokens equal. Measured on the test models: 1e-6 to 1e-5 of max |logit|.
FIDELITY_TOLERANCE = 1e-4

_STOCK = base.scaled_dot_product_attention
# A score no key gets: finite, so that a part whose keys are all masked yields weight 0
# in the merge, not NaN (exp(-inf - -inf)).
_MASKED = -1e30


# The caches seen by the call site while ``routes_attention`` probes a model; else None.
_probe: list | None = None


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's call site: shared-prefix batches here, everything else to mlx-lm's own."""
    if cache is None:  # a layer attending with another layer's K/V (gemma4's KV sharing)
        cache = owner_of(keys)
    if isinstance(cache, SharedPrefixBatchCache):
        out = shared_prefix_attention(queries, keys, values, cache, scale, sinks)
        cache.attended()
        return out
    if isinstance(cache, PagedBatchKVCache) and cache.grouped is not None:
        # Dropped once read: a layer's gathered columns are not held through the pass.
        (grouped, context), cache.grouped = cache.grouped, None
        return grouped_prefill_attention(queries, keys, values, grouped, context, scale, sinks)
    if _probe is not None:
        _probe.append((cache, keys, mask))
    if queries.shape[2] > 1 and isinstance(cache, PagedBatchKVCache | PoolBatchKVCache):
        # Rows' left padding, where the mask is the pass's own causal one (paged_batch.py).
        own = isinstance(cache, PagedBatchKVCache) and mask is cache.rows.causal_mask
        padding = cache._padding if own else None
        return prompt_attention(queries, keys, values, cache, scale, mask, sinks, padding)
    return _STOCK(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


class _Probe(OffsetCache):
    """A layer's cache in a lazy forward pass that checks the call site is reached."""

    def update_and_fetch(self, keys, values):
        self.keys = keys
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None


def _modules(model: nn.Module) -> Iterable:
    seen = set()
    for m in model.modules():
        name = type(m).__module__
        if name not in seen:
            seen.add(name)
            module = sys.modules.get(name)
            if module is not None:
                yield module


def install(model: nn.Module) -> list[str]:
    """Route the attention of ``model``'s modules through this module; returns their names.

    Idempotent. Only modules that imported mlx-lm's function by name are changed.
    """
    patched = []
    for module in _modules(model):
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is _STOCK:
            module.scaled_dot_product_attention = scaled_dot_product_attention
        if getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention:
            patched.append(module.__name__)
    return patched


def attention_calls(model: nn.Module, pool: KVPool) -> int | None:
    """Attention calls in one forward pass of ``model`` if every one goes through the
    patched call site with a pool layer's cache, or with the K a pool layer's cache just
    returned (a layer reusing another's K/V), and with no mask but the cache's; None if any
    does not (shared-prefix decode and the grouped prefill cannot serve that model: they
    make their own masks and read K/V from the pool, so a mask the model computed itself,
    as DeepSeek-V3's attention passes its rotary scores, would be dropped).

    One lazy forward pass with probe caches, never evaluated, after ``install``.
    """
    global _probe
    install(model)
    probes = [_Probe() for _ in range(pool.num_layers)]
    _probe = seen = []
    try:
        model(mx.array([[0]], dtype=mx.int32), cache=probes)
    except Exception:  # a model that needs more of its cache than an offset
        return None
    finally:
        _probe = None
    owners = {id(p.keys): p for p in probes if hasattr(p, "keys")}
    served = [cache if cache is not None else owners.get(id(keys)) for cache, keys, _ in seen]
    if any(c is None for c in served) or {id(c) for c in served} != {id(p) for p in probes}:
        return None
    if any(isinstance(mask, mx.array) for _, _, mask in seen):  # the probes make none
        return None
    return len(served)


_LOG2_E = 1.4426950408889634


def _exp(x: mx.array) -> mx.array:
    """``exp``, as 2^(x log2 e) on the CPU: MLX's CPU ``exp`` is the largest cost of decode
    attention there, and its ``power`` of 2 is 2.7x faster. Measured on 3 x 24 x 2,048
    float32 scores (SmolLM2 shape, 8 rows): exp 1.80 ms, multiply + power 0.71 ms, same
    values to 1e-6 relative; ``exp`` in a compiled function 1.89 ms.
    """
    if mx.default_device() == mx.cpu:
        return mx.power(2.0, x * _LOG2_E)
    return mx.exp(x)


def _softmax_parts(scores: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(max, exp(scores - max), their sum) over the last axis, in float32."""
    scores = scores.astype(mx.float32)
    m = scores.max(axis=-1, keepdims=True)
    e = _exp(scores - m)
    return m, e, e.sum(axis=-1, keepdims=True)


def _empty_part(n: int, H: int, G: int, Dv: int) -> tuple[mx.array, mx.array, mx.array]:
    """What a part with no visible key adds to the merge: nothing (its weight is 0)."""
    return (
        mx.full((n, H, G, 1), _MASKED, mx.float32),
        mx.zeros((n, H, G, 1), mx.float32),
        mx.zeros((n, H, G, Dv), mx.float32),
    )


def _prefix_part(
    q: mx.array, k: mx.array, v: mx.array, visible: mx.array | None
) -> tuple[mx.array, mx.array, mx.array]:
    """One group's prefix ``(H, tokens, D)`` for its ``(n, H, G, D)`` queries, read once:
    ``(m, l, o)`` per row."""
    n, H, G, Dk = q.shape
    stacked = q.transpose(1, 0, 2, 3).reshape(H, n * G, Dk)
    scores = stacked @ k.swapaxes(-1, -2)  # (H, n * G, tokens)
    if visible is not None:
        tokens = visible.shape[-1]
        visible = mx.broadcast_to(visible[:, None, :], (n, G, tokens)).reshape(n * G, tokens)
        scores = mx.where(visible, scores, _MASKED)
    m, e, total = _softmax_parts(scores)
    o = e.astype(v.dtype) @ v  # (H, n * G, Dv)
    return tuple(x.reshape(H, n, G, -1).transpose(1, 0, 2, 3) for x in (m, total, o))


def _prefix_parts(
    q: mx.array, k_views: FlatViews, v_views: FlatViews, index: HeadSlots, visible: mx.array | None
) -> tuple[mx.array, mx.array, mx.array]:
    """``_prefix_part`` over a prefix the pool holds in several chunks.

    On the CPU, a part a chunk, merged, rather than a copy of the prefix into one array
    every layer (2 cores, 8 x 2,048 on SmolLM2's shape: 175 ms a step with the copy, 160 ms
    in one chunk). On a GPU, where a step costs its operations more than its bytes, the
    chunks' rows are put together and read as one part (H200, Llama-3-8B bf16, 32 x 4,096
    with 288 own tokens, split variant, over chunks of 576 MB: 42.5 ms a step joined, 50.6
    ms with a part a chunk; 30-36 ms in one chunk).
    """
    pieces = index.pieces
    joined = CHUNK_READ == "joined" or (CHUNK_READ is None and mx.default_device() == mx.gpu)
    if len(pieces) > 1 and joined:
        k = mx.concatenate([k_views[c][rows] for c, rows, _ in pieces], axis=1)
        v = mx.concatenate([v_views[c][rows] for c, rows, _ in pieces], axis=1)
        if visible is not None:
            visible = mx.concatenate([visible[:, at] for _, _, at in pieces], axis=1)
        return _prefix_part(q, k, v, visible)
    parts = []
    for c, rows, at in pieces:
        seen = visible if visible is None or at is None else visible[:, at]
        parts.append(_prefix_part(q, k_views[c][rows], v_views[c][rows], seen))
    if len(parts) == 1:
        return parts[0]
    top = parts[0][0]
    for m, _, _ in parts[1:]:
        top = mx.maximum(top, m)
    weights = [_exp(m - top) for m, _, _ in parts]
    return (
        top,
        sum(total * w for (_, total, _), w in zip(parts, weights)),
        sum(o * w for (_, _, o), w in zip(parts, weights)),
    )


# How the shared path computes: None decides by device and sizes (``variant``, and the
# paged kernel where the batch's cache allows it); tests set "split", "masked" or "paged"
# to check each on the CPU ("paged" computes there what the kernel does, in MLX operations).
VARIANT: str | None = None
# How the split variant reads a prefix spread over chunks: "parts" (a softmax part a chunk)
# or "joined" (one part); None: joined on a GPU, parts on the CPU (``_prefix_parts``).
CHUNK_READ: str | None = None

# On a GPU the masked variant is taken while a layer's scores (query heads x rows x key
# columns, padding included) stay under this; above, the split one. Measured on the H200
# (Llama-3-8B, bf16, 32 query heads), ms a decode step in process, 40 steps, with 32 and
# 288 own tokens a row (the latter: a request 256 tokens into its answer):
#
#   rows x prefix, own     stock   split   masked   masked scores a layer
#   8 x 1,024, 32            8.6    24.8      9.5     0.5M
#   32 x 2,048, 32          26.5    18.6     16.8     4.2M
#   32 x 4,096, 32          49.3    18.5     21.1     6.3M
#   32 x 2,048, 288         28.9    21.1     30.0    12.6M
#   32 x 4,096, 288         51.8    23.0     33.4    14.7M
#
# The split variant's ~45 operations a layer cost ~11 ms a step whatever the sizes; the
# masked one's single fused call grows with its scores, and passes the split near 5M.
MASKED_MAX_SCORES = 5_000_000


def variant(step: SharedPass, query_heads: int) -> str:
    """``split``: each part by hand and merged (fewest FLOPs, most operations); ``masked``:
    one fused call that also scores the other rows' own tokens (``masked_attention``).

    On the CPU the split variant (OpenBLAS GEMMs, power-of-2 ``_exp``) is the one measured
    to pay: 8 x 2,048 at 1.95x stock in process. On a GPU, by ``MASKED_MAX_SCORES``.
    """
    if VARIANT is not None:
        return VARIANT
    if mx.default_device() == mx.cpu:
        return "split"
    scores = query_heads * len(step.lengths) * step.masked_columns()
    return "masked" if scores <= MASKED_MAX_SCORES else "split"


def masked_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: SharedPrefixBatchCache,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """The step as one fused attention call: the rows' queries stacked as one sequence
    over every group's prefix, every row's own tokens and the step's tokens, with a mask
    giving each row its prefix, its own tokens and its token. One read of each prefix,
    an exact softmax per row, sinks once; the cost is that every row also scores the
    others' own tokens (masked), ``rows x rows x own`` products, which ``variant`` bounds.
    """
    step = cache.step
    k_views, v_views = step.pool.flat_views(cache.layer)
    index, mask = step.masked_layout(keys.shape[1], cache.window)
    # (1, H, tokens + B, D): the gathered columns, then the step's tokens in row order.
    # Columns in the order the pool's chunks give them (the mask was permuted alike).
    k = mx.concatenate(
        [index.gather(k_views, ordered=False)[None], keys.transpose(2, 1, 0, 3)], axis=2
    )
    v = mx.concatenate(
        [index.gather(v_views, ordered=False)[None], values.transpose(2, 1, 0, 3)], axis=2
    )
    out = mx.fast.scaled_dot_product_attention(
        queries.transpose(2, 1, 0, 3), k, v, scale=scale, mask=mask, sinks=sinks
    )
    return out.transpose(2, 1, 0, 3)


def grouped_prefill_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    grouped: GroupedPass,
    context: tuple[mx.array | None, mx.array | None],
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """One layer of a prompt pass whose rows share a prefix (``cache/grouped_prefill.py``):
    ``queries`` ``(B, Hq, S, D)`` stacked as one sequence over the layer's gathered columns
    (``context``, each prefix once) and the pass's ``keys``/``values`` ``(B, H, S, D)``, with
    ``grouped.visible`` as the mask: the masked decode variant's shape, one fused call or the
    scores by hand (``grouped_attention``)."""
    B, Hq, S, Dk = queries.shape
    H = keys.shape[1]
    k, v = (x.transpose(1, 0, 2, 3).reshape(H, B * S, x.shape[-1]) for x in (keys, values))
    k_ctx, v_ctx = context
    if k_ctx is not None:
        k, v = mx.concatenate([k_ctx, k], axis=1), mx.concatenate([v_ctx, v], axis=1)
    q = queries.transpose(1, 0, 2, 3)  # (Hq, B, S, D): each query head's rows in one sequence
    if grouped_attention() == "fused":
        out = mx.fast.scaled_dot_product_attention(
            q.reshape(1, Hq, B * S, Dk), k[None], v[None], scale=scale, mask=grouped.visible,
            sinks=sinks,
        )  # fmt: skip
    else:
        out = _grouped_scores(q.reshape(H, (Hq // H) * B * S, Dk) * scale, k, v, grouped, sinks)
    return out.reshape(Hq, B, S, -1).transpose(1, 0, 2, 3)


def _grouped_scores(
    q: mx.array, k: mx.array, v: mx.array, grouped: GroupedPass, sinks: mx.array | None
) -> mx.array:
    """The grouped pass's attention as two matrix products and a float32 softmax: ``q``
    ``(H, G x queries, D)``, scaled, the ``G`` query heads of each KV head stacked."""
    H, rows, _ = q.shape
    visible = grouped.visible
    G = rows // visible.shape[0]
    scores = (q @ k.swapaxes(-1, -2)).reshape(H, G, visible.shape[0], -1).astype(mx.float32)
    scores = mx.where(visible, scores, _MASKED)
    if sinks is not None:  # the sink's logit enters each query's softmax once
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(H, G, 1, 1), (*scores.shape[:3], 1))
        scores = mx.concatenate([scores, sink], axis=-1)
    weights = mx.softmax(scores, axis=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    return weights.astype(v.dtype).reshape(H, rows, -1) @ v


# How a grouped prompt pass attends: "fused" (one ``mx.fast.scaled_dot_product_attention``
# call) or "scores" (``_grouped_scores``); None: by device (``grouped_attention``).
GROUPED_ATTENTION: str | None = None


def grouped_attention() -> str:
    """``scores`` on CUDA, ``fused`` elsewhere (Metal's fused attention builds no graph per
    shape; the CPU's is the scores by hand anyway).

    On CUDA, MLX's fused attention with an array mask builds a cuDNN graph for every new
    shape (queries x columns), and a prompt pass's shape seldom repeats. Measured on the H200
    (one layer of Llama-3-8B's shape, bf16, ~1,000 queries over ~3,000 columns): a new shape's
    first fused call took 41-766 ms, then 0.66-1.10 ms; by hand 2.7-6.4 ms, then 1.39-1.79 ms,
    its kernels built once (2.3 s, which the warm-up at load pays). A burst's first round
    then answered in 955 ms fused against 379 ms by hand, later rounds 251 and 297 ms
    (docs/benchmarking.md, "Rows that share a prefix read it once in prefill")."""
    if GROUPED_ATTENTION is not None:
        return GROUPED_ATTENTION
    return "scores" if mx.default_device() != mx.cpu and mx.cuda.is_available() else "fused"


def paged(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: SharedPrefixBatchCache,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array | None:
    """The step through the paged kernel: each row's pages read in place, a call for each
    chunk of the pool they lie in. None where it cannot serve (no row has a page in the pool
    yet; the kernel failed its check on this device for this geometry): the MLX-ops variants
    do then."""
    step = cache.step
    tables = step.paged_pages()
    if tables is None:
        return None
    pool = step.pool
    at = []
    for chunk, pages in tables:
        k_pool, v_pool, base = pool.layer_arrays(cache.layer, chunk)
        at.append(paged_attention.PagedLayer(
            k_pool, v_pool, base, pages, step.positions, pool.page_size, scale, cache.window,
            sinks, (step.head(k_pool), step.head(v_pool)),
        ))  # fmt: skip
    if mx.default_device() == mx.cpu:
        return paged_attention.reference(queries, keys, values, at)
    geometry = (queries.dtype, queries.shape[1], keys.shape[1], keys.shape[-1])
    if not paged_attention.check(
        *geometry, values.shape[-1], pool.page_size, cache.window, sinks is not None
    ):
        return None
    return paged_attention.paged_attention(queries, keys, values, at)


@dataclass(frozen=True)
class PagedPass:
    """A shared decode pass whose every layer reads the pool through the paged kernel (its
    MLX-ops form on the CPU, ``VARIANT = "paged"``): what engine/compiled_pass.py runs as
    one compiled call."""

    # What the call is traced for, besides its inputs' shapes: the kernel or its MLX-ops
    # form, the chunks the rows' pages lie in, the page size, and per layer its group and
    # first row in the group's arrays (``KVPool.layer_places``) and its window.
    key: tuple
    positions: mx.array  # (B,) int32: each row's position for the step's token
    # Each chunk's page table (``SharedRows.paged_pages``), then for each group of layers
    # and each chunk, its key and value arrays (one-row views for the kernel: in_place.head).
    arrays: list[mx.array]


def paged_pass(caches: list, geometry: tuple) -> PagedPass | None:
    """The pass about to run over ``caches`` (a decode batch's, one a layer) as a
    ``PagedPass``, begun; None where a layer would not take the paged kernel (another path,
    a layer reusing another's K/V, no row with a page yet, the kernel's ``check`` failed for
    ``geometry``: dtype, query heads, KV heads, key and value dims)."""
    first = caches[0]
    if not isinstance(first, SharedPrefixBatchCache) or first.attention_calls != len(caches):
        return None
    if not (VARIANT == "paged" or (VARIANT is None and first.paged)):
        return None
    pool = first.rows.pool
    kernel = mx.default_device() != mx.cpu
    windows = tuple(c.window for c in caches)
    if kernel and not all(
        paged_attention.check(*geometry, pool.page_size, w) for w in set(windows)
    ):
        return None
    step = first.begin_pass()
    tables = step.paged_pages()
    if tables is None:
        return None
    arrays = [pages for _, pages in tables]
    for g in range(len(pool.groups)):
        for chunk, _ in tables:
            k, v = pool.group_arrays(g, chunk)
            arrays += [step.head(k), step.head(v)] if kernel else [k, v]
    key = (kernel, len(tables), pool.page_size, pool.layer_places(), windows)
    return PagedPass(key, step.positions, arrays)


def shared_prefix_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: SharedPrefixBatchCache,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of one decode step; ``keys``/``values`` are the step's own ``(B, H, 1, D)``."""
    if VARIANT == "paged" or (VARIANT is None and cache.paged):
        out = paged(queries, keys, values, cache, scale, sinks)
        if out is not None:
            return out
    if variant(cache.step, queries.shape[1]) == "masked":
        return masked_attention(queries, keys, values, cache, scale, sinks)
    step = cache.step
    shared = step.shared
    B, Hq, _, Dk = queries.shape
    H, Dv = keys.shape[1], values.shape[-1]
    G = Hq // H
    q = (queries * scale).reshape(B, H, G, Dk)
    k_views, v_views = step.pool.flat_views(cache.layer)

    # Each row's own tokens and this step's token: one part, (B, H, G, .) .
    width = step.own_width
    new_scores = (q * keys).sum(axis=-1, keepdims=True)
    if width:
        index = step.own_index(H)
        own_k, own_v = index.gather(k_views), index.gather(v_views)  # (B, H, width, D)
        own_scores = mx.where(step.own_mask(cache.window), q @ own_k.swapaxes(-1, -2), _MASKED)
        m, e, total = _softmax_parts(mx.concatenate([own_scores, new_scores], axis=-1))
        o = e[..., :width].astype(own_v.dtype) @ own_v + e[..., width:] * values
    else:
        m, e, total = _softmax_parts(new_scores)
        o = e * values
    merged = [(m, total, o)]

    # Each group's prefix, read once for all its rows; parts in group order, then put back
    # in batch order.
    if shared.prefixed:
        parts = []
        for g, group_rows in enumerate(shared.group_rows):
            n = B if group_rows is None else group_rows.shape[0]
            visible = step.prefix_mask(g, cache.window)
            if isinstance(visible, str):  # the window has left this prefix for every row
                parts.append(_empty_part(n, H, G, Dv))
            else:
                qg = q if group_rows is None else q[group_rows]
                parts.append(
                    _prefix_parts(qg, k_views, v_views, shared.prefix_index(g, H), visible)
                )
        if shared.unprefixed:
            parts.append(_empty_part(shared.unprefixed, H, G, Dv))
        part = [mx.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts)]
        if shared.restore is not None:
            part = [x[shared.restore] for x in part]
        merged.append(tuple(part))

    # One softmax over all parts: each part's sum and output rescaled to the common max.
    top = merged[0][0]
    for m, _, _ in merged[1:]:
        top = mx.maximum(top, m)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, H, G, 1)
        top = mx.maximum(top, sink)
    num = den = None
    for m, total, o in merged:
        w = _exp(m - top)
        num = o * w if num is None else num + o * w
        den = total * w if den is None else den + total * w
    if sinks is not None:
        den = den + _exp(sink - top)
    return (num / den).astype(queries.dtype).reshape(B, Hq, 1, Dv)
