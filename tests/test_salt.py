"""``cache_salt``: requests with different salts never share cached prompts (salt.py)."""

import pytest
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm_hooks.salt import MAX_SALT_CHARS, BadSalt, SaltedPromptCache, parse_salt, salted
from test_generation import KEY, generate

from mlx_radix_plugin import KVPool, RadixPromptCache

PROMPT = list(range(10, 42))


@pytest.mark.parametrize("body", [{}, {"cache_salt": None}, "not a dict", None])
def test_no_salt_is_none(body):
    assert parse_salt(body) is None


@pytest.mark.parametrize(
    "salt, shown",
    [(42, "got 42"), ("", "got a string of 0 characters"), (["a"], "got ['a']"),
     ("x" * (MAX_SALT_CHARS + 1), f"got a string of {MAX_SALT_CHARS + 1} characters")],
)  # fmt: skip
def test_a_bad_salt_is_named(salt, shown):
    with pytest.raises(BadSalt) as e:
        parse_salt({"cache_salt": salt})
    assert str(e.value) == (
        f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters, {shown}"
    )


def test_salted_keys_extend_the_model_key():
    assert salted(KEY, "a") == (*KEY, ("cache_salt", "a"))
    assert salted("model", "a") == ("model", ("cache_salt", "a"))
    assert salted(KEY, "a") != salted(KEY, "b")


def serve(cache, model, tok, prompt, salt=None, extra=()):
    """A request as mlx_lm.server runs it: salt set after tokenizing, fetch, generate,
    insert under the model's key; returns the tokens the cache held."""
    cache.salt = salt
    caches, rest = cache.fetch_nearest_cache(KEY, prompt)
    if caches is None:  # stock's cache on a miss
        caches = make_prompt_cache(model)
    out = generate(model, tok, rest, caches)
    cache.insert_cache(KEY, [*prompt, *extra, *out], caches)
    return len(prompt) - len(rest)


@pytest.fixture(params=["stock", "radix"])
def salted_cache(request, loaded):
    model, tok = loaded("llama")
    if request.param == "stock":
        inner = LRUPromptCache(max_size=10)
    else:
        inner = RadixPromptCache(KVPool.for_model(model, page_size=4, pool_tokens=1024))
    return SaltedPromptCache(inner), model, tok


def test_only_requests_with_the_same_salt_share(salted_cache):
    cache, model, tok = salted_cache
    assert serve(cache, model, tok, PROMPT, salt="tenant-a") == 0
    # Another salt, or none, finds nothing of it; the same salt finds it.
    assert serve(cache, model, tok, PROMPT + [50], salt="tenant-b") == 0
    assert serve(cache, model, tok, PROMPT + [51]) == 0
    assert serve(cache, model, tok, PROMPT + [52], salt="tenant-a") >= 28
    # Unsalted requests share with each other as before, and salted ones do not see them.
    assert serve(cache, model, tok, PROMPT + [51, 60]) >= 28
    assert serve(cache, model, tok, PROMPT + [51, 61], salt="tenant-c") == 0


def test_the_salt_is_for_the_next_fetch_only(salted_cache):
    cache, model, tok = salted_cache
    serve(cache, model, tok, PROMPT, salt="tenant-a")
    assert cache.salt is None
    assert serve(cache, model, tok, PROMPT + [50]) == 0


def test_a_segment_of_a_salted_prompt_is_filed_under_its_salt():
    """mlx_lm.server also inserts the cache at a chat segment's end (a prefix of the prompt)."""
    calls = []

    class Inner:
        def fetch_nearest_cache(self, key, tokens):
            return None, list(tokens)

        def insert_cache(self, key, tokens, prompt_cache, *, cache_type="assistant"):
            calls.append((key, list(tokens), cache_type))

    cache = SaltedPromptCache(Inner())
    cache.salt = "a"
    cache.fetch_nearest_cache(KEY, PROMPT)
    cache.insert_cache(KEY, PROMPT[:8], [], cache_type="system")
    cache.insert_cache(KEY, [*PROMPT, 99], [])
    cache.insert_cache(KEY, [7, 8, 9], [])  # another request's, unsalted
    assert calls == [
        (salted(KEY, "a"), PROMPT[:8], "system"),
        (salted(KEY, "a"), [*PROMPT, 99], "assistant"),
        (KEY, [7, 8, 9], "assistant"),
    ]


def test_one_prompt_under_two_salts_files_its_answers_for_no_one():
    """A salted request's prompt sent again without a salt: the first's answer was filed
    unsalted, and a later unsalted request found it (cached_tokens: 1024 on the stock
    cache's path). Whose answer an insert is is not known there: it is cached for no one."""
    calls = []

    class Inner:
        def fetch_nearest_cache(self, key, tokens):
            return None, list(tokens)

        def insert_cache(self, key, tokens, prompt_cache, *, cache_type="assistant"):
            calls.append((key, list(tokens)))

    cache = SaltedPromptCache(Inner())
    cache.salt = "tenant-a"
    cache.fetch_nearest_cache(KEY, PROMPT)
    cache.fetch_nearest_cache(KEY, PROMPT)  # unsalted, the same prompt
    cache.insert_cache(KEY, [*PROMPT, 99], [])  # tenant-a's answer, or the other's
    cache.insert_cache(KEY, PROMPT[:8], [])  # a segment both sent
    cache.salt = "tenant-a"
    cache.fetch_nearest_cache(KEY, [*PROMPT, 5])
    cache.insert_cache(KEY, [*PROMPT, 5, 98], [])  # its prompt came with one salt
    assert calls[0][1] == PROMPT[:8]
    assert calls[1:] == [(salted(KEY, "tenant-a"), [*PROMPT, 5, 98])]
