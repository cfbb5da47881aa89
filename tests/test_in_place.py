"""A shared decode step's K/V stored in place (memory/in_place.py): launched with the step, no
wait for the step before; on CUDA the kernel against MLX's scatter, and the engine's answers
and pool bitwise those of the scatter writes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_shared_prefix import engine_run, on_a_shared_prefix, prefix_of, question, radix, warm

from mlx_radix_plugin.engine import attention
from mlx_radix_plugin.memory import in_place

CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu


def scatter_store(array, idx, rows):
    """What the kernel writes, as a scatter, and a mark that evaluates it."""
    array[idx] = rows
    return array[:1].sum()


def test_the_cpu_and_metal_write_by_scatter():
    """Only CUDA has the kernel (and only once checked); elsewhere nothing changes."""
    if CUDA:
        pytest.skip("CUDA stores in place")
    assert not in_place.available(mx.float32)


def test_a_shared_step_launches_its_stores_with_it_and_waits_for_nothing(loaded, monkeypatch):
    """Where stores are in place, a shared step's writes are launched by the step's own
    ``async_eval`` and no step waits for the one before (``mx.synchronize``); the marks are
    taken by each step. The stores here are scatters standing in for the kernel (the CPU has
    none), so the answers are the engine's own."""
    model, tok = loaded("llama")
    gen, rpc = on_a_shared_prefix(model, tok, 4, 12)
    while gen.decode_stats["decode_path"] != "shared":
        gen.next()
    gen.next()

    stored, events = [], []

    def store(array, idx, rows):
        stored.append(scatter_store(array, idx, rows))
        return stored[-1]

    synchronize, async_eval = mx.synchronize, mx.async_eval

    def sync(*args):
        events.append("wait")
        return synchronize(*args)

    def evaluate(*args):
        flat = [a for x in args for a in (x if isinstance(x, list) else [x])]
        launched = sum(any(a is m for a in flat) for m in stored)
        events.append(f"launch {launched}")
        return async_eval(*args)

    monkeypatch.setattr(in_place, "IN_PLACE", True)
    monkeypatch.setattr(in_place, "store", store)
    monkeypatch.setattr(mx, "synchronize", sync)
    monkeypatch.setattr(mx, "async_eval", evaluate)
    for _ in range(4):
        stored.clear()
        gen.next()
        # One store a pool array (the tiny llama's one group: its keys and its values).
        assert len(stored) == 2 and events == ["launch 2"], events
        events.clear()
        assert rpc.pool._marks == []
    assert gen.decode_stats["decode_path"] == "shared"
    gen.close()


def test_a_prefill_scatter_before_a_shared_step_still_waits_once(loaded, monkeypatch):
    """A scatter into the pool built before a shared step (a request's prefill) is evaluated
    with the step: the step waits for the one before then, so that the scatter updates the
    pool in place, and the steps after it wait for nothing."""
    model, tok = loaded("llama")
    gen, rpc = on_a_shared_prefix(model, tok, 4, 12)
    while gen.decode_stats["decode_path"] != "shared":
        gen.next()
    gen.next()
    monkeypatch.setattr(in_place, "IN_PLACE", True)
    monkeypatch.setattr(in_place, "store", scatter_store)
    waits = []
    synchronize = mx.synchronize
    monkeypatch.setattr(mx, "synchronize", lambda *a: waits.append(1) or synchronize(*a))
    k = mx.zeros((1, rpc.pool.specs[0].kv_heads, 1, rpc.pool.specs[0].k_head_dim))
    rpc.pool.write(0, [rpc.pool.chunk_slots - 1], k, k)  # a scatter, as a prefill's
    gen.next()
    assert waits == [1]
    gen.next()
    gen.next()
    assert waits == [1]
    gen.close()


@pytest.mark.skipif(not CUDA, reason="the store kernel is CUDA's")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_kernel_stores_what_the_scatter_does(dtype):
    rng = np.random.default_rng(0)
    array = mx.array(rng.standard_normal((3000, 8, 128))).astype(dtype)
    idx = mx.array(rng.permutation(3000)[:77], dtype=mx.int32)
    rows = mx.array(rng.standard_normal((77, 8, 128))).astype(dtype)
    want = array + 0
    want[idx] = rows
    mx.eval(array, want, rows)
    before = id(array)
    mx.eval(in_place.store(array, idx, rows))
    assert id(array) == before and mx.array_equal(array, want).item()
    assert in_place.check(dtype)


def emulated_store(array, idx, rows):
    """The kernel's store on the CPU: the rows written into the evaluated array's own memory,
    which MLX does not see change (the array stays the same object, never an output)."""
    mx.eval(array, idx, rows)
    np.asarray(memoryview(array))[np.array(idx)] = np.array(rows)
    return mx.array([1])


def answers_and_pool(model, tok, monkeypatch, stores: bool):
    """Tokens, float32 logits and the pool after 5 requests on a cached prefix, two joining
    3 steps in, their writes stores in place or scatters."""
    monkeypatch.setattr(in_place, "IN_PLACE", stores)
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(5)]
    rpc = radix(model)
    warm(model, rpc, [prefix])
    tokens, logits, paths = engine_run(model, tok, rpc, prompts, [12, 9, 14, 12, 6], late=(3, 4))
    assert "shared" in paths
    mx.eval(rpc.pool.arrays)
    return tokens, logits, [np.array(a.astype(mx.float32)) for a in rpc.pool.arrays]


def assert_bitwise(a, b):
    (tokens, logits, pool), (tokens_ip, logits_ip, pool_ip) = a, b
    assert tokens_ip == tokens
    for i, steps in logits.items():
        assert len(steps) == len(logits_ip[i])
        for step, (x, y) in enumerate(zip(steps, logits_ip[i])):
            assert mx.array_equal(x, y).item(), (i, step, mx.abs(x - y).max().item())
    for x, y in zip(pool, pool_ip):
        assert np.array_equal(x, y), int((x != y).reshape(x.shape[0], -1).any(1).sum())


@pytest.mark.skipif(CUDA, reason="CUDA runs the kernel itself (below)")
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("variant", ["paged", "split", "masked"])
def test_stores_in_place_give_the_scatters_answers_and_pool(loaded, arch, variant, monkeypatch):
    """Every shared variant, rows joining mid-way: with the pool written under MLX as the
    kernel writes it (emulated), the same tokens, logits and pool as with scatters, bit for
    bit: no read of the engine relies on a write's being a new array."""
    model, tok = loaded(arch)
    monkeypatch.setattr(attention, "VARIANT", variant)
    monkeypatch.setattr(in_place, "store", emulated_store)
    scatters = answers_and_pool(model, tok, monkeypatch, stores=False)
    assert_bitwise(scatters, answers_and_pool(model, tok, monkeypatch, stores=True))


@pytest.mark.skipif(not CUDA, reason="the store kernel is CUDA's")
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss"])
def test_the_engine_answers_and_pool_are_the_scatters_bitwise(loaded, arch, monkeypatch):
    """The paged kernel's shared path with the kernel's stores and with scatters."""
    model, tok = loaded(arch)
    monkeypatch.setattr(attention, "VARIANT", "paged")
    scatters = answers_and_pool(model, tok, monkeypatch, stores=False)
    assert_bitwise(scatters, answers_and_pool(model, tok, monkeypatch, stores=True))
