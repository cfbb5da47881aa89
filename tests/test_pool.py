"""KV pool: geometry discovered from the model, budget from the device, slot I/O."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
from tiny_models import ARCHS

from mlx_radix_plugin import KVPool, LayerSpec, UnsupportedModel
from mlx_radix_plugin.memory.allocator import OutOfPages
from mlx_radix_plugin.memory.budget import DeviceMemory, device_memory, pool_budget_bytes
from mlx_radix_plugin.memory.pool import inspect_model, layer_groups, model_nbytes


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_model_reads_heads_dims_windows_and_dtype(loaded, arch):
    model, _ = loaded(arch)
    specs, dtype = inspect_model(model)
    assert dtype == mx.float32
    expected = {
        "gemma3_text": [LayerSpec(1, 16, 16, w) for w in (8, None, 8, None)],
        "gpt_oss": [LayerSpec(2, 16, 16, 8), LayerSpec(2, 16, 16)],
        "olmo3": [LayerSpec(2, 16, 16, w) for w in (8, 8, 8, None)],
        # Layers 2 and 3 reuse the K/V of layers 0 and 1: no cache of their own.
        "gemma4_text": [LayerSpec(1, 16, 16, 8), LayerSpec(1, 32, 32)],
    }
    assert specs == expected.get(arch, [LayerSpec(2, 16, 16)] * 2)


def test_kv_dtype_of_a_quantized_model_is_the_activations(model_dirs):
    from mlx_lm import load

    model, _ = load(str(model_dirs["llama"]))
    nn.quantize(model, group_size=32, bits=4)
    assert model.layers[0].self_attn.k_proj.weight.dtype == mx.uint32
    _, dtype = inspect_model(model)
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
        (ArraysCache(2), "layer 0 uses ArraysCache"),
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
    assert pool.num_pages == budget // pool.bytes_per_token // 16 > 0
    assert pool.nbytes == pool.num_pages * pool.bytes_per_page
    assert pool.used_bytes == 0


def test_pool_that_cannot_fit_says_what_to_change(loaded):
    model, _ = loaded("llama")
    tiny = DeviceMemory("cpu", model_nbytes(model), "test")
    with pytest.raises(OutOfPages, match="raise mem_fraction or set pool_tokens"):
        KVPool.for_model(model, mem_fraction=0.5, memory=tiny)
    with pytest.raises(ValueError, match="mem_fraction must be in \\(0, 1\\], got 1.5"):
        pool_budget_bytes(1.5, 0, tiny)
    with pytest.raises(ValueError, match="pool_tokens must be >= page_size \\(16\\), got 8"):
        KVPool.for_model(model, page_size=16, pool_tokens=8)


def test_device_memory_on_this_machine():
    mem = device_memory()
    assert mem.backend in ("metal", "cuda", "cpu")
    assert mem.usable_bytes > 0 and mem.source


def test_write_read_copy_round_trip():
    pool = KVPool(
        [LayerSpec(2, 4, 3), LayerSpec(1, 4, 4)], num_pages=4, page_size=2, dtype=mx.float32
    )
    assert pool.bytes_per_token == (2 * 7 + 1 * 8) * 4
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    v = -mx.arange(2 * 3 * 3, dtype=mx.float32).reshape(1, 2, 3, 3)
    slots = mx.array([5, 0, 3])
    pool.write(0, slots, k, v)
    rk, rv = pool.read(0, slots)
    assert mx.array_equal(rk, k).item() and mx.array_equal(rv, v).item()
    pool.copy(mx.array([5, 0]), mx.array([6, 7]))
    ck, _ = pool.read(0, mx.array([6, 7]))
    assert mx.array_equal(ck, k[..., :2, :]).item()
    assert pool.slots_of([3, 1]).tolist() == [6, 7, 2, 3]


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


def test_grouped_arrays_write_read_and_copy_each_layer_apart():
    specs = [LayerSpec(2, 4, 4)] * 3 + [LayerSpec(1, 4, 4)]
    pool = KVPool(specs, num_pages=4, page_size=2, dtype=mx.float32, max_array_elements=128)
    assert pool.groups == [[0, 1], [2], [3]]  # 64 elements per layer of the first kind
    assert pool.nbytes == pool.bytes_per_token * 8  # 4 pages x 2 slots
    layers = {}
    for layer, s in enumerate(specs):
        k = mx.random.normal((1, s.kv_heads, 3, 4))
        v = mx.random.normal((1, s.kv_heads, 3, 4))
        pool.write(layer, mx.array([1, 6, 2]), k, v)
        layers[layer] = (k, v)
    pool.copy(mx.array([6]), mx.array([7]))
    for layer, (k, v) in layers.items():
        rk, rv = pool.read(layer, mx.array([1, 6, 2, 7]))
        assert mx.array_equal(rk[..., :3, :], k).item() and mx.array_equal(rv[..., :3, :], v).item()
        assert mx.array_equal(rk[..., 3, :], k[..., 1, :]).item()
    assert mx.all(pool.rows(0, mx.array([0, 3, 4, 5]))[0] == 0).item()


def test_write_layers_puts_each_layers_picked_rows_at_the_slots():
    specs = [LayerSpec(2, 4, 4)] * 3 + [LayerSpec(1, 4, 4)]
    pool = KVPool(specs, num_pages=4, page_size=2, dtype=mx.float32, max_array_elements=128)
    # A decode step's new K/V: (batch, heads, 1, dim) per layer; rows 0 and 2 are real.
    keys = {i: mx.random.normal((3, s.kv_heads, 1, 4)) for i, s in enumerate(specs)}
    values = {i: mx.random.normal((3, s.kv_heads, 1, 4)) for i, s in enumerate(specs)}
    pool.write_layers(mx.array([5, 2]), keys, values, rows=mx.array([0, 2]))
    for i in range(len(specs)):
        k, v = pool.rows(i, mx.array([5, 2]))
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
