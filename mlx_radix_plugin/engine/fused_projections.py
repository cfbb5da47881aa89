"""Sibling projections of one input computed as one matmul (q/k/v; an MLP's gate/up).

A decode step of Llama-3-8B's shape runs 7 matmuls a layer. On MLX's CUDA backend every
matmul of more than one row is a cuBLASLt call whose descriptor, layouts and heuristic MLX
builds again at each call, about 40 us of host time each: at 32 rows, 289 of them are most of
the step's 15 ms launch against 6 ms of kernels (docs/benchmarking.md, "Fused projections").
Fused, a Llama layer runs 4, and every device does fewer, larger matmuls (Metal encodes
fewer dispatches too).

Nothing in mlx-lm's model code changes. Each member layer keeps its own parameters, now
views of the rows of one concatenated weight (the memory is the same, not doubled), so the
model's parameters, its other paths and a fallback are what they were. The first member
called with an input computes all the group's outputs from it and keeps the others' for
their calls with that same input; a member called otherwise (a model that projects other
inputs, say) computes its own, and a group whose outputs go unused stops fusing.

Each output column is the same dot product as before, but a larger matmul may sum in
another order (a split K, another kernel): on the CPU the results measured bitwise stock's,
on CUDA they need not be. So it is a switch (``model.fuse_projections``, ``off``: stock's
matmuls), held to the fidelity tolerance by tests/test_fused_projections.py. ``auto`` is
on: fewer, larger matmuls cost no device more work, and each call saves host time on all of
them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import weight_views
from .weight_views import ViewedLinear

# Sibling names called with one input, in mlx-lm's models (phi3 and others fuse their own).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_QUANT_PARAMS = ("weight", "scales", "biases")


class _Group:
    """One fused weight and the outputs its last input produced for members yet to ask."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.quantized = isinstance(members[0], nn.QuantizedLinear)
        names = [n for n in _QUANT_PARAMS if _has(members[0], n)] if self.quantized else ["weight"]
        names += ["bias"] if _has(members[0], "bias") else []
        self.fused = {n: mx.concatenate([m[n] for m in members]) for n in names}
        mx.eval(self.fused)
        rows = [m["weight"].shape[0] for m in members]
        self.splits = [sum(rows[: i + 1]) for i in range(len(rows) - 1)]
        starts = [0, *self.splits]
        for m, a, n in zip(members, starts, rows):
            # Row slices of an evaluated array are views: the members share the fused memory.
            m.update({k: v[a : a + n] for k, v in self.fused.items()})
        mx.eval([m.parameters() for m in members])
        self.own = [tuple(m[k] for k in names) for m in members]
        self.names = names
        if not self.quantized:
            self.transposed = self.fused["weight"].T
            mx.eval(self.transposed)
        self.live = True
        self.input: mx.array | None = None
        self.pending: dict[int, mx.array] = {}

    def current(self) -> bool:
        """Whether every member still holds the views made here (``model.update`` may not)."""
        return all(
            all(m[k] is v for k, v in zip(self.names, own))
            for m, own in zip(self.members, self.own)
        )

    def compute(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.matmul(x), self.splits, axis=-1)

    def matmul(self, x: mx.array) -> mx.array:
        """Every member's output for ``x``, side by side in the last axis."""
        f = self.fused
        if self.quantized:
            m = self.members[0]
            y = mx.quantized_matmul(
                x,
                f["weight"],
                scales=f["scales"],
                biases=f.get("biases"),
                transpose=True,
                group_size=m.group_size,
                bits=m.bits,
                mode=m.mode,
            )
            if "bias" in f:
                y = y + f["bias"]
        elif "bias" in f:
            y = mx.addmm(f["bias"], x, self.transposed)
        else:
            y = x @ self.transposed
        return y

    def output(self, index: int, x: mx.array) -> mx.array | None:
        """Member ``index``'s output for ``x``, or None where it should compute its own."""
        if self.input is x and index in self.pending:
            out = self.pending.pop(index)
            if not self.pending:
                self.input = None
            return out
        if not self.live:
            return None
        if self.pending or not self.current():
            # Outputs computed for another input went unused, or a weight was replaced:
            # this group's calls do not follow the pattern fusing assumes.
            self.live, self.input, self.pending = False, None, {}
            return None
        outs = self.compute(x)
        self.input = x
        self.pending = {i: o for i, o in enumerate(outs) if i != index}
        return outs[index]


