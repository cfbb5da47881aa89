"""The warm-up at model load: the engine's paths run once on a scratch pool."""

import pytest
from servers import mlx_lm_server
from test_paged_prefill import _plans
from test_server import GREEDY, SYSTEM, hf_cache, start  # noqa: F401 - fixtures
from tiny_models import ARCHS, HYBRID_ARCHS

from mlx_radix_plugin.cache.prompt_cache import RadixPromptCache
from mlx_radix_plugin.engine import attention, prompt_attention, warmup
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.memory.pool import KVPool


@pytest.mark.parametrize("arch", [*ARCHS, *HYBRID_ARCHS])
def test_every_architecture_runs_the_warm_up(loaded, arch):
    model, _ = loaded(arch)
    assert warmup.warm_up(model, page_size=4, shared_prefix="auto") > 0
    assert attention.VARIANT is None  # the shared path's variant is the rule's again


@pytest.mark.parametrize("prefill_shared", ["auto", "off"])
def test_the_warm_up_prefills_rows_on_one_prefix_reading_it_once_unless_that_is_off(
    loaded, monkeypatch, prefill_shared
):
    """The grouped prompt pass (cache/grouped_prefill.py) builds its kernels at load too."""
    plans = _plans(monkeypatch)
    model, _ = loaded("llama")
    warmup.warm_up(model, page_size=4, shared_prefix="off", prefill_shared=prefill_shared)
    grouped = [p for p in plans if p is not None]
    assert bool(grouped) == (prefill_shared != "off")
    assert all(p.rows == warmup.ROWS for p in grouped)


def test_the_warm_up_reads_pages_within_one_chunk_and_across_chunks(loaded, monkeypatch):
    """A long prompt's passes come to read pages from two chunks of the pool, whose kernels
    (parts joined) the warm-up builds at load as well."""
    spans = []
    rows = KVPool.rows

    def counted(self, layer, slots):
        spans.append(len(self._plan(slots).pieces))
        return rows(self, layer, slots)

    monkeypatch.setattr(KVPool, "rows", counted)
    model, _ = loaded("llama")
    warmup.warm_up(model, page_size=4, shared_prefix="auto")
    assert min(spans) == 1 and max(spans) > 1


def test_the_warm_up_builds_the_attention_of_a_fresh_prompts_passes(loaded, monkeypatch):
    """Where cuDNN serves prompt attention (forced here: the CPU computes the same call), a
    graph is built for each new call shape: the warm-up makes the calls of a fresh prompt's
    passes up to the model's context, so that a long prompt builds none but its last pass's."""
    monkeypatch.setattr(prompt_attention, "fused_causal", lambda *a: True)
    monkeypatch.setattr(warmup, "backend", lambda: "cuda")
    calls = []
    stock = prompt_attention._STOCK

    def recorded(q, k, v, cache, scale, mask, sinks=None):
        if mask == "causal":
            calls.append((q.shape, k.shape, v.shape, q.dtype))
        return stock(q, k, v, cache, scale=scale, mask=mask, sinks=sinks)

    monkeypatch.setattr(prompt_attention, "_STOCK", recorded)
    monkeypatch.setattr(prompt_attention, "_CAUSAL_GEOMETRIES", set())
    model, _ = loaded("llama")
    step, context = 32, 160
    warmup.warm_up(model, page_size=4, shared_prefix="off", prefill_step=step, context=context)
    built = set(calls)
    assert {k[2] for _, k, _, _ in built} >= set(range(step, context + 1, step))

    calls.clear()
    pool = KVPool.for_model(model, page_size=4, pool_tokens=512)
    rpc = RadixPromptCache(pool)
    gen = RadixBatchGenerator(model, rpc, prefill_from_pool="on", prefill_step_size=step)
    warmup._serve(gen, rpc, [[3 + i % 50 for i in range(context - 10)]])
    passes = {c for c in calls if c[0][2] == step}
    assert {k[2] for _, k, _, _ in passes} == {32, 64, 96, 128}
    assert passes <= built
    # The last pass has its own shape: 149 tokens prefilled (the last is the first step's).
    assert {c[0][2] for c in calls} == {step, 21}


def test_auto_warms_up_on_a_gpu_only():
    assert not warmup.enabled("auto")  # these tests run on MLX's CPU backend
    assert warmup.enabled("on") and not warmup.enabled("off")
    with pytest.raises(ValueError, match="decode.warmup must be one of auto, on, off, got 'yes'"):
        warmup.enabled("yes")


def test_a_warmed_up_server_starts_with_an_empty_pool_and_answers_as_stock(start):  # noqa: F811
    prompt = {"prompt": SYSTEM + "Where is Paris?", **GREEDY}
    with start(mlx_lm_server()) as stock:
        expected = stock.post("/v1/completions", prompt)["choices"][0]["text"]
    with start(mlx_lm_server("--plugin", "radix"), {"MLX_RADIX_DECODE_WARMUP": "on"}) as radix:
        radix.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})  # the model is loaded
        before = radix.stats()
        got = radix.post("/v1/completions", prompt)
        log = radix.output()
    assert "radix warm-up: the engine's paths ran in" in log
    # What the warm-up ran is not in the pool that serves requests: only the first request.
    assert before["hits"] == 0 and before["cached_tokens"] == 0
    assert got["choices"][0]["text"] == expected
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
