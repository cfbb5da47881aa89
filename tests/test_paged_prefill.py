"""Prefill from the pool (cache/paged_batch.py): the buffer's logits bitwise, and no buffer."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from test_batch import run_batch
from test_generation import KEY, no_eos
from test_shared_prefix import Recorder, admit, decode, prefix_of, question, radix, warm
from tiny_models import ARCHS, CONFIGS

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.cache.batch import BatchRows
from mlx_radix_plugin.cache.page_table import PageTable
from mlx_radix_plugin.cache.paged_batch import PagedBatchKVCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.engine.prefill_path import is_paged
from mlx_radix_plugin.memory.freed_buffers import FreedBuffers


def prefill_run(model, tok, rpc, prompts, *, prefill, step, late=(), shared="off"):
    """The engine (exact decode) on ``prompts``; those in ``late`` join two steps in;
    ``shared``: ``prefill.shared_prefix``. Returns tokens and logits per request, and
    whether a prompt batch read the pool."""
    rec = Recorder(tok.eos_token_ids)
    gen = RadixBatchGenerator(
        model,
        rpc,
        shared_prefix="off",
        prefill_from_pool=prefill,
        prefill_shared=shared,
        completion_batch_size=16,
        prefill_batch_size=8,
        prefill_step_size=step,
    )
    paged = []

    def admit_rows(idx):
        uids = admit(
            gen,
            rpc,
            [prompts[i] for i in idx],
            [6] * len(idx),
            logits_processors=[[rec.processor(i)] for i in idx],
        )
        return dict(zip(uids, idx))

    who = admit_rows([i for i in range(len(prompts)) if i not in late])
    out = {i: [] for i in range(len(prompts))}
    steps = 0
    while sum(len(t) for t in out.values()) < 6 * len(prompts):
        if steps == 2 and late:
            who.update(admit_rows(list(late)))
        paged.append(any(isinstance(c, PagedBatchKVCache) for c in gen._prompt_batch.prompt_cache))
        for c in gen._prompt_batch.prompt_cache:
            if isinstance(c, PagedBatchKVCache):  # the host's copy of the padding is the device's
                assert c._padding == c.left_padding.tolist()
        responses = gen.next()[1]
        steps += bool(responses)
        for r in responses:
            out[who[r.uid]].append(r.token)
            if r.finish_reason is not None:
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()
    return [out[i] for i in range(len(prompts))], rec.logits, any(paged)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("step", [2048, 8], ids=["one pass", "passes of 8 tokens"])
def test_a_prefill_read_from_the_pool_gives_the_buffer_s_logits_bitwise(loaded, arch, step):
    """Against the same engine filling a buffer (itself stock's tokens, test_batch.py):
    rows of several lengths on a cached prefix (right padding, left padding), a cold
    prompt, and rows that join a prompt batch under way."""
    model, tok = loaded(arch)
    prefix = prefix_of(tok, 40)
    prompts = [prefix + question(tok, i) * (1 + i % 3) for i in range(4)]
    prompts += [tok.encode("A cold prompt that nothing cached holds.")]
    prompts += [prefix[:24] + question(tok, 9)]
    runs = {}
    for prefill in ("off", "on"):
        rpc = radix(model)
        warm(model, rpc, [prefix])
        runs[prefill] = prefill_run(model, tok, rpc, prompts, prefill=prefill, step=step, late=(5,))
    (tokens, logits, paged), (stock_tokens, stock_logits, buffered) = runs["on"], runs["off"]
    assert not buffered
    windowed = any(s.window is not None for s in KVPool.for_model(model, pool_tokens=64).specs)
    assert paged == (not windowed)
    assert tokens == stock_tokens
    for i, steps in stock_logits.items():
        assert len(logits[i]) == len(steps)
        for a, b in zip(logits[i], steps):
            assert mx.array_equal(a, b).item(), (arch, i)


def _deep_model():
    """The test llama's shape with 12 layers (random weights, not written to disk)."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(dict(CONFIGS["llama"], num_hidden_layers=12)))
    mx.eval(model.parameters())
    return model


def _joining_peak(prefill: str, working_bytes: int | None, shared: str = "off") -> tuple[int, dict]:
    """MLX's peak over what the pool and weights hold while 8 requests on a cached 1,024-token
    prefix, each 16 tokens of its own, are admitted until all decode; and the sizes the
    tests bound it by."""
    model = _deep_model()
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=16, pool_tokens=8192))
    prefix = mx.random.randint(3, 500, (1024,)).tolist()

    def admit_all(gen, prompts, max_tokens):
        fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
        gen.insert_segments(
            [[r] for _, r in fetched],
            max_tokens=[max_tokens] * len(prompts),
            caches=[c for c, _ in fetched],
            all_tokens=[p[: len(p) - len(r)] for p, (_, r) in zip(prompts, fetched)],
        )

    gen = RadixBatchGenerator(model, rpc, prefill_from_pool=prefill)
    admit_all(gen, [prefix], 1)
    while not (done := [r for r in gen.next()[1] if r.finish_reason]):
        pass
    rpc.insert_cache(KEY, done[0].all_tokens, done[0].prompt_cache)
    gen.close()

    rows, own, layers = 8, 16, len(model.layers)
    token_kv = 2 * 2 * 16 * 4  # K and V of one token in one layer: 2 heads x 16, float32
    width = len(prefix) + own
    capacity = len(prefix) + 256  # the buffer's columns: mlx-lm grows it 256 at a time
    sizes = {
        # One layer: its rows' context gathered, then laid out with the new tokens as wide as
        # the buffer (two copies), and two float32 copies of the scores (4 query heads).
        "layer": 2 * rows * capacity * token_kv + 2 * rows * 4 * own * width * 4,
        "suffix_kv": rows * own * layers * token_kv,
        "one_copy": len(prefix) * layers * token_kv,
    }
    rpc.pool.prefill_working_bytes = working_bytes or sizes["layer"]
    gen = RadixBatchGenerator(
        model,
        rpc,
        shared_prefix="auto",  # the server's default: these rows then decode on one copy
        prefill_from_pool=prefill,
        prefill_shared=shared,
        completion_batch_size=rows,
        prefill_batch_size=rows,
    )
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    admit_all(gen, [prefix + [5 + i] * own for i in range(rows)], 4)
    while len(gen._generation_batch) < rows:
        gen.next()
    mx.synchronize()
    peak = mx.get_peak_memory() - base
    gen.close()
    sizes["grouped_passes"] = rpc.pool.prefill_passes["grouped"]
    return peak, sizes


