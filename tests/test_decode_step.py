"""The engine's decode step in bulk, and the hooks' shared samplers and readable logit bias."""

from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.server import (
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
    _make_logits_processors,
    _make_sampler,
)
from mlx_lm_hooks.sampling import LogitBias, Sampling
from test_generation import KEY

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator


def arguments(temperature=0.0, logit_bias=None, repetition_penalty=None, xtc_probability=0.0):
    """What mlx_lm.server makes of a request's sampling fields."""
    return GenerationArguments(
        model=ModelDescription(model="m", draft=None, adapter=None),
        sampling=SamplingArguments(temperature, 1.0, 0, 0.0, xtc_probability, 0.1),
        logits=LogitsProcessorArguments(logit_bias, repetition_penalty, 20, None, 20, None, 20),
        stop_words=[],
        max_tokens=8,
        num_draft_tokens=0,
        logprobs=False,
        top_logprobs=0,
        seed=None,
        chat_template_kwargs=None,
    )


def test_equal_settings_share_a_sampler_and_xtc_keeps_its_own(loaded):
    _, tok = loaded("llama")
    sampling = Sampling(_make_sampler, _make_logits_processors)
    warm = arguments(temperature=0.7)
    assert sampling.sampler(warm, tok) is sampling.sampler(replace(warm), tok)
    assert sampling.sampler(warm, tok) is not sampling.sampler(arguments(temperature=0.8), tok)
    xtc = arguments(temperature=0.7, xtc_probability=0.5)
    assert sampling.sampler(xtc, tok) is not sampling.sampler(xtc, tok)


def test_a_logit_bias_is_readable_first_and_adds_what_stock_adds():
    sampling = Sampling(_make_sampler, _make_logits_processors)
    assert sampling.logits_processors(arguments()) == []
    bias, penalty = sampling.logits_processors(
        arguments(logit_bias={5: 10.0, 7: -2.5}, repetition_penalty=1.3)
    )
    assert isinstance(bias, LogitBias) and (bias.tokens, bias.values) == ([5, 7], [10.0, -2.5])
    assert not isinstance(penalty, LogitBias)
    logits = mx.random.normal((1, 32))
    (stock,) = make_logits_processors(logit_bias={5: 10.0, 7: -2.5})
    assert mx.array_equal(bias(None, logits), stock(None, logits)).item()


def run(gen, prompts, processors, samplers, steps=10, rpc=None):
    """``rpc``: the engine's cache, which each prompt is fetched from as the server does (its
    rows then decode over the pool's batch caches)."""
    if rpc is None:
        uids = gen.insert(
            prompts, max_tokens=[steps] * len(prompts), samplers=samplers,
            logits_processors=processors,
        )  # fmt: skip
    else:
        fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
        uids = gen.insert_segments(
            [[rest] for _, rest in fetched], max_tokens=[steps] * len(prompts),
            caches=[c for c, _ in fetched], samplers=samplers, logits_processors=processors,
            all_tokens=[p[: len(p) - len(rest)] for p, (_, rest) in zip(prompts, fetched)],
        )  # fmt: skip
    out = {u: [] for u in uids}
    while any(len(v) < steps for v in out.values()):
        for r in gen.next()[1]:
            out[r.uid].append((r.token, r.logprobs))
    gen.close()
    return [out[u] for u in uids]


def test_biases_in_one_scatter_and_shared_samplers_answer_as_stock(loaded):
    """Rows biased by ``LogitBias`` (one scatter for the batch) and sampled by one greedy
    sampler give stock's tokens and bitwise stock's log-probabilities, where stock applies
    mlx-lm's own bias row by row; a row with a penalty after its bias too."""
    model, tok = loaded("llama")
    prompts = [tok.encode(t) for t in ("Once upon a time", "The quick brown fox", "Hi there")]
    biases = [{5: 10.0}, None, {5: 10.0, 9: -3.0}]
    penalties = [None, None, 1.3]
    stock_processors = [
        make_logits_processors(logit_bias=b, repetition_penalty=p)
        for b, p in zip(biases, penalties)
    ]
    sampling = Sampling(_make_sampler, _make_logits_processors)
    ours = [
        sampling.logits_processors(arguments(logit_bias=b, repetition_penalty=p))
        for b, p in zip(biases, penalties)
    ]
    greedy = [make_sampler(0.0)] * 3
    expected = run(
        BatchGenerator(model, completion_batch_size=4), prompts, stock_processors, greedy
    )
    pool = KVPool.for_model(model, page_size=4, pool_tokens=1024)
    engine = RadixBatchGenerator(model, RadixPromptCache(pool), completion_batch_size=4)
    got = run(engine, prompts, ours, greedy)
    for row_got, row_expected in zip(got, expected):
        assert [t for t, _ in row_got] == [t for t, _ in row_expected]
        for (token, a), (_, b) in zip(row_got, row_expected):
            assert mx.array_equal(a, b).item()
            assert a[token].item() == b[token].item()
    assert sum(t == 5 for t, _ in got[0]) >= 5  # the bias shows


