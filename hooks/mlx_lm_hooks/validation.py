"""What a request's sampling may ask of a batch, checked before its row is made.

Every row of a batch runs in one step, so a value the step cannot take fails every request
in it: on main at 49e5ace a ``top_k`` above the vocabulary, a ``logit_bias`` on a token id the
model does not have (1e20, or 5,000 on a 1,024-token vocabulary: an out-of-bounds scatter) or
a NaN temperature was accepted, then failed the shared step, and every other stream of the
batch ended with ``the batch this request was in failed``. And 200,000 stop sequences held the
generation thread for 7.4 s building their matcher. Each request is checked here, on the
generation thread once its model is known and before its row exists
(``ResponseGenerator._tokenize``), for every route: a bad one is refused alone, with HTTP 400
naming the field, the value and what is accepted.
"""

from __future__ import annotations

import math

# Stop sequences a request may send, and characters each. Claude Code and Codex send none
# or a few; matching them costs the generation thread about 37 us a sequence (200,000 took
# 7.4 s), so 256 stay under 10 ms.
MAX_STOP_SEQUENCES = 256
MAX_STOP_CHARS = 1024


class InvalidSampling(ValueError):
    """A sampling setting no batch can run; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def vocab_size(model) -> int | None:
    """Token ids the model scores, from its config (None where the config does not say)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if not isinstance(size, int):
        text = getattr(args, "text_config", None)
        size = text.get("vocab_size") if isinstance(text, dict) else None
    return size if isinstance(size, int) and size > 0 else None


def check_sampling(args, vocab: int | None, names: dict[str, str] | None = None) -> None:
    """Refuse (``InvalidSampling``) what ``args`` (mlx_lm.server's ``GenerationArguments``)
    asks that no step could run on a model of ``vocab`` token ids. ``names``: the route's
    name for a field where it differs (the Messages API's ``stop_sequences``)."""
    names = names or {}
    s, logits = args.sampling, args.logits
    for field, value, low, high in (
        ("temperature", s.temperature, 0.0, None),
        ("top_p", s.top_p, 0.0, 1.0),
        ("min_p", s.min_p, 0.0, 1.0),
        ("xtc_probability", s.xtc_probability, 0.0, 1.0),
        ("xtc_threshold", s.xtc_threshold, 0.0, 1.0),
        ("repetition_penalty", logits.repetition_penalty, 0.0, None),
        ("presence_penalty", logits.presence_penalty, None, None),
        ("frequency_penalty", logits.frequency_penalty, None, None),
    ):
        _finite(names.get(field, field), value, low, high)
    # mlx-lm's top-k sampler takes fewer than the vocabulary (``apply_top_k``).
    if vocab is not None and not 0 <= s.top_k < vocab:
        raise InvalidSampling(
            names.get("top_k", "top_k"),
            f"must be between 0 (off) and {vocab - 1} (the model has {vocab} token ids), "
            f"got {s.top_k}",
        )
    bias = logits.logit_bias or {}
    name = names.get("logit_bias", "logit_bias")
    for token, value in bias.items():
        if vocab is not None and not 0 <= token < vocab:
            raise InvalidSampling(
                name, f"token id {token} is not one of the model's ids, 0 to {vocab - 1}"
            )
        if not math.isfinite(value):
            raise InvalidSampling(
                name, f"token {token}'s bias must be a finite number, got {value}"
            )
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidSampling(
            names.get("seed", "seed"), f"must be from 0 to 2**64 - 1 (MLX's seeds), got {seed}"
        )
    stop = args.stop_words or []
    name = names.get("stop", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidSampling(
            name, f"at most {MAX_STOP_SEQUENCES} stop sequences are accepted, got {len(stop)}"
        )
    for i, word in enumerate(stop):
        if not isinstance(word, str):
            raise InvalidSampling(f"{name}.{i}", f"must be a string, got {word!r}")
        if len(word) > MAX_STOP_CHARS:
            raise InvalidSampling(
                f"{name}.{i}",
                f"a stop sequence is at most {MAX_STOP_CHARS} characters, got {len(word)}",
            )


def check_prompt(prompt: list, vocab: int | None) -> None:
    """Refuse (``InvalidSampling``, on ``prompt``) a tokenized prompt whose items are not the
    model's token ids. A completion's ``prompt`` given as a list of strings tokenizes, in
    Hugging Face's tokenizers, to a list of lists: it reached the prompt cache's lookup and
    failed the step of every request in the batch (found by tests/test_fuzz.py)."""
    if not all(type(t) is int for t in prompt):
        bad = next(t for t in prompt if type(t) is not int)
        raise InvalidSampling(
            "prompt",
            f"must be one string; it tokenized to {type(bad).__name__} items, not token ids",
        )
    if vocab is not None and not 0 <= min(prompt) <= max(prompt) < vocab:
        raise InvalidSampling(
            "prompt",
            f"token ids must be from 0 to {vocab - 1} (the model's), "
            f"got {min(prompt)} to {max(prompt)}",
        )


def _finite(name: str, value, low: float | None, high: float | None) -> None:
    if (
        not math.isfinite(value)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        if low is not None and high is not None:
            accepted = f"a number from {low:g} to {high:g}"
        elif low is not None:
            accepted = f"a finite number of at least {low:g}"
        else:
            accepted = "a finite number"
        raise InvalidSampling(name, f"must be {accepted}, got {value}")