@pytest.mark.parametrize(
    "prefill,shared",
    [("auto", "on"), ("auto", "off"), ("off", "off")],
    ids=["prefix read once", "each row's own read", "buffer"],
)
def test_requests_joining_a_cached_prefix_hold_the_named_working_set_outside_the_pool(
    prefill, shared
):
    """What a prefill holds outside the pool is the suffixes' K/V plus the pool's named
    working set (here one layer's gather and scores, each row reading its own context; the
    grouped read holds less), not copies of the prefix (off: a buffer of every row's context
    in every layer, 16x it). On every backend: CUDA and Metal free a layer's temporaries only
    once its work has run (on the H200 the pass evaluated whole held about 7 layers' of
    them), so the pass is evaluated in pieces that keep under the bound."""
    peak, sizes = _joining_peak(prefill, None, shared)
    assert (sizes["grouped_passes"] > 0) == (shared == "on")
    if prefill == "auto":
        assert peak <= sizes["suffix_kv"] + sizes["layer"] + 2**20, (peak, sizes)
    else:
        assert peak > 8 * sizes["one_copy"]  # what this test holds the pool path against


def test_a_prompt_pass_is_evaluated_in_pieces_its_working_set_bounds(monkeypatch):
    """With a bound of one layer's temporaries, a pass over the pool evaluates before each
    layer after the first; with a bound above the whole pass's, not within it."""
    evals = []
    real = mx.eval

    def counted(*arrays):
        if sys._getframe(1).f_globals["__name__"] == "mlx_radix_plugin.cache.paged_batch":
            evals.append(len(arrays))
        return real(*arrays)

    monkeypatch.setattr(mx, "eval", counted)
    _joining_peak("auto", None)
    per_layer = len(evals)
    evals.clear()
    _joining_peak("auto", 1 << 40)  # the cached prefix's own pass is bounded as before
    layers = len(_deep_model().layers)
    # The joining requests' pass, evaluated before each layer after the first.
    assert per_layer - len(evals) >= layers - 1


