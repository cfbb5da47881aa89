"""The plugin's caches against mlx-lm's own, method by method."""

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlx_radix_plugin import KVPool, LayerSpec, OffsetCache, PageTable
from mlx_radix_plugin.cache.pool_backed import PoolBackedCache
from mlx_radix_plugin.memory.allocator import OutOfPages

H, D, PS, WINDOW = 2, 8, 4, 6


def kv(n, seed):
    mx.random.seed(seed)
    return mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))


def same(a, b):
    return a.shape == b.shape and mx.array_equal(a, b).item()


def mask(cache, n, return_array=False, window_size=None):
    # Models always pass both keywords; mlx-lm's caches require them.
    return cache.make_mask(n, return_array=return_array, window_size=window_size)


def same_mask(a, b):
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return same(a, b)
    return a == b


def make_pool(num_pages=32, windows=(None, WINDOW)):
    return KVPool([LayerSpec(H, D, D, w) for w in windows], num_pages, PS, mx.float32)


def attend(q, keys, values, mask):
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)


STEPS = [5, 1, 1, 7, 1]  # prefill, decode, decode, a chunk, decode


def step_against(ours, stock, n, seed):
    """One update of both caches: same masks before it, same K/V and offset after it."""
    for ra in (False, True):
        assert same_mask(mask(ours, n, ra), mask(stock, n, ra))
    k, v = kv(n, seed)
    for a, b in zip(ours.update_and_fetch(k, v), stock.update_and_fetch(k, v)):
        assert same(a, b)
    assert ours.offset == stock.offset == ours.size()


# -- PoolBackedCache -----------------------------------------------------------------


