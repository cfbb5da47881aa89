"""The server's prompt cache and stats: binding a model (the pool, MLX's buffer cache limit, a
visible fallback), what the stats and metrics show, and reading them while other threads write."""

import mlx.core as mx
import pytest

from mlx_radix_plugin.config import load_config
from mlx_radix_plugin.memory.budget import (
    MIN_BUFFER_CACHE_BYTES,
    UNIFIED_CACHE_SHARE,
    DeviceMemory,
    buffer_cache_limit,
    device_memory,
)
from mlx_radix_plugin.memory.pool import model_nbytes
from mlx_radix_plugin.server.metrics import render
from mlx_radix_plugin.server.server_cache import ServerPromptCache

GiB = 2**30


def test_the_limit_is_a_share_of_what_the_model_the_pool_and_the_batch_buffers_leave():
    memory = DeviceMemory("cuda", 141 * GiB, "test")
    assert buffer_cache_limit(0.25, memory, 16 * GiB, 40 * GiB) == 85 * GiB // 4
    assert buffer_cache_limit(0.25, memory, 16 * GiB, 40 * GiB, 5 * GiB) == 80 * GiB // 4
    # A device the model and pool fill still reuses a step's buffers.
    assert buffer_cache_limit(0.25, memory, 100 * GiB, 41 * GiB) == MIN_BUFFER_CACHE_BYTES
    # No more than the calls' working memory: past it, the cache keeps what no call reuses.
    assert buffer_cache_limit(0.25, memory, 16 * GiB, 40 * GiB, 0, 9 * GiB) == 9 * GiB
    assert buffer_cache_limit(0.25, memory, 16 * GiB, 40 * GiB, 0, GiB // 8) == (
        MIN_BUFFER_CACHE_BYTES
    )
    # The CPU and Metal count the cache in working memory: a quarter of it, with no floor.
    for backend in ("cpu", "metal"):
        unified = DeviceMemory(backend, 141 * GiB, "test")
        assert buffer_cache_limit(0.25, unified, 16 * GiB, 40 * GiB, 0, 9 * GiB) == 9 * GiB // 4
        assert buffer_cache_limit(0.25, unified, 16 * GiB, 40 * GiB, 0, GiB // 8) == GiB // 32
        assert buffer_cache_limit(0.25, unified, 100 * GiB, 41 * GiB, 0, 9 * GiB) == 0
        # A plan without working memory (none named) keeps the share and the floor.
        assert buffer_cache_limit(0.25, unified, 16 * GiB, 40 * GiB) == 85 * GiB // 4
    with pytest.raises(ValueError, match="buffer_cache_fraction must be in \\(0, 1\\], got 0"):
        buffer_cache_limit(0, memory, 0, 0)


@pytest.fixture
def cache_limit():
    """Reads MLX's current cache limit (set_cache_limit returns the previous one); restores it."""
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)

    def current() -> int:
        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        return limit

    yield current
    mx.set_cache_limit(before)


def make(fraction: str) -> ServerPromptCache:
    env = {"MLX_RADIX_POOL_TOKENS": "4096", "MLX_RADIX_BUFFER_CACHE_FRACTION": fraction}
    return ServerPromptCache(load_config(environ=env))


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))


