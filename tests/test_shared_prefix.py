"""Shared-prefix decode: each shared prefix read once, logits within tolerance of stock's.

Every scenario runs the same requests through stock mlx-lm's ``BatchGenerator`` and through
the engine with ``decode.shared_prefix = "on"``, recording the float32 logits each request
is sampled from, and checks at every step: max |logit - stock's| <= FIDELITY_TOLERANCE x
max |stock's logit|, and the same greedy tokens.
"""

from __future__ import annotations

import gc
import os

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base
from test_generation import KEY
from tiny_models import ARCHS

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.cache.shared_batch import SharedPrefixBatchCache
from mlx_radix_plugin.engine import attention
from mlx_radix_plugin.engine.attention import FIDELITY_TOLERANCE
from mlx_radix_plugin.engine.decode_path import RULES, SharedPrefixRule
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.memory import in_place
from mlx_radix_plugin.memory.prefix_groups import PrefixGroup

PS = 4


class Recorder:
    """Logits processors that keep what each request is sampled from."""

    def __init__(self, eos):
        self.logits: dict[int, list[mx.array]] = {}
        self.eos = list(eos)

    def processor(self, i: int):
        def record(tokens, logits):
            self.logits.setdefault(i, []).append(logits.astype(mx.float32))
            logits[:, self.eos] = -1e9  # outputs run to full length
            return logits

        return record


def stock_run(model, tok, prompts, max_tokens, **kwargs):
    rec = Recorder(tok.eos_token_ids)
    gen = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=8, **kwargs)
    uids = gen.insert_segments(
        [[p] for p in prompts],
        max_tokens=max_tokens,
        logits_processors=[[rec.processor(i)] for i in range(len(prompts))],
    )
    out = {u: [] for u in uids}
    done = 0
    while done < len(prompts):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
            done += r.finish_reason is not None
    gen.close()
    return [out[u] for u in uids], rec.logits


def radix(model, tokens=4096):
    return RadixPromptCache(KVPool.for_model(model, page_size=PS, pool_tokens=tokens))


def admit(gen, rpc, prompts, max_tokens, **kwargs) -> list[int]:
    """Hand ``prompts`` to the engine ``gen`` with what ``rpc`` holds of each, as the server
    does; returns their uids."""
    fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
    return gen.insert_segments(
        [[rest] for _, rest in fetched],
        max_tokens=max_tokens,
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(r)] for p, (_, r) in zip(prompts, fetched)],
        **kwargs,
    )


def until_all_decode_shared(gen, rows: int) -> None:
    """Step ``gen`` until its ``rows`` requests all decode, on the shared path: requests that
    follow another's prefix start once its first token has gone out (generator.py)."""
    while len(gen._generation_batch) < rows or gen.decode_stats["decode_path"] != "shared":
        gen.next()


def decode(gen, uids, total: int) -> list[list[int]]:
    """Step the engine ``gen`` until its requests ``uids`` have ``total`` tokens between them;
    returns each request's tokens, in ``uids``' order, and closes it."""
    out = {u: [] for u in uids}
    while sum(map(len, out.values())) < total:
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def warm(model, rpc, prefixes):
    """Cache ``prefixes`` in the tree, as earlier requests would have."""
    gen = RadixBatchGenerator(model, rpc, shared_prefix="off")
    admit(gen, rpc, prefixes, [1] * len(prefixes))
    done = 0
    while done < len(prefixes):
        for r in gen.next()[1]:
            if r.finish_reason:
                done += 1
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()


