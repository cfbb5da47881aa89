"""Paged K/V storage, addressed by slot.

Slot ``s`` of page ``p`` is row ``p * page_size + s`` of every layer. Consecutive
layers with the same K/V geometry share one key and one value array, laid out
``(layers * slots, kv_heads, head_dim)``, layer after layer: a decode step then
writes every layer's new token with one scatter per array (``write_layers``) instead
of two per layer, which on a GPU, where a small model's step is a few ms of mostly
graph building, is the difference between the engine trailing stock mlx-lm and
matching it. Rows are addressed with one flat index (``layer_row * slots + slot``):
indexing a ``(layers, slots, ...)`` array with an integer and an index array takes
MLX's two-index scatter, ~15x slower on the CPU (2.1 s against 0.13 s to write a
4,000-token prefill chunk into 30 layers).
An array stops growing at ``max_array_elements`` (2**31 - 1, or Metal's largest
buffer).

Writes go in place only while nothing else in the same lazy graph still reads the
old array (DESIGN.md section 4). Since an array spans layers, a forward pass must
not read the pool between two layers' writes: readers copy what they need out of
the pool (evaluated) before the pass writes, and nothing here keeps a second
reference to an array. On a GPU a second condition holds: no kernel that reads the old
array may still be running when the write is evaluated (``settle``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .allocator import OutOfPages, PageAllocator
from .budget import DeviceMemory, device_memory, pool_budget_bytes


class UnsupportedModel(Exception):
    """The model's cache layout cannot live in the pool; ``str()`` says why."""


@dataclass(frozen=True)
class LayerSpec:
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None = None  # sliding-window size; None for full attention

    def bytes_per_token(self, dtype: mx.Dtype) -> int:
        return self.kv_heads * (self.k_head_dim + self.v_head_dim) * dtype.size


