"""Pinned prompts: prefixes prefilled ahead of their first request and never evicted.

A pin is a prompt file (its text as the model reads it) or a chat JSON (``{"messages":
[...], "tools": [...]}`` or a bare list of messages, through the model's chat template
without a generation prompt, so a conversation that begins with those messages begins
with these tokens). ``radix.pin`` lists files that are pinned when a model loads;
``POST /v1/cache/pin`` and ``DELETE /v1/cache/pin`` pin and unpin at run time.

Pinning runs on the generation thread, where the model runs: at a model load, and for
the HTTP routes when it is idle (the route waits for it, a while). The pinned pages are
locked in the tree (``RadixPromptCache.pin``) and count against the pool: pins may take at
most ``PIN_SHARE`` of its pages, so that requests always keep room.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

log = logging.getLogger("mlx_radix")

# How long a pin route waits for the generation thread before it answers 202 (queued).
ROUTE_WAIT_SECONDS = 120.0


class PinError(ValueError):
    """A pin that cannot be made: ``str()`` says why and what would be accepted."""


def prompt_tokens(tokenizer: Any, source: Any, where: str) -> list[int]:
    """The tokens of a pin: ``source`` is text, a list of chat messages, or a dict with
    ``prompt`` (text) or ``messages`` (and optionally ``tools``)."""
    if isinstance(source, dict):
        if isinstance(source.get("prompt"), str):
            source = source["prompt"]
        elif isinstance(source.get("messages"), list):
            return _chat_tokens(tokenizer, source["messages"], source.get("tools"), where)
        else:
            raise PinError(
                f"{where}: expected {{'prompt': text}} or {{'messages': [...]}}, "
                f"got keys {sorted(source)}"
            )
    if isinstance(source, list):
        return _chat_tokens(tokenizer, source, None, where)
    if not isinstance(source, str) or not source:
        raise PinError(f"{where}: expected non-empty text or chat messages")
    return list(tokenizer.encode(source))


def _chat_tokens(tokenizer: Any, messages: list, tools: Any, where: str) -> list[int]:
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise PinError(f"{where}: messages must be a non-empty list of {{'role', 'content'}}")
    try:
        tokens = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=False
        )
    except Exception as e:  # noqa: BLE001 - a template's errors are the input's fault
        raise PinError(f"{where}: the chat template refused these messages: {e}") from None
    return list(tokens)


def read_pin_file(tokenizer: Any, path: str | Path) -> list[int]:
    """A pin file's tokens: ``.json`` is chat JSON, anything else text."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise PinError(f"pin file {str(path)!r} cannot be read: {e.strerror or e}") from None
    if path.suffix == ".json":
        try:
            source = json.loads(text)
        except ValueError as e:
            raise PinError(f"pin file {str(path)!r} is not valid JSON: {e}") from None
    else:
        source = text
    tokens = prompt_tokens(tokenizer, source, f"pin file {str(path)!r}")
    if not tokens:
        raise PinError(f"pin file {str(path)!r} holds no tokens")
    return tokens


def prefill(radix: Any, model: Any, key: Hashable, tokens: Sequence[int], step: int) -> int:
    """Run ``model`` over what the pool lacks of ``tokens`` and commit it; returns the tokens
    that were cached already. Only the K/V (and recurrent states) are evaluated: the logits
    of a prefill nobody reads are never computed."""
    caches, rest = radix.fetch_nearest_cache(key, tokens)
    cached = len(tokens) - len(rest)
    for i in range(0, len(rest), step):
        model(mx.array(rest[i : i + step])[None], cache=caches)
        # A pipelined model (``--pipeline``) ties its send to the next rank to the last
        # layer's cache, ``cache[-1].keys``: evaluated here, or that rank waits for it.
        sent = getattr(caches[-1], "keys", None)
        states = [c.cache for c in caches if type(c) is ArraysCache]
        mx.eval(radix.pool.arrays, states, [] if sent is None else sent)
    radix.insert_cache(key, list(tokens), caches)
    radix.commit_finished()  # the server's commits may wait; a pin reads the tree next
    return cached


class Pins:
    """The pins of the model being served, and the pin requests waiting for the
    generation thread."""

    def __init__(self):
        self._jobs: deque[tuple[Callable[[], Any], dict]] = deque()
        self._lock = threading.Lock()

    def run_on_generation_thread(self, job: Callable[[], Any], wait: float) -> dict:
        """Queue ``job`` for ``run_jobs``; wait up to ``wait`` seconds for its result
        (``{"result": ...}``, ``{"error": PinError}``, or ``{}`` while it is queued)."""
        box: dict = {"done": threading.Event()}
        with self._lock:
            self._jobs.append((job, box))
        box["done"].wait(wait)
        return box

    def run_jobs(self) -> None:
        """Run the queued jobs (on the generation thread, while it is idle)."""
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job, box = self._jobs.popleft()
            try:
                box["result"] = job()
            except PinError as e:
                box["error"] = e
            except Exception as e:  # noqa: BLE001 - the generation thread must go on
                log.exception("a pin failed")
                box["error"] = PinError(f"the pin failed: {type(e).__name__}: {e}")
            box["done"].set()
