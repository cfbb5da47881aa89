"""``cache_salt``: requests with different salts never share cached prompt state.

A prefix cache answers sooner for a prompt another client already sent, and
``usage.prompt_tokens_details.cached_tokens`` says by how much, so one client can learn what
another asked (the known prefix-cache side channel). As in vLLM, a completion or chat
request may carry ``cache_salt``, a string: the server's prompt cache is then looked up and
filled under the model's key and the salt, so only requests with the same salt share.
Requests without one share with each other as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

MAX_SALT_CHARS = 1024
# Prompts remembered to file what the server inserts after a request (its prompt and answer,
# or a segment of its prompt) under the request's salt; see ``SaltedPromptCache._salt_of``.
REMEMBERED_PROMPTS = 4096


class BadSalt(ValueError):
    """``cache_salt`` is not a non-empty string of at most ``MAX_SALT_CHARS`` characters."""


def parse_salt(body: Any) -> str | None:
    """The request body's ``cache_salt``, or None; raises ``BadSalt`` naming a bad value."""
    if not isinstance(body, dict) or body.get("cache_salt") is None:
        return None
    salt = body["cache_salt"]
    if not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS:
        shown = repr(salt) if not isinstance(salt, str) else f"a string of {len(salt)} characters"
        raise BadSalt(
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters, "
            f"got {shown}"
        )
    return salt


def salted(model_key: Hashable, salt: str) -> tuple:
    """The cache key of ``model_key`` for requests carrying ``salt``."""
    base = model_key if isinstance(model_key, tuple) else (model_key,)
    return (*base, ("cache_salt", salt))


class SaltedPromptCache:
    """The server's prompt cache (stock's ``LRUPromptCache`` or a plugin's), looked up and
    filled under ``salted(model key, salt)`` for requests that carry a salt.

    The generation thread sets ``salt`` when it has tokenized a request, right before it
    fetches that request's cache. Inserts come later, with the model's key only: each is
    filed under the salt of the request it came from, found among the prompts fetched since
    the first salted one (``_salt_of``).
    """

    def __init__(self, cache: Any):
        self.cache = cache
        self.salt: str | None = None
        # Prompts fetched, newest last, with the salts they came with (None: unsalted); kept
        # only once a salted request has come, so a server whose clients send none pays
        # nothing. One prompt may come with several salts: remembering only the last filed a
        # salted request's answer under the unsalted one's key, for everyone to find.
        self._prompts: OrderedDict[tuple[int, ...], set[str | None]] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def __len__(self) -> int:
        return len(self.cache)

    def fetch_nearest_cache(self, model_key: Hashable, tokens: Sequence[int]):
        salt, self.salt = self.salt, None
        if salt is not None or self._prompts:
            prompt = tuple(tokens)
            self._prompts.setdefault(prompt, set()).add(salt)
            self._prompts.move_to_end(prompt)
            while len(self._prompts) > REMEMBERED_PROMPTS:
                self._prompts.popitem(last=False)
        key = model_key if salt is None else salted(model_key, salt)
        return self.cache.fetch_nearest_cache(key, tokens)

    def insert_cache(
        self, model_key: Hashable, tokens: Sequence[int], prompt_cache, *, cache_type="assistant"
    ):
        salt = self._salt_of(tokens)
        if salt is _UNKNOWN:
            return None  # whose it is is not known: cached for no one rather than the wrong one
        if salt is not None:
            model_key = salted(model_key, salt)
        return self.cache.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)

    def _salt_of(self, tokens: Sequence[int]):
        """The salt of the request ``tokens`` came from: the one with the longest prompt that
        ``tokens`` extend (a finished request's prompt and answer), else the newest whose
        prompt they begin (a segment of its prompt); ``_UNKNOWN`` where that prompt came
        with several salts, its answer being one of theirs. A segment that several requests'
        prompts begin with was sent by each of them, so filing it under any of their salts
        tells no one anything they did not send."""
        if not self._prompts:
            return None
        tokens = tuple(tokens)
        longest, begun = None, None
        for prompt, salts in reversed(self._prompts.items()):
            if len(prompt) <= len(tokens):
                if tokens[: len(prompt)] == prompt and (
                    longest is None or len(prompt) > len(longest[0])
                ):
                    longest = (prompt, salts)
            elif begun is None and prompt[: len(tokens)] == tokens:
                begun = (prompt, salts)
        if longest is not None:
            salts = longest[1]
            return next(iter(salts)) if len(salts) == 1 else _UNKNOWN
        return None if begun is None else next(iter(begun[1]))


_UNKNOWN = object()  # a prompt and answer whose request's salt is not known