def test_pool_backed_full_layer_matches_kvcache():
    pool = make_pool()
    table = PageTable(pool)
    ours, stock = PoolBackedCache(table, 0), KVCache()
    for i, n in enumerate(STEPS):
        step_against(ours, stock, n, i)
    total = sum(STEPS)
    assert len(table.pages) == -(-total // PS)
    assert ours.nbytes == total * H * 2 * D * 4
    assert ours.size() == total and not ours.empty()


def test_pool_backed_window_layer_attends_like_rotating_cache():
    pool = make_pool()
    ours, stock = PoolBackedCache(PageTable(pool), 1), RotatingKVCache(max_size=WINDOW)
    assert ours.window == WINDOW
    for i, n in enumerate([5, 1, 1, 1, 7, 1, 1, 9, 1]):
        q = mx.random.normal((1, H, n, D))
        m_ours = mask(ours, n, window_size=WINDOW)
        m_stock = mask(stock, n, window_size=WINDOW)
        k, v = kv(n, i)
        k_ours, v_ours = ours.update_and_fetch(k, v)
        k_stock, v_stock = stock.update_and_fetch(k, v)
        # It reads back only what its queries can see: the window plus the new tokens.
        assert k_ours.shape[2] == min(ours.offset, WINDOW - 1 + n)
        out_ours = attend(q, k_ours, v_ours, m_ours)
        out_stock = attend(q, k_stock, v_stock, m_stock)
        assert mx.allclose(out_ours, out_stock, atol=1e-5).item(), i


def test_layers_share_one_page_table():
    pool = make_pool()
    table = PageTable(pool)
    layers = [PoolBackedCache(table, i) for i in range(2)]
    for i, n in enumerate(STEPS):
        for c in layers:
            c.update_and_fetch(*kv(n, i))
    assert len(table.pages) == -(-sum(STEPS) // PS)
    assert pool.allocator.num_used == len(table.pages)


def test_shared_prefix_is_read_in_place_and_copied_on_write():
    pool = make_pool()
    first = PageTable(pool)
    writer = PoolBackedCache(first, 0)
    k, v = kv(10, 0)
    writer.update_and_fetch(k, v)
    shared = first.pages[:2]  # tokens 0..7
    pool.allocator.incref(shared)
    second = PageTable(pool, shared, shared_tokens=8)
    reader = PoolBackedCache(second, 0, offset=8)
    k2, v2 = kv(3, 1)
    keys, _ = reader.update_and_fetch(k2, v2)
    assert same(keys[..., :8, :], k[..., :8, :]) and same(keys[..., 8:, :], k2)
    assert second.pages[:2] == shared  # no copy of the prefix
    # Rewriting inside the shared span copies the page first; the original stays intact.
    reader.trim(5)
    k3, v3 = kv(2, 2)
    keys, _ = reader.update_and_fetch(k3, v3)
    assert second.pages[0] == shared[0] and second.pages[1] != shared[1]
    assert same(keys[..., :6, :], k[..., :6, :]) and same(keys[..., 6:, :], k3)
    again, _ = PoolBackedCache(first, 0, offset=10).update_and_fetch(*kv(1, 3))
    assert same(again[..., :10, :], k)


def test_pool_backed_state_to_mlx_cache_and_merge():
    pool = make_pool()
    table = PageTable(pool)
    full, windowed = PoolBackedCache(table, 0), PoolBackedCache(table, 1)
    assert full.state == [] and full.empty()
    k, v = kv(11, 0)
    full.update_and_fetch(k, v)
    windowed.update_and_fetch(k, v)
    detached = KVCache()
    detached.update_and_fetch(*full.state)
    assert detached.offset == 11 and same(detached.keys[..., :11, :], k)
    assert same(windowed.state[0], k[..., -WINDOW:, :])
    with pytest.raises(TypeError, match="into mlx-lm's KVCache instead"):
        PoolBackedCache.from_state(full.state)
    stock = windowed.to_mlx_cache()
    assert isinstance(stock, RotatingKVCache) and stock.offset == 11
    q = mx.random.normal((1, H, 1, D))
    k1, v1 = kv(1, 1)
    m = mask(windowed, 1, window_size=WINDOW)
    assert same_mask(m, mask(stock, 1, window_size=WINDOW))
    a = attend(q, *windowed.update_and_fetch(k1, v1), m)
    b = attend(q, *stock.update_and_fetch(k1, v1), m)
    assert mx.allclose(a, b, atol=1e-5).item()
    merged = PoolBackedCache.merge([full, PoolBackedCache(PageTable(pool), 0)])
    assert isinstance(merged, BatchKVCache) and merged.keys.shape[2] == 11
    assert full.is_trimmable() and full.trim(20) == 11 and full.offset == 0


def test_page_table_release_and_finalizer_return_pages():
    pool = make_pool(num_pages=8)
    table = PageTable(pool)
    PoolBackedCache(table, 0).update_and_fetch(*kv(9, 0))
    assert pool.allocator.num_free == 5
    table.release()
    table.release()  # idempotent
    assert pool.allocator.num_free == 8 and table.released
    with pytest.raises(RuntimeError, match="already released"):
        table.prepare_write(0, 1)
    dropped = PageTable(pool)
    PoolBackedCache(dropped, 0).update_and_fetch(*kv(9, 0))
    del dropped
    gc.collect()
    assert pool.allocator.num_free == 5  # deferred to the owner's thread...
    pool.run_deferred()
    assert pool.allocator.num_free == 8  # ...and returned there


@pytest.mark.parametrize("start", [PS + 1, PS])  # mid-page (copy on write), page boundary
def test_a_write_the_pool_cannot_serve_changes_nothing(start):
    """Out of pages while copying a shared page or adding pages: the table and every page
    reference stay as they were, and releasing it returns the pool to empty."""
    pool = make_pool(num_pages=6)
    shared = pool.alloc_pages(3)  # a cached 3-page prefix, held by the "tree"
    table = PageTable(pool, pages=shared, shared_tokens=3 * PS)
    pool.allocator.incref(shared)  # the table's own references
    others = pool.alloc_pages(pool.allocator.num_free)  # someone holds every other page
    refs = [pool.allocator.refcount(p) for p in shared]
    with pytest.raises(OutOfPages):
        table.prepare_write(start, 6 * PS)
    assert table.pages == shared and table.shared_tokens == 3 * PS
    assert [pool.allocator.refcount(p) for p in shared] == refs == [2, 2, 2]
    pool.release_pages(others)
    table.prepare_write(start, 4 * PS)  # now it fits
    assert table.pages[:1] == shared[:1] and table.shared_tokens == start // PS * PS
    table.release()
    pool.release_pages(shared)
    assert pool.allocator.num_free == 6


# -- OffsetCache ---------------------------------------------------------------------


def test_offset_cache_masks_like_kvcache_and_holds_nothing():
    for offset in (0, 3):
        ours, stock = OffsetCache(offset), KVCache()
        if offset:
            stock.update_and_fetch(*kv(offset, 0))
        for n in (1, 4):
            for ra in (False, True):
                assert same_mask(mask(ours, n, ra), mask(stock, n, ra))
    c = OffsetCache(7, window=4)
    assert c.nbytes == 0 and c.empty() and c.size() == 7
    assert same_mask(
        c.make_mask(3, window_size=4),
        PoolBackedCache(PageTable(make_pool(windows=(4,))), 0, offset=7).make_mask(
            3, window_size=4
        ),
    )
    with pytest.raises(RuntimeError, match="holds no K/V"):
        c.update_and_fetch(*kv(1, 0))
    restored = OffsetCache.from_state(c.state)
    assert (restored.offset, restored.window) == (7, 4)
    assert c.trim(2) == 2 and c.offset == 5
    batched = OffsetCache(mx.array([3, 5]))
    assert not batched.is_trimmable()
    with pytest.raises(TypeError, match="batch context"):
        batched.make_mask(1)