@pytest.mark.parametrize(
    "prefill,shared",
    [("auto", "on"), ("auto", "off"), ("off", "off")],
    ids=["prefix read once", "each row's own read", "buffer"],
)
def test_a_burst_on_a_new_prefix_holds_no_buffer_from_admission_to_decoding(
    loaded, prefill, shared, monkeypatch
):
    """8 requests at once on a new 1,024-token prefix: the first computes it, the others
    prefill their suffixes on its pages, then all decode on the shared path (the CPU rule
    takes it for 7k token reads saved a layer). Read from the pool, no batch holds a copy
    of anyone's K/V at any call: not the prompt batches, nor the first request's decode
    batch while its followers prefill (it waits for them on the shared path). With
    ``prefill.shared_prefix`` on (its default on a GPU), the followers read the prefix once
    a layer."""
    grouped = _plans(monkeypatch)
    model, tok = loaded("llama")
    rpc = radix(model, tokens=16384)
    prefix = (tok.encode("You are a helpful assistant. ") * 200)[:1024]
    gen = RadixBatchGenerator(
        model,
        rpc,
        shared_prefix="auto",
        prefill_from_pool=prefill,
        prefill_shared=shared,
        completion_batch_size=8,
        prefill_batch_size=8,
    )
    admit(gen, rpc, [prefix + question(tok, i) for i in range(8)], [4] * 8)
    held, done = [], 0
    while done < 8:
        done += sum(r.finish_reason is not None for r in gen.next()[1])
        stats = gen.decode_stats
        held.append(stats["decode_buffer_bytes"] + stats["prefill_buffer_bytes"])
    gen.close()
    assert rpc.stats()["cached_tokens"] >= 7 * 1024  # the prefix computed once
    if prefill == "auto":
        assert max(held) == 0
    else:
        assert max(held) > 0
    followers = [g for g in grouped if g is not None]
    assert bool(followers) == (shared == "on")
    assert rpc.stats()["prefill_passes_grouped"] == len(followers)
    # The 7 followers' pass gathers the prefix once (and a few tokens a row holds past it).
    assert all(g.rows == 7 and 1024 <= g.cached < 1024 + 16 * 7 for g in followers)


def test_aligned_slots_follow_the_rows_not_only_their_lengths(loaded):
    """A prompt batch whose rows change (one leaves, another of the same length joins)
    reads the new row's pages, though the lengths are the same as before."""
    model, _ = loaded("llama")
    pool = KVPool.for_model(model, page_size=4, pool_tokens=256)
    tables = []
    for _ in range(3):
        t = PageTable(pool)
        t.prepare_write(0, 8)
        tables.append(t)
    rows = BatchRows(pool, tables[:2], [8, 8])
    before = rows.aligned_slots(rows.lengths, 8).host.tolist()
    rows.filter([1])
    rows.extend(BatchRows(pool, tables[2:], [8]))
    after = rows.aligned_slots(rows.lengths, 8).host.tolist()
    assert before[:8] == tables[0].host_slots(0, 8).tolist()
    assert after == tables[1].host_slots(0, 8).tolist() + tables[2].host_slots(0, 8).tolist()


