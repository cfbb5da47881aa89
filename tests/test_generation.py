"""Generation through mlx-lm with the plugin's caches equals stock mlx-lm."""

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from tiny_models import ARCHS

from mlx_radix_plugin import KVPool, RadixPromptCache

MAX_TOKENS = 10
PAGE_SIZE = 4
KEY = ("tiny", None, None)


def no_eos(eos_ids):
    # Random weights may pick EOS early; banning it keeps every comparison full length.
    def process(tokens, logits):
        logits[:, list(eos_ids)] = -1e9
        return logits

    return process


def generate(model, tokenizer, prompt, cache=None, sampler=None):
    return [
        r.token
        for r in stream_generate(
            model,
            tokenizer,
            mx.array(prompt),
            max_tokens=MAX_TOKENS,
            prompt_cache=cache if cache is not None else make_prompt_cache(model),
            sampler=sampler,
            logits_processors=[no_eos(tokenizer.eos_token_ids)],
        )
    ]


class CountingModel:
    """Forwards to the model and counts the input tokens it is run on."""

    def __init__(self, model):
        self._model = model
        self.tokens_seen = 0

    def __call__(self, inputs, *args, **kwargs):
        self.tokens_seen += inputs.shape[1]
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def served(rpc, model, tokenizer, prompt, sampler=None):
    """What mlx_lm.server does per request: fetch, generate on the rest, insert."""
    counting = CountingModel(model)
    cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
    out = generate(counting, tokenizer, rest, cache, sampler)
    rpc.insert_cache(KEY, prompt + out, cache)
    return out, len(prompt) - len(rest), counting.tokens_seen


def prompts(tokenizer):
    base = tokenizer.encode(
        "You are a helpful assistant. Answer the question briefly and politely. "
        "Paris is the capital of France."
    )
    assert len(base) > 3 * PAGE_SIZE
    cut = 2 * PAGE_SIZE + 2  # inside the third page
    return {
        "cold": base,
        "extends": base + tokenizer.encode(" Berlin is the capital of Germany."),
        "diverges mid-page": base[:cut] + tokenizer.encode(" once upon a time, 1 2 3"),
        "equal": base,
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, PAGE_SIZE])
def test_greedy_token_identical_to_stock(loaded, arch, page_size):
    model, tokenizer = loaded(arch)
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=page_size, pool_tokens=1024))
    cases = prompts(tokenizer)
    for name, prompt in cases.items():
        expected = generate(model, tokenizer, prompt)
        got, cached, seen = served(rpc, model, tokenizer, prompt)
        assert got == expected, f"{arch} {name}: {got} != {expected}"
        # The model runs on exactly the tokens the cache did not hold (plus one step per
        # output: generate_step computes one token ahead).
        assert seen == len(prompt) - cached + MAX_TOKENS, name
        if name == "cold":
            assert cached == 0
        elif name == "diverges mid-page":
            assert cached == 2 * PAGE_SIZE + 2
        else:
            assert cached == len(prompt) - 1 if name == "equal" else cached >= len(cases["cold"])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_sampling_with_seed_matches_stock(loaded, arch):
    model, tokenizer = loaded(arch)
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PAGE_SIZE, pool_tokens=1024))
    sampler = make_sampler(temp=0.9, top_p=0.95)
    for prompt in prompts(tokenizer).values():
        mx.random.seed(7)
        expected = generate(model, tokenizer, prompt, sampler=sampler)
        mx.random.seed(7)
        got, _, _ = served(rpc, model, tokenizer, prompt, sampler)
        assert got == expected


def test_shared_prefix_is_stored_once(loaded):
    model, tokenizer = loaded("llama")
    pool = KVPool.for_model(model, page_size=PAGE_SIZE, pool_tokens=4096)
    rpc = RadixPromptCache(pool)
    prefix = (tokenizer.encode("You are a helpful assistant. ") * 16)[: 16 * PAGE_SIZE]
    P, suffix_len, n = len(prefix), 3 * PAGE_SIZE, 6
    used = []
    for i in range(n):
        suffix = [(7 * i + j) % 400 + 50 for j in range(suffix_len)]
        prompt = prefix + suffix
        cache, rest = rpc.fetch_nearest_cache(KEY, prompt)
        generate(model, tokenizer, rest, cache)
        rpc.insert_cache(KEY, prompt, cache)
        used.append(pool.used_bytes)
    per_token = pool.bytes_per_token
    assert used[0] == (P + suffix_len) * per_token
    # Every later prompt adds its own suffix only: P + N x suffix, not N x P.
    assert used[-1] == (P + n * suffix_len) * per_token
    assert rpc.nbytes == used[-1]
