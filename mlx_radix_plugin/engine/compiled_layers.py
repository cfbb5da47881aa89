"""A decode step's layers as two compiled calls each, around the cache and the attention.

A decode step's device work on a small model is a millisecond or less, and the host's work
building its graph sets the pace: mlx-lm's layer makes about twenty MLX calls from Python
(the norm, the projections, reshapes, RoPE, the residuals, the MLP), each some microseconds
of the host's time. Here a layer of mlx-lm's Llama classes (``mlx_lm.models.llama``: Llama,
and the models built from them) decodes as ``mx.compile``'d calls: what comes before the
cache (the norm, q/k/v, their reshapes and RoPE at the rows' offsets) and what comes after the
attention (the output projection, the residuals, the MLP); the cache's update and the attention
call stay the engine's, in Python, as before. A compiled call replays the graph it traced, once
for each batch size.

The compiled graphs hold the same operations in the same order as the layer's own code: on the
CPU the logits are stock's bit for bit (tests/test_compiled_layers.py). The path is taken for
one new token a row with the offsets of the rows an MLX array (the engine's batch caches),
where a traced graph stays valid from step to step; anything else runs mlx-lm's code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

MODES = ("auto", "off")


def _parts(layer: llama.TransformerBlock) -> tuple:
    """The layer's two halves, compiled (each traced once a batch size)."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = attn.n_heads, attn.n_kv_heads

    def before(x: mx.array, offset: mx.array):
        B, L, _ = x.shape
        h = layer.input_layernorm(x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    def after(x: mx.array, attended: mx.array):
        B, _, L, _ = attended.shape
        h = x + attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return h + mlp(layer.post_attention_layernorm(h))

    return mx.compile(before), mx.compile(after)


class CompiledBlock(llama.TransformerBlock):
    """mlx-lm's Llama layer, decoding through its compiled halves where it can."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        offset = getattr(cache, "offset", None)
        if x.shape[1] != 1 or not isinstance(offset, mx.array):
            return super().__call__(x, mask, cache)
        before, after = self.__dict__["_compiled"]
        queries, keys, values = before(x, offset)
        keys, values = cache.update_and_fetch(keys, values)
        # The call site the engine routes (engine/attention.py), looked up at each call.
        attended = llama.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.self_attn.scale, mask=mask
        )
        return after(x, attended)


def _compilable(module: nn.Module) -> bool:
    return (
        type(module) is llama.TransformerBlock
        and type(module.self_attn) is llama.Attention
        and type(module.mlp) is llama.MLP
    )


def install(model: nn.Module) -> int:
    """Compile the decode of ``model``'s Llama layers; returns how many. Call it after the
    layers' weights are final (fused_projections.prepare): the traced graphs hold them."""
    layers = 0
    for _, module in model.named_modules():
        if _compilable(module):
            module.__dict__["_compiled"] = _parts(module)
            module.__class__ = CompiledBlock
            layers += 1
    return layers


def uninstall(model: nn.Module) -> None:
    """mlx-lm's layer class again (a benchmark's stock runs beside the engine)."""
    for _, module in model.named_modules():
        if type(module) is CompiledBlock:
            module.__class__ = llama.TransformerBlock
            module.__dict__.pop("_compiled", None)


def enabled(mode: str) -> bool:
    """``decode.compile``: ``auto`` compiles."""
    if mode not in MODES:
        raise ValueError(f"decode.compile must be one of {', '.join(MODES)}, got {mode!r}")
    return mode != "off"
