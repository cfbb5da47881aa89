"""A decode step's layers as two compiled calls each, around the cache and the attention.

A decode step's device work on a small model is a millisecond or less, and the host's work
building its graph sets the pace: mlx-lm's layer makes about twenty MLX calls from Python
(the norm, the projections, reshapes, RoPE, the residuals, the MLP), each some microseconds
of the host's time. Here a layer of mlx-lm's Llama, Qwen2 or Qwen3 classes (and of the models
built from them: Mistral's is Llama's) decodes as ``mx.compile``'d calls: what comes before the
cache (the norm, q/k/v, their reshapes and RoPE at the rows' offsets) and what comes after the
attention (the output projection, the residuals, the MLP); the cache's update and the attention
call stay the engine's, in Python, as before. A compiled call replays the graph it traced, once
for each batch size.

The compiled graphs compute what the layer's own code does, in its order, less the operations
that only move data (``_parts``): on the CPU the logits are stock's bit for bit
(tests/test_compiled_layers.py). The path is taken for
one new token a row with the offsets of the rows an MLX array (the engine's batch caches),
where a traced graph stays valid from step to step; anything else runs mlx-lm's code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3

MODES = ("auto", "layers", "pass", "off")

# Layer classes whose decode compiles, with the module whose attention call site the engine
# routes (engine/attention.py patches each module's name) and their attention and MLP classes:
# each attention reshapes, (Qwen3) normalizes q and k per head, transposes and applies RoPE in
# this order, and each block is ``h = x + attn(norm(x)); h + mlp(norm(h))``.
LAYERS = {
    llama.TransformerBlock: (llama, llama.Attention, llama.MLP),
    qwen2.TransformerBlock: (qwen2, qwen2.Attention, qwen2.MLP),
    qwen3.TransformerBlock: (qwen3, qwen3.Attention, qwen3.MLP),
}


def _parts(layer: nn.Module, flat_out: bool) -> tuple:
    """The layer's two halves for one new token a row, compiled (each traced once a batch
    size).

    One token a row lets the halves skip operations that move nothing: a row's heads as
    ``(B, heads, 1, dim)`` are in the order of its ``(B, 1, heads, dim)``, so a reshape
    replaces reshape-and-transpose for q, k, v and the attention's output; and a matmul of
    a 3-D input is a flatten, the 2-D matmul and an unflatten, so unquantized projections
    take the rows 2-D. The same kernels run on the same values, in 9 fewer operations a Llama
    layer (a 16-layer step of one row on the CPU: 1,306 to 1,161). Between two such layers
    (``flat_out``) the residual stream stays ``(B, hidden)``: 3 reshapes a layer fewer.

    Where q, k and v are one fused matmul (fused_projections.py) of heads of one size and
    nothing acts on q and k apart before RoPE (Qwen3 normalizes each), RoPE is one call on
    all the matmul's heads, v's too, whose rotated copy goes unused: RoPE rotates each
    element by its position and dimension alone, so q and k are the values two calls give,
    in one kernel and one split where two kernels, a split and three reshapes were."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    flat = _flat(layer)

    joint = _joint_qkv(attn) if flat and q_norm is None else None

    def before(x: mx.array, offset: mx.array):
        B = x.shape[0]
        h = layer.input_layernorm(x)
        if flat and h.ndim == 3:
            h = h.reshape(B, -1)
        if joint is not None:
            qkv = joint.matmul(h).reshape(B, heads + 2 * kv_heads, 1, -1)
            q, k, _ = mx.split(attn.rope(qkv, offset=offset), [heads, heads + kv_heads], axis=1)
            return q, k, qkv[:, heads + kv_heads :]
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q, k = q.reshape(B, heads, 1, -1), k.reshape(B, kv_heads, 1, -1)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        v = v.reshape(B, kv_heads, 1, -1)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    def after(x: mx.array, attended: mx.array):
        B = x.shape[0]
        if flat:
            h = (x if x.ndim == 2 else x.reshape(B, -1)) + attn.o_proj(attended.reshape(B, -1))
            out = h + mlp(layer.post_attention_layernorm(h))
            return out if flat_out else out.reshape(B, 1, -1)
        h = x + attn.o_proj(attended.reshape(B, 1, -1))
        return h + mlp(layer.post_attention_layernorm(h))

    return mx.compile(before), mx.compile(after), flat_out and flat


