"""RadixPromptCache: the LRUPromptCache interface over the tree and the pool."""

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_generation import KEY, generate

from mlx_radix_plugin import KVPool, RadixPromptCache

PS = 4


@pytest.fixture
def llama(loaded):
    return loaded("llama")


def radix(model, pool_tokens=1024, **kw):
    return RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=pool_tokens), **kw)


def serve(rpc, model, tokenizer, prompt, key=KEY):
    cache, rest = rpc.fetch_nearest_cache(key, prompt)
    out = generate(model, tokenizer, rest, cache)
    rpc.insert_cache(key, prompt + out, cache)
    return len(prompt) - len(rest)


def balanced(stats):
    return (
        stats["pages_free"] + stats["pages_locked"] + stats["pages_evictable"]
        == stats["pages_total"]
    )


def idle(stats):
    """No request holds anything: the tree alone references its pages, once each."""
    return (
        balanced(stats)
        and stats["pages_locked"] == stats["tree_locks"] == stats["requests_holding_pages"] == 0
        and stats["page_refs"] == stats["pages_cached"] == stats["pages_evictable"]
    )


def test_exact_match_always_leaves_one_token(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(10, 10 + 4 * PS))  # page aligned: every page of it gets cached
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    generate(model, tok, rest, cache)
    rpc.insert_cache(KEY, prompt, cache)
    for _ in range(3):
        cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
        assert rest == prompt[-1:]
        assert all(c.offset == len(prompt) - 1 for c in cache)
        del cache


def test_model_keys_never_share_prefixes(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = tok.encode("You are a helpful assistant. Answer the question.")
    serve(rpc, model, tok, prompt, key=("model-a", None, None))
    _, rest = rpc.fetch_nearest_cache(("model-a", "adapter", None), prompt)
    assert rest == prompt
    _, rest = rpc.fetch_nearest_cache(("model-a", None, None), prompt)
    assert len(rest) < len(prompt)


def test_mid_page_divergence_copies_only_the_partial_page(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(100, 100 + 5 * PS))
    serve(rpc, model, tok, prompt)
    other = prompt[: 2 * PS + 3] + [7, 8, 9, 11]
    cache, rest = rpc.fetch_nearest_cache(KEY, other)
    table = cache[0].table
    assert rest == [7, 8, 9, 11]
    assert table.shared_tokens == 2 * PS  # two pages shared in place, read without a copy
    tree_pages = rpc.tree.match_prefix(KEY, other[: 2 * PS]).pages
    assert table.pages[:2] == tree_pages
    # Then a private page that starts with the copied 3 tokens; nothing for the rest of the
    # prompt until it is admitted (a queued request holds only what it matched).
    assert table.pages[2] not in rpc.tree.all_pages()
    assert len(table.pages) == 3
    assert mx.array_equal(rpc.pool.read(0, table.slots(0, 2 * PS + 3))[0], cache[0].state[0]).item()


def test_dropped_caches_release_their_locks(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(50, 50 + 6 * PS))
    serve(rpc, model, tok, prompt)
    cache, _ = rpc.fetch_nearest_cache(KEY, prompt + [1, 2, 3])
    assert rpc.stats()["pages_locked"] == 6  # the cached prefix: nothing reserved yet
    cache[0].update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    assert rpc.stats()["pages_locked"] == 6 + 1  # and the page its 3 tokens were written to
    del cache  # a client disconnect: the server drops the cache without inserting it
    gc.collect()
    stats = rpc.stats()
    assert idle(stats)
    assert stats["pages_evictable"] == rpc.tree.total_pages


def test_eviction_keeps_serving_under_pressure(llama):
    model, tok = llama
    rpc = radix(model, pool_tokens=16 * PS)  # room for about two requests at a time
    for i in range(12):
        prompt = [(i * 31 + j) % 400 + 20 for j in range(5 * PS)]
        for attempt in range(2):
            cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
            assert (len(rest) < len(prompt)) == (attempt == 1)
            out = generate(model, tok, rest, cache)
            assert out == generate(model, tok, prompt)
            rpc.insert_cache(KEY, prompt + out, cache)
            stats = rpc.stats()
            assert balanced(stats) and stats["pages_locked"] == 0
    assert rpc.counters.evictions > 0 and rpc.counters.hits == 12


def test_prompt_larger_than_the_pool_is_served_uncached(llama, caplog):
    """The one-request path keeps such a request's K/V privately, as mlx-lm's cache does."""
    caplog.set_level("WARNING", logger="mlx_radix")
    model, tok = llama
    rpc = radix(model, pool_tokens=4 * PS)
    prompt = list(range(10, 60))
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    out = generate(model, tok, rest, cache)
    assert out == generate(model, tok, prompt)
    assert "KV pool full: request goes on uncached from 0 tokens" in caplog.text
    rpc.insert_cache(KEY, prompt + out, cache)  # nothing reached the pool: nothing cached
    assert idle(rpc.stats()) and rpc.stats()["pages_free"] == 4


def test_running_out_of_pages_mid_request_caches_what_was_written(llama):
    model, tok = llama
    rpc = radix(model, pool_tokens=4 * PS)
    prompt = list(range(10, 10 + 3 * PS))
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    out = generate(model, tok, rest, cache)  # runs past the 4 pages there are
    assert out == generate(model, tok, prompt)
    rpc.insert_cache(KEY, prompt + out, cache)
    stats = rpc.stats()
    assert idle(stats) and stats["pages_cached"] == 4
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt + out)
    assert len(rest) == len(prompt + out) - 4 * PS


