"""A prompt pass's attention within the working set, at any prompt length (``prefill.attention``).

mlx-lm's batch caches hand attention an array mask (left padding), and MLX then holds
arrays as large as the scores: on the CPU its attention is the scores by hand, and on CUDA
a boolean mask is made an additive one of the scores' shape (queries x keys x query heads,
from two arrays of that size: ``fast.cpp``) before cuDNN reads it. Measured on an H100 (one
layer of Llama-3.1-8B's shape, bf16, 2,048 queries over 24,576 keys): 6.46 GB of
temporaries and 9.5 ms with the array mask, 0.02 GB and 1.5 ms as a causal call; over 65,536
keys 17.2 GB and 34 ms against 0.02 GB and 4 ms. A prompt pass builds every layer before the
device runs them, so an 8B model's 25.6k-token prompt died of ``cudaMallocAsync`` on the 80 GB
card, in stock's server as in ours (docs/benchmarking.md, "Prompt attention in blocks").

With ``auto``:
- on CUDA, where cuDNN's flash attention serves the shapes (fp16/bf16, head dims a multiple
  of 8 up to 128, no sinks), a pass over the pool (``PagedBatchKVCache``, whose rows' left
  padding is known on the host) attends with the causal mask, each padded row on its own
  columns: nothing as large as the scores is held;
- elsewhere, where a layer's scores (``SCORE_BYTES`` a query, key and head) would pass
  ``KVPool.attention_bytes`` (half the prefill reserve, at least ``ATTENTION_MIN_BYTES``:
  memory/budget.py), the queries are split into blocks that fit, each block over
  the keys it can see (the causal mask hides the rest); where even ``MIN_QUERY_BLOCK``
  queries over those keys would not fit, the keys are split too, with an online softmax
  (``_flash``).

A query block is mlx-lm's own call on fewer rows (each query's softmax is its own), but a
BLAS may round a product by its rows (the system OpenBLAS does, MLX's own did not), and
the causal kernel and the key split sum in another order than stock: all within
``FIDELITY_TOLERANCE`` (tests/test_prompt_attention.py). ``off``: mlx-lm's call, whole, as
stock, bitwise.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

MODES = ("auto", "off")

# Bytes a query holds per key and query head while MLX computes attention by hand: the
# float32 scores, their masked copy and the softmax (fast.cpp's fallback).
SCORE_BYTES = 12
# The fewest queries a block takes before the keys are split as well (a block reads every
# key it sees once: smaller blocks read them more often), unless MIN_KEY_BLOCK keys leave
# room for fewer.
MIN_QUERY_BLOCK = 64
# Keys a block of the online softmax takes at once, at least.
MIN_KEY_BLOCK = 256
# Rows whose left padding differs share one causal call (``rolled``) while the most padding
# is at most 1/ROLLED_PADDING of the pass's queries: each row computes that many queries
# more (a row alone in its call computes none, but builds a graph of its own).
ROLLED_PADDING = 4

_STOCK = base.scaled_dot_product_attention
# A score no key gets: finite, so that a block whose keys are all masked weighs 0, not NaN.
_MASKED = -1e30


def fused_causal(queries: mx.array, keys: mx.array, values: mx.array, sinks) -> bool:
    """Whether MLX runs a causal call of these shapes through cuDNN's flash attention
    (``supports_sdpa_cudnn`` in mlx/backend/cuda/scaled_dot_product_attention.cpp)."""
    if sinks is not None or mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return False
    if queries.dtype not in (mx.float16, mx.bfloat16):
        return False
    dims = (queries.shape[-1], values.shape[-1])
    return all(d % 8 == 0 and d <= 128 for d in dims) and queries.shape[2] <= keys.shape[2]


def prompt_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,
    scale: float,
    mask,
    sinks: mx.array | None = None,
    padding: list[int] | None = None,
) -> mx.array:
    """A prompt pass's attention (``queries`` ``(B, Hq, S, D)`` over ``keys`` ``(B, H, L, D)``,
    the pass's ``S`` tokens last) within the pool's ``attention_bytes``; ``padding``: each
    row's left padding, where the cache knows it on the host."""
    pool = cache.rows.pool
    B, Hq, S, _ = queries.shape
    L = keys.shape[2]
    plain = mask == "causal" if isinstance(mask, str) else getattr(mask, "dtype", None) == mx.bool_
    if pool.prefill_attention == "off" or S == 1 or not plain:
        return _STOCK(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    fused = padding is not None and fused_causal(queries, keys, values, sinks)
    if padding is not None:
        pool.prompt_attention_fused[cache.layer] = fused  # what the next passes' estimates count
    if fused:
        if not any(padding):
            return causal(queries, keys, values, scale)
        # The rows' keys and values copied: within the share of the working set that the
        # scores have elsewhere (cuDNN holds none).
        copies = keys.nbytes + values.nbytes
        fits = pool.attention_bytes is None or copies <= pool.attention_bytes
        if fits and max(padding) * ROLLED_PADDING <= S:
            return rolled(queries, keys, values, scale, padding)
        # Each row over its own columns: its padding is at their start.
        rows = [
            causal(queries[i : i + 1], keys[i : i + 1, :, p:], values[i : i + 1, :, p:], scale)
            for i, p in enumerate(padding)
        ]
        return mx.concatenate(rows, axis=0)
    budget = pool.attention_bytes
    if budget is None or B * Hq * S * L * SCORE_BYTES <= budget:
        return _STOCK(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    # Nothing reads the last layer's output in a prompt pass (mlx-lm evaluates the caches'
    # state, and a recurrent layer after it would read it): evaluating its blocks would run
    # what the lazy graph leaves out. On the wide model of tests/test_prompt_attention.py (2
    # layers), 24,576 tokens took 35 s with its blocks evaluated against 22 s without.
    last = cache.layer == pool.num_layers - 1 and not pool.state_sizes
    return blocked(queries, keys, values, scale, mask, sinks, budget, settle=not last)


def rolled(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, padding: list[int]
) -> mx.array:
    """The causal call over rows with left padding, one call for the batch: each row's
    padding moved after its keys, and as many queries that nothing reads added after its own,
    so that its queries still end at its last key (cuDNN's causal mask is aligned to the
    last key); then queries before them until every row has as many. Each row's own queries
    see the keys they saw. Rows called one by one each have a shape of their own, so a graph
    of their own to build (``causal``). On an H100 (Llama-3.1-8B's attention, bf16, 3 rows
    of 1,057 queries over 28,836 columns, padding 0, 7 and 250): the first call 165 ms
    against 1,501 one by one, then 4.5 against 3.6 ms; outputs bitwise the same."""
    B, Hq, S, _ = queries.shape
    most = max(padding)
    qs, ks, vs = [], [], []
    for i, p in enumerate(padding):
        qs.append(mx.pad(queries[i : i + 1], [(0, 0), (0, 0), (most - p, p), (0, 0)]))
        ks.append(mx.pad(keys[i : i + 1, :, p:], [(0, 0), (0, 0), (0, p), (0, 0)]))
        vs.append(mx.pad(values[i : i + 1, :, p:], [(0, 0), (0, 0), (0, p), (0, 0)]))
    q, k, v = (mx.concatenate(x, axis=0) for x in (qs, ks, vs))
    out = causal(q, k, v, scale)
    return mx.concatenate(
        [out[i : i + 1, :, most - p : most - p + S] for i, p in enumerate(padding)], axis=0
    )


def causal(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """cuDNN's causal call (``fused_causal``), its queries row-contiguous.

    MLX builds a cuDNN graph for each new set of input shapes and strides (``sdpa_cudnn``):
    about 65 ms on an H100, against 1 ms a call once built (one layer of Llama-3.1-8B's
    shape, 1,024 queries over 27,000 keys). A prompt's passes meet a new key count each, so
    a fresh 65,536-token prompt built 32 graphs, about 2.1 s of its 6.5 s. With the queries'
    layout fixed here, whatever the model left them in, a fresh prompt's passes (keys as
    wide as their columns: ``PagedBatchKVCache``'s growth rule) are the shapes ``prebuild``
    builds at load."""
    geometry = (queries.shape[1], keys.shape[1], queries.shape[-1], values.shape[-1])
    _CAUSAL_GEOMETRIES.add((*geometry, queries.dtype))
    return _STOCK(mx.contiguous(queries), keys, values, None, scale=scale, mask="causal")


# (query heads, KV heads, key and value head dims, dtype) of the calls ``causal`` made: the
# warm-up's passes show ``prebuild`` the model's.
_CAUSAL_GEOMETRIES: set[tuple] = set()


def prebuild(step: int, limit: int) -> int:
    """Build cuDNN's graphs for a fresh prompt's passes of ``step`` queries over ``step``,
    ``2 x step``, ... up to ``limit`` keys, one row, for each geometry ``causal`` has met
    (none where cuDNN does not serve); returns the calls made. A graph took 57-69 ms to build
    on an H100, so a 131,072-token context in passes of 2,048 (64 graphs) about 4 s."""
    calls = 0
    for heads, kv_heads, k_dim, v_dim, dtype in sorted(_CAUSAL_GEOMETRIES, key=str):
        queries = mx.zeros((1, heads, step, k_dim), dtype)
        for columns in range(step, limit + 1, step):
            keys = mx.zeros((1, kv_heads, columns, k_dim), dtype)
            values = mx.zeros((1, kv_heads, columns, v_dim), dtype)
            mx.eval(causal(queries, keys, values, k_dim**-0.5))
            calls += 1
    return calls


def blocked(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask,
    sinks: mx.array | None,
    budget: int,
    settle: bool = False,
) -> mx.array:
    """Attention in query blocks whose scores fit ``budget``, each over the keys it can see
    (its pass's tokens are the last ``S`` keys, so a block ending at query ``b`` sees the
    first ``L - S + b``); the keys split too where ``MIN_QUERY_BLOCK`` queries do not fit.

    ``settle``: evaluate each block (and each key block) before the next is built. MLX
    allocates an operation's output when it is queued, not when it runs, so blocks built
    together are held together: on 2 CPU cores, 1,755 queries over 16,091 keys (4 query
    heads, one KV head) in blocks of 82 MB of scores held 437 MB at once, and 91 MB with
    each block evaluated, in the same time; with 64 query heads over 16,384 keys and a 256
    MiB budget, 1,436 MB against 199 MB. In the server, a 24,576-token prompt's passes held
    474 MB of working memory against 322 MB named, and 149 MB once settled."""
    B, Hq, S, _ = queries.shape
    L = keys.shape[2]
    prev = L - S
    per_key = B * Hq * SCORE_BYTES
    block = max(1, budget // (per_key * L))
    if block < MIN_QUERY_BLOCK:
        # Fewer queries than that over all keys: blocks of keys too, each at least
        # MIN_KEY_BLOCK, and as many queries as the budget leaves over them.
        block = min(S, MIN_QUERY_BLOCK, max(1, budget // (per_key * MIN_KEY_BLOCK)))
    outs = []
    for a in range(0, S, block):
        b = min(S, a + block)
        cols = prev + b
        m = mask[..., a:b, :cols] if isinstance(mask, mx.array) else mask
        q, k, v = queries[:, :, a:b], keys[:, :, :cols], values[:, :, :cols]
        if per_key * (b - a) * cols <= budget:
            outs.append(_STOCK(q, k, v, None, scale=scale, mask=m, sinks=sinks))
        else:
            key_block = max(MIN_KEY_BLOCK, budget // (per_key * (b - a)))
            outs.append(_flash(q, k, v, scale, m, sinks, key_block, settle))
        if settle and b < S:
            mx.eval(outs[-1])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _flash(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask,
    sinks: mx.array | None,
    key_block: int,
    settle: bool = False,
) -> mx.array:
    """Attention over ``keys`` in blocks of ``key_block``, with a running max and sum in
    float32 (an online softmax): one block's scores held at a time.

    A block's weights have one reader, a product with its values and a column of ones (the
    sum comes with the output): read twice, MLX's evaluation, which follows the output's
    chain first, would hold every block's weights until it followed the sum's."""
    B, Hq, S, D = queries.shape
    H, L = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = (queries * scale).reshape(B, H, G * S, D)
    if isinstance(mask, str):  # causal, aligned to the last key
        rows = mx.arange(L - S, L)[:, None]
        mask = rows >= mx.arange(L)[None]
    if mask.ndim == 4:  # (B or 1, 1, S, L) -> (B or 1, 1, 1, S, L): every query head alike
        mask = mask[:, :, None]
    top = acc = None  # acc: (B, H, G, S, Dv + 1), the output's sum and the weights' last
    for c in range(0, L, key_block):
        d = min(L, c + key_block)
        scores = (q @ keys[:, :, c:d].swapaxes(-1, -2)).astype(mx.float32)
        scores = mx.where(mask[..., c:d], scores.reshape(B, H, G, S, d - c), _MASKED)
        new_top = scores.max(axis=-1, keepdims=True)
        if top is not None:
            new_top = mx.maximum(top, new_top)
        v = values[:, :, c:d].astype(mx.float32)
        v = mx.concatenate([v, mx.ones((*v.shape[:-1], 1), mx.float32)], axis=-1)
        e = mx.exp(scores - new_top).reshape(B, H, G * S, d - c)
        part = (e @ v).reshape(B, H, G, S, -1)
        acc = part if acc is None else acc * mx.exp(top - new_top) + part
        top = new_top
        if settle and d < L:
            mx.eval(acc, top)
    out, total = acc[..., :-1], acc[..., -1:]
    if sinks is not None:  # the sink's logit enters each query's softmax once
        sink = sinks.astype(mx.float32).reshape(1, H, G, 1, 1)
        new_top = mx.maximum(top, sink)
        w = mx.exp(top - new_top)
        out, total = out * w, total * w + mx.exp(sink - new_top)
    return (out / total).astype(queries.dtype).reshape(B, Hq, S, -1)
