"""mlx-lm's batch path over pool-backed caches: same tokens as stock, K/V written once."""

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from test_generation import KEY, no_eos
from tiny_models import ARCHS

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.cache.batch import BatchedDecodeContext, BatchRows, PoolBatchKVCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator

PS = 4


def run_batch(
    model,
    tokenizer,
    prompts,
    rpc=None,
    max_tokens=8,
    samplers=None,
    step=2048,
    engine=False,
    prefill="auto",
):
    """Requests through one batch generator, as mlx_lm.server sends them; tokens per request.

    ``engine``: the plugin's RadixBatchGenerator instead of mlx-lm's BatchGenerator, its
    ``prefill_from_pool`` set to ``prefill``.
    """
    sizes = dict(completion_batch_size=8, prefill_batch_size=4, prefill_step_size=step)
    if engine:
        gen = RadixBatchGenerator(model, rpc, prefill_from_pool=prefill, **sizes)
    else:
        gen = BatchGenerator(model, **sizes)
    fetched = [rpc.fetch_nearest_cache(KEY, p) if rpc is not None else (None, p) for p in prompts]
    uids = gen.insert_segments(
        segments=[[rest] for _, rest in fetched],
        max_tokens=[max_tokens] * len(prompts),
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(rest)] for p, (_, rest) in zip(prompts, fetched)],
        samplers=samplers,
        logits_processors=[[no_eos(tokenizer.eos_token_ids)]] * len(prompts),
    )
    del fetched
    out = {u: [] for u in uids}
    finished = {}
    while len(finished) < len(uids):
        prompt_responses, responses = gen.next()
        # As mlx_lm.server does: a segment that ends before the prompt does is cached.
        ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt]
        if rpc is not None:
            for cache, tokens in gen.extract_cache(ends).values():
                rpc.insert_cache(KEY, tokens[:], cache)
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = True
                if rpc is not None:
                    rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()
    return [out[u] for u in uids]


