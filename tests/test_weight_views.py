"""Linear layers' transposes made once (engine/weight_views.py): stock's results, bitwise,
with fewer nodes a step."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_radix_plugin.engine import weight_views
from mlx_radix_plugin.tools.step_profile import graph_ops


def forward(model, tokens):
    return model(mx.array([tokens]), cache=make_prompt_cache(model))


def test_logits_are_stocks_bitwise_with_fewer_transposes(loaded):
    model, tok = loaded("llama")
    tokens = tok.encode("Once upon a time there was")
    weight_views.uninstall(model)
    stock = forward(model, tokens)
    stock_ops = graph_ops([stock])
    mx.eval(stock)
    linear = sum(type(m) is nn.Linear for _, m in model.named_modules())
    try:
        assert weight_views.install(model) == linear > 0
        viewed = forward(model, tokens)
        viewed_ops = graph_ops([viewed])
        assert mx.array_equal(stock, viewed).item()
        assert viewed_ops["Transpose"] == stock_ops["Transpose"] - linear
        # The views share the weights' memory: the model's parameters are what they were.
        names = {k for k, _ in nn.utils.tree_flatten(model.parameters())}
        assert not any("_transposed" in k or "_viewed" in k for k in names)
    finally:
        weight_views.uninstall(model)
    assert all(type(m) is not weight_views.ViewedLinear for _, m in model.named_modules())


def test_a_replaced_weight_gets_a_new_view():
    layer = nn.Linear(8, 4)
    weight_views.install(layer)
    x = mx.random.normal((2, 8))
    mx.eval(layer(x))
    layer.update({"weight": mx.zeros((4, 8))})
    assert mx.array_equal(layer(x), mx.broadcast_to(layer.bias, (2, 4))).item()


def test_other_linear_kinds_are_left_alone():
    class Scaled(nn.Linear):
        pass

    model = nn.Sequential(Scaled(4, 4), nn.QuantizedLinear(64, 64), nn.Linear(4, 4))
    assert weight_views.install(model) == 1
    assert type(model.layers[0]) is Scaled and type(model.layers[1]) is nn.QuantizedLinear