def test_a_request_joining_a_prompt_batch_the_pool_cannot_hold_takes_its_buffer(loaded):
    """A prompt larger than the pool prefills from a buffer (its K/V are not all in the
    pool); a short request arriving while it prefills joins that batch on a buffer too,
    and both answer as stock's engine does."""
    model, tok = loaded("llama")
    long = tok.encode("A long story about foxes, dogs, rivers and hills. " * 4)
    short = tok.encode("Hi there")
    stock = run_batch(model, tok, [long, short], max_tokens=6, step=8)
    rpc = radix(model, tokens=16 * 4)
    assert len(long) > 16 * 4
    gen = RadixBatchGenerator(model, rpc, prefill_step_size=8, prefill_batch_size=4)
    uids = admit(gen, rpc, [long], [6], logits_processors=[[no_eos(tok.eos_token_ids)]])
    gen.next()
    assert len(gen._prompt_batch) == 1 and not is_paged(gen._prompt_batch.prompt_cache)
    uids += admit(gen, rpc, [short], [6], logits_processors=[[no_eos(tok.eos_token_ids)]])
    out = {u: [] for u in uids}
    kinds = set()
    while sum(map(len, out.values())) < 12:
        if len(gen._prompt_batch):
            kinds.add(is_paged(gen._prompt_batch.prompt_cache))
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    gen.close()
    assert kinds == {False}
    assert [out[u] for u in uids] == stock


@pytest.mark.parametrize(
    "case,paged",
    [
        ("a history of its own", False),
        ("a row others wait for", True),
        ("rows sharing a prefix read once", True),
        ("rows sharing a prefix, each its own read", False),
        ("a buffer over the working set", True),
        ("rows decoding on the shared path", True),
    ],
)
def test_auto_reads_the_pool_where_a_buffer_would_hold_a_copy_nothing_else_needs(
    loaded, case, paged
):
    """``prefill.from_pool = auto`` (``prefill_path.reads_pool``): a turn over a history of
    its own takes the buffer, which reads the history once (the exact decode batch holds one
    anyway), as rows sharing a cached prefix do where ``prefill.shared_prefix`` is off; a row
    whose pages others wait for, rows whose shared prefix a pass reads once, a buffer that
    would pass the pool's working set and rows that decode on the shared path read the pool.
    Stock's tokens either way."""
    model, tok = loaded("llama")
    prefix = prefix_of(tok, 40)
    rows = 1 if case in ("a history of its own", "a buffer over the working set") else 2
    if case.startswith("rows sharing a prefix"):  # only the cached prefix
        prompts = [prefix + tok.encode(w) for w in (" apples and pears", " zebras at the zoo")]
    else:
        # Two prompts sharing a span past the cached prefix: the second waits for the first
        # to write it (in-flight sharing), then prefills on its pages.
        prompts = [prefix + question(tok, i) for i in range(rows)]
    rpc = radix(model)
    warm(model, rpc, [prefix])
    stock = run_batch(model, tok, prompts, max_tokens=4)
    if case == "a buffer over the working set":
        rpc.pool.prefill_working_bytes = len(prompts[0]) * rpc.pool.bytes_per_token - 1
    decoding = "on" if case == "rows decoding on the shared path" else "off"
    once = "on" if case == "rows sharing a prefix read once" else "off"
    gen = RadixBatchGenerator(model, rpc, shared_prefix=decoding, prefill_shared=once)
    processors = [[no_eos(tok.eos_token_ids)]] * rows
    uids = admit(gen, rpc, prompts, [4] * rows, logits_processors=processors)
    gen.next()  # the first prompt batch (a row sharing the first's span waits for its pages)
    assert len(gen._prompt_batch) == (2 if case.startswith("rows sharing a prefix") else 1)
    assert is_paged(gen._prompt_batch.prompt_cache) == paged
    assert decode(gen, uids, 4 * rows) == stock


def test_a_pass_whose_scores_would_pass_the_working_set_takes_fewer_queries(loaded, monkeypatch):
    """``_bound`` evaluates the layers before one, but one layer's scores grow with the pass's
    queries: where they alone would pass the pool's working set, the pass takes fewer queries
    (``query_step``, down to ``MIN_QUERY_STEP``). Same tokens, logits within the tolerance."""
    from mlx_radix_plugin.cache.paged_batch import MIN_QUERY_STEP

    model, tok = loaded("llama")
    prefix = prefix_of(tok, 40)
    own = 2 * MIN_QUERY_STEP + 20
    prompts = [prefix + (question(tok, i) * 20)[:own] for i in range(4)]
    passes = _pass_sizes(monkeypatch, model)
    runs, prefills = {}, {}
    for bound in (None, 1):  # no bound; one smaller than any pass's temporaries
        rpc = radix(model)
        warm(model, rpc, [prefix])
        rpc.pool.prefill_working_bytes = bound
        passes.clear()
        runs[bound] = prefill_run(model, tok, rpc, prompts, prefill="auto", step=2048)
        prefills[bound] = [n for n in passes if n > 1]
    # The same tokens prefilled, in passes of at most MIN_QUERY_STEP where they were longer.
    assert max(prefills[None]) > 2 * MIN_QUERY_STEP
    assert max(prefills[1]) == MIN_QUERY_STEP and sum(prefills[1]) == sum(prefills[None])
    _assert_same_tokens_within_tolerance(runs[1], runs[None])


