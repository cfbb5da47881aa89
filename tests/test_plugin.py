"""The radix plugin's hook implementations, in process."""

from types import SimpleNamespace

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm_hooks.server import RequestRecord

from mlx_radix_plugin.config import load_config
from mlx_radix_plugin.server.plugin import RadixPlugin


@pytest.fixture
def plugin():
    def make(**overrides):
        p = RadixPlugin()
        p.config = load_config(cli=overrides, environ={})
        return p

    return make


@pytest.fixture(autouse=True)
def stock_layers(loaded):
    """The session's shared models get stock's layer classes back: a model load here fuses
    and compiles them, as the server does."""
    yield
    from mlx_radix_plugin.engine import compiled_layers, fused_projections

    for arch in ("llama", "qwen3"):
        model, _ = loaded(arch)
        compiled_layers.uninstall(model)
        fused_projections.restore(model)


def args(**kw):
    return SimpleNamespace(**{"prompt_cache_size": 10, "kv_bits": None, "host": "127.0.0.1", **kw})


def test_batch_size_is_capped_only_above_the_limit(plugin, loaded):
    model, _ = loaded("llama")
    p = plugin(**{"decode.max_batch_size": 4})
    assert (
        p.mlx_lm_batch_generator(model, {"completion_batch_size": 2, "prefill_batch_size": 2})
        is None
    )
    capped = p.mlx_lm_batch_generator(model, {"completion_batch_size": 32})
    assert isinstance(capped, BatchGenerator)
    assert capped.completion_batch_size == 4
    capped.close()


def test_model_load_binds_a_pool_and_can_turn_batching_off(plugin, loaded):
    model, _ = loaded("qwen3")
    p = plugin(**{"radix.pool_tokens": 256, "decode.batched": False})
    cache = p.mlx_lm_prompt_cache(args())
    provider = SimpleNamespace(is_batchable=True)
    p.mlx_lm_model_loaded(model, None, ("m", None, None), None, args(), provider)
    assert provider.is_batchable is False
    stats = p.stats()
    assert stats["fallback"] is None and stats["pages_max"] == 256 // 16
    assert cache.radix.pool.max_pages == 16


def test_draft_model_and_kv_bits_fall_back_with_reasons(plugin, loaded):
    model, _ = loaded("llama")
    p = plugin(**{"radix.pool_tokens": 256})
    p.mlx_lm_prompt_cache(args())
    provider = SimpleNamespace(is_batchable=False)
    p.mlx_lm_model_loaded(model, None, ("m", None, "d"), model, args(), provider)
    assert "draft model" in p.stats()["fallback"]
    p.mlx_lm_model_loaded(model, None, ("m", None, None), None, args(kv_bits=4), provider)
    assert "--kv-bits" in p.stats()["fallback"]
    p.mlx_lm_model_loaded(model, None, ("m", None, None), None, args(), provider)
    assert p.stats()["fallback"] is None


def test_the_model_is_served_as_prepared_before_its_memory_is_planned(plugin, loaded, monkeypatch):
    """Fusing and the warm-up leave device memory MLX does not count (CUDA), which the plan
    must read as used: they run first. A model the plugin will not serve is left as it is."""
    from mlx_radix_plugin.engine import fused_projections
    from mlx_radix_plugin.memory.pool import KVPool

    model, _ = loaded("llama")
    calls = []
    prepare, for_model = fused_projections.prepare, KVPool.for_model.__func__
    monkeypatch.setattr(
        fused_projections, "prepare", lambda *a: calls.append("prepare") or prepare(*a)
    )
    monkeypatch.setattr(
        KVPool, "for_model", classmethod(lambda *a, **k: calls.append("plan") or for_model(*a, **k))
    )
    p = plugin(**{"radix.pool_tokens": 256})
    p.mlx_lm_prompt_cache(args())
    provider = SimpleNamespace(is_batchable=True)
    p.mlx_lm_model_loaded(model, None, ("m", None, "d"), model, args(), provider)
    assert calls == [] and "draft model" in p.stats()["fallback"]
    p.mlx_lm_model_loaded(model, None, ("m", None, None), None, args(), provider)
    assert calls == ["prepare", "plan"] and p.stats()["fallback"] is None


def test_disabled_radix_and_metrics(plugin):
    p = plugin(**{"radix.enabled": False, "metrics.enabled": False})
    assert p.mlx_lm_prompt_cache(args()) is None
    assert p.stats()["fallback"] == "radix.enabled is false"
    response = p.metrics_route(None)
    assert response.status == 404 and "metrics.enabled" in response.body["error"]


def test_requests_are_counted_by_finish_reason(plugin):
    p = plugin()
    for reason in ("stop", "length", "stop", None):
        p.mlx_lm_request_finished(RequestRecord(None, 5, 0, 1, reason, 0.1))
    assert p.stats()["requests"] == {"stop": 2, "length": 1, "unknown": 1}


def test_batch_generator_is_the_engine_when_the_pool_is_on(plugin, loaded):
    from mlx_radix_plugin.engine.generator import RadixBatchGenerator

    model, _ = loaded("llama")
    p = plugin(**{"radix.pool_tokens": 256, "decode.max_batch_size": 4})
    p.mlx_lm_prompt_cache(args())
    p.mlx_lm_model_loaded(model, None, ("m", None, None), None, args(), SimpleNamespace())
    engine = p.mlx_lm_batch_generator(model, {"completion_batch_size": 32})
    assert isinstance(engine, RadixBatchGenerator) and engine.completion_batch_size == 4
    assert p.cache.radix.share_inflight
    engine.close()
    assert not p.cache.radix.share_inflight
