"""mlx-lm's ``CacheList``: a layer whose cache has parts (falcon_h1: a Mamba-2 state and
attention K/V side by side; baichuan_m1, deepseek_v32, longcat_flash).

The pool and the snapshots work on parts: a model's caches are read as one flat list, a
``CacheList``'s parts in its place, so a part's index is its entry in the pool's layout
(K/V to pages, recurrent state to snapshots) whatever holds it. A request's caches are
built flat and nested back into the model's shape. mlx-lm batches a ``CacheList`` part by
part (``CacheList.merge``), so each part batches as it would on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.models.cache import CacheList


def flat(caches: Sequence[Any]) -> list[Any]:
    """The caches with each ``CacheList`` replaced by its parts."""
    return [p for c in caches for p in (c.caches if isinstance(c, CacheList) else (c,))]


def shape_of(caches: Sequence[Any]) -> tuple[int, ...]:
    """Per entry, how many parts its ``CacheList`` has; 0 for a cache of its own."""
    return tuple(len(c.caches) if isinstance(c, CacheList) else 0 for c in caches)


def map_parts(fn: Callable[[Any], Any], caches: Sequence[Any]) -> list[Any]:
    """``caches`` with ``fn`` applied to each part, in the same shape."""
    return nested([fn(c) for c in flat(caches)], shape_of(caches))


def nested(parts: Sequence[Any], shape: Sequence[int]) -> list[Any]:
    """``parts`` (a flat list) in the model's ``shape`` (``shape_of``)."""
    out, i = [], 0
    for n in shape:
        out.append(CacheList(*parts[i : i + n]) if n else parts[i])
        i += n or 1
    if i != len(parts):
        raise ValueError(f"{len(parts)} caches do not fill a model's shape of {i}")
    return out