def _pass_sizes(monkeypatch, model) -> list[int]:
    """The tokens of every forward pass of ``model``'s class, in order (decode steps: 1)."""
    passes = []
    call = type(model).__call__

    def recorded(self, inputs, *args, **kwargs):
        passes.append(inputs.shape[1])
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", recorded)
    return passes


def _assert_same_tokens_within_tolerance(run, reference) -> None:
    """Two ``prefill_run`` results: the same tokens, every logit within the tolerance."""
    from mlx_radix_plugin.engine.attention import FIDELITY_TOLERANCE

    (tokens, logits, _), (ref_tokens, ref_logits, _) = run, reference
    assert tokens == ref_tokens
    for i, steps in ref_logits.items():
        for a, b in zip(logits[i], steps):
            scale = mx.abs(b).max().item()
            assert mx.abs(a - b).max().item() <= FIDELITY_TOLERANCE * scale


def test_a_pass_through_cudnns_causal_call_is_not_split_for_scores_it_does_not_hold(
    loaded, monkeypatch
):
    """Through cuDNN's causal call (``prompt_attention.fused_causal``, forced here: MLX's CPU
    path computes the call) a pass holds no scores, only its rows' K/V copied for the call
    (``rolled``, rows of two cached lengths): a working set that the scores' share would
    split passes under takes them whole there. Same tokens, logits within the tolerance."""
    from mlx_radix_plugin.cache.paged_batch import MIN_QUERY_STEP
    from mlx_radix_plugin.engine import prompt_attention
    from mlx_radix_plugin.memory.budget import activation_bytes_per_token

    model, tok = loaded("llama")
    prefix = prefix_of(tok, 40)
    own, rows = 2 * MIN_QUERY_STEP + 20, 4
    # Half the rows on all of the cached prefix, half on its first 24 tokens: left padding.
    prompts = [
        (prefix if i % 2 else prefix[:24]) + (question(tok, i) * 20)[:own] for i in range(rows)
    ]
    passes, rolled = _pass_sizes(monkeypatch, model), []
    roll = prompt_attention.rolled
    monkeypatch.setattr(prompt_attention, "rolled", lambda *a: rolled.append(1) or roll(*a))
    runs, prefills = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(prompt_attention, "fused_causal", lambda *a, f=fused: f)
        rpc = radix(model)
        warm(model, rpc, [prefix])
        pool = rpc.pool
        # One layer of the pass through the causal call: its context laid out (two copies
        # as wide as the buffer, which grows 256 columns at a time), its K/V copied for the
        # call (two copies), its tokens' activations and staged K/V.
        layer_kv = pool.specs[0].bytes_per_token(pool.dtype)
        columns = len(prefix) + own + 256
        token = activation_bytes_per_token(model, pool.bytes_per_token) + pool.bytes_per_token
        pool.prefill_working_bytes = 4 * rows * columns * layer_kv + rows * own * token
        pool.attention_bytes = pool.prefill_working_bytes  # the scores' share: all of it
        # As the passes before this one left it.
        pool.prompt_attention_fused = dict.fromkeys(range(pool.num_layers), fused)
        passes.clear()
        runs[fused] = prefill_run(model, tok, rpc, prompts, prefill="on", step=2048)
        prefills[fused] = [n for n in passes if n > 1]
        assert set(pool.prompt_attention_fused.values()) == {fused}
    # The same tokens prefilled: whole through the causal call, else in the fewest queries.
    assert rolled and min(prefills[True]) > 2 * MIN_QUERY_STEP
    assert max(prefills[False]) == MIN_QUERY_STEP
    assert sum(prefills[True]) == sum(prefills[False])
    _assert_same_tokens_within_tolerance(runs[True], runs[False])