def engine_run(model, tok, rpc, prompts, max_tokens, *, mode="on", late=(), join_after=3):
    """The engine on ``prompts``; those in ``late`` are admitted ``join_after`` steps in.

    Returns the tokens and logits per request and, per step, the path the batch took.
    """
    rec = Recorder(tok.eos_token_ids)
    gen = RadixBatchGenerator(
        model, rpc, shared_prefix=mode, completion_batch_size=16, prefill_batch_size=8
    )

    def admit_rows(idx):
        uids = admit(
            gen,
            rpc,
            [prompts[i] for i in idx],
            [max_tokens[i] for i in idx],
            logits_processors=[[rec.processor(i)] for i in idx],
        )
        return dict(zip(uids, idx))

    who = admit_rows([i for i in range(len(prompts)) if i not in late])
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    paths, steps, done = [], 0, 0
    while done < len(prompts):
        if steps == join_after and late:
            who.update(admit_rows(list(late)))
        responses = gen.next()[1]
        steps += bool(responses)
        paths.append(gen.decode_stats["decode_path"])
        for r in responses:
            out[who[r.uid]].append(r.token)
            if r.finish_reason is not None:
                done += 1
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()
    return [out[i] for i in range(len(prompts))], rec.logits, paths


def assert_close_to_stock(got, expected):
    tokens, logits = got
    stock_tokens, stock_logits = expected
    assert tokens == stock_tokens
    for i, steps in stock_logits.items():
        assert len(logits[i]) == len(steps)
        for step, (a, b) in enumerate(zip(logits[i], steps)):
            worst = mx.abs(a - b).max().item()
            assert worst <= FIDELITY_TOLERANCE * mx.abs(b).max().item(), (i, step, worst)


def prefix_of(tok, n=40, text="You are a helpful assistant. Answer briefly. "):
    return (tok.encode(text) * n)[:n]


def question(tok, i):
    return tok.encode(f" Question {i}: where is city {i}?")


def on_a_shared_prefix(model, tok, rows: int, max_tokens: int, pool_tokens: int = 4096):
    """An engine with ``rows`` requests on one cached prefix, each with its question,
    admitted (``shared_prefix = "on"``); returns it and its ``RadixPromptCache``."""
    prefix = prefix_of(tok)
    rpc = radix(model, tokens=pool_tokens)
    warm(model, rpc, [prefix])
    gen = RadixBatchGenerator(model, rpc, shared_prefix="on", completion_batch_size=8)
    admit(gen, rpc, [prefix + question(tok, i) for i in range(rows)], [max_tokens] * rows)
    return gen, rpc


@pytest.fixture(params=["split", "masked", "split, chunks joined", "paged"])
def variant(request, monkeypatch):
    """Every way of computing the shared path, whatever this machine's device picks; the
    split one also reading a prefix over several chunks as one part, as a GPU does; the
    paged one as CUDA's kernel (elsewhere its MLX-ops form, engine/paged_attention.py)."""
    monkeypatch.setattr(attention, "VARIANT", request.param.split(",")[0])
    monkeypatch.setattr(attention, "CHUNK_READ", "joined" if "joined" in request.param else "parts")
    return request.param