def test_binding_a_model_sets_the_limit_and_stats_report_it(loaded, cache_limit):
    model, _ = loaded("llama")
    server_cache = make("0.5")
    server_cache.bind(model, ("m", None, None))
    expected_pool = server_cache.radix.pool.max_nbytes  # its ceiling, not what it holds yet
    limit = cache_limit()
    assert server_cache.buffer_cache_limit == limit
    # The same rule on this machine's memory, read again here: within what the test moved;
    # at most the plan's working memory.
    left = device_memory().usable_bytes - model_nbytes(model) - expected_pool
    working = server_cache.radix.pool.plan.working_bytes
    if device_memory().backend == "cuda":
        if working < left // 2:
            assert limit == max(working, MIN_BUFFER_CACHE_BYTES)
        else:
            assert abs(limit - left // 2) <= 0.05 * left
    else:  # counted in working memory
        assert limit == min(int(working * UNIFIED_CACHE_SHARE), left // 2)
    stats = server_cache.stats()
    assert stats["mlx_cache_limit_bytes"] == limit
    assert stats["mlx_active_bytes"] >= 0 and stats["mlx_cache_bytes"] >= 0
    text = render({**stats, **_decode_idle()}, {})
    assert f"mlx_radix_mlx_cache_bytes {stats['mlx_cache_bytes']}" in text
    assert f"mlx_radix_mlx_cache_trims_total {stats['mlx_cache_trims']}" in text
    assert server_cache.radix.pool.freed_buffers.limit == limit


def test_a_fraction_of_0_leaves_mlx_its_own_limit(loaded, cache_limit):
    model, _ = loaded("llama")
    before = cache_limit()
    server_cache = make("0")
    server_cache.bind(model, ("m", None, None))
    assert cache_limit() == before
    assert server_cache.stats()["mlx_cache_limit_bytes"] is None


@pytest.mark.parametrize("hold", ["true", "false"])
def test_binding_a_model_measures_working_memory_and_holds_mlx_to_the_plan(loaded, hold):
    model, _ = loaded("llama")
    before = mx.get_memory_limit()  # conftest sets it back after the test
    env = {"MLX_RADIX_POOL_TOKENS": "4096", "MLX_RADIX_HOLD_TO_PLAN": hold}
    server_cache = ServerPromptCache(load_config(environ=env))
    server_cache.bind(model, ("m", None, None))
    working = server_cache.radix.pool.working_set
    assert working is server_cache.working_set and working.hold == (hold == "true")
    working.begin_call()
    working.end_call()
    stats = server_cache.stats()
    assert stats["working_bytes"] == server_cache.radix.pool.plan.working_bytes
    assert stats["working_peak_decode_bytes"] == working.peaks["decode"]
    if hold == "true":
        assert stats["mlx_memory_limit_bytes"] == mx.get_memory_limit() == working.limit
    else:
        assert stats["mlx_memory_limit_bytes"] is None and mx.get_memory_limit() == before
    text = render({**stats, **_decode_idle()}, {})
    assert f"mlx_radix_working_peak_decode_bytes {working.peaks['decode']}" in text
    # A model that keeps no pool (a draft model's falls back) gives MLX its limit back.
    server_cache.bind(model, ("m2", None, None), draft_model=model)
    assert server_cache.working_set is None and mx.get_memory_limit() == before


def _decode_idle() -> dict:
    from mlx_radix_plugin.engine.decode_path import idle_stats

    return idle_stats("auto")


def test_metrics_render_with_the_radix_path_disabled():
    from mlx_radix_plugin.server.plugin import RadixPlugin

    plugin = RadixPlugin()
    plugin.config = load_config(environ={"MLX_RADIX_ENABLED": "false"})
    stats = plugin.stats()
    assert stats["fallback"] == "radix.enabled is false"
    assert stats["mlx_cache_limit_bytes"] is None and stats["mlx_active_bytes"] >= 0
    assert "mlx_radix_mlx_active_bytes " in plugin.metrics_route(None).body


def test_a_pool_that_fails_to_build_is_a_visible_fallback(loaded, monkeypatch, caplog):
    """Any failure building the pool at model load: the server goes on with the stock cache,
    and the stats and the log say why (it used to escape bind, and later requests failed)."""
    from mlx_radix_plugin.server import server_cache as module

    def fail(*args, **kwargs):
        raise MemoryError("cannot allocate 9 TB")

    monkeypatch.setattr(module.KVPool, "for_model", fail)
    model, _ = loaded("llama")
    cache = make("0.25")
    cache.bind(model, ("/home/me/models/Llama-tiny", None, None))
    stats = cache.stats()
    assert stats["fallback"] == "the KV pool could not be built: MemoryError: cannot allocate 9 TB"
    assert stats["model"] == ["Llama-tiny", None, None]  # the name, not the local path
    assert cache.radix is None and cache.stock is not None
    assert "could not be built" in caplog.text


def test_finish_reasons_are_read_under_the_lock_their_writers_take():
    """HTTP threads count finished requests while /metrics and the stats read the counts:
    every read is a snapshot taken under the writers' lock (a dict read while another
    thread adds a key raises; free-threaded Python makes that reachable)."""
    from collections import Counter
    from types import SimpleNamespace

    from mlx_radix_plugin.server.plugin import RadixPlugin

    plugin = RadixPlugin()
    plugin.config = load_config(environ={"MLX_RADIX_ENABLED": "false"})

    def held() -> None:
        lock = getattr(plugin, "_requests_lock", None)
        assert lock is not None and lock.locked(), "finish reasons read without the lock"

    class Guarded(Counter):
        def __iter__(self):
            held()
            return super().__iter__()

        def keys(self):
            held()
            return super().keys()

        def items(self):
            held()
            return super().items()

    plugin.requests = Guarded()
    plugin.mlx_lm_request_finished(SimpleNamespace(finish_reason="stop"))
    plugin.mlx_lm_request_finished(SimpleNamespace(finish_reason=None))
    assert plugin.stats()["requests"] == {"stop": 1, "unknown": 1}
    assert 'mlx_radix_requests_total{finish_reason="stop"} 1' in plugin.metrics_route(None).body


def test_stats_read_the_pool_once_while_a_model_load_swaps_it(loaded):
    """A model load (generation thread) may set ``radix`` to None between two reads."""
    model, _ = loaded("llama")
    cache = make("0.25")
    cache.bind(model, ("m", None, None))
    bound = cache.radix

    class Swapping(ServerPromptCache):
        reads = 0

        @property
        def radix(self):
            Swapping.reads += 1
            return bound if Swapping.reads == 1 else None

        @radix.setter
        def radix(self, value):
            pass

    cache.__class__ = Swapping
    assert cache.stats()["pages_total"] == bound.pool.num_pages


def test_one_list_of_keys_serves_the_stats_the_idle_stats_and_the_metrics(loaded):
    """The pool's counts come from one table (POOL_STATS), decode's from DECODE_STATS: a
    server with a pool, one without, and the metrics all name the same keys."""
    from mlx_radix_plugin.cache.prompt_cache import POOL_STATS
    from mlx_radix_plugin.engine.decode_path import DECODE_STATS
    from mlx_radix_plugin.engine.decode_path import idle_stats as idle_decode
    from mlx_radix_plugin.server.metrics import METRICS

    model, _ = loaded("llama")
    unbound = make("0.25").stats()
    bound = make("0.25")
    bound.bind(model, ("m", None, None))
    assert set(bound.stats()) == set(unbound)
    assert set(POOL_STATS) <= set(unbound)
    paths = {"decode_shared_prefix", "decode_path", "prefill_path"}
    assert set(idle_decode("auto")) == {*paths, *DECODE_STATS}
    # Every metric is a count some state of the server reports.
    assert set(METRICS) <= set(unbound) | set(DECODE_STATS)


def test_an_idle_server_gives_back_the_chunks_that_stayed_empty(loaded, monkeypatch):
    from mlx_radix_plugin.memory import pool

    monkeypatch.setattr(pool, "chunk_bytes_for", lambda ceiling, per_token: 1)  # a chunk a page
    model, _ = loaded("llama")
    cache = make("0.25")
    cache.bind(model, ("m", None, None))
    assert cache.stats()["pool_chunks"] == 0  # nothing allocated before a request
    radix = cache.radix
    radix.pool.release_pages(radix.pool.alloc_pages(5))
    assert cache.stats()["pool_chunks"] == 5
    cache.idle()  # empty from now on
    assert cache.stats()["pool_chunks"] == 5
    monkeypatch.setattr(pool, "CHUNK_IDLE_SECONDS", 0.0)
    cache.idle()
    stats = cache.stats()
    assert stats["pool_chunks"] == 1 and stats["pool_bytes_total"] == radix.pool.bytes_per_page


def test_idle_right_after_a_batch_drains_commits_and_leaves_the_rest_for_the_next_call(
    loaded, monkeypatch
):
    """The idle hook runs as soon as the batch drains: it commits the requests that
    finished last, and leaves trimming, disk writes and pins for its next call, so a
    chat's next turn arriving at once does not wait for them."""
    model, _ = loaded("llama")
    cache = make("0.25")
    cache.bind(model, ("m", None, None))
    radix = cache.radix
    trims = []
    monkeypatch.setattr(radix.pool, "trim", lambda: trims.append(len(trims)))
    tokens = list(range(1, 40))
    caches, _ = cache.fetch_nearest_cache("m", tokens)
    cache.insert_cache("m", tokens, caches)  # finished: its commit waits
    assert cache.stats()["requests_holding_pages"] == 1
    cache.idle()
    assert cache.stats()["requests_holding_pages"] == 0 and trims == []
    cache.idle()
    assert trims == [0]
