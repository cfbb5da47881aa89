"""The disk tier under the pool: pages written through, read back after a restart or an
eviction, and only for the model, page size and salt that wrote them."""

import time

import numpy as np
import pytest
from test_generation import KEY, generate
from test_prompt_cache import idle
from tiny_models import build_model

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.cache.tiering import Tiering, disk_identity
from mlx_radix_plugin.memory.disk_tier import DiskTier

PS = 4


@pytest.fixture
def llama(loaded):
    return loaded("llama")


def with_disk(model, root, page_size=PS, pool_tokens=1024, write="through", budget=1 << 30):
    """A prompt cache over a fresh pool, on the disk tier at ``root`` (a restart), under
    the identity the server gives it."""
    pool = KVPool.for_model(model, page_size=page_size, pool_tokens=pool_tokens)
    rpc = RadixPromptCache(pool)
    disk = DiskTier(root, disk_identity(model, pool), budget)
    rpc.tiering = Tiering(pool, disk, KEY, write=write)
    return rpc


def serve(rpc, model, tok, prompt, key=KEY):
    cache, rest = rpc.fetch_nearest_cache(key, prompt)
    out = generate(model, tok, rest, cache)
    rpc.insert_cache(key, prompt + out, cache)
    del cache
    return out, len(prompt) - len(rest)


def on_disk(model, tok, root, prompt, key=KEY):
    """A server's life: ``prompt`` served, its pages written, the server stopped."""
    first = with_disk(model, root)
    serve(first, model, tok, prompt, key=key)
    stop(first)


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


def test_other_weights_settings_or_page_size_see_nothing(llama, tmp_path):
    model, tok = llama
    prompt = list(range(10, 10 + 8 * PS))
    on_disk(model, tok, tmp_path / "disk", prompt)

    from mlx_lm import load

    # The same model moved elsewhere sees it all.
    moved, _ = load(str(build_model("llama", tmp_path / "moved", seed=0)))
    rpc = with_disk(moved, tmp_path / "disk")
    _, cached = serve(rpc, moved, tok, prompt + [1])
    assert cached >= len(prompt) - PS and rpc.stats()["disk_hits"] == 1
    stop(rpc)
    other, _ = load(str(build_model("llama", tmp_path / "other", seed=1)))
    # Same weights, another config.json (RoPE's base): other K for the same tokens.
    rope, _ = load(str(build_model("llama", tmp_path / "rope", seed=0, rope_theta=10.0)))
    for m, ps in ((other, PS), (rope, PS), (model, 2 * PS)):
        rpc = with_disk(m, tmp_path / "disk", page_size=ps)
        assert len(rpc.tiering.disk) == 0
        _, cached = serve(rpc, m, tok, prompt + [1])
        assert cached == 0 and rpc.stats()["disk_hits"] == 0
        stop(rpc)


def test_salted_requests_share_on_disk_only_with_their_salt(llama, tmp_path):
    model, tok = llama
    salted = (*KEY, ("cache_salt", "a")) if isinstance(KEY, tuple) else (KEY, "a")
    prompt = list(range(10, 10 + 8 * PS))
    on_disk(model, tok, tmp_path, prompt, key=salted)
    second = with_disk(model, tmp_path)
    assert serve(second, model, tok, prompt + [1])[1] == 0
    assert serve(second, model, tok, prompt + [1], key=salted)[1] == len(prompt)
    stop(second)


