"""A shared decode pass through the paged kernel as one compiled call a step.

compiled_layers.py compiles each layer's halves around the cache and the attention; between
them the engine's Python runs for every layer of every step: the attention's routing, the
paged kernel's inputs and call, the cache's staging. On an H100 (Llama-3.2-1B's shape, one
row, shared path) that Python took about 45 us a layer of the step's 0.73 ms of building: the
halves' calls 7 us each, the kernel's compiled call 8.5, the Python around it 8.7, the cache's
update 2.8 (results: ``host_parts_1b_h100_2026_12_07``). Where every layer of a pass reads the
pool through the paged kernel, nothing between the layers needs the host: here the model's
layer loop (the embedding, each layer's halves and kernel call, the final norm) is one
compiled call, which hands back each layer's K/V of the step for the caches to stage as
their ``update_and_fetch`` would (``shared_batch.stage_pass``).

A compiled call replays the graph it traced for its key: the batch's rows, its page tables'
width (a bucket of pages: shared_batch.PAGED_BUCKET) and chunks, and the layers' places in
the pool. A key is traced the second time a pass meets it (the first runs layer by layer), so
a batch whose rows change at every step (a burst being admitted) traces nothing; the traces
of the ``MAX_PASSES`` keys met last are kept.

The same kernels and operations as layer by layer, in the same order: on the CPU (the
kernel's MLX-ops form) the logits are the layer-by-layer pass's bit for bit
(tests/test_compiled_pass.py). Only Llama, Qwen2 and Qwen3 models whose every layer decodes
through compiled halves, under ``decode.compile = "pass"``.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..cache.shared_batch import stage_pass
from . import attention, compiled_layers, paged_attention

MAX_PASSES = 64
REPEATS = 2  # passes of a key before it is traced


class _PassLoop:
    """A model's layer loop that runs a paged shared decode pass as one compiled call."""

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None):
        if input_embeddings is None and cache and inputs.ndim == 2 and inputs.shape[1] == 1:
            plan = attention.paged_pass(cache, self.__dict__["_geometry"])
            if plan is not None:
                out = self._compiled_pass(inputs, cache, plan)
                if out is not None:
                    return out
        return super().__call__(inputs, cache, input_embeddings)

    def _compiled_pass(self, inputs: mx.array, caches: list, plan: attention.PagedPass):
        """The pass as its key's compiled call; None the first times a key is met."""
        key = (plan.key, inputs.shape[0], plan.arrays[0].shape[1])
        passes = self.__dict__["_passes"]
        call = passes.pop(key, None)
        if call is None:
            seen = self.__dict__["_seen"]
            seen[key] = seen.pop(key, 0) + 1
            if len(seen) > MAX_PASSES:
                del seen[next(iter(seen))]
            if seen[key] < REPEATS:
                return None
            del seen[key]
            call = mx.compile(partial(_pass, self, plan.key))
        passes[key] = call  # most recently used last
        if len(passes) > MAX_PASSES:
            del passes[next(iter(passes))]
        h, keys, values = call(inputs, plan.positions, *plan.arrays)
        stage_pass(caches, keys, values)
        return h


def _pass(loop: nn.Module, layout: tuple, tokens: mx.array, positions: mx.array, *arrays):
    """The layer loop of one paged pass: ``layout`` is ``PagedPass.key``, ``arrays`` its
    ``arrays``. Returns the final norm's output and each layer's K and V of the step."""
    kernel, chunks, page_size, places, windows = layout
    attend = paged_attention.paged_attention if kernel else paged_attention.reference
    tables = arrays[:chunks]
    h = loop.embed_tokens(tokens)
    keys, values = [], []
    for layer, (group, base), window in zip(loop.layers, places, windows):
        before, after, _ = layer.__dict__["_compiled"]
        q, k, v = before(h, positions)
        parts = []
        for i, pages in enumerate(tables):
            at = chunks + 2 * (group * chunks + i)  # the group's arrays in chunk i
            kp, vp = arrays[at], arrays[at + 1]
            # For the kernel, ``kp``/``vp`` are the arrays' one-row views, as its ``heads``.
            parts.append(paged_attention.PagedLayer(
                kp, vp, base, pages, positions, page_size, layer.self_attn.scale, window,
                heads=(kp, vp) if kernel else None,
            ))  # fmt: skip
        h = after(h, attend(q, k, v, parts))
        keys.append(k)
        values.append(v)
    return loop.norm(h), keys, values


_PASS_LOOPS = {
    loop: type(f"PassCompiled{loop.__name__}", (_PassLoop, loop), {})
    for loop in compiled_layers.LOOPS
}
_STOCK = {compiled: loop for loop, compiled in _PASS_LOOPS.items()}


def _geometry(layers) -> tuple | None:
    """The paged kernel's geometry (dtype, query heads, KV heads, key and value dims) if
    every layer's attention has the same one and the same scale; else None."""
    shapes = set()
    for layer in layers:
        attn = layer.self_attn
        dim = round(attn.scale**-2)
        shapes.add((layer.input_layernorm.weight.dtype, attn.n_heads, attn.n_kv_heads, dim, dim))
    return shapes.pop() if len(shapes) == 1 else None


def install(model: nn.Module) -> int:
    """Run ``model``'s paged shared decode passes as compiled calls, in each layer loop whose
    every layer compiled_layers.install has compiled; returns how many loops."""
    loops = 0
    for _, module in model.named_modules():
        compiled = _PASS_LOOPS.get(type(module))
        if compiled is None or getattr(module, "pipeline_size", 1) != 1:
            continue
        layers = module.layers
        if not layers or not all("_compiled" in m.__dict__ for m in layers):
            continue
        geometry = _geometry(layers)
        if geometry is None:
            continue
        module.__dict__.update(_geometry=geometry, _passes=OrderedDict(), _seen={})
        module.__class__ = compiled
        loops += 1
    return loops


def enabled(mode: str) -> bool:
    """``decode.compile = "pass"``. ``auto`` does not take it: on an H100 it was faster in
    process (one row 1.83 against 2.13 ms a step) but not through the server, within the
    rounds' spread (results: compiled_pass_1b_h100_2026_12_07)."""
    return compiled_layers.enabled(mode) and mode == "pass"


def uninstall(model: nn.Module) -> None:
    """mlx-lm's loop classes again."""
    for _, module in model.named_modules():
        stock = _STOCK.get(type(module))
        if stock is not None:
            module.__class__ = stock
            for name in ("_geometry", "_passes", "_seen"):
                module.__dict__.pop(name, None)