@pytest.mark.parametrize("bounded", [False, True])
def test_a_pass_empties_mlx_s_buffer_cache_only_where_the_server_does_not_bound_it(
    loaded, monkeypatch, bounded
):
    """Stock empties MLX's cache of freed buffers after every prompt pass; under the bound the
    server sets (``radix.buffer_cache_fraction``) the pool's prompt passes leave it, and the
    tokens are the same either way."""
    model, tok = loaded("llama")
    prompts = [tok.encode("Once upon a time, in a quiet town by the sea,"), tok.encode("Hi")]
    stock = run_batch(model, tok, prompts, max_tokens=4, step=8)
    rpc = radix(model)
    rpc.pool.freed_buffers = FreedBuffers(1 << 30) if bounded else None
    emptied = []
    real = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: emptied.append(1) or real())
    gen = RadixBatchGenerator(model, rpc, prefill_step_size=8)
    uids = admit(gen, rpc, prompts, [4] * 2, logits_processors=[[no_eos(tok.eos_token_ids)]] * 2)
    assert decode(gen, uids, 8) == stock
    assert bool(emptied) is not bounded


def _plans(monkeypatch) -> list:
    """What ``GroupedPass.plan`` returns for each prompt pass, in order (None: per row)."""
    from mlx_radix_plugin.cache.grouped_prefill import GroupedPass

    plans = []
    plan = GroupedPass.plan.__func__

    def spy(cls, *args):
        plans.append(plan(cls, *args))
        return plans[-1]

    monkeypatch.setattr(GroupedPass, "plan", classmethod(spy))
    return plans


def _recording(monkeypatch, model) -> list:
    """The logits of every forward pass of ``model``'s class that serves requests, in order
    (not the lazy pass that checks the attention's call site: ``attention_calls``)."""
    from mlx_radix_plugin.engine.attention import _Probe

    outputs = []
    call = type(model).__call__

    def recorded(self, inputs, *args, cache=None, **kwargs):
        out = call(self, inputs, *args, cache=cache, **kwargs)
        if not any(isinstance(c, _Probe) for c in cache or ()):
            outputs.append(out)
        return out

    monkeypatch.setattr(type(model), "__call__", recorded)
    return outputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("step", [2048, 8], ids=["one pass", "passes of 8 tokens"])
@pytest.mark.parametrize("how", ["fused", "scores"])
def test_rows_sharing_a_prefix_read_it_once_with_the_per_row_read_s_logits(
    loaded, arch, step, how, monkeypatch, chunking
):
    """``prefill.shared_prefix`` on against off (each row reads its own context, the buffer's
    logits bitwise): rows on a cached prefix with suffixes of several lengths, a cold
    prompt, a row on part of the prefix, and a row joining a prompt batch under way. Every
    pass's float32 logits, at every position, within the tolerance of the per-row read's;
    greedy tokens equal. Both ways of attending: one fused call, or the scores by hand (CUDA's);
    pools in one chunk and in a chunk a page (the columns then come in the chunks' order)."""
    from mlx_radix_plugin.engine import attention
    from mlx_radix_plugin.engine.attention import FIDELITY_TOLERANCE

    monkeypatch.setattr(attention, "GROUPED_ATTENTION", how)

    model, tok = loaded(arch)
    windowed = any(s.window is not None for s in KVPool.for_model(model, pool_tokens=64).specs)
    if windowed:
        # A sliding-window layer keeps the batch buffer, whose rows read their own context
        # (prefill_path.enable): asked for the grouped read, the pool never takes it.
        rpc = radix(model)
        RadixBatchGenerator(model, rpc, prefill_shared="on").close()
        assert not rpc.pool.prefill_from_pool and rpc.pool.prefill_shared == "off"
        return
    prefix = prefix_of(tok, 40)
    prompts = [prefix + question(tok, i) * (1 + i % 3) for i in range(4)]
    prompts += [tok.encode("A cold prompt that nothing cached holds.")]
    prompts += [prefix[:24] + question(tok, 9)]
    grouped = _plans(monkeypatch)
    outputs = _recording(monkeypatch, model)
    runs = {}
    for shared in ("off", "on"):
        rpc = radix(model)
        warm(model, rpc, [prefix])
        outputs.clear()
        grouped.clear()
        tokens, logits, _ = prefill_run(
            model, tok, rpc, prompts, prefill="auto", step=step, late=(5,), shared=shared
        )
        runs[shared] = (tokens, list(outputs), any(g is not None for g in grouped))
    (tokens, passes, took), (exact_tokens, exact_passes, exact_took) = runs["on"], runs["off"]
    assert took and not exact_took
    assert tokens == exact_tokens
    assert [p.shape for p in passes] == [p.shape for p in exact_passes]
    for a, b in zip(passes, exact_passes):
        scale = mx.abs(b).max().item()
        assert mx.abs(a - b).max().item() <= FIDELITY_TOLERANCE * scale, arch


