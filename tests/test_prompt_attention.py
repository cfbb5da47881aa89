"""A prompt pass's attention within the working set (engine/prompt_attention.py): query blocks,
key blocks and the causal kernel's row split stay within the fidelity tolerance of stock's
attention, and a long prompt on a wide model holds its passes to the plan with stock's tokens."""

import gc

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.base import create_causal_mask
from test_generation import KEY, no_eos
from test_shared_prefix import admit, decode, stock_run
from tiny_models import build_model

from mlx_radix_plugin.cache.paged_batch import PagedBatchKVCache
from mlx_radix_plugin.cache.prompt_cache import RadixPromptCache
from mlx_radix_plugin.engine import prompt_attention
from mlx_radix_plugin.engine.attention import FIDELITY_TOLERANCE
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.memory import budget
from mlx_radix_plugin.memory.budget import DeviceMemory
from mlx_radix_plugin.memory.pool import KVPool, model_nbytes
from mlx_radix_plugin.memory.working_set import WorkingSet

# (rows, query heads, KV heads, queries, cached keys, head dim), each row's left padding
SHAPES = [
    ((1, 32, 8, 512, 1500, 64), [0]),
    ((3, 4, 1, 513, 70, 32), [0, 0, 5]),
    ((1, 8, 8, 1000, 0, 64), [5]),
    ((2, 6, 2, 300, 900, 16), [0, 37]),
]


def inputs(shape, padding, seed=0):
    B, Hq, H, S, prev, D = shape
    mx.random.seed(seed)
    L = prev + S
    q, k, v = (mx.random.normal(s) for s in ((B, Hq, S, D), (B, H, L, D), (B, H, L, D)))
    return q, k, v, create_causal_mask(S, offset=prev, left_padding=mx.array(padding))


def real(x, padding, prev):
    """Each row's queries that are tokens, not padding (padding queries see no key)."""
    skip = max(0, max(padding) - prev)
    return x[:, :, skip:]


@pytest.mark.parametrize("shape,padding", SHAPES)
@pytest.mark.parametrize("share", [2, 3, 7])
def test_query_blocks_stay_within_the_fidelity_tolerance(shape, padding, share):
    """Each query's softmax is its own; what differs is the BLAS's rounding, which may
    depend on a product's rows (the system OpenBLAS the suite preloads: MLX's own gave
    these bitwise)."""
    q, k, v, mask = inputs(shape, padding)
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    B, Hq, _, S, prev, _ = shape
    full = B * Hq * S * (prev + S) * prompt_attention.SCORE_BYTES
    out = prompt_attention.blocked(q, k, v, 0.125, mask, None, full // share)
    want, got = real(stock, padding, prev), real(out, padding, prev)
    assert mx.abs(got - want).max().item() <= FIDELITY_TOLERANCE * mx.abs(want).max().item()


@pytest.mark.parametrize("shape,padding", SHAPES)
@pytest.mark.parametrize("sinks", [False, True])
def test_key_blocks_stay_within_the_fidelity_tolerance(shape, padding, sinks):
    q, k, v, mask = inputs(shape, padding, seed=1)
    B, Hq, _, S, prev, _ = shape
    s = mx.random.normal((Hq,)) if sinks else None
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=s)
    # 64 queries over 300 keys at most: every block of queries splits its keys.
    budget = B * Hq * prompt_attention.SCORE_BYTES * 64 * 300
    out = prompt_attention.blocked(q, k, v, 0.125, mask, s, budget)
    want, got = real(stock, padding, prev), real(out, padding, prev)
    assert mx.abs(got - want).max().item() <= FIDELITY_TOLERANCE * mx.abs(want).max().item()