class _Member:
    """A fused group's member: its output from the group, else its own layer's."""

    def __call__(self, x: mx.array) -> mx.array:
        group, index = self.__dict__["_fused"]
        out = group.output(index, x)
        return super().__call__(x) if out is None else out


class FusedLinear(_Member, ViewedLinear):
    """A member of a fused group of ``nn.Linear`` layers."""


class FusedQuantizedLinear(_Member, nn.QuantizedLinear):
    """A member of a fused group of ``nn.QuantizedLinear`` layers."""


_FUSED = {
    nn.Linear: FusedLinear,
    ViewedLinear: FusedLinear,
    nn.QuantizedLinear: FusedQuantizedLinear,
}
_STOCK = {FusedLinear: nn.Linear, FusedQuantizedLinear: nn.QuantizedLinear}


def _has(module: nn.Module, name: str) -> bool:
    return module.get(name) is not None


def _fusable(members: list[nn.Module]) -> bool:
    first = members[0]
    kind = type(first)
    if kind not in _FUSED or any(type(m) is not kind for m in members):
        return False
    same = ["weight", "bias"]
    if kind is nn.QuantizedLinear:
        same += ["scales", "biases"]
        if any(
            (m.group_size, m.bits, m.mode) != (first.group_size, first.bits, first.mode)
            for m in members
        ):
            return False
    for name in same:
        have = [_has(m, name) for m in members]
        if any(have) != all(have):
            return False
        if all(have) and any(
            m[name].dtype != first[name].dtype or m[name].shape[1:] != first[name].shape[1:]
            for m in members
        ):
            return False
    return True


def install(model: nn.Module) -> int:
    """Fuse ``model``'s sibling projections; returns how many groups were fused."""
    fused = 0
    for _, module in model.named_modules():
        children = module.children()
        for names in GROUPS:
            members = [children[n] for n in names if isinstance(children.get(n), nn.Module)]
            if len(members) < 2 or not _fusable(members):
                continue
            group = _Group(members)
            for i, m in enumerate(members):
                # A view made before of a weight now replaced would keep its memory alive.
                m.__dict__.pop("_viewed", None)
                m.__dict__.pop("_transposed", None)
                m.__class__ = _FUSED[type(m)]
                # One attribute that is no setting: the model's fingerprint (the disk tier's
                # identity, memory/fingerprint.py) stays what it was.
                m.__dict__["_fused"] = (group, i)
            fused += 1
    if fused:
        mx.clear_cache()  # the members' former arrays, kept by MLX as free buffers
    return fused


def uninstall(model: nn.Module) -> None:
    """Back to stock's layer classes; the weights stay views with stock's values, so stock's
    results are unchanged (benchmarks set stock beside the engine in one process)."""
    for _, module in model.named_modules():
        stock = _STOCK.get(type(module))
        if stock is not None:
            module.__class__ = stock
            module.__dict__.pop("_fused", None)
            module.__dict__.pop("_viewed", None)
            module.__dict__.pop("_transposed", None)


def enabled(mode: str) -> bool:
    """``model.fuse_projections``: ``auto`` and ``on`` fuse."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"model.fuse_projections must be one of auto, on, off, got {mode!r}")
    return mode != "off"


def prepare(model: nn.Module, fuse: bool) -> int:
    """``model``'s layers as the plugin serves them: fused groups where ``fuse``, and every
    other ``nn.Linear`` with its transposed view; returns the groups fused."""
    groups = install(model) if fuse else 0
    weight_views.install(model)
    return groups


def restore(model: nn.Module) -> None:
    """Stock's layer classes again (a benchmark's stock runs beside the engine)."""
    uninstall(model)
    weight_views.uninstall(model)