@pytest.mark.parametrize(
    "rows, own, step, grouped",
    [(32, 0, 31, True), (8, 1024, 512, False)],
    ids=["a burst's followers", "agents with long contexts of their own"],
)
def test_auto_groups_a_pass_where_it_holds_less_than_each_row_s_own_read(rows, own, step, grouped):
    """Llama-3-8B's K/V geometry (bf16, 32 query heads), rows on one cached 2,048-token
    prefix: the H200 burst's followers (32 rows of 31 tokens) are grouped; 8 agents with
    1,024 cached tokens of their own each, adding 512, are not: the grouped pass's scores
    (every query over every row's columns) would outweigh each row reading its own."""
    from mlx_radix_plugin.memory.pool import LayerSpec

    specs = [LayerSpec(8, 128, 128)] * 2
    pool = KVPool(specs, 4096, 16, mx.bfloat16, chunk_pages=512)
    pool.prefill_shared, pool.query_heads = "auto", 32
    prefix = PageTable(pool)
    prefix.prepare_write(0, 2048)
    tables = []
    for _ in range(rows):
        t = PageTable(pool, prefix.pages, shared_tokens=2048)
        pool.allocator.incref(prefix.pages)
        t.prepare_write(2048, 2048 + own + step)
        tables.append(t)
    batch = BatchRows(pool, tables, [2048 + own] * rows)
    caches = [PagedBatchKVCache(batch, layer, object, [0] * rows) for layer in range(2)]
    x = mx.zeros((rows, 8, step, 128), mx.bfloat16)
    caches[0].update_and_fetch(x, x)
    assert (batch.grouped_pass is not None) == grouped
    assert pool.prefill_passes == {"grouped": int(grouped), "per_row": int(not grouped)}


def test_a_pass_s_estimate_counts_its_tokens_activations_and_staged_k_v(loaded):
    """Each query of a pass adds its scores (two float32 copies a column) and, per row, its
    activations through a layer and every layer's staged K/V (``prefill_token_bytes``, set
    from the model when the engine is built)."""
    from mlx_radix_plugin.memory.budget import activation_bytes_per_token

    model, _ = loaded("llama")
    rpc = radix(model)
    RadixBatchGenerator(model, rpc)
    pool = rpc.pool
    activations = activation_bytes_per_token(model, pool.bytes_per_token) * pool.dtype.size // 4
    assert pool.prefill_token_bytes == activations + pool.bytes_per_token
    rows, heads, columns = 3, model.args.num_attention_heads, 100
    tables = [PageTable(pool) for _ in range(rows)]
    for t in tables:
        t.prepare_write(0, columns)
    cache = PagedBatchKVCache(BatchRows(pool, tables, [0] * rows), 0, object, [0] * rows)
    per_query = cache._layer_bytes(1, columns) - cache._layer_bytes(0, columns)
    assert per_query == 2 * rows * heads * columns * 4 + rows * pool.prefill_token_bytes