def test_rows_of_one_sampler_sample_in_one_call(loaded):
    """Each distinct sampler runs once a step on its rows; greedy rows get stock's tokens."""
    model, tok = loaded("llama")
    calls = []

    def counted(name, sampler):
        def sample(logprobs):
            calls.append((name, logprobs.shape[0]))
            return sampler(logprobs)

        return sample

    greedy, other = counted("greedy", make_sampler(0.0)), counted("other", make_sampler(0.0))
    prompts = [tok.encode(t) for t in ("Once upon a time", "The quick brown fox", "Hi", "Go on")]
    expected = run(BatchGenerator(model, completion_batch_size=4), prompts, None, [None] * 4)
    pool = KVPool.for_model(model, page_size=4, pool_tokens=1024)
    engine = RadixBatchGenerator(model, RadixPromptCache(pool), completion_batch_size=4)
    calls.clear()
    got = run(engine, prompts, None, [greedy, other, greedy, other])
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
    # Once every row decodes together: one call a sampler a step, on its two rows.
    assert calls[-2:] == [("greedy", 2), ("other", 2)]


def calls_of(gen, prompts, max_tokens, stops=None, join_at=None):
    """Per prompt: ``(call, token, finish_reason, all_tokens, logprobs)`` of each response,
    in order. ``stops``: each prompt's stop sequences; the last prompt joins after call
    ``join_at`` (with the others, if None)."""
    stops = [StopSequences(s) for s in stops] if stops else [StopSequences()] * len(prompts)
    n = len(prompts) - (join_at is not None)
    uids = gen.insert(prompts[:n], max_tokens=max_tokens[:n], stop_sequences=stops[:n])
    out, call = {u: [] for u in uids}, 0
    while len(uids) < len(prompts) or sum(
        bool(v) and v[-1][2] is not None for v in out.values()
    ) < len(uids):
        if call == join_at:
            (uid,) = gen.insert(prompts[n:], max_tokens=max_tokens[n:], stop_sequences=stops[n:])
            uids.append(uid)
            out[uid] = []
        call += 1
        assert call < 50, "a row never finished"
        for r in gen.next()[1]:
            out[r.uid].append((call, r.token, r.finish_reason, r.all_tokens, r.logprobs))
    gen.close()
    return [out[u] for u in uids]


def same_but_first_tokens_sooner(got, expected, max_tokens, ended_by_first=()):
    for i, (row, ref, n) in enumerate(zip(got, expected, max_tokens)):
        assert [r[1:4] for r in row] == [r[1:4] for r in ref]
        assert all(mx.array_equal(a[4], b[4]).item() for a, b in zip(row, ref))
        sooner = 0 if n <= 1 or i in ended_by_first else 1  # those keep stock's call
        assert row[0][0] == ref[0][0] - sooner
        assert [r[0] for r in row[1:]] == [r[0] for r in ref[1:]]


def test_first_tokens_go_out_in_the_call_that_computed_them(loaded):
    """On MLX's CPU backend a joining row's first token is handed over in the call that ran
    its first step, a step sooner than stock; tokens, log-probabilities and the finished
    rows' tokens stay stock's, and a row that its first token ends finishes as in stock."""
    model, tok = loaded("llama")
    prompts = [tok.encode(t) for t in ("Once upon a time", "The quick brown fox", "Hi there")]
    max_tokens = [5, 1, 5]
    expected = calls_of(BatchGenerator(model, completion_batch_size=4), prompts, max_tokens)
    pool = KVPool.for_model(model, page_size=4, pool_tokens=1024)
    engine = RadixBatchGenerator(model, RadixPromptCache(pool), completion_batch_size=4)
    assert engine.first_tokens_at_once == (mx.default_device() == mx.cpu)
    engine.first_tokens_at_once = True  # the CPU's setting; the same code on every backend
    got = calls_of(engine, prompts, max_tokens)
    same_but_first_tokens_sooner(got, expected, max_tokens)


def test_stop_sequences_across_a_first_token_handed_over_early_and_rows_joining_later(loaded):
    """Stop sequences that start with a row's first token end it where stock's do: the
    matcher handed over early stands where stock's would; a row that joins a decoding
    batch gets its first token a call sooner too."""
    model, tok = loaded("llama")
    prompts = [tok.encode(t) for t in ("Once upon a time", "The quick brown fox", "Hi there")]
    max_tokens = [6, 6, 6]
    free = calls_of(BatchGenerator(model, completion_batch_size=4), prompts, max_tokens)
    first, second = ([row[i][1] for row in free] for i in (0, 1))
    assert first[2] != second[2]
    stops = [
        [[first[0], second[0]]],  # spans the first token and the second: stop at the second
        [[first[1]]],  # the first token ends the row: stock's call
        # A partial match, then another; and the first token twice, which a matcher
        # that took it twice would see.
        [[first[2], second[2] + 1], [second[2]], [first[2], first[2]]],
    ]
    for join_at in (None, 2):
        expected = calls_of(
            BatchGenerator(model, completion_batch_size=4), prompts, max_tokens, stops, join_at
        )
        assert [row[-1][2] for row in expected] == ["stop"] * 3
        pool = KVPool.for_model(model, page_size=4, pool_tokens=1024)
        engine = RadixBatchGenerator(model, RadixPromptCache(pool), completion_batch_size=4)
        engine.first_tokens_at_once = True
        got = calls_of(engine, prompts, max_tokens, stops, join_at)
        same_but_first_tokens_sooner(got, expected, max_tokens, ended_by_first=(1,))


