"""The disk tier under the pool: pages written through, read back after a restart or an
eviction, and only for the model, page size and salt that wrote them."""

import pytest
from test_generation import KEY, generate
from test_prompt_cache import idle
from tiny_models import build_model

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.cache.tiering import Tiering
from mlx_radix_plugin.memory.disk_tier import DiskTier
from mlx_radix_plugin.memory.fingerprint import weights_fingerprint

PS = 4


@pytest.fixture
def llama(loaded):
    return loaded("llama")


def identity(model, page_size=PS):
    pool = KVPool.for_model(model, page_size=page_size, pool_tokens=64)
    return {
        "weights": weights_fingerprint(model),
        "page_size": page_size,
        "kv_dtype": str(pool.dtype),
        "layers": [str(s) for s in pool.specs],
    }


def with_disk(model, root, page_size=PS, pool_tokens=1024):
    """A prompt cache over a fresh pool, on the disk tier at ``root`` (a restart)."""
    pool = KVPool.for_model(model, page_size=page_size, pool_tokens=pool_tokens)
    rpc = RadixPromptCache(pool)
    rpc.tiering = Tiering(pool, DiskTier(root, identity(model, page_size), 1 << 30), KEY)
    return rpc


def serve(rpc, model, tok, prompt, key=KEY):
    cache, rest = rpc.fetch_nearest_cache(key, prompt)
    out = generate(model, tok, rest, cache)
    rpc.insert_cache(key, prompt + out, cache)
    del cache
    return out, len(prompt) - len(rest)


def written(rpc):
    rpc.tiering.pump(everything=True)
    assert rpc.tiering.disk.flush(10)
    return rpc.tiering.disk.counters.pages_written


def stop(rpc):
    written(rpc)
    rpc.tiering.disk.close(10)


def test_a_restart_hits_on_disk_and_answers_as_stock(llama, tmp_path):
    model, tok = llama
    prompt = list(range(10, 10 + 11 * PS + 2))
    first = with_disk(model, tmp_path)
    out, cached = serve(first, model, tok, prompt)
    assert cached == 0 and written(first) == len(prompt + out) // PS
    stop(first)

    second = with_disk(model, tmp_path)  # a new process: an empty pool, the same disk
    turn2 = prompt + out + [7, 8, 9]
    out2, cached2 = serve(second, model, tok, turn2)
    assert cached2 == len(prompt + out) // PS * PS
    assert out2 == generate(model, tok, turn2)
    stats = second.stats()
    assert stats["disk_hits"] == 1 and stats["disk_pages_read"] == cached2 // PS
    assert stats["disk_restore_seconds"] > 0
    assert idle(stats)
    stop(second)


def test_pages_the_pool_evicted_come_back_from_disk(llama, tmp_path):
    model, tok = llama
    rpc = with_disk(model, tmp_path, pool_tokens=24 * PS)
    a = list(range(100, 100 + 12 * PS))
    serve(rpc, model, tok, a)
    written(rpc)
    for i in range(3):  # other prompts push ``a`` out of the pool
        serve(rpc, model, tok, list(range(200 + 60 * i, 200 + 60 * i + 12 * PS)))
    assert rpc.counters.evictions > 0
    out, cached = serve(rpc, model, tok, a + [5])
    assert cached == len(a) and out == generate(model, tok, a + [5])
    assert rpc.stats()["disk_hits"] >= 1
    assert idle(rpc.stats())
    stop(rpc)


def test_other_weights_or_page_size_see_nothing(llama, model_dirs, tmp_path, loaded):
    model, tok = llama
    prompt = list(range(10, 10 + 8 * PS))
    first = with_disk(model, tmp_path / "disk")
    serve(first, model, tok, prompt)
    stop(first)

    from mlx_lm import load

    other, _ = load(str(build_model("llama", tmp_path / "other", seed=1)))
    assert weights_fingerprint(other) != weights_fingerprint(model)
    for m, ps in ((other, PS), (model, 2 * PS)):
        rpc = with_disk(m, tmp_path / "disk", page_size=ps)
        assert len(rpc.tiering.disk) == 0
        _, cached = serve(rpc, m, tok, prompt + [1])
        assert cached == 0 and rpc.stats()["disk_hits"] == 0
        stop(rpc)


def test_salted_requests_share_on_disk_only_with_their_salt(llama, tmp_path):
    model, tok = llama
    salted = (*KEY, ("cache_salt", "a")) if isinstance(KEY, tuple) else (KEY, "a")
    prompt = list(range(10, 10 + 8 * PS))
    first = with_disk(model, tmp_path)
    serve(first, model, tok, prompt, key=salted)
    stop(first)
    second = with_disk(model, tmp_path)
    assert serve(second, model, tok, prompt + [1])[1] == 0
    assert serve(second, model, tok, prompt + [1], key=salted)[1] == len(prompt)
    stop(second)


def test_a_corrupt_page_is_a_miss_from_there_on(llama, tmp_path):
    model, tok = llama
    prompt = list(range(10, 10 + 8 * PS))
    first = with_disk(model, tmp_path)
    serve(first, model, tok, prompt)
    stop(first)
    second = with_disk(model, tmp_path)
    tier = second.tiering
    keys = tier.hashes(KEY, prompt, 8)
    path = tier.disk.path_of(keys[3])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x55
    path.write_bytes(bytes(data))
    out, cached = serve(second, model, tok, prompt + [1])
    assert cached == 3 * PS and out == generate(model, tok, prompt + [1])
    assert second.stats()["disk_corrupt"] == 1
    stop(second)


def test_write_through_gathers_only_pages_the_disk_lacks(llama, tmp_path):
    model, tok = llama
    rpc = with_disk(model, tmp_path)
    prompt = list(range(10, 10 + 8 * PS))
    serve(rpc, model, tok, prompt)
    before = written(rpc)
    out, _ = serve(rpc, model, tok, prompt + [1, 2, 3])  # the same pages, and new ones
    queued = {key for _, meta, _ in rpc.tiering._pending for key, *_ in meta}
    assert queued and not queued & set(rpc.tiering.hashes(KEY, prompt, 8))
    assert written(rpc) - before == len(queued) == (len(prompt) + 3 + len(out)) // PS - 8
    stop(rpc)