def _flat(layer: nn.Module) -> bool:
    """Whether the layer's projections take the rows 2-D: a quantized matmul's kernel may be
    chosen by the rows' layout, so a layer with one keeps their shape."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *mlp.children().values()]
    return not any(isinstance(m, nn.QuantizedLinear) for m in projections)


def _joint_qkv(attn: nn.Module):
    """The fused group of ``attn``'s q, k and v projections, in that order and of heads of
    one size; else None."""
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    fused = [m.__dict__.get("_fused") for m in members]
    if None in fused or fused[0][0].quantized or any(f[0] is not fused[0][0] for f in fused):
        return None
    if [f[1] for f in fused] != [0, 1, 2] or len(fused[0][0].members) != 3:
        return None
    sizes = [m.weight.shape[0] for m in members]
    dim = sizes[0] // attn.n_heads
    if sizes != [attn.n_heads * dim, attn.n_kv_heads * dim, attn.n_kv_heads * dim]:
        return None
    return fused[0][0]


class _Compiled:
    """A layer that decodes through its compiled halves where it can, else as its class."""

    module = llama  # where its attention call site is looked up, at each call

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        offset = getattr(cache, "offset", None)
        if x.ndim == 2:  # the layer before's residual stream, one token a row
            if not isinstance(offset, mx.array):
                return super().__call__(x[:, None], mask, cache)
        elif x.shape[1] != 1 or not isinstance(offset, mx.array):
            return super().__call__(x, mask, cache)
        before, after, _ = self.__dict__["_compiled"]
        queries, keys, values = before(x, offset)
        keys, values = cache.update_and_fetch(keys, values)
        attended = self.module.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.self_attn.scale, mask=mask
        )
        return after(x, attended)


_COMPILED = {
    block: type(
        f"Compiled{module.__name__.rsplit('.', 1)[1].title()}Block",
        (_Compiled, block),
        {"module": module},
    )
    for block, (module, _, _) in LAYERS.items()
}
_STOCK = {compiled: block for block, compiled in _COMPILED.items()}


def _compilable(module: nn.Module) -> bool:
    classes = LAYERS.get(type(module))
    return classes is not None and (type(module.self_attn), type(module.mlp)) == classes[1:]


# Models whose layer loop only hands each layer's output to the next (mlx-lm's own, for the
# classes of ``LAYERS``; Qwen2's over a pipeline's layers, of one process here): a layer
# followed by another of its list may hand it the residual stream 2-D.
LOOPS = (llama.LlamaModel, qwen2.Qwen2Model, qwen3.Qwen3Model)


def _followed(model: nn.Module) -> set[int]:
    """ids of the layers whose output goes only to the next layer of the same loop, where
    every layer of it takes its rows 2-D."""
    followed = set()
    for _, module in model.named_modules():
        if isinstance(module, LOOPS) and getattr(module, "pipeline_size", 1) == 1:
            layers = module.layers
            if all(_compilable(m) and _flat(m) for m in layers):
                followed.update(id(m) for m in layers[:-1])
    return followed


def install(model: nn.Module) -> int:
    """Compile the decode of ``model``'s layers of ``LAYERS``; returns how many. Call it after
    the layers' weights are final (fused_projections.prepare): the traced graphs hold them."""
    layers = 0
    followed = _followed(model)
    for _, module in model.named_modules():
        if _compilable(module):
            module.__dict__["_compiled"] = _parts(module, id(module) in followed)
            module.__class__ = _COMPILED[type(module)]
            layers += 1
    return layers


def uninstall(model: nn.Module) -> None:
    """mlx-lm's layer classes again (a benchmark's stock runs beside the engine)."""
    for _, module in model.named_modules():
        stock = _STOCK.get(type(module))
        if stock is not None:
            module.__class__ = stock
            module.__dict__.pop("_compiled", None)


def enabled(mode: str) -> bool:
    """``decode.compile``: all but ``off`` compile the layers (``pass`` a paged shared pass
    whole as well: compiled_pass.py)."""
    if mode not in MODES:
        raise ValueError(f"decode.compile must be one of {', '.join(MODES)}, got {mode!r}")
    return mode != "off"
