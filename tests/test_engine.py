"""The plugin's engine: in-flight prefix sharing, early commits, removals, stock answers."""

import gc

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from test_batch import mixed_prompts, run_batch
from test_generation import KEY, CountingModel, no_eos
from tiny_models import ARCHS

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator

PS = 4


def radix(model, tokens=4096):
    return RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=tokens))


def burst(tokenizer, n=6, prefix_tokens=40):
    prefix = (tokenizer.encode("You are a helpful assistant. ") * 10)[:prefix_tokens]
    return [prefix + tokenizer.encode(f" Question {i}: where is city {i}?") for i in range(n)]


def admit(gen, rpc, prompts, max_tokens):
    """What mlx_lm.server does for requests that arrive together: fetch all, then insert."""
    fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
    return gen.insert_segments(
        [[rest] for _, rest in fetched],
        max_tokens=[max_tokens] * len(prompts),
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(r)] for p, (_, r) in zip(prompts, fetched)],
        logits_processors=[[no_eos([2])]] * len(prompts),
    )


class PrefillCounter(CountingModel):
    """Counts the prompt tokens the model computes (decode steps feed one token a row)."""

    def __call__(self, inputs, *args, **kwargs):
        if inputs.shape[1] > 1:
            self.tokens_seen += inputs.shape[0] * inputs.shape[1]
        return self._model(inputs, *args, **kwargs)


class PrefillPasses(CountingModel):
    """Records the rows of each prefill pass (a decode step feeds one token a row)."""

    def __init__(self, model):
        super().__init__(model)
        self.passes = []

    def __call__(self, inputs, *args, **kwargs):
        if inputs.shape[1] > 1:
            self.passes.append(inputs.shape[0])
        return self._model(inputs, *args, **kwargs)


def test_a_burst_s_followers_prefill_together_however_many(loaded):
    """Followers that prefill only their short suffixes start together, in one pass, where
    mlx-lm would start ``prefill_batch_size`` (--prompt-concurrency) at a time; a batch of
    long prompts still starts that many at a time. Answers as stock's."""
    model, tok = loaded("llama")
    prompts = burst(tok, n=8)
    expected = run_batch(model, tok, prompts)
    model_passes = PrefillPasses(model)
    assert run_batch(model_passes, tok, prompts, radix(model), engine=True) == expected
    # The first request writes the prefix; the 7 others follow in one pass, not 3 then 4.
    assert model_passes.passes == [1, 7]

    long = [tok.encode(f"Story {i}: once upon a time, far away. " * 30) for i in range(6)]
    model_passes = PrefillPasses(model)
    gen = RadixBatchGenerator(
        model_passes, radix(model), completion_batch_size=8, prefill_batch_size=2,
        prefill_step_size=64,
    )  # fmt: skip
    gen.insert(long, max_tokens=[2] * 6)
    while len(model_passes.passes) < 3:
        gen.next()
    gen.close()
    assert max(model_passes.passes) == 2  # 6 rows x 64-token chunks: over the budget of 2 x 64


def test_requests_sharing_nothing_prefill_together_where_the_device_admits_so(loaded):
    """Where ``admit_together`` holds (a CUDA device), short requests that share nothing
    start in one pass within mlx-lm's budget, not ``prefill_batch_size`` at a time; where it
    does not, as mlx-lm starts them. Answers as stock's either way."""
    model, tok = loaded("llama")
    words = ("Rivers", "Mountains", "Cities", "Oceans", "Forests", "Deserts")
    prompts = [tok.encode(f"{w} of land {i} run to the sea.") for i, w in enumerate(words)]
    expected = run_batch(model, tok, prompts)
    for together, passes in ((True, [6]), (False, [4, 2])):
        model_passes = PrefillPasses(model)
        gen = RadixBatchGenerator(
            model_passes, radix(model), completion_batch_size=8, prefill_batch_size=4
        )
        gen.admit_together = together
        uids = admit(gen, gen.radix, prompts, 8)
        out = {uid: [] for uid in uids}
        while any(len(t) < 8 for t in out.values()):
            for r in gen.next_generated():
                out[r.uid].append(r.token)
        gen.close()
        assert model_passes.passes == passes
        assert [out[u] for u in uids] == expected