def test_trim_to_evicts_unlocked_sequences(llama):
    model, tok = llama
    rpc = radix(model)
    for i in range(3):
        serve(rpc, model, tok, [i + 1] + list(range(200, 200 + 3 * PS)))
    assert len(rpc) == 3
    assert rpc.stats_by_type() == {"radix": {"n_sequences": 3, "n_bytes": rpc.nbytes}}
    held, _ = rpc.fetch_nearest_cache(KEY, [1] + list(range(200, 200 + 3 * PS)))
    rpc.trim_to(n_sequences=1)
    assert len(rpc) == 1
    rpc.trim_to(n_bytes=0)
    assert rpc.nbytes == rpc.tree.protected_pages * rpc.pool.bytes_per_page > 0  # held ones stay
    del held
    rpc.trim_to(n_bytes=0)
    assert rpc.nbytes == 0 and len(rpc) == 0


def test_stock_kvcache_is_ingested_once_then_shared(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = tok.encode("Paris is the capital of France. Berlin is the capital of Germany.")
    stock = make_prompt_cache(model)
    out = generate(model, tok, prompt, stock)
    rpc.insert_cache(KEY, prompt + out, stock)
    cached = stock[0].offset  # all that has K/V, the last page a tail if it ends mid-page
    assert rpc.tree.total_pages == -(-cached // PS)
    longer = prompt + out + tok.encode(" Rome")
    cache, rest = rpc.fetch_nearest_cache(KEY, longer)
    assert len(longer) - len(rest) == cached
    assert generate(model, tok, rest, cache) == generate(model, tok, longer)
    rpc.insert_cache(KEY, prompt + out, stock)  # again: nothing new to store
    assert rpc.tree.total_pages == -(-cached // PS)


def test_counters_and_stats(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(300, 300 + 3 * PS))
    serve(rpc, model, tok, prompt)
    serve(rpc, model, tok, prompt + [5, 6])
    s = rpc.stats()
    assert (s["hits"], s["misses"]) == (1, 1)
    assert s["prompt_tokens"] == 2 * len(prompt) + 2
    assert s["cached_tokens"] == len(prompt)
    assert s["pool_bytes_used"] == rpc.pool.allocator.num_used * rpc.pool.bytes_per_page
    assert s["pool_bytes_total"] == rpc.pool.nbytes and balanced(s)


def test_tokens_that_do_not_match_the_pages_are_not_committed(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(40, 40 + 4 * PS))
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    generate(model, tok, rest, cache)
    rpc.insert_cache(KEY, [9] + prompt, cache)  # a caller's bookkeeping gone wrong
    assert rpc.tree.total_pages == 0
    assert rpc.stats()["pages_free"] == rpc.pool.num_pages


def tail_of(rpc, tokens):
    """The tail node ``tokens`` end in, if they end mid-page in the tree."""
    match = rpc.tree.match_prefix(KEY, tokens)
    node = match.partial_node
    assert node is not None and rpc.tree.is_tail(node)
    assert match.partial_len == len(node.tokens) == len(tokens) % PS
    return node


def test_a_short_prompt_repeated_gets_all_but_its_last_token(llama):
    """Stock's cache gives a repeat every token but the last; so does the pool, whole
    pages and then the slots of the page the prompt ends in."""
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(60, 60 + 2 * PS + 3))
    serve(rpc, model, tok, prompt)
    assert serve(rpc, model, tok, prompt) == len(prompt) - 1
    short = [5, 6]  # shorter than a page: a tail of the root
    serve(rpc, model, tok, short)
    assert serve(rpc, model, tok, short) == 1
    assert idle(rpc.stats())


def test_a_turn_completes_the_tail_it_extends_in_place(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(70, 70 + 2 * PS + 1))
    out = generate(model, tok, prompt, make_prompt_cache(model))
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    assert generate(model, tok, rest, cache) == out
    rpc.insert_cache(KEY, prompt + out, cache)
    turn = prompt + out
    assert len(turn) % PS  # the sequence ends in a tail
    done = cache[0].offset  # K/V of all but the last token generated
    tail = tail_of(rpc, turn[:done])
    (page,) = tail.pages

    follow = turn + [9, 10, 11]
    cache, rest = rpc.fetch_nearest_cache(KEY, follow)
    assert len(follow) - len(rest) == done
    table = cache[0].table
    # No one else held the tail: its page is the request's now, out of the tree.
    assert table.pages[-1] == page and page not in rpc.tree.all_pages()
    assert table.shared_tokens == done // PS * PS  # the tail page is written in place
    assert generate(model, tok, rest, cache) == generate(model, tok, follow)
    rpc.insert_cache(KEY, follow, cache)
    assert page in rpc.tree.all_pages() and idle(rpc.stats())


def test_a_tail_someone_else_holds_is_copied(llama):
    model, tok = llama
    rpc = radix(model)
    prompt = list(range(90, 90 + PS + 2))
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    generate(model, tok, rest, cache)
    rpc.insert_cache(KEY, prompt, cache)
    (page,) = tail_of(rpc, prompt).pages
    # A running request that committed this tail at a segment's end still holds its page
    # and writes past the tail: the next request must not write into it.
    rpc.pool.allocator.incref([page])
    follow = prompt + [3, 4, 5]
    cache, rest = rpc.fetch_nearest_cache(KEY, follow)
    assert rest == [3, 4, 5]
    table = cache[0].table
    assert table.pages[-1] != page and page in rpc.tree.all_pages()
    assert mx.array_equal(
        rpc.pool.read(0, table.slots(PS, PS + 2))[0],
        rpc.pool.read(0, rpc.pool.slots([page * PS, page * PS + 1]))[0],
    ).item()
    assert generate(model, tok, rest, cache) == generate(model, tok, follow)
    rpc.insert_cache(KEY, follow, cache)
    rpc.pool.allocator.decref([page])
    assert idle(rpc.stats())
