"""Reading an agent request's fields: each reader names the field, by its path, and what it
accepts, in the error it raises (``ApiError``, which each API renders in its own shape)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mlx_lm_hooks.salt import BadSalt, parse_salt

IMAGE_PLACEHOLDER = "[an image: this model reads text only]"
# JSON kinds of fields a local model has no use for, as the readers of ``unused`` name them.
KINDS: dict[str, tuple[type, ...]] = {
    "an object": (dict,),
    "a string": (str,),
    "true or false": (bool,),
    "a list": (list,),
}


class ApiError(Exception):
    """A request the API answers with an error of its own shape; ``param`` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status = status
        self.param = param
        self.retry_after: int | None = None  # seconds, for a 503's Retry-After
        self.kind = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            503: "overloaded_error",
        }.get(status, "api_error")


def bad(param: str, message: str) -> ApiError:
    """HTTP 400 naming the field: ``param`` is its path (``messages.2.content.0.type``)."""
    return ApiError(400, f"{param}: {message}", param)


def model_of(body: object) -> str:
    """The request's ``model``, once the body is known to be a JSON object."""
    if not isinstance(body, dict):
        raise bad("body", f"must be a JSON object, got {type(body).__name__}")
    return nonempty(body.get("model"), "model")


def nonempty(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(param, f"must be a non-empty string, got {value!r}")
    return value


def number(body: dict, name: str, low: float, high: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        limit = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise bad(name, f"must be {limit}, got {value!r}")
    return float(value)


def integer(body: dict, name: str, low: int, required: bool = False) -> int | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad(name, "is required: an integer")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(name, f"must be an integer of at least {low}, got {value!r}")
    return value


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


def strings(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad(name, f"must be a list of non-empty strings, got {value!r}")
    return list(value)


def text_of(
    value: Any,
    param: str,
    text_types: tuple[str, ...],
    others: Mapping[str, Callable[[dict, str], str]] | None = None,
) -> str:
    """A string, or the text of a list of text parts (``{"type": "text", "text": ...}``);
    ``others``: part types read by a function of their own (the part, its path) to text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(param, f"must be a string or a list of text blocks, got {value!r}")
    out = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if others and kind in others:
            out.append(others[kind](part, f"{param}.{i}"))
            continue
        if kind not in text_types or not isinstance(part.get("text"), str):
            accepted = " or ".join(text_types)
            if others:
                accepted += ", or " + " or ".join(others)
            raise bad(
                f"{param}.{i}",
                f"must be a text block ({accepted} with a string 'text'), got {part!r}",
            )
        out.append(part["text"])
    return "".join(out)


def image_placeholder(part: dict, param: str) -> str:
    """An image in a tool's result, for a model that reads text: a tool's output stays in an
    agent's history, so refusing it would refuse every later turn of the session."""
    return IMAGE_PLACEHOLDER


def logit_bias(body: dict) -> dict[int, float] | None:
    """``logit_bias``, as chat completions take it (token id -> bias): an extension of both
    APIs, as ``cache_salt`` is, so that one benchmark can ban EOS on every route."""
    value = body.get("logit_bias")
    if value is None:
        return None
    try:
        if not isinstance(value, dict):
            raise TypeError
        return {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise bad("logit_bias", f"must map token ids to numbers, got {value!r}") from None


def block_text(block: dict, param: str) -> str:
    """A text block's text."""
    if not isinstance(block.get("text"), str):
        raise bad(f"{param}.text", f"must be a string, got {block.get('text')!r}")
    return block["text"]


def salt_of(body: dict) -> str | None:
    try:
        return parse_salt(body)
    except BadSalt as e:
        raise ApiError(400, str(e), "cache_salt") from e


def unused(body: dict, fields: Mapping[str, str]) -> None:
    """Fields a local model has no use for (``metadata``, ``thinking`` modes, ``store``, ...):
    accepted, their JSON kind still checked. ``fields``: name -> a key of ``KINDS``."""
    for name, kind in fields.items():
        value = body.get(name)
        if value is not None and not isinstance(value, KINDS[kind]):
            raise bad(name, f"must be {kind}, got {value!r}")
