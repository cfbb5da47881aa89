"""Working memory held to the plan (memory/working_set.py): MLX's memory limit set to the
model, the pool and the plan's working memory before each engine call, each call's working
memory measured by phase, and MLX's own limit back when the radix path goes."""

import gc

import mlx.core as mx
import pytest
from test_generation import no_eos
from test_shared_prefix import admit, decode, stock_run

from mlx_radix_plugin.cache.prompt_cache import RadixPromptCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.memory.pool import KVPool, model_nbytes
from mlx_radix_plugin.memory.working_set import WorkingSet


@pytest.fixture
def mlx_limit():
    """MLX's memory limit before the test (conftest sets it back after)."""
    return mx.get_memory_limit()


def temporaries_peak(limit: int | None) -> int:
    """MLX's peak over its inputs evaluating 40 independent products of 1 MiB temporaries,
    summed, under ``limit`` if given."""
    x = mx.random.normal((512, 512))
    mx.eval(x)
    before = mx.set_memory_limit(limit) if limit else None
    try:
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        parts = [mx.exp(x * i) @ x for i in range(40)]
        total = sum(p.sum() for p in parts)
        del parts
        mx.eval(total)
        return mx.get_peak_memory() - base
    finally:
        if before is not None:
            mx.set_memory_limit(before)


def test_mlx_holds_an_evaluation_to_its_memory_limit(mlx_limit):
    """What the working set relies on: past its memory limit, MLX's evaluation waits for the
    work it launched (freeing its temporaries) before it builds more."""
    free = temporaries_peak(None)
    held = temporaries_peak(mx.get_active_memory() + (8 << 20))
    # MLX's own bound is ten tasks in flight; under the limit it waits at each one.
    assert held <= 12 << 20
    assert free >= 2 * held


def test_each_call_runs_under_the_plans_limit_and_is_measured_by_phase(loaded, mlx_limit):
    model, tok = loaded("llama")
    prompts = [tok.encode("Once upon a time, in a quiet town by the sea,"), tok.encode("Hi")]
    expected, _ = stock_run(model, tok, prompts, [12] * 2)
    gc.collect()
    # Arrays earlier tests left alive count as working memory here, as anything else the
    # server's process holds would.
    others = mx.get_active_memory() - model_nbytes(model)
    pool = KVPool.for_model(model, page_size=16, pool_tokens=4096)
    rpc = RadixPromptCache(pool)
    pool.working_set = working = WorkingSet(pool, model_nbytes(model), rpc.snapshots)
    limits = []
    begin = working.begin_call

    def spy():
        begin()
        limits.append((mx.get_memory_limit(), working.held() + working.named))

    working.begin_call = spy
    gen = RadixBatchGenerator(model, rpc)
    eos = [[no_eos(tok.eos_token_ids)]] * 2
    uids = admit(gen, rpc, prompts, [12] * 2, logits_processors=eos)
    assert decode(gen, uids, 24) == expected
    assert limits and all(mlx == plan for mlx, plan in limits)
    # The pool's first chunk comes with the first prompt: the limit follows it.
    assert limits[0][0] < limits[-1][0]
    assert limits[-1][0] == model_nbytes(model) + pool.nbytes + pool.plan.working_bytes
    assert 0 < working.peaks["prefill"] - others <= working.named
    assert 0 < working.peaks["decode"] - others <= working.named
    # The pass of the largest prefill call, as the stats report it.
    assert working.peak_pass["path"] in ("per_row", "grouped", "buffer")
    assert working.peak_pass["rows"] >= 1 and working.peak_pass["layer_bytes"] > 0
    assert working.mlx_peak_bytes >= model_nbytes(model) + pool.nbytes

    working.release()
    assert mx.get_memory_limit() == mlx_limit


def test_the_peak_since_start_survives_each_calls_reset(loaded, mlx_limit):
    model, _ = loaded("llama")
    pool = KVPool.for_model(model, page_size=16, pool_tokens=4096)
    working = WorkingSet(pool, model_nbytes(model), hold=False)
    big = mx.zeros((4 << 20,))
    mx.eval(big)
    high = mx.get_active_memory()
    del big
    working.begin_call()
    working.end_call()
    assert mx.get_peak_memory() < high <= working.mlx_peak_bytes
    assert working.limit is None and mx.get_memory_limit() == mlx_limit  # not held


def test_a_pool_without_a_plan_is_refused(loaded):
    model, _ = loaded("llama")
    pool = KVPool.for_model(model, pool_tokens=4096)
    pool.plan = None  # a pool built by hand, as tests do
    with pytest.raises(ValueError, match="memory plan"):
        WorkingSet(pool, model_nbytes(model))
