"""A decode step's Llama and Qwen layers as compiled calls (engine/compiled_layers.py): the same
operations, so the engine's logits are the uncompiled engine's bit for bit on the CPU (stock's
on the exact path), for rows that start together and rows that join; anything but one new
token a row over the engine's batch caches runs mlx-lm's own code."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from test_shared_prefix import engine_run, prefix_of, question, radix, stock_run, warm
from tiny_models import ARCHS

from mlx_radix_plugin.engine import compiled_layers, fused_projections
from mlx_radix_plugin.tools.step_profile import graph_ops

# The tiny models built on mlx-lm's Llama, Qwen2 and Qwen3 classes (mistral's are llama's):
# their layers compiled.
COMPILED = {"llama": 2, "mistral": 2, "qwen2": 2, "qwen3": 2}


@contextlib.contextmanager
def served(model, compiled: bool):
    """``model`` as the plugin serves it: projections fused, layers compiled or not (a model
    the fixtures share may come compiled by a plugin test)."""
    compiled_layers.uninstall(model)
    fused_projections.restore(model)
    fused_projections.prepare(model, fuse=True)
    layers = compiled_layers.install(model) if compiled else 0
    try:
        yield layers
    finally:
        compiled_layers.uninstall(model)
        fused_projections.restore(model)


def run(model, tok, mode, compiled):
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)] + [tok.encode("Once upon a time")]
    with served(model, compiled) as layers:
        rpc = radix(model)
        warm(model, rpc, [prefix])
        got = engine_run(model, tok, rpc, prompts, [8, 6, 8, 7], mode=mode, late=(2,))
    return layers, got


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["off", "on"])
def test_compiled_layers_give_the_engines_logits_bit_for_bit(loaded, arch, mode):
    model, tok = loaded(arch)
    layers, (tokens, logits, paths) = run(model, tok, mode, compiled=True)
    _, (plain_tokens, plain_logits, plain_paths) = run(model, tok, mode, compiled=False)
    assert layers == COMPILED.get(arch, 0)
    assert tokens == plain_tokens and paths == plain_paths
    for i, steps in plain_logits.items():
        assert len(logits[i]) == len(steps)
        for step, (a, b) in enumerate(zip(logits[i], steps)):
            assert mx.array_equal(a, b).item(), (i, step, mx.abs(a - b).max().item())
    if mode == "off" and layers:  # the exact path: stock's greedy tokens too
        prefix = prefix_of(tok)
        prompts = [prefix + question(tok, i) for i in range(3)] + [tok.encode("Once upon a time")]
        assert tokens == stock_run(model, tok, prompts, [8, 6, 8, 7])[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's q/k/v carry biases
@pytest.mark.parametrize("which", ["every layer", "one projection"])
def test_quantized_layers_compile_with_the_engines_logits_bit_for_bit(model_dirs, arch, which):
    """Quantized projections keep their inputs' shape in the compiled halves (a quantized
    matmul's kernel may follow it), and a layer before one with a quantized projection hands
    it its residual stream 3-D: logits the uncompiled engine's, bit for bit."""
    from mlx_lm import load

    model, tok = load(str(model_dirs[arch]))
    if which == "every layer":
        nn.quantize(model, group_size=32, bits=4)
    else:
        nn.quantize(
            model, 32, 4, class_predicate=lambda path, _: path.endswith("layers.1.self_attn.q_proj")
        )
    layers, (tokens, logits, _) = run(model, tok, "off", compiled=True)
    _, (plain_tokens, plain_logits, _) = run(model, tok, "off", compiled=False)
    assert layers == 2 and tokens == plain_tokens
    for i, steps in plain_logits.items():
        assert all(mx.array_equal(a, b).item() for a, b in zip(logits[i], steps))


def test_calls_that_are_no_batch_decode_step_run_mlx_lms_code_and_the_model_is_the_same(loaded):
    from mlx_radix_plugin.memory.fingerprint import model_fingerprint

    model, tok = loaded("llama")
    fingerprint = model_fingerprint(model)  # the disk tier's identity of the weights
    tokens = tok.encode("Once upon a time there was a fox")

    def logits_and_ops():
        cache = make_prompt_cache(model)  # mlx-lm's own cache: its offset is a number
        outs = [model(mx.array([tokens]), cache=cache), model(mx.array([[5]]), cache=cache)]
        ops = sum(graph_ops(outs).values())
        mx.eval(outs)
        return outs, ops

    with served(model, compiled=False):
        expected, plain_ops = logits_and_ops()
    with served(model, compiled=True) as layers:
        assert layers == 2 and all(
            type(layer).__name__ == "CompiledLlamaBlock" for layer in model.layers
        )
        got, ops = logits_and_ops()
        assert model_fingerprint(model) == fingerprint
    assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, expected))
    assert ops == plain_ops  # no compiled call ran


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_layer_but_the_last_hands_the_next_its_residual_stream_2d(loaded, arch):
    """Within mlx-lm's own layer loop a compiled layer's output goes only to the next one:
    it stays ``(B, hidden)``, and the last layer gives the model its ``(B, 1, hidden)``."""
    model, _ = loaded(arch)
    with served(model, compiled=True):
        layers = model.model.layers
        assert [layer._compiled[2] for layer in layers] == [True] * (len(layers) - 1) + [False]


def test_off_leaves_mlx_lms_layers_and_a_bad_value_is_named():
    assert all(compiled_layers.enabled(m) for m in ("auto", "layers", "pass"))
    assert not compiled_layers.enabled("off")
    with pytest.raises(ValueError, match="must be one of auto, layers, pass, off, got 'on'"):
        compiled_layers.enabled("on")
