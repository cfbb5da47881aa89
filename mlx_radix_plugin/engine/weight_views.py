"""Linear layers' transposed weights made once, not in every step's graph.

``mlx.nn.Linear`` computes ``x @ weight.T``. The transpose is a view (no kernel), but it is a
node of every step's graph: built in Python, then walked and evaluated at launch. Llama-3-8B
has 7 a layer, 224 of the ~2,170 nodes of a decode step (tools/step_profile.py, H200); on
MLX's CUDA backend a step's launch costs about 5 us a node. Evaluated once, the view shares
the weight's memory (no copy) and enters each step as an input: the matmul reads the same
strides as before, so its result is stock's, bitwise.

Only layers whose class is exactly ``nn.Linear`` change (quantized layers pass a transpose
flag instead, and subclasses such as LoRA's may compute otherwise). A layer whose weight is
replaced (``model.update``, ``load_weights``) makes its view again at its next call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class ViewedLinear(nn.Linear):
    """``nn.Linear`` with its transposed weight kept as an evaluated view."""

    def __call__(self, x: mx.array) -> mx.array:
        weight, attrs = self["weight"], self.__dict__
        if attrs.get("_viewed") is not weight:
            # Kept outside the module's parameters (a dict entry would be one); the view
            # shares the weight's memory.
            attrs["_viewed"], attrs["_transposed"] = weight, weight.T
            mx.eval(attrs["_transposed"])
        transposed = attrs["_transposed"]
        if "bias" in self:
            return mx.addmm(self["bias"], x, transposed)
        return x @ transposed


def install(model: nn.Module) -> int:
    """Give every ``nn.Linear`` layer of ``model`` its view; returns how many changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = ViewedLinear
            changed += 1
    return changed


def uninstall(model: nn.Module) -> None:
    """Back to ``nn.Linear`` (benchmarks set stock beside the engine in one process)."""
    for _, module in model.named_modules():
        if type(module) is ViewedLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_viewed", None)
            module.__dict__.pop("_transposed", None)
