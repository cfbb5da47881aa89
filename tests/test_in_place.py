"""A shared decode step's K/V stored in place (memory/in_place.py): launched with the step, no
wait for the step before; on CUDA the kernel against MLX's scatter, and the engine's answers
and pool bitwise those of the scatter writes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generation_stream
from test_shared_prefix import (
    PS,
    admit,
    engine_run,
    on_a_shared_prefix,
    prefix_of,
    question,
    radix,
    until_all_decode_shared,
    warm,
)

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.engine import attention, generator
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
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
    stored, events = [], []

    def store(array, idx, rows):
        stored.append(scatter_store(array, idx, rows))
        return stored[-1]

    monkeypatch.setattr(in_place, "IN_PLACE", True)
    monkeypatch.setattr(in_place, "store", store)
    gen, rpc = on_a_shared_prefix(model, tok, 4, 12)
    until_all_decode_shared(gen, 4)
    # The batch's first decode step is mlx-lm's own (the prompt batch's ``generate``): no
    # launch of ours takes its stores, and the next step launches them on their own first.
    gen.next()
    gen.next()

    synchronize, async_eval = mx.synchronize, mx.async_eval

    def sync(*args):
        events.append("wait")
        return synchronize(*args)

    def evaluate(*args):
        flat = [a for x in args for a in (x if isinstance(x, list) else [x])]
        launched = sum(any(a is m for a in flat) for m in stored)
        events.append(f"launch {launched}")
        return async_eval(*args)

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


class EmulatedStores:
    """The kernel's stores on the CPU, as MLX's CUDA backend orders them: a store writes
    the evaluated array's own memory (MLX does not see it change), only when an evaluation
    launches it, and nothing orders it against the other work of that evaluation (on CUDA
    it is a node of the same command graph with no edge to the readers of its rows). So
    it lands either before all of that work (``early``) or after all of it (``late``);
    one never launched never lands."""

    def __init__(self, when: str, monkeypatch):
        self.when = when
        self.pending: dict[int, tuple] = {}
        self._eval, self._async_eval = mx.eval, mx.async_eval
        monkeypatch.setattr(in_place, "store", self.store)
        monkeypatch.setattr(mx, "eval", self._evaluating(self._eval))
        monkeypatch.setattr(mx, "async_eval", self._evaluating(self._async_eval))

    def store(self, array, idx, rows):
        mark = mx.array([1])
        self.pending[id(mark)] = (array, idx, rows)
        return mark

    def _land(self, stores):
        for array, idx, rows in stores:
            self._eval(array, idx, rows)
            np.asarray(memoryview(array))[np.array(idx)] = np.array(rows)

    def _evaluating(self, evaluate):
        def run(*args):
            launched = [self.pending.pop(id(a)) for a in _flat(args) if id(a) in self.pending]
            if self.when == "early":
                self._land(launched)
            out = evaluate(*args)
            if self.when == "late":
                self._eval(*args)
                self._land(launched)
            return out

        return run


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [a for y in x for a in _flat(y)]
    if isinstance(x, dict):
        return _flat(list(x.values()))
    return [x]


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
    rpc.pool.launch_stores()
    mx.eval(rpc.pool.arrays)
    # The engine's stream is mlx-lm's (thread-local): its stores may still be running.
    mx.synchronize(generation_stream)
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
@pytest.mark.parametrize("when", ["early", "late"])
def test_stores_in_place_give_the_scatters_answers_and_pool(
    loaded, arch, variant, when, monkeypatch
):
    """Every shared variant, rows joining mid-way: with the stores emulated as CUDA orders
    them, the same tokens, logits and pool as with scatters, bit for bit. ``late`` failed
    (llama's first request, logits 0.28 apart from its second token) while the first step
    of a batch leaving prefill, mlx-lm's own, left its stores to the next step's launch."""
    model, tok = loaded(arch)
    monkeypatch.setattr(attention, "VARIANT", variant)
    scatters = answers_and_pool(model, tok, monkeypatch, stores=False)
    emulated = EmulatedStores(when, monkeypatch)
    assert_bitwise(scatters, answers_and_pool(model, tok, monkeypatch, stores=True))
    assert not emulated.pending


@pytest.mark.skipif(not CUDA, reason="the store kernel is CUDA's")
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss"])
def test_the_engine_answers_and_pool_are_the_scatters_bitwise(loaded, arch, monkeypatch):
    """The paged kernel's shared path with the kernel's stores and with scatters."""
    model, tok = loaded(arch)
    monkeypatch.setattr(attention, "VARIANT", "paged")
    scatters = answers_and_pool(model, tok, monkeypatch, stores=False)
    assert_bitwise(scatters, answers_and_pool(model, tok, monkeypatch, stores=True))


@pytest.mark.parametrize("chunk_pages, path", [(None, "shared"), (2, "exact")])
def test_auto_stores_in_place_where_the_paged_kernel_reads_every_page(
    loaded, chunk_pages, path, monkeypatch
):
    """On CUDA with stores in place, 12 requests that share nothing decode on the shared
    path while their pages lie in one chunk of the pool, and on the exact path (CUDA's rule
    for more than 8 rows) where they span chunks, which the paged kernel does not read."""
    model, tok = loaded("llama")
    monkeypatch.setattr(generator, "backend", lambda: "cuda")
    monkeypatch.setattr(in_place, "IN_PLACE", True)
    monkeypatch.setattr(in_place, "store", scatter_store)
    pool = KVPool.for_model(model, page_size=PS, pool_tokens=4096)
    if chunk_pages is not None:
        pool = KVPool(pool.specs, pool.max_pages, PS, pool.dtype, chunk_pages=chunk_pages)
    rpc = RadixPromptCache(pool)
    gen = RadixBatchGenerator(
        model, rpc, shared_prefix="auto", completion_batch_size=16, prefill_batch_size=16
    )
    admit(gen, rpc, [question(tok, i) for i in range(12)], [6] * 12)
    paths = []
    for _ in range(8):
        gen.next()
        stats = gen.decode_stats
        if stats["decode_rows"] == 12:
            paths.append(stats["decode_path"])
    assert paths and set(paths) == {path}, paths
    gen.close()
