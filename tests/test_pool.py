"""KV pool: geometry discovered from the model, budget from the device, slot I/O."""

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
from tiny_models import ARCHS

from mlx_radix_plugin import KVPool, LayerSpec, UnsupportedModel
from mlx_radix_plugin.memory.allocator import OutOfPages
from mlx_radix_plugin.memory.budget import (
    CHUNK_TOKENS,
    MIN_POOL_TOKENS,
    DeviceMemory,
    device_memory,
    pool_budget_bytes,
)
from mlx_radix_plugin.memory.pool import inspect_model, layer_groups, model_nbytes
from mlx_radix_plugin.memory.slots import Slots


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_model_reads_heads_dims_windows_and_dtype(loaded, arch):
    model, _ = loaded(arch)
    specs, dtype, layout = inspect_model(model)
    assert dtype == mx.float32
    assert layout == tuple(range(len(specs)))
    expected = {
        "gemma3_text": [LayerSpec(1, 16, 16, w) for w in (8, None, 8, None)],
        "gpt_oss": [LayerSpec(2, 16, 16, 8), LayerSpec(2, 16, 16)],
        "olmo3": [LayerSpec(2, 16, 16, w) for w in (8, 8, 8, None)],
        # Layers 2 and 3 reuse the K/V of layers 0 and 1: no cache of their own.
        "gemma4_text": [LayerSpec(1, 16, 16, 8), LayerSpec(1, 32, 32)],
    }
    assert specs == expected.get(arch, [LayerSpec(2, 16, 16)] * 2)