@pytest.mark.parametrize("arch", ARCHS)
def test_one_group_reads_its_prefix_once_and_answers_as_stock(loaded, arch, variant, chunking):
    model, tok = loaded(arch)
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(4)]
    expected = stock_run(model, tok, prompts, [10] * 4)
    rpc = radix(model)
    warm(model, rpc, [prefix])
    tokens, logits, paths = engine_run(model, tok, rpc, prompts, [10] * 4)
    assert_close_to_stock((tokens, logits), expected)
    assert paths.count("shared") >= 8
    stats = rpc.stats()
    assert stats["pages_locked"] == 0 and stats["requests_holding_pages"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_groups_joining_leaving_and_diverging_mid_page(loaded, arch, variant, chunking):
    """Two prefixes of two requests each, a request sharing nothing, one that diverges from
    a prefix mid-page; two requests join mid-decode, and requests leave at different steps."""
    model, tok = loaded(arch)
    a, b = prefix_of(tok), prefix_of(tok, 36, "Summarise the text below in one line. ")
    prompts = [
        a + question(tok, 0),
        b + question(tok, 1),
        tok.encode("Once upon a time"),
        a[:30] + question(tok, 3),  # leaves prefix a at token 30, mid-page
        a + question(tok, 4),
        b + question(tok, 5),
    ]
    max_tokens = [12, 6, 9, 12, 7, 12]
    expected = stock_run(model, tok, prompts, max_tokens)
    rpc = radix(model)
    warm(model, rpc, [a, b])
    got = engine_run(model, tok, rpc, prompts, max_tokens, late=(4, 5))
    assert_close_to_stock(got[:2], expected)
    assert "shared" in got[2]


def test_the_shared_path_holds_no_batch_buffer_and_reads_each_prefix_once(loaded):
    model, tok = loaded("llama")
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(4)]
    seen = []
    for mode in ("off", "on"):
        rpc = radix(model)
        warm(model, rpc, [prefix])
        gen = RadixBatchGenerator(model, rpc, shared_prefix=mode, completion_batch_size=8)
        admit(gen, rpc, prompts, [8] * 4)
        while len(gen._generation_batch) < 4:
            gen.next()
        gen.next()
        seen.append(dict(gen.decode_stats, held_outside=rpc.pool.buffer_bytes))
        gen.close()
    exact, shared = (dict(s) for s in seen)
    held = {"exact": exact.pop("held_outside"), "shared": shared.pop("held_outside")}
    # A decoding batch reports the keys an idle engine does (DECODE_STATS), no more.
    from mlx_radix_plugin.engine.decode_path import idle_stats

    assert set(exact) == set(shared) == set(idle_stats("on"))
    assert exact["decode_path"] == "exact" and exact["decode_buffer_bytes"] > 0
    assert shared["decode_path"] == "shared" and shared["decode_buffer_bytes"] == 0
    # What the pool counts outside itself is the batch buffer, and nothing on the shared path.
    assert held == {"exact": exact["decode_buffer_bytes"], "shared": 0}
    assert shared["decode_rows"] == 4 and shared["decode_groups"] == 1
    assert exact["decode_steps_shared"] == 0 and exact["decode_steps_exact"] >= 1
    assert shared["decode_steps_shared"] >= 1
    # The prefix and the pages of " Question" after it, shared in flight.
    common = len(os.path.commonprefix(prompts))
    assert shared["decode_shared_tokens"] == common // PS * PS > len(prefix)


def test_pool_writes_stay_in_place_while_layers_read_the_pool(loaded):
    """Every layer gathers from the pool and the step's writes come after the last read,
    evaluated after the logits: MLX updates the pool's arrays in place. A write evaluated
    with a read of the same array would copy the array (twice the memory of one)."""
    model, tok = loaded("llama")
    # Pool arrays of 25 MB, against a few MB of step.
    gen, rpc = on_a_shared_prefix(model, tok, 4, 20, pool_tokens=200_000)
    array_bytes = rpc.pool.arrays[0].nbytes
    while gen.decode_stats["decode_path"] != "shared":
        gen.next()
    mx.eval(rpc.pool.arrays)
    base_bytes = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(5):
        gen.next()
    mx.eval(rpc.pool.arrays)
    assert gen.decode_stats["decode_path"] == "shared"
    assert mx.get_peak_memory() - base_bytes < array_bytes // 2
    gen.close()