def test_an_old_generator_closing_late_leaves_in_flight_sharing_on(loaded):
    """mlx-lm's generators close again when collected; the server makes a new one after
    draining a batch. The old one closing (or being collected) after the new one is made
    must not turn in-flight sharing off for it."""
    model, tok = loaded("llama")
    rpc = radix(model)
    old = RadixBatchGenerator(model, rpc)
    new = RadixBatchGenerator(PrefillCounter(model), rpc)
    old.close()
    del old
    gc.collect()
    prompts = burst(tok, n=4)
    admit(new, rpc, prompts, 2)
    # The three requests after the first wait for its prefix instead of computing it.
    assert all(s[3][0].table.depends is not None for s in list(new._unprocessed_sequences)[1:])
    done = 0
    while done < 4:
        done += sum(r.finish_reason is not None for r in new.next()[1])
    new.close()
    assert new.model.tokens_seen <= 40 + sum(len(p) - 40 for p in prompts) + 4 * PS
    assert not rpc.share_inflight  # its own close turns it off


@pytest.mark.parametrize("arch", ARCHS)
def test_burst_on_a_new_prefix_computes_it_once(loaded, arch, chunking):
    model, tok = loaded(arch)
    prompts = burst(tok)
    expected = run_batch(model, tok, prompts)
    rpc = radix(model)
    counting = PrefillCounter(model)
    assert run_batch(counting, tok, prompts, rpc, engine=True) == expected
    stats = rpc.stats()
    suffixes = sum(len(p) - 40 for p in prompts)
    # The first request computes the prefix; the others only their suffixes (give or
    # take the page the prefix ends in).
    assert counting.tokens_seen <= 40 + suffixes + len(prompts) * PS
    assert stats["cached_tokens"] >= (len(prompts) - 1) * 36
    assert stats["pages_locked"] == 0


def test_sampling_and_logits_processors_as_stock(loaded):
    model, tok = loaded("llama")
    # No shared prefix: the engine forms the same batches as stock, so the random
    # draws come in the same order.
    prompts = [mixed_prompts(tok)[0], mixed_prompts(tok)[2], tok.encode("Once upon a time")]
    samplers = [
        make_sampler(temp=0.7, top_p=0.9),
        make_sampler(temp=1.0, top_k=5, min_p=0.05),
        make_sampler(temp=0.0),
    ]
    mx.random.seed(11)
    expected = run_batch(model, tok, prompts, samplers=samplers)
    mx.random.seed(11)
    got = run_batch(model, tok, prompts, radix(model), samplers=samplers, engine=True)
    assert got == expected

    def processed(gen, **kwargs) -> list[int]:
        processors = make_logits_processors(**kwargs)
        gen.insert_segments(
            [[prompts[0]]], max_tokens=[12], logits_processors=[processors + [no_eos([2])]]
        )
        tokens = []
        while len(tokens) < 12:
            tokens += [r.token for r in gen.next()[1]]
        gen.close()
        return tokens

    outputs = []
    for kwargs in (
        dict(logit_bias={5: 10.0}),
        dict(logit_bias={5: 10.0}, repetition_penalty=1.3, presence_penalty=20.0),
    ):
        expected = processed(BatchGenerator(model, completion_batch_size=4), **kwargs)
        engine = RadixBatchGenerator(model, radix(model), completion_batch_size=4)
        assert processed(engine, **kwargs) == expected, kwargs
        outputs.append(expected)
    biased, penalised = outputs
    assert biased.count(5) >= 6  # the bias shows...
    assert penalised.count(5) < biased.count(5)  # ...and the penalties hold it back


def test_request_arriving_while_another_decodes_hits_its_prompt(loaded):
    model, tok = loaded("qwen2")
    rpc = radix(model)
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=4, prefill_batch_size=4)
    first = burst(tok, n=1)[0]
    cache, rest = rpc.fetch_nearest_cache(KEY, first)
    gen.insert_segments([[rest]], max_tokens=[30], caches=[cache])
    del cache
    while not len(gen._generation_batch):
        gen.next()
    gen.next()
    second = first[:-3] + tok.encode(" somewhere else entirely")
    cache, rest = rpc.fetch_nearest_cache(KEY, second)
    assert len(second) - len(rest) >= (len(first) - 3) // PS * PS
    # It generates from those pages, while the first still decodes, as stock would alone.
    (uid,) = gen.insert_segments(
        [[rest]],
        max_tokens=[8],
        caches=[cache],
        all_tokens=[second[: len(second) - len(rest)]],
        logits_processors=[[no_eos(tok.eos_token_ids)]],
    )
    del cache
    out = []
    while len(out) < 8:
        out += [r.token for r in gen.next()[1] if r.uid == uid]
    gen.close()
    assert out == run_batch(model, tok, [second])[0]