class _ProbeCache:
    """Records the K/V shapes and dtype a layer produces; the graph is never evaluated."""

    def __init__(self):
        self.offset = 0
        self.seen = None

    def update_and_fetch(self, keys, values):
        self.seen = (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        return keys, values

    def make_mask(self, *args, **kwargs):
        return None


def inspect_model(model: nn.Module) -> tuple[list[LayerSpec], mx.Dtype]:
    """Per-layer K/V geometry and the KV dtype, read off one lazy forward pass.

    The dtype is the activations' (never a quantized weight's packed integer type),
    since it is what the attention layers actually hand to their cache.
    """
    windows = []
    for i, c in enumerate(make_prompt_cache(model)):
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(c.max_size)
        else:
            raise UnsupportedModel(
                f"layer {i} uses {type(c).__name__}"
                + (f"(keep={c.keep})" if isinstance(c, RotatingKVCache) else "")
                + "; the radix pool holds plain and sliding-window attention K/V only"
            )
    probes = [_ProbeCache() for _ in windows]
    model(mx.array([[0]], dtype=mx.int32), cache=probes)
    specs, dtypes = [], set()
    for i, (p, w) in enumerate(zip(probes, windows)):
        if p.seen is None:
            raise UnsupportedModel(f"layer {i} never wrote to its cache")
        heads, dk, dv, dtype = p.seen
        specs.append(LayerSpec(heads, dk, dv, w))
        dtypes.add(dtype)
    if len(dtypes) != 1:
        raise UnsupportedModel(f"layers produce K/V of several dtypes: {sorted(map(str, dtypes))}")
    return specs, dtypes.pop()


def model_nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def plan_pool_tokens(
    bytes_per_token: int,
    *,
    page_size: int,
    mem_fraction: float,
    model_bytes: int,
    memory: DeviceMemory,
) -> int:
    """Tokens the pool gets from ``memory``: whole pages, at least one."""
    budget = pool_budget_bytes(mem_fraction, model_bytes, memory)
    pages = budget // bytes_per_token // page_size
    if pages < 1:
        raise OutOfPages(
            f"no room for a KV pool: {memory.usable_bytes / 2**30:.2f} GiB usable "
            f"({memory.source}) x mem_fraction {mem_fraction} leaves "
            f"{budget / 2**30:.2f} GiB after the model; raise mem_fraction or set pool_tokens"
        )
    return pages * page_size


def _max_array_elements(dtype: mx.Dtype) -> int:
    limit = 2**31 - 1  # kernels index an array's elements with 32-bit offsets below this
    if mx.metal.is_available():
        buffer = mx.device_info().get("max_buffer_length")
        if buffer:
            limit = min(limit, int(buffer) // dtype.size)
    return limit


def layer_groups(specs: list[LayerSpec], slots: int, max_elements: int) -> list[list[int]]:
    """Runs of consecutive layers with the same K/V geometry, each within ``max_elements``."""

    def geometry(s: LayerSpec) -> tuple[int, int, int]:
        return s.kv_heads, s.k_head_dim, s.v_head_dim

    groups: list[list[int]] = []
    for layer, s in enumerate(specs):
        per_layer = slots * s.kv_heads * max(s.k_head_dim, s.v_head_dim)
        last = groups[-1] if groups else None
        if (
            last
            and geometry(specs[last[0]]) == geometry(s)
            and (len(last) + 1) * per_layer <= max_elements
        ):
            last.append(layer)
        else:
            groups.append([layer])
    return groups


class KVPool:
    def __init__(
        self,
        specs: list[LayerSpec],
        num_pages: int,
        page_size: int,
        dtype: mx.Dtype,
        max_array_elements: int | None = None,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.specs = specs
        self.page_size = page_size
        self.dtype = dtype
        self.allocator = PageAllocator(num_pages)
        slots = num_pages * page_size
        self.groups = layer_groups(specs, slots, max_array_elements or _max_array_elements(dtype))
        # layer -> (its group's arrays, the flat row of its slot 0 there)
        self._where = [
            (g, r * slots) for g, layers in enumerate(self.groups) for r in range(len(layers))
        ]
        self._bases = [
            mx.arange(len(layers), dtype=mx.int32)[:, None] * slots for layers in self.groups
        ]
        self.keys, self.values = [], []
        for layers in self.groups:
            s = specs[layers[0]]
            self.keys.append(mx.zeros((len(layers) * slots, s.kv_heads, s.k_head_dim), dtype))
            self.values.append(mx.zeros((len(layers) * slots, s.kv_heads, s.v_head_dim), dtype))
        mx.eval(self.keys, self.values, self._bases)
        # Called with a page count when the free list runs short; returns pages it freed.
        self.reclaim: Callable[[int], int] | None = None
        # Releases queued by finalizers of dropped page tables, run under the lock later:
        # a finalizer may fire on any thread, in the middle of anything.
        self._deferred: deque[Callable[[], None]] = deque()
        # Guards the allocator and whatever owns the pages (the radix tree): the
        # generation thread allocates while HTTP threads read statistics.
        self.lock = threading.RLock()
        # The stream of an evaluation that reads the pool and may still run (``reading``).
        self._reader: mx.Stream | None = None

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        *,
        page_size: int = 16,
        pool_tokens: int | None = None,
        mem_fraction: float = 0.4,
        memory: DeviceMemory | None = None,
    ) -> KVPool:
        """A pool for ``model``: ``pool_tokens`` if given, else sized from device memory."""
        specs, dtype = inspect_model(model)
        if pool_tokens is None:
            per_token = sum(s.bytes_per_token(dtype) for s in specs)
            pool_tokens = plan_pool_tokens(
                per_token,
                page_size=page_size,
                mem_fraction=mem_fraction,
                model_bytes=model_nbytes(model),
                memory=memory or device_memory(),
            )
        if pool_tokens < page_size:
            raise ValueError(f"pool_tokens must be >= page_size ({page_size}), got {pool_tokens}")
        return cls(specs, pool_tokens // page_size, page_size, dtype)

    # -- accounting --------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token(self.dtype) for s in self.specs)

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def used_bytes(self) -> int:
        self.run_deferred()
        return self.allocator.num_used * self.bytes_per_page

    # -- pages -------------------------------------------------------------------

    def defer(self, release: Callable[[], None]) -> None:
        self._deferred.append(release)

    def run_deferred(self) -> None:
        with self.lock:
            while self._deferred:
                self._deferred.popleft()()

    def alloc_pages(self, n: int) -> list[int]:
        with self.lock:
            self.run_deferred()
            short = n - self.allocator.num_free
            if short > 0 and self.reclaim is not None:
                self.reclaim(short)
            return self.allocator.alloc(n)

    def release_pages(self, pages: Iterable[int]) -> None:
        with self.lock:
            self.allocator.decref(pages)

    def slots_of(self, pages: list[int]) -> mx.array:
        ps = self.page_size
        return (
            mx.array(pages, dtype=mx.int32)[:, None] * ps + mx.arange(ps, dtype=mx.int32)
        ).reshape(-1)

    # -- data --------------------------------------------------------------------

    @property
    def arrays(self) -> list[mx.array]:
        """Every array of the pool: evaluate these to run pending writes."""
        return self.keys + self.values

    def reading(self) -> None:
        """An evaluation about to start reads the pool and may still run when the next
        write is evaluated: ``settle`` waits for it first."""
        self._reader = mx.default_stream(mx.default_device())

    def settle(self) -> None:
        """Wait for the evaluation ``reading`` announced, if any, so that the writes
        evaluated next update the pool in place.

        MLX's GPU backends keep a kernel's inputs alive until the kernel has run, so a
        scatter into an array that a running kernel reads cannot reuse its buffer: it
        copies the whole array. Shared-prefix decode reads the pool every step while
        mlx-lm already runs the next one. Measured on the H200 (a 4 GiB bfloat16 array, a
        32-row write each iteration while a gather from it still runs): 2.9 ms an iteration
        and 13-17 GiB peak, against 0.77 ms with a 128 MiB array; in process, Llama-3-8B's
        shape, 32 rows on a 2,048-token prefix, a decode step took 20.4 ms with a
        65,536-token pool (8.6 GB) and 16.6 ms with one just large enough.
        """
        if self._reader is not None:
            reader, self._reader = self._reader, None
            mx.synchronize(reader)

    def write_rows(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store ``(n, heads, dim)`` rows of one layer at ``n`` slots."""
        g, idx = self._index(layer, slots)
        self.keys[g][idx] = keys
        self.values[g][idx] = values

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store ``(1, heads, S, dim)`` K/V at ``S`` slots."""
        self.write_rows(layer, slots, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))

    def write_layers(
        self,
        slots: mx.array,
        keys: Mapping[int, mx.array],
        values: Mapping[int, mx.array],
        rows: mx.array | None = None,
    ) -> None:
        """Store every layer's new K/V at the same slots: one scatter per array.

        ``keys[layer]`` holds ``m`` rows of ``(heads, dim)`` in any shape of that size
        (a decode step's ``(batch, heads, 1, dim)``); ``rows`` picks which of the ``m``
        go to ``slots``, all of them when None.
        """
        for g, layers in enumerate(self.groups):
            idx = (self._bases[g] + slots).reshape(-1)
            for new, arrays in ((keys, self.keys), (values, self.values)):
                row = arrays[g].shape[1:]
                x = mx.stack([new[i] for i in layers])
                if rows is not None:
                    x = x.reshape(len(layers), -1, *row)[:, rows]
                arrays[g][idx] = x.reshape(-1, *row)

    def _index(self, layer: int, slots: mx.array) -> tuple[int, mx.array]:
        g, base = self._where[layer]
        return g, (slots + base if base else slots)

    def rows(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """One layer's K/V rows at ``slots``, ``(n, heads, dim)``."""
        g, idx = self._index(layer, slots)
        return self.keys[g][idx], self.values[g][idx]

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K/V at ``slots`` as contiguous ``(1, heads, L, dim)``, the layout attention expects.

        Made contiguous here: on the CPU, attention over the strided transpose is ~2.5x
        slower than the copy (0.2 ms vs 1.2 ms extra per layer at 1k tokens, 3 KV heads).
        """
        k, v = self.rows(layer, slots)
        return mx.contiguous(k.transpose(1, 0, 2))[None], mx.contiguous(v.transpose(1, 0, 2))[None]

    def copy(self, src: mx.array, dst: mx.array) -> None:
        """Copy slots ``src`` to ``dst`` in every layer.

        The gathered rows are evaluated before the scatter so that the scatter is
        the only reader of each array and can update it in place.
        """
        self.settle()
        src, dst = ([(b + i).reshape(-1) for b in self._bases] for i in (src, dst))
        rows = [(k[i], v[i]) for k, v, i in zip(self.keys, self.values, src)]
        mx.eval(rows)
        for g, (k, v) in enumerate(rows):
            self.keys[g][dst[g]] = k
            self.values[g][dst[g]] = v