def test_a_cache_lists_parts_are_entries_of_the_layout(loaded):
    """falcon_h1: a CacheList (Mamba-2 state, attention K/V) a layer; its K/V parts go to
    pool layers, its recurrent parts to snapshots, and a request's caches nest back."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    from mlx_radix_plugin.memory.cache_list import flat, nested

    model, _ = loaded("falcon_h1")
    specs, _, layout = inspect_model(model)
    assert specs == [LayerSpec(2, 16, 16)] * 2 and layout == (None, 0, None, 1)
    pool = KVPool.for_model(model, page_size=4, pool_tokens=64)
    assert pool.cache_shape == (2, 2) and pool.recurrent == [0, 2]
    assert pool.state_sizes == {0: 2, 2: 2} and pool.snapshot_row_bytes > 0
    parts = [ArraysCache(2), "kv 0", ArraysCache(2), "kv 1"]
    caches = nested(parts, pool.cache_shape)
    assert all(isinstance(c, CacheList) for c in caches) and flat(caches) == parts
    with pytest.raises(ValueError, match="3 caches"):
        nested(parts[:3], pool.cache_shape)


def test_kv_dtype_of_a_quantized_model_is_the_activations(model_dirs):
    from mlx_lm import load

    model, _ = load(str(model_dirs["llama"]))
    nn.quantize(model, group_size=32, bits=4)
    assert model.layers[0].self_attn.k_proj.weight.dtype == mx.uint32
    _, dtype, _ = inspect_model(model)
    assert dtype == mx.float32


class _FakeModel(nn.Module):
    def __init__(self, cache):
        super().__init__()
        self._cache = cache
        self.layers = [nn.Identity()]

    def make_cache(self):
        return [self._cache]


@pytest.mark.parametrize(
    "cache, reason",
    [
        (ArraysCache(2), "no attention layer"),
        (RotatingKVCache(max_size=64, keep=4), r"RotatingKVCache\(keep=4\)"),
    ],
)
def test_unsupported_cache_layouts_are_named(cache, reason):
    with pytest.raises(UnsupportedModel, match=reason):
        inspect_model(_FakeModel(cache))


def test_pool_sized_from_device_memory(loaded):
    model, _ = loaded("llama")
    memory = DeviceMemory("cpu", 64 * 2**20, "test")
    pool = KVPool.for_model(model, page_size=16, mem_fraction=0.5, memory=memory)
    budget = 32 * 2**20 - model_nbytes(model)
    ceiling = budget // pool.bytes_per_token // 16
    # Whole chunks, short of the budget by less than a page a chunk.
    assert ceiling - pool.allocator.num_chunks < pool.max_pages <= ceiling
    assert pool.max_nbytes == pool.max_pages * pool.bytes_per_page
    # Nothing is allocated before a page is asked for.
    assert (pool.num_pages, pool.nbytes, pool.used_bytes, pool.arrays) == (0, 0, 0, [])


def test_the_plan_gives_the_pool_what_the_model_working_memory_and_margin_leave(loaded):
    model, _ = loaded("llama")
    memory = DeviceMemory("cpu", 16 * 2**30, "test")
    pool = KVPool.for_model(model, page_size=16, memory=memory, max_batch_size=4)
    plan = pool.plan
    assert plan.model_bytes == model_nbytes(model) and plan.margin_bytes == 16 * 2**30 // 20
    # 4 rows of 2,048 tokens of K/V, and activations from the model's config
    assert plan.working_bytes > 4 * 2048 * pool.bytes_per_token
    left = 16 * 2**30 - plan.model_bytes - plan.working_bytes - plan.margin_bytes
    assert plan.pool_bytes == left and plan.warning is None
    assert left - pool.allocator.num_chunks * pool.bytes_per_page < pool.max_nbytes <= left


def test_a_hybrid_models_plan_counts_its_batchs_recurrent_states(loaded):
    """Every row of a full batch holds a recurrent state, and a step its next one."""
    from mlx_radix_plugin.memory.budget import working_bytes

    model, _ = loaded("qwen3_5")
    memory = DeviceMemory("cpu", 16 * 2**30, "test")
    pool = KVPool.for_model(model, page_size=16, memory=memory, max_batch_size=4)
    row = pool.snapshot_row_bytes
    assert row > 0
    without = working_bytes(model, pool.bytes_per_token, 4, 2048)
    assert pool.plan.working_bytes == without + 2 * 4 * row


def test_on_unified_memory_a_chunk_holds_a_few_thousand_tokens(loaded):
    """The CPU (and Metal) pool follows demand in chunks of CHUNK_TOKENS tokens, 64 MiB at
    least, whatever its ceiling."""
    model, _ = loaded("llama")
    for usable in (4 * 2**30, 64 * 2**30):
        memory = DeviceMemory("cpu", usable, "test")
        pool = KVPool.for_model(model, page_size=16, memory=memory)
        chunk = pool.allocator.chunk_pages * pool.bytes_per_page
        expected = max(64 << 20, CHUNK_TOKENS * pool.bytes_per_token)
        # (the ceiling is cut into equal chunks: a little under the size asked for)
        assert 0.9 * expected < chunk <= expected
        assert pool.allocator.num_chunks > 1


def test_a_model_that_leaves_no_room_gets_a_minimal_pool_and_a_warning(loaded):
    model, _ = loaded("llama")
    tiny = DeviceMemory("cpu", int(model_nbytes(model) * 1.5), "test")  # the model is 67%
    pool = KVPool.for_model(model, page_size=16, memory=tiny)
    assert pool.max_pages * 16 == MIN_POOL_TOKENS
    assert "leave no room for a KV pool" in pool.plan.warning
    assert "minimal pool of 2048 tokens" in pool.plan.warning
    assert "set radix.pool_tokens" in pool.plan.warning
    with pytest.raises(ValueError, match="mem_fraction must be in \\(0, 1\\], got 1.5"):
        pool_budget_bytes(1.5, 0, tiny)
    with pytest.raises(ValueError, match="pool_tokens must be >= page_size \\(16\\), got 8"):
        KVPool.for_model(model, page_size=16, pool_tokens=8)


def test_device_memory_on_this_machine():
    mem = device_memory()
    assert mem.backend in ("metal", "cuda", "cpu")
    assert mem.usable_bytes > 0 and mem.source


def online(pool: KVPool) -> KVPool:
    """Every chunk of ``pool`` allocated, every page free."""
    pool.release_pages(pool.alloc_pages(pool.max_pages))
    return pool


# One chunk of every page, allocated at once; a chunk a page, every read across chunks.
CHUNKINGS = pytest.mark.parametrize("chunk_pages", [None, 1])


@CHUNKINGS
def test_write_read_copy_round_trip(chunk_pages):
    specs = [LayerSpec(2, 4, 3), LayerSpec(1, 4, 4)]
    pool = online(KVPool(specs, 4, page_size=2, dtype=mx.float32, chunk_pages=chunk_pages))
    assert pool.bytes_per_token == (2 * 7 + 1 * 8) * 4
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    v = -mx.arange(2 * 3 * 3, dtype=mx.float32).reshape(1, 2, 3, 3)
    slots = [5, 0, 3]
    pool.write(0, slots, k, v)
    rk, rv = pool.read(0, slots)
    assert mx.array_equal(rk, k).item() and mx.array_equal(rv, v).item()
    pool.copy([5, 0], [6, 7])
    ck, _ = pool.read(0, [6, 7])
    assert mx.array_equal(ck, k[..., :2, :]).item()
    assert pool.slots_of([3, 1]).host.tolist() == [6, 7, 2, 3]


def test_layers_of_one_geometry_share_arrays_up_to_the_element_cap():
    a, b = LayerSpec(2, 4, 4), LayerSpec(1, 8, 8)
    assert layer_groups([a, a, a, b, b, a], slots=10, max_elements=10**6) == [
        [0, 1, 2],
        [3, 4],
        [5],
    ]
    # 80 elements per layer of ``a``: two fit under 200, the third starts a new array.
    assert layer_groups([a, a, a], slots=10, max_elements=200) == [[0, 1], [2]]
    # A layer larger than the cap still gets its array.
    assert layer_groups([a, a], slots=10, max_elements=50) == [[0], [1]]
    window = LayerSpec(2, 4, 4, window=8)  # a window changes what is read, not the layout
    assert layer_groups([a, window], slots=10, max_elements=10**6) == [[0, 1]]


@CHUNKINGS
def test_grouped_arrays_write_read_and_copy_each_layer_apart(chunk_pages):
    specs = [LayerSpec(2, 4, 4)] * 3 + [LayerSpec(1, 4, 4)]
    pool = online(KVPool(specs, 4, 2, mx.float32, max_array_elements=128, chunk_pages=chunk_pages))
    if chunk_pages is None:
        assert pool.groups == [[0, 1], [2], [3]]  # 64 elements per layer of the first kind
    assert pool.nbytes == pool.bytes_per_token * 8  # 4 pages x 2 slots
    layers = {}
    for layer, s in enumerate(specs):
        k = mx.random.normal((1, s.kv_heads, 3, 4))
        v = mx.random.normal((1, s.kv_heads, 3, 4))
        pool.write(layer, [1, 6, 2], k, v)
        layers[layer] = (k, v)
    pool.copy([6, 1], [7, 3])
    for layer, (k, v) in layers.items():
        rk, rv = pool.read(layer, [1, 6, 2, 7, 3])
        assert mx.array_equal(rk[..., :3, :], k).item() and mx.array_equal(rv[..., :3, :], v).item()
        assert mx.array_equal(rk[..., 3, :], k[..., 1, :]).item()
        assert mx.array_equal(rv[..., 4, :], v[..., 0, :]).item()
    assert mx.all(pool.rows(0, [0, 4, 5])[0] == 0).item()


@CHUNKINGS
def test_write_layers_puts_each_layers_picked_rows_at_the_slots(chunk_pages):
    specs = [LayerSpec(2, 4, 4)] * 3 + [LayerSpec(1, 4, 4)]
    pool = online(KVPool(specs, 4, 2, mx.float32, max_array_elements=128, chunk_pages=chunk_pages))
    # A decode step's new K/V: (batch, heads, 1, dim) per layer; rows 0 and 2 are real.
    keys = {i: mx.random.normal((3, s.kv_heads, 1, 4)) for i, s in enumerate(specs)}
    values = {i: mx.random.normal((3, s.kv_heads, 1, 4)) for i, s in enumerate(specs)}
    pool.write_layers(pool.slots([5, 2]), keys, values, rows=mx.array([0, 2]))
    for i in range(len(specs)):
        k, v = pool.rows(i, [5, 2])
        assert mx.array_equal(k, keys[i][mx.array([0, 2]), :, 0]).item()
        assert mx.array_equal(v, values[i][mx.array([0, 2]), :, 0]).item()


def test_alloc_reclaims_when_short():
    pool = KVPool([LayerSpec(1, 2, 2)], num_pages=3, page_size=1, dtype=mx.float32)
    held = pool.alloc_pages(3)
    asked = []

    def reclaim(n):
        asked.append(n)
        return len(pool.allocator.decref(held[:n]))

    pool.reclaim = reclaim
    assert sorted(pool.alloc_pages(2)) == [0, 1]
    assert asked == [2]
    with pytest.raises(OutOfPages, match="asked for 5 pages"):
        pool.alloc_pages(5)


def test_the_pool_grows_a_chunk_at_a_time_before_it_evicts_and_keeps_what_it_held():
    spec = LayerSpec(8, 64, 64)  # 4 KiB a token: chunks of 1 MiB
    pool = KVPool([spec], 12, page_size=64, dtype=mx.float32, chunk_pages=4)
    chunk = 4 * 64 * spec.bytes_per_token(mx.float32)
    evicted = []
    pool.reclaim = lambda n: evicted.append(n) or 0
    first = pool.alloc_pages(3)
    assert (first, pool.nbytes, pool.allocator.online_chunks) == ([0, 1, 2], chunk, [0])
    k = mx.random.normal((1, 8, 3 * 64, 64))
    pool.write(0, pool.slots_of(first), k, -k)
    mx.eval(pool.arrays)
    gc.collect()
    mx.synchronize()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    second = pool.alloc_pages(3)  # one page left in chunk 0: chunk 1 comes online
    assert second == [3, 4, 5] and pool.allocator.online_chunks == [0, 1] and not evicted
    # One chunk's allocation (and a few index bytes), no copy of what the pool held.
    assert chunk <= mx.get_active_memory() - active < chunk + 16384
    assert mx.get_peak_memory() - active < chunk + 16384
    assert mx.array_equal(pool.read(0, pool.slots_of(first))[0], k).item()
    pool.alloc_pages(6)
    assert pool.num_pages == pool.max_pages == 12 and not evicted
    with pytest.raises(OutOfPages):
        pool.alloc_pages(1)
    assert evicted == [1]  # at the ceiling, and only then, it evicts


class Holder:
    """Something holding K/V outside the pool (a batch buffer), ``buffer_nbytes`` of it."""

    def __init__(self, nbytes: int):
        self.buffer_nbytes = nbytes


def test_kv_held_outside_the_pool_beyond_its_reserve_is_taken_from_the_pools_room(loaded):
    model, _ = loaded("llama")
    memory = DeviceMemory("cpu", 4 * 2**30, "test")
    chunk_bytes = 4 * 2**20
    pool = KVPool.for_model(model, page_size=16, memory=memory, chunk_bytes=chunk_bytes)
    reserve = pool.plan.buffer_reserve_bytes
    assert reserve == 32 * 2048 * pool.bytes_per_token  # decode.max_batch_size rows of 2,048
    chunk_pages = pool.allocator.chunk_pages
    pool.alloc_pages(chunk_pages)
    assert pool.allocator.online_chunks == [0] and pool.buffer_bytes == 0
    # Buffers within the reserve: the pool grows as before.
    small = Holder(reserve)
    pool.hold_outside(small)
    assert pool.buffer_bytes == reserve
    pool.alloc_pages(1)
    assert pool.allocator.online_chunks == [0, 1]
    # Buffers that take all the pool's room but what it holds: no more chunks, it evicts.
    big = Holder(reserve + pool.max_nbytes - pool.nbytes)
    pool.hold_outside(big)
    asked = []
    pool.reclaim = lambda n: asked.append(n) or 0
    with pytest.raises(OutOfPages):
        pool.alloc_pages(2 * chunk_pages)
    assert pool.allocator.online_chunks == [0, 1] and asked
    # Once they are gone, the pool grows again.
    del big
    gc.collect()
    assert pool.buffer_bytes == reserve
    pool.alloc_pages(2 * chunk_pages)
    assert len(pool.allocator.online_chunks) == 4
    # A pool the user sized (radix.pool_tokens) is theirs: buffers do not shrink it.
    sized = KVPool.for_model(model, page_size=16, pool_tokens=4096, chunk_bytes=chunk_bytes)
    assert sized.plan.buffer_reserve_bytes is None
    sized.hold_outside(Holder(2**40))
    sized.alloc_pages(sized.max_pages)


def test_chunks_that_stay_empty_are_given_back_lowest_pages_first_and_the_first_stays():
    pool = KVPool([LayerSpec(1, 4, 4)], 6, page_size=2, dtype=mx.float32, chunk_pages=2)
    pages = pool.alloc_pages(6)
    assert pool.allocator.online_chunks == [0, 1, 2]
    pool.release_pages(pages[1:])  # page 0 stays in use
    assert pool.trim(idle_seconds=10, now=100.0) == 0  # empty since now
    held = pool.alloc_pages(1)
    assert held == [1]  # the lowest free page: chunk 1 and 2 stay empty
    assert pool.trim(idle_seconds=10, now=105.0) == 0
    assert pool.trim(idle_seconds=10, now=110.0) == 2
    assert pool.allocator.online_chunks == [0] and pool.nbytes == 2 * pool.bytes_per_page
    assert len(pool.arrays) == 2 and pool.chunks_freed == 2
    pool.release_pages(pages[:1] + held)
    assert pool.trim(idle_seconds=10, now=1e9) == 0  # the first chunk stays
    assert pool.alloc_pages(5) == [0, 1, 2, 3, 4] and pool.chunks_grown == 5


def test_a_chunk_that_held_a_page_meanwhile_waits_again():
    pool = KVPool([LayerSpec(1, 4, 4)], 4, page_size=2, dtype=mx.float32, chunk_pages=2)
    pool.release_pages(pool.alloc_pages(4))
    assert pool.trim(idle_seconds=10, now=0.0) == 0
    pages = pool.alloc_pages(3)  # reaches into chunk 1
    assert pool.trim(idle_seconds=10, now=20.0) == 0
    pool.release_pages(pages)
    assert pool.trim(idle_seconds=10, now=25.0) == 0
    assert pool.trim(idle_seconds=10, now=35.0) == 1


@pytest.mark.parametrize("axis", [0, 1])
def test_head_slots_read_across_chunks_as_one_gather_would(axis):
    """The slots a shared-prefix pass reads, laid out (heads, ...) or (rows, heads, ...),
    read the same from one chunk and from a chunk a page, in any order."""
    spec = LayerSpec(3, 4, 4)
    slots = np.array([[7, 2, 5, 0], [1, 6, 6, 3]])
    k = mx.random.normal((1, 3, 8, 4), key=mx.random.key(1))
    reads = []
    for chunk_pages in (None, 1):
        pool = online(KVPool([spec], 4, 2, mx.float32, chunk_pages=chunk_pages))
        pool.write(0, list(range(8)), k, -k)
        k_views, _ = pool.flat_views(0)
        index = pool.head_slots(slots, 3, axis=axis)
        assert len(index.pieces) == (1 if chunk_pages is None else 4)
        reads.append(index.gather(k_views))
    one, many = reads
    assert one.shape == ((3, 2, 4, 4) if axis == 0 else (2, 3, 4, 4))
    assert mx.array_equal(one, many).item()


@given(st.lists(st.integers(0, 63), min_size=1, max_size=40), st.sampled_from([8, 16, 64]))
def test_slots_from_python_ints_plan_the_reads_numpy_slots_do(slots, chunk_slots):
    """A decode step hands its slots over as Python ints: read the same as host arrays,
    in one chunk (any one) or across several."""
    fast, host = Slots(list(slots), chunk_slots), Slots(np.array(slots), chunk_slots)
    assert fast.host.tolist() == host.host.tolist() == slots and len(fast) == len(slots)
    assert [c for c, _, _ in fast.pieces] == [c for c, _, _ in host.pieces]
    for (_, a, at_a), (_, b, at_b) in zip(fast.pieces, host.pieces):
        assert a.tolist() == b.tolist()
        assert (at_a is None) == (at_b is None) and (at_a is None or at_a.tolist() == at_b.tolist())
    assert (fast.order is None) == (host.order is None)
    assert fast.order is None or fast.order.tolist() == host.order.tolist()