def test_a_pass_writes_the_pool_only_once_the_pass_before_it_has_stopped_reading(
    loaded, monkeypatch
):
    """On a GPU, a kernel's inputs stay alive until it has run, so a write evaluated while
    the previous pass still reads the pool copies the whole array. Each shared pass's writes
    are evaluated with the next pass, after waiting for the one before (KVPool.settle), and
    the engine does not evaluate them on its own between shared steps."""
    model, tok = loaded("llama")
    monkeypatch.setattr(in_place, "IN_PLACE", False)  # scatters, as everywhere but CUDA
    gen, rpc = on_a_shared_prefix(model, tok, 4, 12)
    until_all_decode_shared(gen, 4)
    gen.next()  # a pass now runs, announced as reading the pool

    events = []
    synchronize, async_eval = mx.synchronize, mx.async_eval

    def sync(*args):
        events.append("wait")
        return synchronize(*args)

    def evaluate(*args):
        pool = {id(a) for a in rpc.pool.arrays}
        if any(id(a) in pool for x in args for a in (x if isinstance(x, list) else [x])):
            events.append("pool written alone")
        return async_eval(*args)

    monkeypatch.setattr(mx, "synchronize", sync)
    monkeypatch.setattr(mx, "async_eval", evaluate)
    for _ in range(4):
        events.append("step")
        gen.next()
    assert gen.decode_stats["decode_path"] == "shared"
    assert events == ["step", "wait"] * 4
    monkeypatch.undo()
    while any(gen.next()):  # the rows finish: what they wrote last is evaluated after a wait
        pass
    assert rpc.pool._reader is None
    gen.close()


def test_off_is_bitwise_the_exact_path_with_or_without_the_patched_call_site(loaded, monkeypatch):
    model, tok = loaded("qwen3")
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)]
    runs = []
    for patched in (False, True):
        attention.install(model)
        if not patched:  # mlx-lm's own function at every call site
            for name in attention.install(model):
                monkeypatch.setattr(
                    f"{name}.scaled_dot_product_attention", base.scaled_dot_product_attention
                )
        rpc = radix(model)
        warm(model, rpc, [prefix])
        runs.append(engine_run(model, tok, rpc, prompts, [8] * 3, mode="off"))
        monkeypatch.undo()
    (tokens_a, logits_a, paths_a), (tokens_b, logits_b, _) = runs
    assert set(paths_a) <= {"exact", None}
    assert tokens_a == tokens_b
    for i in logits_a:
        assert all(mx.array_equal(x, y).item() for x, y in zip(logits_a[i], logits_b[i]))


