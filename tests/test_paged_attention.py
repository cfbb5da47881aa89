"""The paged decode attention (engine/paged_attention.py): its MLX-ops form against a plain
per-row softmax everywhere, and on CUDA the kernel against that form, over the geometries
the models in use have (grouped query heads, head sizes, windows, sinks, split rows)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_radix_plugin.cache.shared_batch import chunk_page_tables
from mlx_radix_plugin.engine import paged_attention as pa

CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu


def problem(seed, geometry, dtype=mx.float32):
    """Random pool arrays holding a layer from row ``base``, each row's pages scattered:
    the host's copies, the step's queries and own K/V, and the layer for the kernel."""
    rows, lengths, Hq, Hkv, DK, DV, ps, window, sinks = geometry
    rng = np.random.default_rng(seed)
    per_row = -(-max(lengths) // ps) + 1
    total = rows * per_row + 2
    base = 3 * ps  # another layer's rows come first in the array
    k_pool = rng.standard_normal((base + total * ps, Hkv, DK)).astype(np.float32)
    v_pool = rng.standard_normal((base + total * ps, Hkv, DV)).astype(np.float32)
    pages = rng.permutation(total)[: rows * per_row].reshape(rows, per_row).astype(np.int32)
    q = rng.standard_normal((rows, Hq, 1, DK)).astype(np.float32)
    kn = rng.standard_normal((rows, Hkv, 1, DK)).astype(np.float32)
    vn = rng.standard_normal((rows, Hkv, 1, DV)).astype(np.float32)
    s = rng.standard_normal((Hq,)).astype(np.float32) if sinks else None
    host = dict(q=q, kn=kn, vn=vn, k_pool=k_pool, v_pool=v_pool, pages=pages, base=base, sinks=s)
    q, kn, vn, k_pool, v_pool = (mx.array(x).astype(dtype) for x in (q, kn, vn, k_pool, v_pool))
    sinks = None if s is None else mx.array(s).astype(dtype)
    n = mx.array(lengths, dtype=mx.int32)
    at = pa.PagedLayer(k_pool, v_pool, base, mx.array(pages), n, ps, DK**-0.5, window, sinks)
    return host, [q, kn, vn], at


def by_hand(host, at, lengths, dtype=np.float64):
    """Each row and query head: its positions gathered one by one, one softmax."""
    ps, scale, window = at.page_size, at.scale, at.window
    q, kn, vn = host["q"], host["kn"], host["vn"]
    B, Hq, _, _ = q.shape
    Hkv, DV = kn.shape[1], vn.shape[-1]
    out = np.zeros((B, Hq, 1, DV))
    for b, n in enumerate(lengths):
        first = max(0, n + 1 - window) if window else 0
        for hq in range(Hq):
            h = hq // (Hq // Hkv)
            keys, vals = [], []
            for p in range(first, n + 1):
                if p == n:
                    keys.append(kn[b, h, 0]), vals.append(vn[b, h, 0])
                    continue
                row = host["base"] + host["pages"][b, p // ps] * ps + p % ps
                keys.append(host["k_pool"][row, h]), vals.append(host["v_pool"][row, h])
            scores = np.array(keys, dtype) @ q[b, hq, 0].astype(dtype) * scale
            if host["sinks"] is not None:
                scores = np.append(scores, host["sinks"][hq])
            w = np.exp(scores - scores.max())
            w = w[: len(vals)] / w.sum()
            out[b, hq, 0] = w @ np.array(vals, dtype)
    return out


GEOMETRIES = [
    # rows, lengths, Hq, Hkv, DK, DV, page size, window, sinks
    (3, [5, 37, 70], 8, 2, 64, 64, 16, None, False),
    (2, [1, 9], 4, 4, 16, 16, 4, None, False),
    (2, [40, 300], 4, 1, 32, 16, 4, 8, True),  # gemma-like: one KV head, window, sinks
    (1, [1500], 28, 4, 128, 128, 16, None, False),  # Qwen's 7 heads a group, split rows
    (4, [100, 2, 700, 64], 32, 8, 128, 128, 16, 128, True),  # gpt-oss-like
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_mlx_form_is_a_softmax_over_each_rows_pages_and_its_token(geometry):
    host, args, at = problem(0, geometry)
    got = np.array(pa.reference(*args, at))
    want = by_hand(host, at, geometry[1])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def over_two_chunks(host, at: pa.PagedLayer, seed: int) -> list[pa.PagedLayer]:
    """``at``'s pages over two chunks, each with arrays of its own: a random half moves to
    the second, and each chunk holds noise where the other holds a page's rows."""
    rng = np.random.default_rng(seed)
    pages, ps, base = host["pages"], at.page_size, host["base"]
    moved = rng.random(pages.shape) < 0.5
    second = np.zeros(host["k_pool"].shape[0], dtype=bool)
    for p in pages[moved]:
        second[base + p * ps : base + (p + 1) * ps] = True
    dtype = at.keys.dtype
    layers = []
    tables = (np.where(moved, -1, pages), np.where(moved, pages, -1))
    for mine, table in zip((~second, second), tables):
        arrays = []
        for name in ("k_pool", "v_pool"):
            x = host[name]
            noise = rng.standard_normal(x.shape).astype(np.float32) * 9
            arrays.append(mx.array(np.where(mine[:, None, None], x, noise)).astype(dtype))
        layers.append(replace(at, keys=arrays[0], values=arrays[1], pages=mx.array(table)))
    return layers


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_over_two_chunks_the_mlx_form_reads_each_page_from_its_own(geometry):
    host, args, at = problem(2, geometry)
    got = np.array(pa.reference(*args, over_two_chunks(host, at, 3)))
    want = by_hand(host, at, geometry[1])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.skipif(not CUDA, reason="the kernel runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_over_two_chunks_the_kernel_gives_the_mlx_forms_output(geometry, dtype):
    host, args, at = problem(4, geometry, dtype)
    two = over_two_chunks(host, at, 5)
    got = pa.paged_attention(*args, two).astype(mx.float32)
    want = pa.reference(*args, two).astype(mx.float32)
    limit = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx.abs(got - want).max().item() <= limit * mx.abs(want).max().item()


@pytest.mark.skipif(not CUDA, reason="the kernel runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_kernel_gives_the_mlx_forms_output(geometry, dtype):
    host, args, at = problem(1, geometry, dtype)
    # Queries and the step's K/V laid out as models hand them over: (B, 1, H, D) in memory,
    # seen transposed.
    for i, name in enumerate(("q", "kn", "vn")):
        x = mx.array(host[name]).astype(dtype).transpose(0, 2, 1, 3)
        args[i] = mx.contiguous(x).transpose(0, 2, 1, 3)
    got = pa.paged_attention(*args, at).astype(mx.float32)
    want = pa.reference(*args, at).astype(mx.float32)
    limit = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx.abs(got - want).max().item() <= limit * mx.abs(want).max().item()
    rows, lengths, Hq, Hkv, DK, DV, ps, window, sinks = geometry
    assert pa.check(dtype, Hq, Hkv, DK, DV, ps, window, sinks)


@pytest.mark.skipif(CUDA, reason="on CUDA the kernel is checked")
def test_the_kernel_is_not_used_where_cuda_does_not_run_it():
    assert not pa.check(mx.float32, 8, 2, 64, 64, 16)


def test_rows_split_over_blocks_until_the_batch_fills_the_device():
    assert pa._splits(32, 8, 40) == 1  # short: one block a row and head
    assert pa._splits(32, 8, 4097) == 3  # 256 blocks, to about TARGET_BLOCKS
    assert pa._splits(1, 8, 4097) == 65  # one row: split to MIN_SPLIT_TOKENS-long parts
    assert pa._splits(1, 8, 100_000) == 66


def test_the_kernels_page_tables_name_each_rows_pages_in_their_chunk():
    [(chunk, table)] = chunk_page_tables([[4, 6], [5, 7, 4]], chunk_pages=4)
    assert chunk == 1 and table.tolist() == [[0, 2, 0], [1, 3, 0]]
    # Rows whose pages span chunks: a table a chunk, -1 where a page is in another.
    (c1, t1), (c2, t2) = chunk_page_tables([[4, 9], [8, 5, 6]], chunk_pages=4)
    assert (c1, t1.tolist()) == (1, [[0, -1, 0], [-1, 1, 2]])
    assert (c2, t2.tolist()) == (2, [[-1, 1, 0], [0, -1, -1]])
    assert chunk_page_tables([[], []], chunk_pages=4) == []
    # In whole buckets of pages, the kernel's compiled calls replayed while rows grow.
    [(_, table)] = chunk_page_tables([[4, 6], [5, 7, 4]], chunk_pages=4, bucket=4)
    assert table.tolist() == [[0, 2, 0, 0], [1, 3, 0, 0]]


@pytest.mark.skipif(not CUDA, reason="the kernel runs on MLX's CUDA backend only")
def test_the_kernels_calls_are_compiled_once_for_each_launch_shape():
    geometry = GEOMETRIES[0]
    host, args, at = problem(6, geometry, mx.bfloat16)
    pa._calls.clear()
    first = pa.paged_attention(*args, at)
    again = pa.paged_attention(*args, at)
    assert len(pa._calls) == 1 and mx.array_equal(first, again).item()
    # Rows a token longer in tables of the same width: split alike, the same call replayed.
    pa.paged_attention(*args, replace(at, lengths=at.lengths + 1))
    assert len(pa._calls) == 1
    # Another batch, its rows split over more blocks: a launch shape of its own.
    _, args, at = problem(6, GEOMETRIES[3], mx.bfloat16)
    pa.paged_attention(*args, at)
    assert len(pa._calls) == 2
