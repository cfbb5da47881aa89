"""A paged shared decode pass as one compiled call (engine/compiled_pass.py): the same
operations as layer by layer, so on the CPU (the paged kernel's MLX-ops form) the logits are
the layer-by-layer pass's bit for bit, for rows that start together, join and leave, over
one chunk of the pool or several; any other pass runs layer by layer."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from test_compiled_layers import COMPILED
from test_compiled_layers import served as layers_served
from test_shared_prefix import (
    assert_close_to_stock,
    engine_run,
    prefix_of,
    question,
    radix,
    stock_run,
    warm,
)

from mlx_radix_plugin.engine import attention, compiled_layers, compiled_pass


@contextlib.contextmanager
def served(model, whole: bool):
    """``model`` as the plugin serves it with its layers compiled, its paged passes compiled
    or not."""
    compiled_pass.uninstall(model)
    with layers_served(model, compiled=True):
        loops = compiled_pass.install(model) if whole else 0
        try:
            yield loops
        finally:
            compiled_pass.uninstall(model)


@pytest.fixture
def traced(monkeypatch):
    """How many times a pass was traced (``_pass`` ran at trace time) and replayed."""
    counts = {"traced": 0, "run": 0}
    trace = compiled_pass._pass

    def counted(*args):
        counts["traced"] += 1
        return trace(*args)

    monkeypatch.setattr(compiled_pass, "_pass", counted)
    stage = compiled_pass.stage_pass

    def staged(*args):
        counts["run"] += 1
        return stage(*args)

    monkeypatch.setattr(compiled_pass, "stage_pass", staged)
    return counts


def assert_bitwise(got, expected):
    tokens, logits = got
    plain_tokens, plain_logits = expected
    assert tokens == plain_tokens
    for i, steps in plain_logits.items():
        assert len(logits[i]) == len(steps)
        assert all(mx.array_equal(a, b).item() for a, b in zip(logits[i], steps)), i


def run(model, tok, whole: bool):
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)] + [tok.encode("Once upon a time")]
    with served(model, whole) as loops:
        rpc = radix(model)
        warm(model, rpc, [prefix])
        got = engine_run(model, tok, rpc, prompts, [12, 6, 12, 9], late=(2,))
    return loops, prompts, got


@pytest.mark.parametrize("arch", sorted(COMPILED))
def test_a_compiled_pass_gives_the_layer_by_layer_logits_bit_for_bit(
    loaded, arch, chunking, traced, monkeypatch
):
    monkeypatch.setattr(attention, "VARIANT", "paged")
    model, tok = loaded(arch)
    loops, prompts, (tokens, logits, paths) = run(model, tok, whole=True)
    assert loops == 1 and traced["run"] > 0
    # A key is traced once it repeats, then replayed: rows joining and leaving change it.
    assert 0 < traced["traced"] < traced["run"]
    ran = traced["run"]
    _, _, (plain_tokens, plain_logits, plain_paths) = run(model, tok, whole=False)
    assert traced["run"] == ran  # not installed: every pass layer by layer
    assert paths == plain_paths
    assert_bitwise((tokens, logits), (plain_tokens, plain_logits))
    assert_close_to_stock((tokens, logits), stock_run(model, tok, prompts, [12, 6, 12, 9]))


@pytest.mark.parametrize("which", ["4-bit layers", "sliding windows"])
def test_quantized_and_windowed_llamas_pass_as_layer_by_layer(tmp_path, which, traced, monkeypatch):
    """Quantized projections keep the residual stream 3-D between the halves, and a layer
    with a sliding window reads only the positions in it: the pass's logits the
    layer-by-layer pass's bit for bit, and stock's tokens."""
    from mlx_lm import load
    from tiny_models import build_model

    monkeypatch.setattr(attention, "VARIANT", "paged")
    window = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    model, tok = load(str(build_model("llama", tmp_path, **(window if "window" in which else {}))))
    if "bit" in which:
        nn.quantize(model, group_size=32, bits=4)
    _, prompts, (tokens, logits, _) = run(model, tok, whole=True)
    assert traced["run"] > 0
    _, _, (plain_tokens, plain_logits, _) = run(model, tok, whole=False)
    assert_bitwise((tokens, logits), (plain_tokens, plain_logits))
    assert tokens == stock_run(model, tok, prompts, [12, 6, 12, 9])[0]


def test_passes_of_another_path_run_layer_by_layer(loaded, traced, monkeypatch):
    """The split variant (the CPU's own), and the exact path: no compiled pass."""
    model, tok = loaded("llama")
    monkeypatch.setattr(attention, "VARIANT", "split")
    for mode in ("on", "off"):
        with served(model, whole=True) as loops:
            rpc = radix(model)
            prefix = prefix_of(tok)
            warm(model, rpc, [prefix])
            prompts = [prefix + question(tok, i) for i in range(2)]
            engine_run(model, tok, rpc, prompts, [6, 6], mode=mode)
        assert loops == 1
    assert traced == {"traced": 0, "run": 0}


def test_the_passes_of_the_latest_keys_are_kept(loaded, traced, monkeypatch):
    """Rows join and leave, so the batch meets several keys: with room for one trace, each
    key met again after another is traced again, and one trace is held at the end."""
    monkeypatch.setattr(attention, "VARIANT", "paged")
    model, tok = loaded("llama")
    _, _, _ = run(model, tok, whole=True)
    kept_all = traced["traced"]
    monkeypatch.setattr(compiled_pass, "MAX_PASSES", 1)
    prefix = prefix_of(tok)
    prompts = [prefix + question(tok, i) for i in range(3)] + [tok.encode("Once upon a time")]
    with served(model, whole=True):
        rpc = radix(model)
        warm(model, rpc, [prefix])
        engine_run(model, tok, rpc, prompts, [12, 6, 12, 9], late=(2,))
        assert len(model.model.__dict__["_passes"]) == 1
    assert traced["traced"] - kept_all >= kept_all >= 2


def test_install_takes_loops_whose_layers_all_compiled_and_uninstall_restores(loaded):
    model, _ = loaded("llama")
    with served(model, whole=True) as loops:
        assert loops == 1 and type(model.model).__name__ == "PassCompiledLlamaModel"
        assert isinstance(model.model, llama.LlamaModel)
    assert type(model.model) is llama.LlamaModel
    compiled_layers.uninstall(model)
    assert compiled_pass.install(model) == 0  # layers not compiled: no pass
    assert type(model.model) is llama.LlamaModel


def test_only_pass_compiles_passes():
    assert compiled_pass.enabled("pass")
    assert not any(compiled_pass.enabled(m) for m in ("auto", "layers", "off"))
