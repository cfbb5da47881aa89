"""Sibling projections fused (engine/fused_projections.py): fewer matmuls, no more memory,
float32 logits within the fidelity tolerance of stock's and stock's greedy tokens, through a
forward pass and through the engine."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from test_shared_prefix import (
    assert_close_to_stock,
    engine_run,
    prefix_of,
    question,
    radix,
    stock_run,
    warm,
)
from tiny_models import ARCHS, HYBRID_ARCHS

from mlx_radix_plugin.engine import fused_projections
from mlx_radix_plugin.engine.attention import FIDELITY_TOLERANCE
from mlx_radix_plugin.tools.step_profile import graph_ops

MATMULS = ("Matmul", "AddMM", "QuantizedMatmul")


@contextlib.contextmanager
def fused(model):
    try:
        yield fused_projections.prepare(model, fuse=True)
    finally:
        fused_projections.restore(model)


def prefill_and_decode(model, tokens):
    """Logits of a prefill and two decode steps, and the graph's matmuls."""
    cache = make_prompt_cache(model)
    outs = [model(mx.array([tokens]), cache=cache)]
    for t in (5, 9):
        outs.append(model(mx.array([[t]]), cache=cache))
    ops = graph_ops(outs)
    mx.eval(outs)
    return [o.astype(mx.float32) for o in outs], sum(ops.get(k, 0) for k in MATMULS)


def assert_within_tolerance(got, expected):
    for a, b in zip(got, expected):
        assert mx.abs(a - b).max().item() <= FIDELITY_TOLERANCE * mx.abs(b).max().item()
        assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item()


def check_model(model, tokens) -> int:
    """Fused against stock on ``model``; returns the groups fused."""
    stock, stock_matmuls = prefill_and_decode(model, tokens)
    with fused(model) as groups:
        got, matmuls = prefill_and_decode(model, tokens)
        again, _ = prefill_and_decode(model, tokens)  # the groups' stash left clean
        members = sum(len(g.members) for g in groups_of(model))
    assert_within_tolerance(got, stock)
    assert_within_tolerance(again, stock)
    # Three passes, each with one matmul a group where its members had one each.
    assert matmuls == stock_matmuls - 3 * (members - groups)
    restored, _ = prefill_and_decode(model, tokens)
    assert all(mx.array_equal(a, b).item() for a, b in zip(restored, stock))
    return groups


def groups_of(model) -> list:
    found = {id(f[0]): f[0] for _, m in model.named_modules() if (f := m.__dict__.get("_fused"))}
    return list(found.values())


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_logits_within_tolerance_with_fewer_matmuls(loaded, arch):
    model, tok = loaded(arch)
    groups = check_model(model, tok.encode("Once upon a time there was a fox"))
    # phi3 computes q, k and v in one projection of its own; every other model has groups.
    assert (groups == 0) == (arch == "phi3")


def test_layers_viewed_before_fusing_keep_no_old_weight(model_dirs):
    from mlx_radix_plugin.engine import weight_views

    model, tok = load(str(model_dirs["llama"]))
    weight_views.install(model)
    mx.eval(prefill_and_decode(model, tok.encode("Once upon a time"))[0])
    with fused(model) as groups:
        members = [m for g in groups_of(model) for m in g.members]
        assert groups == 4 and len(members) == 10
        assert not any("_transposed" in m.__dict__ for m in members)


def test_the_models_fingerprint_is_unchanged(model_dirs):
    """The disk tier's identity: fusing changes no weight, so pages computed either way are
    one model's."""
    from mlx_radix_plugin.memory.fingerprint import model_fingerprint

    model, _ = load(str(model_dirs["llama"]))
    before = model_fingerprint(model)
    with fused(model):
        assert model_fingerprint(model) == before


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's q/k/v carry biases
def test_quantized_layers_fuse_too(model_dirs, arch):
    model, tok = load(str(model_dirs[arch]))
    nn.quantize(model, group_size=32, bits=4)
    assert check_model(model, tok.encode("Once upon a time there was a fox")) > 0
    assert {type(m) for _, m in model.named_modules()} >= {nn.QuantizedLinear}


def test_the_fused_weights_take_no_more_memory(model_dirs):
    model, _ = load(str(model_dirs["llama"]))
    mx.eval(model.parameters())
    before = mx.get_active_memory()
    with fused(model) as groups:
        mx.eval(model.parameters())
        assert groups == 4
        # The members' parameters are views of the fused arrays: what the model held.
        assert mx.get_active_memory() <= before
        names = {k for k, _ in nn.utils.tree_flatten(model.parameters())}
        assert not any("fused" in k for k in names)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_engine_answers_as_stock(loaded, arch, mode):
    model, tok = loaded(arch)
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)] + [tok.encode("Once upon a time")]
    max_tokens = [8, 6, 8, 7]
    expected = stock_run(model, tok, prompts, max_tokens)
    with fused(model):
        rpc = radix(model)
        warm(model, rpc, [prefix])
        tokens, logits, paths = engine_run(model, tok, rpc, prompts, max_tokens, mode=mode)
    assert_close_to_stock((tokens, logits), expected)
    assert ("shared" in paths) == (mode == "on")


class Attention(nn.Module):
    def __init__(self, same_input=True):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, n, bias=False) for n in (8, 4, 4))
        self.same_input = same_input

    def __call__(self, x):
        y = x if self.same_input else x + 1
        return mx.concatenate([self.q_proj(x), self.k_proj(y), self.v_proj(y)], axis=-1)


def test_a_member_projecting_another_input_computes_its_own():
    layer = Attention(same_input=False)
    x = mx.random.normal((2, 3, 8))
    expected = layer(x)
    assert fused_projections.prepare(layer, fuse=True) == 1
    (group,) = groups_of(layer)
    for _ in range(3):
        assert mx.allclose(layer(x), expected, atol=1e-6).item()
    # The outputs computed for q's input went unused once: the group stopped fusing.
    assert not group.live and not group.pending


def test_a_replaced_weight_is_used_and_the_group_stops_fusing():
    layer = Attention()
    x = mx.random.normal((2, 3, 8))
    fused_projections.prepare(layer, fuse=True)
    (group,) = groups_of(layer)
    mx.eval(layer(x))
    assert group.live
    layer.k_proj.update({"weight": mx.zeros((4, 8))})
    q, v = layer.q_proj.weight, layer.v_proj.weight
    expected = mx.concatenate([x @ q.T, mx.zeros((2, 3, 4)), x @ v.T], axis=-1)
    assert mx.allclose(layer(x), expected, atol=1e-6).item()
    assert not group.live


def test_off_leaves_stocks_matmuls_and_bad_values_are_named():
    layer = Attention()
    assert fused_projections.prepare(layer, fuse=fused_projections.enabled("off")) == 0
    assert type(layer.q_proj).__name__ == "ViewedLinear"
    assert fused_projections.enabled("auto") and fused_projections.enabled("on")
    with pytest.raises(ValueError, match="must be one of auto, on, off, got 'yes'"):
        fused_projections.enabled("yes")