def test_removing_the_request_others_wait_for(loaded):
    model, tok = loaded("llama")
    prompts = burst(tok, n=3)
    expected = run_batch(model, tok, prompts)
    rpc = radix(model)
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=8, prefill_batch_size=4)
    uids = admit(gen, rpc, prompts, max_tokens=8)
    assert gen._unprocessed_sequences[1][3][0].table.depends is not None
    gen.remove([uids[0]])  # a disconnect before its prefill started
    gc.collect()
    out = {u: [] for u in uids[1:]}
    done = set()
    while len(done) < 2:
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
            if r.finish_reason:
                done.add(r.uid)
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()
    assert [out[u] for u in uids[1:]] == expected[1:]


def test_disconnect_mid_stream_leaves_no_locked_page(loaded):
    model, tok = loaded("gemma3_text")
    rpc = radix(model)
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=8, prefill_batch_size=4)
    prompts = burst(tok, n=4)
    uids = admit(gen, rpc, prompts, max_tokens=20)
    steps = 0
    while steps < 12:
        steps += bool(gen.next()[1])
    gen.remove(uids[:2])  # two clients go away mid-stream
    finished = 0
    while finished < 2:
        for r in gen.next()[1]:
            if r.finish_reason:
                finished += 1
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()
    del gen
    gc.collect()
    stats = rpc.stats()
    assert stats["pages_locked"] == 0
    assert stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]


def test_a_removed_request_gives_its_pages_back_while_its_cache_is_still_referenced(loaded):
    """mlx_lm.server keeps the last fetched cache in a local variable until its next request."""
    model, tok = loaded("llama")
    rpc = radix(model)
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=8, prefill_batch_size=4)
    waiting, running = burst(tok, n=1)[0], tok.encode("A different prompt, long enough.")
    lingering = [rpc.fetch_nearest_cache(KEY, p) for p in (running, waiting)]
    uids = gen.insert_segments(
        [[rest] for _, rest in lingering],
        max_tokens=[20, 20],
        caches=[c for c, _ in lingering],
        all_tokens=[[], []],
    )
    while not gen.next()[1]:
        pass
    gen.remove(uids)  # both clients hang up, one decoding, one maybe not yet admitted
    stats = rpc.stats()
    assert stats["requests_holding_pages"] == stats["tree_locks"] == stats["pages_locked"] == 0
    assert stats["page_refs"] == stats["pages_cached"] == stats["pages_evictable"]
    assert len(lingering) == 2  # the caches are still referenced
    gen.close()


def test_a_full_pool_never_stops_the_batch(loaded, caplog, chunking):
    """More live tokens than pages: requests finish as stock's, caching what fit."""
    caplog.set_level("WARNING", logger="mlx_radix")
    model, tok = loaded("llama")
    prompts = [
        tok.encode(f"Request {i}: the quick brown fox jumps over the lazy dog.") for i in range(3)
    ]
    expected = run_batch(model, tok, prompts, max_tokens=16)
    rpc = radix(model, tokens=12 * PS)  # 48 tokens for 3 x ~35
    assert run_batch(model, tok, prompts, rpc, max_tokens=16, engine=True) == expected
    assert "KV pool full: request stops caching" in caplog.text
    stats = rpc.stats()
    assert stats["pages_locked"] == 0
    assert stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]
    assert 0 < stats["pool_bytes_used"] <= rpc.pool.nbytes