def test_a_corrupt_page_is_a_miss_from_there_on(llama, tmp_path):
    model, tok = llama
    prompt = list(range(10, 10 + 8 * PS))
    on_disk(model, tok, tmp_path, prompt)
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
    queued = {key for *_, meta, _ in rpc.tiering._pending for key, *_ in meta}
    assert queued and not queued & set(rpc.tiering.hashes(KEY, prompt, 8))
    assert written(rpc) - before == len(queued) == (len(prompt) + 3 + len(out)) // PS - 8
    stop(rpc)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_pages_round_trip_bit_for_bit(model_dirs, tmp_path, dtype):
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(model_dirs["llama"]))
    model.set_dtype(getattr(mx, dtype))
    prompt = list(range(10, 10 + 6 * PS))
    first = with_disk(model, tmp_path)
    cache, _ = first.fetch_nearest_cache(KEY, prompt)
    model(mx.array(prompt[:-1])[None], cache=cache)
    first.insert_cache(KEY, prompt[:-1], cache)
    del cache
    pages = first.tree.match_prefix(KEY, prompt).pages
    before = [first.pool.rows(layer, first.pool.slots_of(pages)) for layer in range(2)]
    stop(first)
    second = with_disk(model, tmp_path)
    _, rest = second.fetch_nearest_cache(KEY, prompt)
    assert len(rest) == len(prompt) - len(pages) * PS
    pages = second.tree.match_prefix(KEY, prompt).pages
    after = [second.pool.rows(layer, second.pool.slots_of(pages)) for layer in range(2)]
    assert second.pool.dtype == getattr(mx, dtype)
    for (k0, v0), (k1, v1) in zip(before, after):
        assert mx.array_equal(k0, k1).item() and mx.array_equal(v0, v1).item()
    stop(second)


def test_auto_reads_back_only_what_is_faster_than_computing(llama, tmp_path):
    from mlx_radix_plugin.cache.tiering import prefill_seconds_per_token

    model, tok = llama
    prompt = list(range(10, 10 + 8 * PS))
    on_disk(model, tok, tmp_path, prompt)
    rate = prefill_seconds_per_token(model)
    assert 0 < rate < 1
    # A machine that computes a page in a nanosecond, and one that takes a second a token.
    for prefill_rate, reads in ((1e-9, False), (1.0, True)):
        rpc = with_disk(model, tmp_path)
        rpc.tiering.restore_mode, rpc.tiering.prefill_rate = "auto", prefill_rate
        rpc.tiering.measure_reads()
        assert rpc.tiering.read_rate is not None
        assert rpc.tiering.worth_reading() is reads
        out, cached = serve(rpc, model, tok, prompt + [1])
        assert (cached > 0) is reads and out == generate(model, tok, prompt + [1])
        assert rpc.stats()["disk_restores_skipped"] == (0 if reads else 1)
        stop(rpc)


def test_writes_a_full_queue_dropped_are_retried_when_idle(llama, tmp_path, monkeypatch):
    from mlx_radix_plugin.memory import disk_tier

    model, tok = llama
    rpc = with_disk(model, tmp_path)
    gate = __import__("threading").Event()
    write = rpc.tiering.disk._write_page
    monkeypatch.setattr(rpc.tiering.disk, "_write_page", lambda *a: gate.wait(10) and write(*a))
    page_bytes = rpc.pool.bytes_per_page
    monkeypatch.setattr(disk_tier, "QUEUE_BYTES", 2 * page_bytes)
    prompt = list(range(10, 10 + 8 * PS))
    serve(rpc, model, tok, prompt)
    # Gathered (a copy in device memory) only as much as the queue takes; the rest is
    # remembered once, to the request's deepest page.
    assert sum(len(pending[3]) for pending in rpc.tiering._pending) == 2
    [((key, data), n)] = rpc.tiering._later.items()  # the prompt and its answer's pages
    tokens = np.frombuffer(data, dtype="<i4").tolist()
    assert key == KEY and tokens[: len(prompt)] == prompt and n == len(tokens)
    assert n % PS == 0
    rpc.tiering.pump(everything=True)
    assert rpc.stats()["disk_writes_dropped"] == len(tokens) // PS - 2
    gate.set()
    rpc.tiering.disk.flush(10)
    monkeypatch.setattr(disk_tier, "QUEUE_BYTES", 1 << 30)
    rpc.tiering.write_later(rpc.tree)  # what the server does when idle
    rpc.tiering.disk.flush(10)
    keys = rpc.tiering.hashes(KEY, prompt, 8)
    assert rpc.tiering.disk.stored(keys) == 8
    stop(rpc)