def test_auto_goes_back_to_the_exact_path_when_the_group_leaves(loaded):
    model, tok = loaded("llama")
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, 0), prefix + question(tok, 1), tok.encode("Once upon")]
    max_tokens = [4, 4, 14]
    expected = stock_run(model, tok, prompts, max_tokens)
    rpc = radix(model)
    warm(model, rpc, [prefix])
    rule = SharedPrefixRule(min_saved_tokens=30, min_saved_fraction=0.2)
    original = RadixBatchGenerator.__init__

    def with_rule(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.decode_path.rule = rule

    RadixBatchGenerator.__init__ = with_rule
    try:
        got = engine_run(model, tok, rpc, prompts, max_tokens, mode="auto")
    finally:
        RadixBatchGenerator.__init__ = original
    assert_close_to_stock(got[:2], expected)
    paths = [p for p in got[2] if p]
    assert paths[1] == "shared" and paths[-1] == "exact"


def test_a_pool_too_small_for_the_next_token_goes_back_to_the_exact_path(loaded, caplog):
    caplog.set_level("WARNING", logger="mlx_radix")
    model, tok = loaded("llama")
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)]
    expected = stock_run(model, tok, prompts, [16] * 3)
    longest = max(map(len, prompts))
    # Room for the prefix and the prompts' own pages, not for 16 more tokens each.
    rpc = radix(model, tokens=(longest // PS + 3 * 3 + 2) * PS)
    warm(model, rpc, [prefix])
    tokens, logits, paths = engine_run(model, tok, rpc, prompts, [16] * 3)
    assert_close_to_stock((tokens, logits), expected)
    assert "shared" in paths and "exact" in paths
    gc.collect()
    assert rpc.stats()["pages_locked"] == 0


def test_the_attention_of_a_shared_batch_needs_one_token_a_row(loaded):
    model, _ = loaded("llama")
    cache = SharedPrefixBatchCache.__new__(SharedPrefixBatchCache)
    with pytest.raises(ValueError, match="one token a row, got 3"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))


def test_models_that_attend_outside_the_call_site_keep_the_exact_path(loaded, caplog):
    caplog.set_level("INFO", logger="mlx_radix")
    model, _ = loaded("llama")
    rpc = radix(model)
    assert attention.attention_calls(model, rpc.pool) == len(model.layers)

    class Direct:  # calls MLX's fused attention itself, as some architectures do
        layers = model.layers

        def __call__(self, inputs, cache):
            for c in cache:
                k = mx.zeros((1, 2, 1, 16))
                c.update_and_fetch(k, k)
            return mx.zeros((1, 1, 8))

        def modules(self):
            return []

    assert attention.attention_calls(Direct(), rpc.pool) is None
    gen = RadixBatchGenerator(Direct(), rpc, shared_prefix="on")
    assert gen.decode_path.mode == "off"
    assert "shared-prefix decode off" in caplog.text
    gen.close()


def test_a_model_that_hands_the_call_site_its_own_mask_keeps_the_exact_paths(caplog):
    """DeepSeek-V3's attention (MLA) passes its rotary scores to the call site as the mask:
    the shared decode path and the grouped prefill, which make their own masks, would drop
    them, so neither serves it."""
    from mlx_lm.models import deepseek_v3

    caplog.set_level("INFO", logger="mlx_radix")
    mx.random.seed(0)
    config = dict(
        model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, first_k_dense_replace=1,
    )  # fmt: skip
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    rpc = radix(model)
    assert attention.attention_calls(model, rpc.pool) is None
    gen = RadixBatchGenerator(model, rpc, shared_prefix="on", prefill_shared="on")
    assert gen.decode_path.mode == "off" and rpc.pool.prefill_shared == "off"
    assert "prefill.shared_prefix off" in caplog.text
    gen.close()


@pytest.mark.parametrize(
    "backend, rows, prefix, shared",
    [
        # The CPU calibration points around the threshold (decode_path.py has the numbers).
        ("cpu", 8, 512, False),
        ("cpu", 4, 1024, False),
        ("cpu", 4, 2048, True),
        ("cpu", 8, 2048, True),
        # H200: level at 8 x 1,024, 1.5x stock from 32 x 2,048.
        ("gpu", 8, 1024, False),
        ("gpu", 32, 2048, True),
        ("gpu", 32, 4096, True),
        # CUDA's paged kernel: up to 8 rows whatever they share (1 row 6.0-6.4 ms a step
        # against 9.1-13.9 exact), above that as the GPU rule (32 short rows: exact).
        ("cuda", 1, 0, True),
        ("cuda", 8, 0, True),
        ("cuda", 8, 1024, True),
        ("cuda", 32, 0, False),
        ("cuda", 32, 2048, True),
    ],
)
def test_auto_takes_the_shared_path_where_it_was_measured_faster(backend, rows, prefix, shared):
    group = PrefixGroup(tuple(range(rows)), tuple(range(prefix // 16)))
    lengths = [prefix + 32 + 16] * rows  # own question and half the measured steps
    assert RULES[backend].takes_shared([group], lengths, 16) is shared


@pytest.mark.parametrize(
    "rows, prefix, one_chunk, shared",
    [
        # With stores in place no step waits: 32 short rows 9.9 ms paged, 12.7 exact.
        (1, 0, True, True),
        (32, 0, True, True),
        (32, 2048, True, True),
        # Pages across chunks: the kernel reads them a chunk at a time; CUDA's rule holds.
        (8, 0, False, True),
        (32, 0, False, False),
        (32, 2048, False, True),
    ],
)
def test_cuda_with_stores_in_place_takes_the_paged_kernel_wherever_it_reads(
    rows, prefix, one_chunk, shared
):
    group = PrefixGroup(tuple(range(rows)), tuple(range(prefix // 16)))
    lengths = [prefix + 32 + 16] * rows
    assert RULES["cuda_in_place"].takes_shared([group], lengths, 16, one_chunk) is shared


def test_a_paged_pass_gives_its_layers_one_view_of_each_pool_array(loaded, monkeypatch):
    """The kernel reads a pool array through a one-row view (in_place.head); every layer of a
    pass in a chunk reads the same arrays, so the pass makes each view once."""
    model, tok = loaded("llama")
    monkeypatch.setattr(attention, "VARIANT", "paged")
    seen = []

    def recorded(attend):
        def call(queries, keys, values, at):
            if isinstance(at, list) and at[0].heads is not None:  # not ``check``'s own (CUDA)
                seen.append(at)
            return attend(queries, keys, values, at)

        return call

    # The kernel on CUDA, its MLX-ops form elsewhere.
    for name in ("paged_attention", "reference"):
        attend = getattr(attention.paged_attention, name)
        monkeypatch.setattr(attention.paged_attention, name, recorded(attend))
    prefix = prefix_of(tok)
    rpc = radix(model)
    warm(model, rpc, [prefix])
    engine_run(model, tok, rpc, [prefix + question(tok, i) for i in range(2)], [4, 4])
    layers = rpc.pool.num_layers
    assert seen and len(seen) % layers == 0
    for n in range(0, len(seen), layers):  # a pass: one call a layer, one part a chunk here
        parts = [at[0] for at in seen[n : n + layers]]
        first = parts[0]
        assert all(p.heads[0] is first.heads[0] and p.heads[1] is first.heads[1] for p in parts)
        for view, array in zip(first.heads, (first.keys, first.values)):
            assert view.shape == (1, *array.shape[1:])
            assert mx.array_equal(view, array[:1]).item()


def test_a_batch_goes_shared_where_cuda_runs_the_paged_kernel(loaded, monkeypatch):
    """On CUDA the engine's decode path may take the paged kernel, and its rule is CUDA's;
    elsewhere neither (the kernel runs on CUDA only)."""
    from mlx_radix_plugin.engine import generator

    model, tok = loaded("llama")
    monkeypatch.setattr(generator, "backend", lambda: "cuda")
    monkeypatch.setattr(in_place, "IN_PLACE", False)
    gen = RadixBatchGenerator(model, radix(model), shared_prefix="auto")
    assert gen.decode_path.paged and gen.decode_path.rule is RULES["cuda"]
    gen.close()
    monkeypatch.setattr(in_place, "IN_PLACE", True)  # where CUDA stores in place
    gen = RadixBatchGenerator(model, radix(model), shared_prefix="auto")
    assert gen.decode_path.paged and gen.decode_path.rule is RULES["cuda_in_place"]
    gen.close()
    monkeypatch.setattr(generator, "backend", lambda: "cpu")  # also where the suite runs on a GPU
    gen = RadixBatchGenerator(model, radix(model), shared_prefix="auto")
    assert not gen.decode_path.paged and gen.decode_path.rule is RULES["cpu"]
    gen.close()


def test_auto_counts_every_group_and_the_longest_own_part():
    rule = SharedPrefixRule(min_saved_tokens=100, min_saved_fraction=0.4)
    groups = [PrefixGroup((0, 2), tuple(range(16))), PrefixGroup((1, 3), tuple(range(16, 32)))]
    groups.append(PrefixGroup((4,), ()))
    # Two groups of two on 64-token prefixes, 16 own tokens each, and a lone row of 10:
    # stock reads 5 x 80 = 400 tokens a layer, the shared path 2 x 64 + 5 x 16 = 208.
    assert rule.takes_shared(groups, [80, 80, 80, 80, 10], 4)
    # A lone row of 40 own tokens pads every row's own part to 40: 2 x 64 + 5 x 40 = 328.
    assert not rule.takes_shared(groups, [80, 80, 80, 80, 40], 4)


def test_on_a_gpu_the_masked_variant_serves_until_its_scores_pass_the_split(monkeypatch):
    """The variant follows the scores of a layer (heads x rows x padded columns)."""

    class Step:
        def __init__(self, rows, columns):
            self.lengths = [0] * rows
            self.masked_columns = lambda: columns

    monkeypatch.setattr(attention.mx, "default_device", lambda: attention.mx.gpu)
    assert attention.variant(Step(32, 4096), 32) == "masked"  # 4.2M scores
    assert attention.variant(Step(32, 12288), 32) == "split"  # 12.6M
    monkeypatch.setattr(attention, "VARIANT", "split")
    assert attention.variant(Step(8, 2048), 32) == "split"


def test_masked_columns_are_whole_buckets_of_prefixes_and_own_tokens(loaded, monkeypatch):
    from mlx_radix_plugin.cache import shared_batch

    monkeypatch.setattr(shared_batch, "MASKED_BUCKET", 64)
    model, tok = loaded("llama")
    gen, rpc = on_a_shared_prefix(model, tok, 3, 6)
    prefix = prefix_of(tok)
    seen = []
    real = attention.masked_attention

    def spy(queries, keys, values, cache, scale, sinks=None):
        step = cache.step
        index, mask = step.masked_layout(keys.shape[1], cache.window)
        seen.append(
            (step.masked_columns(), index.shape[0], mask.shape, mask.sum(axis=1).tolist(), step)
        )
        return real(queries, keys, values, cache, scale, sinks)

    monkeypatch.setattr(attention, "VARIANT", "masked")
    monkeypatch.setattr(attention, "masked_attention", spy)
    until_all_decode_shared(gen, 3)
    seen.clear()
    gen.next()
    gen.close()
    columns, gathered, shape, visible, step = seen[-1]
    assert columns % 64 == 0 and shape == (3, columns) and gathered == columns - 3
    # Each row sees its group's prefix, its own tokens and its token: all its context, and
    # (the columns being more) not the others' own tokens.
    assert visible == [n + 1 for n in step.lengths]
    assert columns >= len(prefix) // PS * PS + sum(n - len(prefix) // PS * PS for n in step.lengths)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_responses_carry_stock_logprobs_and_their_tokens_value_on_the_host(loaded, mode):
    """Each response's log-probabilities are an MLX row with stock's values (stock prefilled
    the whole prompts here, the engine only what follows the cached prefix: rounding
    differs on both paths); ``[token]``, which mlx_lm.server reads every step, answers
    from the host, and the server's top-logprobs formatting works on the row."""
    from mlx_lm.server import _format_top_logprobs

    from mlx_radix_plugin.engine.decode_step import TokenLogprobs

    model, tok = loaded("llama")
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)]

    def run(gen, uids):
        rows = {u: [] for u in uids}
        done = 0
        while done < 3:
            for r in gen.next()[1]:
                rows[r.uid].append((r.token, r.logprobs))
                done += r.finish_reason is not None
        gen.close()
        return [rows[u] for u in uids]

    gen = BatchGenerator(model, completion_batch_size=8)
    stock = run(gen, gen.insert_segments([[p] for p in prompts], max_tokens=[5] * 3))
    rpc = radix(model)
    warm(model, rpc, [prefix])
    gen = RadixBatchGenerator(model, rpc, shared_prefix=mode, completion_batch_size=8)
    got = run(gen, admit(gen, rpc, prompts, [5] * 3))
    for ours, theirs in zip(got, stock):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        for (token, row), (_, expected) in zip(ours, theirs):
            assert isinstance(row, TokenLogprobs) and row.dtype == expected.dtype
            worst = mx.abs(row - expected).max().item()
            assert worst <= FIDELITY_TOLERANCE * mx.abs(expected).max().item()
            assert row[token].item() == row.tolist()[token] == row.value
            assert row[token].dtype == row.dtype
            assert row[token + 1].item() == row.tolist()[token + 1]  # the array's own
            top = _format_top_logprobs(row, 3, tok)
            best = sorted((t["logprob"] for t in top), reverse=True)  # argpartition: unordered
            assert best == sorted(row.tolist(), reverse=True)[:3]