def test_a_causal_mask_splits_alike():
    q, k, v, _ = inputs((1, 8, 2, 700, 1300, 32), [0])
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    full = 8 * 700 * 2000 * prompt_attention.SCORE_BYTES
    for bound in (full // 3, 8 * 12 * 64 * 256):
        out = prompt_attention.blocked(q, k, v, 0.2, "causal", None, bound)
        assert mx.abs(out - stock).max().item() <= FIDELITY_TOLERANCE * mx.abs(stock).max().item()


class _Pool:
    prefill_attention, attention_bytes = "auto", None

    def __init__(self):
        self.prompt_attention_fused = {}


class _Rows:
    pool = _Pool()


class _Cache:
    rows, layer = _Rows(), 0


@pytest.mark.parametrize(
    "padding,budget,calls",
    [
        ([0, 0], None, 1),
        ([0, 9], None, 1),
        ([17, 3], None, 1),
        ([5, 0, 30], None, 1),
        ([0, 31], None, 2),
        ([0, 9], 2 * 2 * 2 * 520 * 32 * 4 - 1, 2),
    ],
)
def test_the_causal_kernels_rows_each_over_their_own_columns(monkeypatch, padding, budget, calls):
    """Where cuDNN's flash attention serves (CUDA), each padded row attends over its own
    columns with the causal mask: rows whose padding is at most a quarter of the pass's 120
    queries, and whose keys and values fit the attention's share of the working set, in one
    call, each row's padding moved after its keys (``rolled``), others a call each. Computed
    here by MLX's CPU path, as a check of the layout."""
    monkeypatch.setattr(prompt_attention, "fused_causal", lambda *a: True)
    monkeypatch.setattr(_Pool, "attention_bytes", budget)
    made = []
    causal = prompt_attention.causal
    monkeypatch.setattr(prompt_attention, "causal", lambda *a: made.append(a) or causal(*a))
    q, k, v, mask = inputs((len(padding), 8, 2, 120, 400, 32), padding, seed=2)
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    out = prompt_attention.prompt_attention(q, k, v, _Cache(), 0.2, mask, padding=padding)
    assert mx.abs(out - stock).max().item() <= FIDELITY_TOLERANCE * mx.abs(stock).max().item()
    assert len(made) == calls


def test_only_the_passs_own_causal_mask_gives_way_to_the_causal_kernel(loaded, monkeypatch):
    """A pass over the pool hands its rows' padding to the causal kernel only with the mask
    its cache made; a mask with a window, or one the model made itself, keeps the call."""
    from mlx_radix_plugin.engine import attention

    seen = []
    monkeypatch.setattr(attention, "prompt_attention", lambda *a: seen.append(a[-1]))
    model, tok = loaded("llama")
    pool = KVPool.for_model(model, page_size=16, pool_tokens=1024)
    caches, _ = RadixPromptCache(pool).fetch_nearest_cache(KEY, tok.encode("Once upon a time"))
    layer = PagedBatchKVCache.from_pool_caches([caches[0]])
    mask = layer.make_mask(3)
    q, kv = mx.zeros((1, 4, 3, 16)), mx.zeros((1, 2, 3, 16))
    attention.scaled_dot_product_attention(q, kv, kv, layer, 1.0, mask)
    attention.scaled_dot_product_attention(q, kv, kv, layer, 1.0, mask | True)
    layer.make_mask(3, window_size=2)
    attention.scaled_dot_product_attention(q, kv, kv, layer, 1.0, mask)
    assert seen == [layer._padding, None, None]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny model with many query heads and one KV head, reading 131,072 tokens: its
    scores grow 64 heads a query and key, its K/V one head, so the plan's working memory,
    sized by the K/V, is small against a long prompt's scores."""
    path = build_model(
        "llama",
        tmp_path_factory.mktemp("wide") / "llama",
        hidden_size=256,
        num_attention_heads=64,
        num_key_value_heads=1,
        max_position_embeddings=131072,
    )
    model, tok = load(str(path))
    prompt = [5 + (i * 7919) % 500 for i in range(3072)]
    expected, _ = stock_run(model, tok, [prompt], [4], prefill_step_size=STEP)
    return model, tok, prompt, expected


STEP = 1024  # prompt tokens a pass


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_long_prompt_holds_its_passes_to_the_working_set(wide, mlx_limit, mode, monkeypatch):
    """3,072 tokens on the wide model: with ``prefill.attention`` on, every pass's working
    memory (MLX's peak over the model and the pool) is within the plan's, and the tokens are
    stock's; off, as stock, one layer's scores pass it (the fewest queries a pass takes,
    ``MIN_QUERY_STEP``, over every key). The attention's share is the reserve's half alone
    here: its floor, ``ATTENTION_MIN_BYTES``, would name more than this prompt's scores."""
    monkeypatch.setattr(budget, "ATTENTION_MIN_BYTES", 0)
    model, tok, prompt, expected = wide
    gc.collect()
    others = mx.get_active_memory() - model_nbytes(model)
    memory = DeviceMemory("cpu", 2 << 30, "test")
    pool = KVPool.for_model(model, page_size=16, memory=memory, prefill_step_size=STEP)
    rpc = RadixPromptCache(pool)
    pool.working_set = working = WorkingSet(pool, model_nbytes(model), rpc.snapshots)
    # The pool's passes report to the working set (a lone row's buffer here would be
    # under 1 MB, which prefill.from_pool = auto would take).
    gen = RadixBatchGenerator(
        model, rpc, prefill_attention=mode, prefill_from_pool="on", prefill_step_size=STEP
    )
    uids = admit(gen, rpc, [prompt], [4], logits_processors=[[no_eos(tok.eos_token_ids)]])
    assert decode(gen, uids, 4) == expected
    held = working.peaks["prefill"] - others
    if mode == "auto":
        assert 0 < held <= working.named
    else:
        assert held > 3 * working.named
    working.release()


@pytest.fixture
def mlx_limit():
    return mx.get_memory_limit()