def test_preload_reads_the_most_recent_unsalted_prompts_up_to_a_limit(llama, tmp_path):
    model, tok = llama
    older, newer = list(range(10, 10 + 8 * PS)), list(range(100, 100 + 8 * PS))
    salted = (*KEY, ("cache_salt", "a"))
    first = with_disk(model, tmp_path)
    for key, prompt in ((KEY, older), (KEY, newer), (salted, list(range(300, 300 + 8 * PS)))):
        serve(first, model, tok, prompt, key=key)
        written(first)
        time.sleep(0.05)  # distinct modification times: the LRU order
    stop(first)
    second = with_disk(model, tmp_path)
    loaded = second.tiering.preload(second.tree, KEY, limit=10 * PS)
    # The salted prompt is the newest but not this namespace's; then ``newer`` whole, and
    # what the limit leaves of ``older``.
    assert loaded == 10 * PS
    assert second.tree.cached_pages(KEY, newer[: 8 * PS]) is not None
    assert second.tree.cached_pages(salted, list(range(300, 300 + 4))) is None
    out, cached = serve(second, model, tok, newer + [1])
    assert cached == len(newer) and out == generate(model, tok, newer + [1])
    assert second.stats()["disk_hits"] == 0  # served from the pool
    stop(second)


def test_a_restore_with_no_room_leaves_the_match_whole(llama, tmp_path):
    # Found by the restart soak: an allocation for pages read back evicted the cached page
    # the match continued into, then failed, and the fetch copied from the freed page.
    model, tok = llama
    x = list(range(10, 10 + 10 * PS))
    first = with_disk(model, tmp_path, pool_tokens=64 * PS)
    serve(first, model, tok, x + [5])
    stop(first)
    rpc = with_disk(model, tmp_path, pool_tokens=8 * PS)
    serve(rpc, model, tok, x[:5])  # the tree: x's first page, then x[4] and its answer
    stats = rpc.stats()
    held = rpc.pool.alloc_pages(stats["pages_total"] - stats["pages_cached"])  # requests'
    cache, rest = rpc.fetch_nearest_cache(KEY, x + [7])
    assert len(rest) < len(x)  # the pool's page and the partial page, not what the disk has
    out = generate(model, tok, rest, cache)
    assert out == generate(model, tok, x + [7])
    del cache
    rpc.pool.release_pages(held)
    assert idle(rpc.stats())
    stop(rpc)


@pytest.mark.parametrize("queue_pages", [2, 0.5])
def test_a_clean_stop_writes_the_whole_tree_through_a_small_queue(
    llama, tmp_path, monkeypatch, queue_pages
):
    from mlx_radix_plugin.memory import disk_tier

    model, tok = llama
    prompts = [list(range(b, b + 12 * PS)) for b in (10, 100)]
    rpc = with_disk(model, tmp_path)
    tiering, rpc.tiering = rpc.tiering, None
    for prompt in prompts:  # in the tree, not on disk (as writes a full queue dropped)
        serve(rpc, model, tok, prompt)
    rpc.tiering = tiering
    # Half a page: a queue smaller than one page takes one page once it is empty.
    monkeypatch.setattr(disk_tier, "QUEUE_BYTES", int(queue_pages * rpc.pool.bytes_per_page))
    write = tiering.disk._write_page
    monkeypatch.setattr(tiering.disk, "_write_page", lambda *a: time.sleep(0.01) or write(*a))
    written = tiering.save_tree(rpc.tree, time.monotonic() + 30)
    assert written >= 24
    for prompt in prompts:
        assert tiering.disk.stored(tiering.hashes(KEY, prompt, 12)) == 12
    stop(rpc)


def test_a_clean_stop_keeps_its_deadline(llama, tmp_path, monkeypatch):
    model, tok = llama
    rpc = with_disk(model, tmp_path)
    tiering, rpc.tiering = rpc.tiering, None
    serve(rpc, model, tok, list(range(10, 10 + 40 * PS)))
    rpc.tiering = tiering
    write = tiering.disk._write_page
    monkeypatch.setattr(tiering.disk, "_write_page", lambda *a: time.sleep(0.1) or write(*a))
    began = time.monotonic()
    written = tiering.save_tree(rpc.tree, began + 0.5)
    assert time.monotonic() - began < 0.5 + 0.3 and 0 < written < 40
    tiering.disk.close(0)