def mixed_prompts(tokenizer):
    system = tokenizer.encode("You are a helpful assistant. Answer the question briefly.")
    return [
        system + tokenizer.encode(" Where is Paris?"),
        system + tokenizer.encode(" Count: 1 2 3 4 5 6 7 8 9 10."),
        tokenizer.encode("def add(a, b):"),
        system[:9] + tokenizer.encode(" The quick brown fox jumps over the lazy dog."),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_outputs_equal_stock_request_by_request(loaded, arch, chunking):
    model, tok = loaded(arch)
    prompts = mixed_prompts(tok)
    expected = run_batch(model, tok, prompts)
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    assert run_batch(model, tok, prompts, rpc) == expected  # cold: nothing cached
    assert rpc.stats()["pages_locked"] == 0
    assert run_batch(model, tok, prompts, rpc) == expected  # warm: prefixes from the pool
    stats = rpc.stats()
    assert stats["hits"] == 4 and stats["pages_locked"] == 0
    assert (stats["pool_chunks"] > 1) == (chunking == "a chunk a page")


def test_finished_requests_commit_their_pages_without_a_copy(loaded, monkeypatch):
    model, tok = loaded("llama")
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    prompts = mixed_prompts(tok)
    # Commits hand the request's own pages to the tree: no page copied, none allocated.
    committing, moved, commits = [False], [], []
    for name in ("copy", "alloc_pages"):
        real = getattr(KVPool, name)

        def watched(self, *args, _real=real, _name=name):
            if committing[0]:
                moved.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(KVPool, name, watched)
    insert = rpc.insert_cache

    def commit(*args, **kwargs):
        commits.append(1)
        committing[0] = True
        try:
            return insert(*args, **kwargs)
        finally:
            committing[0] = False

    monkeypatch.setattr(rpc, "insert_cache", commit)
    run_batch(model, tok, prompts, rpc, max_tokens=6)
    assert len(commits) >= len(prompts) and moved == []
    monkeypatch.undo()
    # Every prompt + output is now cached: its K/V came from the batch's pool writes.
    for p in prompts:
        cache, rest = rpc.fetch_nearest_cache(KEY, p + [7])
        assert len(rest) <= PS + 1
        del cache
    # What the pool holds for a request equals a fresh single-request computation.
    cache, rest = rpc.fetch_nearest_cache(KEY, prompts[0] + [7])
    fresh = [c for c in __import__("mlx_lm").models.cache.make_prompt_cache(model)]
    model(mx.array([prompts[0]]), cache=fresh)
    n = len(prompts[0])
    ours = cache[1].state[0][..., :n, :]
    assert mx.allclose(ours, fresh[1].state[0][..., :n, :], atol=1e-4).item()


def test_context_is_built_once_per_forward_not_per_layer(loaded, monkeypatch):
    model, tok = loaded("gemma3_text")  # 4 layers, two of them windowed
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    built = forwards = 0
    init = BatchedDecodeContext.__init__

    def counted(self, *args, **kwargs):
        nonlocal built
        built += 1
        init(self, *args, **kwargs)

    class Counting:
        def __init__(self, model):
            self.model = model

        def __call__(self, *a, **k):
            nonlocal forwards
            forwards += 1
            return self.model(*a, **k)

        def __getattr__(self, name):
            return getattr(self.model, name)

    monkeypatch.setattr(BatchedDecodeContext, "__init__", counted)
    run_batch(Counting(model), tok, mixed_prompts(tok), rpc, max_tokens=5)
    assert built == forwards > 0


@pytest.mark.parametrize("prefill", ["on", "off"])
def test_a_decode_pass_writes_the_pool_once_per_array(loaded, monkeypatch, prefill):
    model, tok = loaded("llama")
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    assert len(rpc.pool.groups) == 1  # every layer of this model in one pair of arrays
    writes = {"write_rows": 0, "write_layers": 0}
    passes = {1: 0, "prefill": 0}
    end = BatchRows.end

    def counted(name):
        original = getattr(KVPool, name)

        def wrapped(*a, **k):
            writes[name] += 1
            return original(*a, **k)

        return wrapped

    def end_of_pass(rows):
        if rows.ctx.any:
            passes[1 if rows.ctx.step == 1 else "prefill"] += 1
        return end(rows)

    for name in writes:
        monkeypatch.setattr(KVPool, name, counted(name))
    monkeypatch.setattr(BatchRows, "end", end_of_pass)
    expected = run_batch(model, tok, mixed_prompts(tok), max_tokens=6)
    got = run_batch(model, tok, mixed_prompts(tok), rpc, max_tokens=6, engine=True, prefill=prefill)
    assert got == expected
    if prefill == "off":
        # Prefill chunks over a buffer write layer by layer; a decode pass once, after its
        # last layer.
        assert writes["write_rows"] == passes["prefill"] * len(model.layers) > 0
        assert writes["write_layers"] == passes[1] > 0
    else:
        # Read from the pool, a prefill chunk writes once too, after its last layer's read.
        assert writes["write_rows"] == 0
        assert writes["write_layers"] == passes[1] + passes["prefill"] > passes[1] > 0


def test_every_layer_of_a_decode_batch_holds_one_offset_array(loaded):
    model, tok = loaded("llama")
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    gen = RadixBatchGenerator(model, rpc)
    prompts = mixed_prompts(tok)
    fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
    gen.insert_segments(
        segments=[[rest] for _, rest in fetched],
        max_tokens=[20] * len(prompts),
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(rest)] for p, (_, rest) in zip(prompts, fetched)],
    )
    del fetched
    for _ in range(6):
        gen.next()
    caches = gen._generation_batch.prompt_cache
    assert len(gen._generation_batch) == len(prompts)
    # Added to once per step for the whole batch, not once per layer as mlx-lm does.
    assert all(c.offset is caches[0].offset for c in caches)
    assert caches[0].offset.tolist() == [len(t) for t in gen._generation_batch.tokens]
    gen.close()


def test_chunked_prefill_and_sampling_match_stock(loaded):
    model, tok = loaded("qwen3")
    prompts = mixed_prompts(tok)
    samplers = [make_sampler(temp=0.8, top_k=20) for _ in prompts]
    mx.random.seed(3)
    expected = run_batch(model, tok, prompts, samplers=samplers, step=5)
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    mx.random.seed(3)
    assert run_batch(model, tok, prompts, rpc, samplers=samplers, step=5) == expected


def test_merge_builds_pool_batch_caches(loaded):
    model, tok = loaded("llama")
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=2048))
    a, _ = rpc.fetch_nearest_cache(KEY, [5, 6, 7])
    b, _ = rpc.fetch_nearest_cache(KEY, [8, 9])
    merged = [a[i].merge([a[i], b[i]]) for i in range(len(a))]
    assert all(isinstance(m, PoolBatchKVCache) for m in merged)
    assert merged[0].rows is merged[1].rows  # one shared row state for all layers