def test_a_request_that_cannot_fit_yet_waits_for_pages(loaded, caplog):
    """Its prompt's pages are reserved once the running request gives its pages back."""
    caplog.set_level("WARNING", logger="mlx_radix")
    model, tok = loaded("llama")
    prompts = [
        tok.encode(f"Tale {i}: once upon a time a fox met a dog by the river.") for i in (1, 2)
    ]
    longest = max(len(p) for p in prompts) + 8
    expected = run_batch(model, tok, prompts, max_tokens=8)
    rpc = radix(model, tokens=-(-longest // PS) * PS + PS)  # room for one request at a time
    assert run_batch(model, tok, prompts, rpc, max_tokens=8, engine=True) == expected
    # Neither ran out of pages: the second waited rather than running uncached.
    assert "KV pool" not in caplog.text
    for p in prompts[1:]:
        caches, rest = rpc.fetch_nearest_cache(KEY, p)
        assert len(rest) == 1  # its whole prompt was cached
        rpc.insert_cache(KEY, p, caches)
    assert rpc.stats()["pages_locked"] == 0


def test_a_prompt_larger_than_the_pool_is_served_uncached(loaded, caplog):
    caplog.set_level("WARNING", logger="mlx_radix")
    model, tok = loaded("llama")
    prompts = [tok.encode("A long story about foxes, dogs, rivers and hills. " * 4)]
    expected = run_batch(model, tok, prompts, max_tokens=6)
    rpc = radix(model, tokens=4 * PS)
    assert len(prompts[0]) > 4 * PS
    assert run_batch(model, tok, prompts, rpc, max_tokens=6, engine=True) == expected
    assert "KV pool too small for a" in caplog.text
    stats = rpc.stats()
    assert stats["pages_locked"] == 0
    assert stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]


def test_a_request_waiting_for_room_is_passed_by_a_bounded_number_of_later_ones(loaded, caplog):
    """Requests behind one that waits for pool room may go first while they fit, but only
    MAX_PASSES of them: then the queue waits for it (aging), and the rest follow it."""
    from mlx_radix_plugin.engine.generator import MAX_PASSES

    caplog.set_level("WARNING", logger="mlx_radix")
    model, tok = loaded("llama")
    running = tok.encode("A fox and a dog walk by the river in the morning sun. " * 2)[:40]
    large = tok.encode("Tell me a long story about hills, woods and rivers, please. " * 4)[:96]
    smalls = [tok.encode(f"Hi {i}.")[:6] for i in range(3 * MAX_PASSES)]
    rpc = radix(model, tokens=32 * PS)  # the large prompt's 24 pages fit only once alone
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=16, prefill_batch_size=1)
    admit(gen, rpc, [running], 40)
    while not len(gen._generation_batch):
        gen.next()
    (large_uid,) = admit(gen, rpc, [large], 4)
    small_uids = admit(gen, rpc, smalls, 2)
    started, done = [], set()
    while len(done) < 2 + len(smalls):
        for r in gen.next()[1]:
            if r.uid not in started:
                started.append(r.uid)
            if r.finish_reason is not None:
                done.add(r.uid)
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)  # as the server does
    gen.close()
    before = started[: started.index(large_uid)]
    assert sum(uid in small_uids for uid in before) == MAX_PASSES
    # It waited for room rather than running uncached, and everything was given back.
    assert "KV pool" not in caplog.text
    assert rpc.stats()["pages_locked"] == 0


def test_a_decode_step_on_the_exact_path_launches_its_pool_writes_with_it(loaded, monkeypatch):
    model, tok = loaded("llama")
    rpc = radix(model)
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=4)
    admit(gen, rpc, burst(tok, n=3), max_tokens=12)
    while len(gen._unprocessed_sequences) or len(gen._prompt_batch):
        gen.next()
    launches = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: launches.append(a) or real(*a))
    gen.next()
    gen.next()
    # One launch a step, holding the pool's arrays: no second launch for the writes.
    assert len(launches) == 2
    pool_ids = {id(a) for a in rpc.pool.arrays}
    assert pool_ids & {id(a) for a in launches[-1][-1]}
    monkeypatch.undo()
    # What the launch wrote: the last decoded token's K/V in the pool, as the buffer has it.
    for layer in (0, -1):
        cache = gen._generation_batch.prompt_cache[layer]
        n = cache.rows.lengths[0]
        keys, values = rpc.pool.read(cache.layer, cache.rows.tables[0].host_slots(n - 1, n))
        assert mx.array_equal(keys[0, :, 0], cache.keys[0, :, cache._idx - 1])
        assert mx.array_equal(values[0, :, 0], cache.values[0, :, cache._idx - 1])
    gen.close()