def test_written_when_idle_only_once_idle_and_hit_after_a_restart(llama, tmp_path):
    model, tok = llama
    prompts = [list(range(b, b + 6 * PS)) for b in (10, 100)]
    rpc = with_disk(model, tmp_path, write="idle")
    for prompt in prompts:
        serve(rpc, model, tok, prompt)
    assert written(rpc) == 0  # busy: nothing gathered, nothing written
    assert not rpc.tiering.write_later(rpc.tree)  # what the server does when idle
    assert written(rpc) >= 12
    stop(rpc)
    again = with_disk(model, tmp_path, write="idle")
    for prompt in prompts:
        out, cached = serve(again, model, tok, prompt + [1])
        assert cached >= len(prompt) and out == generate(model, tok, prompt + [1])
    assert again.stats()["disk_hits"] == 2
    stop(again)


def test_prompts_remembered_for_later_keep_the_newest_and_go_oldest_first(
    llama, tmp_path, monkeypatch
):
    from mlx_radix_plugin.cache import tiering

    monkeypatch.setattr(tiering, "LATER_MOST_TOKENS", 25)
    rpc = with_disk(llama[0], tmp_path, write="idle")
    prompts = [list(range(b, b + 10)) for b in (10, 100, 200, 300)]
    for prompt in prompts + [prompts[-1]]:
        rpc.tiering._remember(KEY, prompt)
    assert rpc.tiering._later_tokens == 20
    assert [rpc.tiering._recall()[1] for _ in range(2)] == prompts[2:]
    assert not rpc.tiering._later and rpc.tiering._later_tokens == 0
    stop(rpc)


def test_pages_larger_than_the_queue_are_written_one_at_a_time(llama, tmp_path, monkeypatch):
    from mlx_radix_plugin.memory import disk_tier

    model, tok = llama
    rpc = with_disk(model, tmp_path)
    monkeypatch.setattr(disk_tier, "QUEUE_BYTES", rpc.pool.bytes_per_page // 2)
    prompt = list(range(10, 10 + 8 * PS))
    serve(rpc, model, tok, prompt)
    for _ in range(40):  # each idle write takes one page (and never spins)
        rpc.tiering.pump(everything=True)
        assert rpc.tiering.disk.flush(10)
        if not rpc.tiering.write_later(rpc.tree):
            break
    assert rpc.tiering.disk.stored(rpc.tiering.hashes(KEY, prompt, 8)) == 8
    stop(rpc)


def test_a_prompt_longer_than_half_the_budget_is_written_once_up_to_it(llama, tmp_path):
    model, tok = llama
    first = with_disk(model, tmp_path)
    serve(first, model, tok, list(range(500, 500 + PS)))
    stop(first)
    file_bytes = first.tiering.disk.nbytes // len(first.tiering.disk)
    rpc = with_disk(model, tmp_path, budget=11 * file_bytes)  # 4 pages a chain at most
    prompt = list(range(10, 10 + 12 * PS))
    serve(rpc, model, tok, prompt)
    written(rpc)
    keys = rpc.tiering.hashes(KEY, prompt, 12)
    assert rpc.tiering.disk.stored(keys) == 4
    before = rpc.tiering.disk.counters.pages_written
    assert not rpc.tiering.write_later(rpc.tree)
    assert written(rpc) == before and rpc.tiering.disk.nbytes <= 11 * file_bytes
    stop(rpc)


def test_written_when_idle_as_far_as_the_tree_still_holds_a_prompt(llama, tmp_path):
    model, tok = llama
    prompt = list(range(10, 10 + 8 * PS))
    rpc = with_disk(model, tmp_path, write="idle")
    serve(rpc, model, tok, prompt)
    serve(rpc, model, tok, prompt[: 6 * PS] + [7] * PS)  # shares 6 pages, then its own
    # Both prompts' own tails evicted before the server was idle; their 6 pages stay.
    rpc._evict(rpc.stats()["pages_cached"] - 6)
    assert rpc.tree.cached_pages(KEY, prompt[: 6 * PS]) is not None
    assert not rpc.tiering.write_later(rpc.tree)
    written(rpc)
    assert rpc.tiering.disk.stored(rpc.tiering.hashes(KEY, prompt, 8)) == 6
    stop(rpc)
