"""A fingerprint of a model: what decides whether K/V computed earlier, by another process,
can be used (the disk tier's identity).

Its weights: every parameter's name, shape and dtype, and its values: all of a small
tensor's, and an evenly spaced sample of 65,536 of a large one's. Hashing every byte costs
about 1.4 s a GB here (blake2b at 0.7 GB/s on this CPU): 23 s at each start for Llama-3-8B
in bfloat16. The sample changes with any retraining, fine-tune, fused adapter or
requantization, all of which change nearly every value; an edit of a few values of a large
tensor can escape it.

And its settings, which change K/V without changing a weight: what ``config.json`` puts in
the modules (RoPE's base and scaling, a norm's eps, attention's scale, a LoRA's scale) and
the arrays they derive from it (RoPE's frequencies, kept out of ``parameters()`` under a
leading underscore). Editing ``rope_scaling`` in ``config.json`` for a long context must not
serve the K/V computed without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

SAMPLE = 65536
# A module's own attributes that are MLX's bookkeeping, not the model's settings.
BOOKKEEPING = ("_no_grad", "_training")


def model_fingerprint(model: nn.Module) -> str:
    """A hex digest of ``model``'s parameters (names, shapes, dtypes, sampled values), its
    modules' settings and their private arrays."""
    arrays = [(name, a) for name, a in tree_flatten(model.parameters())]
    settings = {}
    for name, module in model.named_modules():
        settings[name] = {
            key: _plain(value)
            for key, value in sorted(vars(module).items())
            if key not in BOOKKEEPING and _plain(value) is not _SKIP
        }
        arrays += [
            (f"{name}.{key}", value)
            for key, value in module.items()
            if key.startswith("_") and isinstance(value, mx.array)
        ]
    arrays.sort(key=lambda kv: kv[0])
    samples = []
    for _, a in arrays:
        flat = a.reshape(-1)
        step = max(1, flat.size // SAMPLE)
        samples.append(mx.contiguous(flat[::step][:SAMPLE]).view(mx.uint8))
    mx.eval(samples)
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(settings, sort_keys=True).encode())
    for (name, a), sample in zip(arrays, samples):
        h.update(f"{name}|{a.shape}|{a.dtype}|".encode())
        h.update(np.asarray(sample).tobytes())
    return h.hexdigest()


_SKIP = object()


def _plain(value: Any) -> Any:
    """``value`` as JSON if it is a setting (numbers, strings, their lists and dicts, a
    dataclass of them such as ``ModelArgs``); ``_SKIP`` otherwise (functions, objects
    whose text would name an address)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _SKIP}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return _SKIP