def test_a_row_hands_its_first_token_over_before_later_rows_prefill(loaded):
    """A request that arrives just after another's prompt pass starts in the call after the
    one that hands the first one's first token over: that token does not wait for the
    newcomer's pass. Without first tokens at once (a GPU's setting) it starts as in stock.
    Tokens stay stock's."""
    model, tok = loaded("llama")
    prompts = [tok.encode(t) for t in ("Once upon a time", "The quick brown fox")]
    expected = calls_of(BatchGenerator(model, completion_batch_size=4), prompts, [4, 4], None, 1)
    for at_once in (True, False):
        pool = KVPool.for_model(model, page_size=4, pool_tokens=1024)
        engine = RadixBatchGenerator(model, RadixPromptCache(pool), completion_batch_size=4)
        engine.first_tokens_at_once = at_once
        (first,) = engine.insert([prompts[0]], max_tokens=[4])
        engine.next()  # the first prompt's pass
        (later,) = engine.insert([prompts[1]], max_tokens=[4])
        passes, tokens, call = [], {first: [], later: []}, 1
        while len(tokens[first]) < 4 or len(tokens[later]) < 4:
            call += 1
            assert call < 20, "a row never finished"
            prompt_responses, responses = engine.next()
            if any(r.uid == later and not r.end_of_prompt for r in prompt_responses):
                passes.append(call)
            for r in responses:
                tokens[r.uid].append((call, r.token))
        engine.close()
        assert tokens[first][0][0] == (2 if at_once else 3)  # stock's: the call after
        assert passes[0] == (3 if at_once else 2)
        assert [[t for _, t in tokens[u]] for u in (first, later)] == [
            [r[1] for r in row] for row in expected
        ]


def test_the_stats_buffer_bytes_follow_the_buffers_as_they_grow_and_rows_leave(loaded):
    """The decode buffers' bytes are summed again only where they may have changed: every
    step's stats still show what the batch holds (its buffers grow every 256 tokens)."""
    model, _ = loaded("llama")
    prompts = [[5 + (i * 7 + j) % 90 for j in range(240)] for i in range(3)]
    pool = KVPool.for_model(model, page_size=4, pool_tokens=2048)
    engine = RadixBatchGenerator(model, RadixPromptCache(pool), completion_batch_size=4)
    engine.insert(prompts, max_tokens=[8, 30, 30])
    seen, rows, finished = set(), set(), 0
    while finished < 3:
        _, responses = engine.next()
        finished += sum(r.finish_reason is not None for r in responses)
        held = sum(c.nbytes for c in engine._generation_batch.prompt_cache)
        assert engine.decode_stats["decode_buffer_bytes"] == held
        seen.add(held)
        rows.add(engine.decode_stats["decode_rows"])
    engine.close()
    assert len(seen) >= 3 and {3, 2} <= rows  # grown past 256 tokens; a row left


def test_a_decode_step_with_no_padded_row_attends_without_a_mask(loaded, monkeypatch):
    """``decode.attention = auto``: one request (or rows of one length) decodes over the pool's
    batch caches with no mask, rows of different lengths keep stock's; ``off`` keeps stock's.
    Stock's tokens and log-probabilities either way (the CPU's attention takes an all-true
    mask as none)."""
    model, tok = loaded("llama")
    masks = []

    def recorded(queries, keys, values, *, scale, mask=None, **kwargs):
        if queries.shape[2] == 1:
            masks.append(mask is None)
        return fused(queries, keys, values, scale=scale, mask=mask, **kwargs)

    fused = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
    one, two = [tok.encode("Once upon a time")], [tok.encode(t) for t in ("Hi", "The quick fox")]
    for mode, prompts, unmasked in [("auto", one, True), ("auto", two, False), ("off", one, False)]:
        expected = run(BatchGenerator(model, completion_batch_size=4), prompts, None, None)
        rpc = RadixPromptCache(KVPool.for_model(model, page_size=4, pool_tokens=1024))
        engine = RadixBatchGenerator(model, rpc, completion_batch_size=4, decode_attention=mode)
        masks.clear()
        got = run(engine, prompts, None, None, rpc=rpc)
        assert masks and set(masks) == {unmasked}, (mode, len(prompts))
        for row_got, row_expected in zip(got, expected):
            assert [t for t, _ in row_got] == [t for t, _ in row_expected]
            assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(row_got, row_expected))
