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
array may still be running when the write is evaluated (``settle``). On CUDA a shared decode
step's writes are stores in place instead, which need neither (``in_place.py``).

The pool is a ceiling, not an allocation: its storage comes in chunks of whole pages,
each chunk its own arrays, brought online when the free pages run out (before anything
is evicted) and given back once they have held nothing for a while (``trim``). Growing
allocates one chunk and touches no other array; reads and writes go to each chunk they
touch (``slots.py``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from . import in_place as _in_place
from . import ranks
from .allocator import PageAllocator
from .budget import (
    DeviceMemory,
    MemoryPlan,
    attention_bytes,
    buffer_reserve_bytes,
    chunk_bytes_for,
    device_memory,
    plan_memory,
    working_bytes,
)
from .cache_list import flat, nested, shape_of
from .freed_buffers import FreedBuffers
from .slots import HeadSlots, Slots
from .working_set import WorkingSet

# A chunk that has held no page this long is given back (the first chunk stays): long
# enough that a server between two bursts keeps its pages, short enough that memory an
# exceptional burst took goes back while the machine is in use for something else.
CHUNK_IDLE_SECONDS = 30.0


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
        # A pipelined model (mlx-lm's PipelineMixin, ``--pipeline``) ties its send to the
        # last layer's cache: ``cache[-1].keys = mx.depends(cache[-1].keys, h)``.
        self.keys = None

    def update_and_fetch(self, keys, values):
        self.seen = (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        self.keys = keys
        return keys, values

    def make_mask(self, *args, **kwargs):
        return None


def inspect_model(model: nn.Module) -> tuple[list[LayerSpec], mx.Dtype, tuple[int | None, ...]]:
    """Per-layer K/V geometry, the KV dtype and the layout, read off one lazy forward pass.

    The layout has an entry per entry of the model's cache, a ``CacheList``'s parts each an
    entry of their own (memory/cache_list.py): the pool layer that holds its K/V, or None
    for a recurrent layer (mlx-lm's ``ArraysCache``: conv and SSM states), whose state is
    kept as snapshots instead (snapshots.py). The dtype is the activations' (never a
    quantized weight's packed integer type), since it is what the attention layers
    actually hand to their cache.
    """
    windows, layout, probes = [], [], []
    caches = make_prompt_cache(model)
    for i, c in enumerate(flat(caches)):
        if type(c) is ArraysCache:
            layout.append(None)
            probes.append(c)  # the model's own: a recurrent layer reads its arrays
            continue
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(c.max_size)
        else:
            raise UnsupportedModel(
                f"layer {i} uses {type(c).__name__}"
                + (f"(keep={c.keep})" if isinstance(c, RotatingKVCache) else "")
                + "; the radix pool holds plain and sliding-window attention K/V and"
                " recurrent (ArraysCache) states only"
            )
        layout.append(len(windows) - 1)
        probes.append(_ProbeCache())
    if not windows:
        raise UnsupportedModel("the model has no attention layer: nothing for the pool to hold")
    model(mx.array([[0]], dtype=mx.int32), cache=nested(probes, shape_of(caches)))
    specs, dtypes = [], set()
    kv_probes = [p for p, where in zip(probes, layout) if where is not None]
    for i, (p, w) in enumerate(zip(kv_probes, windows)):
        if p.seen is None:
            raise UnsupportedModel(f"layer {layout.index(i)} never wrote to its cache")
        heads, dk, dv, dtype = p.seen
        specs.append(LayerSpec(heads, dk, dv, w))
        dtypes.add(dtype)
    if len(dtypes) != 1:
        raise UnsupportedModel(f"layers produce K/V of several dtypes: {sorted(map(str, dtypes))}")
    return specs, dtypes.pop(), tuple(layout)


def model_nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


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


def recurrent_row_bytes(model: nn.Module) -> int:
    """Bytes of one sequence's recurrent state, what a snapshot holds (``Snapshot``), read
    off a lazy forward pass that is never evaluated."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.int32), cache=caches)
    return sum(
        a.nbytes // a.shape[0]
        for c in flat(caches)
        if type(c) is ArraysCache
        for a in c.cache
        if a is not None
    )


class KVPool:
    def __init__(
        self,
        specs: list[LayerSpec],
        num_pages: int,
        page_size: int,
        dtype: mx.Dtype,
        max_array_elements: int | None = None,
        chunk_pages: int | None = None,
    ):
        """A pool of at most ``num_pages`` pages, in chunks of ``chunk_pages`` allocated on
        demand; without ``chunk_pages``, one chunk of every page, allocated now."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.specs = specs
        self.page_size = page_size
        self.dtype = dtype
        self.allocator = PageAllocator(num_pages, chunk_pages, online=False)
        self.chunk_slots = slots = self.allocator.chunk_pages * page_size
        self.groups = layer_groups(specs, slots, max_array_elements or _max_array_elements(dtype))
        # layer -> (its group's arrays, the flat row of its slot 0 there), the same in
        # every chunk
        self._where = [
            (g, r * slots) for g, layers in enumerate(self.groups) for r in range(len(layers))
        ]
        self._bases = [
            mx.arange(len(layers), dtype=mx.int32)[:, None] * slots for layers in self.groups
        ]
        mx.eval(self._bases)
        # Each chunk's arrays, one key and one value array a group; None while offline.
        self._chunks: list[tuple[list[mx.array], list[mx.array]] | None] = [
            None
        ] * self.allocator.num_chunks
        self._empty_since: dict[int, float] = {}
        self.chunks_grown = 0
        self.chunks_freed = 0
        # Called with a page count when the free list runs short and the pool is at its
        # ceiling; returns pages it freed.
        self.reclaim: Callable[[int], int] | None = None
        # Releases queued by finalizers of dropped page tables, run under the lock later:
        # a finalizer may fire on any thread, in the middle of anything.
        self._deferred: deque[Callable[[], None]] = deque()
        # Guards the allocator and whatever owns the pages (the radix tree): the
        # generation thread allocates while HTTP threads read statistics.
        self.lock = threading.RLock()
        # The stream of an evaluation that reads the pool and may still run (``reading``).
        self._reader: mx.Stream | None = None
        # Whether a scatter into the pool was built since the last ``settle``.
        self._scattered = False
        # In-place stores of a decode step not yet launched (in_place.py): the step takes them.
        self._marks: list[mx.array] = []
        self.plan: MemoryPlan | None = None  # how for_model sized it
        # Per entry of the model's cache (a CacheList's parts each one), the pool layer
        # holding its K/V, or None for a recurrent layer (inspect_model); one pool layer an
        # entry unless for_model says.
        self.layout: tuple[int | None, ...] = tuple(range(len(specs)))
        # How the model nests those entries (memory/cache_list.py): all plain by default.
        self.cache_shape: tuple[int, ...] = (0,) * len(specs)
        self.state_sizes: dict[int, int] = {}  # recurrent entry -> its ArraysCache's arrays
        self.snapshot_budget = 0  # bytes for the recurrent-state snapshots (snapshots.py)
        self.snapshot_row_bytes = 0  # one snapshot's (recurrent_row_bytes)
        # What holds K/V outside the pool (batch buffers, private copies): objects with a
        # ``buffer_nbytes``, counted in ``buffer_bytes`` while they live.
        self._buffers: weakref.WeakSet = weakref.WeakSet()
        # Whether prompt batches read cached K/V from here layer by layer instead of
        # filling a batch buffer (set by the engine: engine/prefill_path.py).
        self.prefill_from_pool = False
        # Whether such a batch's rows read a prefix they share once a layer: "auto", "on"
        # or "off" (cache/grouped_prefill.py; set with the above).
        self.prefill_shared = "off"
        # Prompt passes over the pool so far, by how their rows read it (paged_batch.py).
        self.prefill_passes = {"grouped": 0, "per_row": 0}
        # What a prompt pass reading the pool may hold in temporaries between evaluations
        # (its layers' gathered context and scores; paged_batch.py), and the query heads a
        # layer's scores have (engine/prefill_path.py). None: no bound.
        self.prefill_working_bytes: int | None = None
        self.query_heads: int | None = None
        # How a prompt pass attends (``prefill.attention``: engine/prompt_attention.py) and
        # what one layer's attention may hold in scores (None: no bound).
        self.prefill_attention = "auto"
        self.attention_bytes: int | None = None
        # Layer -> whether its last call in a pass over the pool attended through cuDNN's
        # causal call, which holds no scores, only the rows' K/V copied (prompt_attention.py).
        self.prompt_attention_fused: dict[int, bool] = {}
        # ``decode.attention``: a decode step none of whose rows is padded attends without a
        # mask (cache/batch.py); the engine sets it.
        self.unmasked_decode = False
        # What each token of a prompt pass holds besides a layer's context and scores: its
        # activations through the layer and every layer's staged K/V (engine/prefill_path.py).
        self.prefill_token_bytes = 0
        # The server's bound on MLX's cache of freed buffers (mx.set_cache_limit), if it
        # sets one: a prompt pass then leaves the cache as it is (engine/prefill_path.py),
        # and a decode call starts with room in it (freed_buffers.py).
        self.freed_buffers: FreedBuffers | None = None
        # The server's measure of each engine call's working memory, and MLX's memory limit
        # from the plan (working_set.py); None outside the server.
        self.working_set: WorkingSet | None = None
        if chunk_pages is None:
            self._grow()

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        *,
        page_size: int = 16,
        pool_tokens: int | None = None,
        mem_fraction: float = 0.0,
        memory: DeviceMemory | None = None,
        max_batch_size: int = 32,
        prefill_step_size: int = 2048,
        chunk_bytes: int | None = None,
        snapshot_bytes: int | None = None,
    ) -> KVPool:
        """A pool for ``model`` that grows to ``pool_tokens`` tokens if given, else to the
        ceiling ``plan_memory`` gives it on ``memory`` (``plan`` says how); its chunks of
        about ``chunk_bytes`` (default: ``chunk_bytes_for`` the ceiling) come as needed.

        A hybrid model's recurrent-state snapshots get ``snapshot_bytes`` of their own
        (``snapshot_budget``); by default a quarter of what the plan gives the pool, or a
        third of the pages' bytes on top of a pool sized in tokens."""
        if pool_tokens is not None and pool_tokens < page_size:
            raise ValueError(f"pool_tokens must be >= page_size ({page_size}), got {pool_tokens}")
        specs, dtype, layout = inspect_model(model)
        per_token = sum(s.bytes_per_token(dtype) for s in specs)
        caches = make_prompt_cache(model)
        state_sizes = {i: len(c.cache) for i, c in enumerate(flat(caches)) if layout[i] is None}
        row_bytes = recurrent_row_bytes(model) if state_sizes else 0
        reserve = buffer_reserve_bytes(per_token, max_batch_size)
        plan = plan_memory(
            memory or device_memory(),
            model_bytes=model_nbytes(model),
            working=working_bytes(model, per_token, max_batch_size, prefill_step_size, row_bytes),
            kv_bytes_per_token=per_token,
            mem_fraction=mem_fraction,
            pool_tokens=pool_tokens or 0,
            buffer_reserve=reserve,
        )
        page_bytes = per_token * page_size
        pages_bytes = plan.pool_bytes
        if state_sizes:
            # Snapshots are far larger than pages, with a budget of their own (snapshots.py).
            if snapshot_bytes is None:
                snapshot_bytes = plan.pool_bytes // (3 if pool_tokens else 4)
            if not pool_tokens:
                pages_bytes = max(page_bytes, plan.pool_bytes - snapshot_bytes)
        pages = max(1, pages_bytes // page_bytes)
        chunk_bytes = chunk_bytes or chunk_bytes_for(pages * page_bytes, per_token)
        chunks = -(-pages // max(1, chunk_bytes // page_bytes))
        pool = cls(specs, pages // chunks * chunks, page_size, dtype, chunk_pages=pages // chunks)
        pool.plan = plan
        # The plan's reserve for K/V outside the pool, which a prefill reading the pool holds
        # no buffers in, is its temporaries' bound: of it, ``attention_bytes`` for a layer's
        # attention scores (engine/prompt_attention.py), more where its floor is more; the
        # rest holds the layer's gathered context, its activations and the pass's staged K/V.
        pool.attention_bytes = attention_bytes(per_token, max_batch_size)
        pool.prefill_working_bytes = reserve + pool.attention_bytes - reserve // 2
        pool.layout, pool.cache_shape = layout, shape_of(caches)
        pool.state_sizes = state_sizes
        pool.snapshot_budget = (snapshot_bytes or 0) if state_sizes else 0
        pool.snapshot_row_bytes = row_bytes
        return pool

    def agreed(self) -> KVPool:
        """This pool as every rank of ``mlx.launch`` has it: the fewest pages, pages a chunk
        and snapshots of any rank (each rank planned from its own device and shard), so that
        pages run out, chunks come and evictions fall alike everywhere (memory/ranks.py). A
        collective; call it before any chunk is online. The pool itself in one process."""
        if ranks.size() == 1:
            return self
        # Snapshots are agreed in number: a rank's are all one size, its shard's state.
        each = self.snapshot_row_bytes
        pages, chunk, snapshots = ranks.least(
            [
                self.max_pages,
                self.allocator.chunk_pages,
                self.snapshot_budget // each if each else 0,
            ]
        )
        pool = type(self)(
            self.specs, pages // chunk * chunk, self.page_size, self.dtype, chunk_pages=chunk
        )
        pool.plan, pool.layout, pool.state_sizes = self.plan, self.layout, self.state_sizes
        pool.cache_shape = self.cache_shape
        pool.prefill_working_bytes = self.prefill_working_bytes
        pool.attention_bytes = self.attention_bytes
        pool.snapshot_row_bytes, pool.snapshot_budget = each, snapshots * each
        return pool

    # -- accounting --------------------------------------------------------------

    @property
    def attention_bound(self) -> int | None:
        """What a prompt pass's attention holds at most in a layer's scores, where it is
        bounded (``prefill.attention`` on and a plan's ``attention_bytes``); else None."""
        return self.attention_bytes if self.prefill_attention != "off" else None

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def recurrent(self) -> list[int]:
        """Entries of the model's cache that hold recurrent state, not K/V."""
        return [i for i, layer in enumerate(self.layout) if layer is None]

    @property
    def num_pages(self) -> int:
        """Pages online now (``max_pages``: the most it grows to)."""
        return self.allocator.num_pages

    @property
    def max_pages(self) -> int:
        return self.allocator.max_pages

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token(self.dtype) for s in self.specs)

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks online now."""
        return self.num_pages * self.bytes_per_page

    @property
    def max_nbytes(self) -> int:
        return self.max_pages * self.bytes_per_page

    @property
    def used_bytes(self) -> int:
        self.run_deferred()
        return self.allocator.num_used * self.bytes_per_page

    def hold_outside(self, holder: object) -> None:
        """Count ``holder.buffer_nbytes`` (K/V it holds outside the pool) while it lives."""
        with self.lock:
            self._buffers.add(holder)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of K/V held outside the pool now: batch buffers and private copies."""
        with self.lock:
            return sum(h.buffer_nbytes for h in list(self._buffers))

    def _room_for_chunk(self) -> bool:
        """Whether one more chunk, and the K/V held outside the pool beyond the plan's
        reserve for it, stay within the ceiling. The first chunk always comes."""
        reserve = self.plan.buffer_reserve_bytes if self.plan is not None else None
        if reserve is None or not self.allocator.online_chunks:
            return True
        over = max(0, self.buffer_bytes - reserve)
        chunk = self.allocator.chunk_pages * self.bytes_per_page
        return self.nbytes + chunk + over <= self.max_nbytes

    # -- chunks ------------------------------------------------------------------

    def _grow(self) -> bool:
        """Bring the lowest offline chunk online: one chunk's allocation, no other array
        touched (a new array, not a larger copy of the old ones)."""
        c = self.allocator.next_chunk
        # The ranks of mlx.launch hold K/V of different sizes outside the pool (their own
        # shards): a chunk comes on every rank or on none.
        if c is None or not ranks.all_agree(self._room_for_chunk()):
            return False
        keys, values = [], []
        for layers in self.groups:
            s, rows = self.specs[layers[0]], len(layers) * self.chunk_slots
            keys.append(mx.zeros((rows, s.kv_heads, s.k_head_dim), self.dtype))
            values.append(mx.zeros((rows, s.kv_heads, s.v_head_dim), self.dtype))
        mx.eval(keys, values)
        self._chunks[c] = (keys, values)
        self.allocator.add_chunk(c)
        self.chunks_grown += 1
        if self.working_set is not None:
            self.working_set.hold_limit()
        return True

    def trim(self, idle_seconds: float | None = None, now: float | None = None) -> int:
        """Give back the chunks that have held no page for ``idle_seconds`` (default
        ``CHUNK_IDLE_SECONDS``); the first chunk stays once allocated. Returns how many went.
        Call it where no pass is being built."""
        idle_seconds = CHUNK_IDLE_SECONDS if idle_seconds is None else idle_seconds
        with self.lock:
            self.run_deferred()
            now = time.monotonic() if now is None else now
            due = [False] * self.allocator.num_chunks
            for c in self.allocator.online_chunks[1:]:
                if self.allocator.chunk_used(c):
                    self._empty_since.pop(c, None)
                else:
                    due[c] = now - self._empty_since.setdefault(c, now) >= idle_seconds
            # Under mlx.launch a chunk goes only where it is empty and due on every rank (each
            # rank's clock says when); every rank has the same chunks (``agreed``).
            due = ranks.least(due)
            freed = 0
            for c, go in enumerate(due):
                if go:
                    self.allocator.remove_chunk(c)
                    self._chunks[c] = None
                    del self._empty_since[c]
                    freed += 1
            self.chunks_freed += freed
        if freed:
            mx.clear_cache()  # back to the system, not only to MLX's cache of free buffers
        return freed

    # -- pages -------------------------------------------------------------------

    def defer(self, release: Callable[[], None]) -> None:
        self._deferred.append(release)

    @property
    def has_deferred(self) -> bool:
        """Whether releases are queued (read without the lock: one queued as this is read
        runs at the next call that takes it)."""
        return bool(self._deferred)

    def run_deferred(self) -> None:
        with self.lock:
            while self._deferred:
                self._deferred.popleft()()

    def alloc_pages(self, n: int) -> list[int]:
        """``n`` pages: free ones, then new chunks up to the ceiling (less what K/V outside
        the pool takes beyond its reserve), then evicted ones."""
        with self.lock:
            self.run_deferred()
            while n > self.allocator.num_free and self._grow():
                pass
            short = n - self.allocator.num_free
            if short > 0 and self.reclaim is not None:
                self.reclaim(short)
            return self.allocator.alloc(n)

    def release_pages(self, pages: Iterable[int]) -> None:
        with self.lock:
            self.allocator.decref(pages)

    def slots_of(self, pages: list[int]) -> Slots:
        return self.slots(page_slots(pages, self.page_size))

    def slots(self, host: Sequence[int] | np.ndarray) -> Slots:
        """Slot ids as the pool reads and writes them (build once, use in every layer)."""
        return Slots(host, self.chunk_slots)

    def head_slots(self, host: np.ndarray, heads: int, axis: int = 0) -> HeadSlots:
        """Slot ids laid out for ``gather_heads``: ``(heads, *shape)`` rows, heads at ``axis``."""
        return HeadSlots(host, self.chunk_slots, heads, axis)

    def _plan(self, slots: Slots | Sequence[int] | np.ndarray) -> Slots:
        return slots if isinstance(slots, Slots) else self.slots(slots)

    # -- data --------------------------------------------------------------------

    @property
    def arrays(self) -> list[mx.array]:
        """Every array of the pool: evaluate these to run pending scatters (stores in place
        are launched apart: ``take_marks``, ``launch_stores``)."""
        return [a for chunk in self._chunks if chunk is not None for a in chunk[0] + chunk[1]]

    @property
    def writes_in_place(self) -> bool:
        """Whether a decode step's writes may be stores in place (in_place.py: CUDA)."""
        return _in_place.available(self.dtype)

    def take_marks(self) -> list[mx.array]:
        """The in-place stores built since the last call, for the step's launch: launched
        with the step whose K/V they store, so every later read comes after them."""
        marks, self._marks = self._marks, []
        return marks

    def launch_stores(self) -> None:
        """Launch stores in place that no step's launch took: before anything else that
        reads or writes the pool is built, and before the arrays are read outside MLX.

        A store writes through its input, so MLX sees no write: within one evaluation
        nothing orders it before a read of its rows (on CUDA the two are nodes of one
        command graph with no edge between them), and only the stream orders it before
        the evaluations after its own. A pass that mlx-lm runs itself (the first step of
        a batch leaving prefill, in ``PromptProcessingBatch.generate``) builds stores no
        launch takes: left for the next step's launch, they ran in that step's graph,
        which reads their rows. On the H200 one request's float32 logits differed from
        the scatters' by up to 0.28 from its second token.
        """
        if self._marks:
            mx.async_eval(self.take_marks())

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
        self._scattered = False
        if self._reader is not None:
            reader, self._reader = self._reader, None
            mx.synchronize(reader)

    def settle_writes(self) -> None:
        """``settle``, where a scatter into the pool was built since the last: a pass whose
        own writes are stores in place waits for nothing else."""
        if self._scattered:
            self.settle()

    def write_rows(self, layer: int, slots, keys: mx.array, values: mx.array) -> None:
        """Store ``(n, heads, dim)`` rows of one layer at ``n`` slots."""
        self.launch_stores()
        g, base = self._where[layer]
        self._scattered = True
        for c, local, at in self._plan(slots).pieces:
            idx = local + base if base else local
            k_arrays, v_arrays = self._chunks[c]
            k_arrays[g][idx] = keys if at is None else keys[at]
            v_arrays[g][idx] = values if at is None else values[at]

    def write(self, layer: int, slots, keys: mx.array, values: mx.array) -> None:
        """Store ``(1, heads, S, dim)`` K/V at ``S`` slots."""
        self.write_rows(layer, slots, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))

    def write_layers(
        self,
        slots: Slots,
        keys: Mapping[int, mx.array],
        values: Mapping[int, mx.array],
        rows: mx.array | None = None,
        in_place: bool = False,
    ) -> None:
        """Store every layer's new K/V at the same slots: one scatter per array, or with
        ``in_place`` (a shared decode pass's, where ``writes_in_place``) one store in place
        per array, which the pass's launch takes (``take_marks``).

        ``keys[layer]`` holds ``m`` rows of ``(heads, dim)`` in any shape of that size
        (a decode step's ``(batch, heads, 1, dim)``); ``rows`` picks which of the ``m``
        go to ``slots``, all of them when None.
        """
        self.launch_stores()
        in_place = in_place and self.writes_in_place
        self._scattered |= not in_place
        for g, layers in enumerate(self.groups):
            spec = self.specs[layers[0]]
            # The group's rows for each piece: the same for its keys and its values.
            flat = [(self._bases[g] + local).reshape(-1) for _, local, _ in slots.pieces]
            for new, which, dim in ((keys, 0, spec.k_head_dim), (values, 1, spec.v_head_dim)):
                row = (spec.kv_heads, dim)
                x = mx.stack([new[i] for i in layers]).reshape(len(layers), -1, *row)
                if rows is not None:
                    x = x[:, rows]
                for (c, _, at), idx in zip(slots.pieces, flat):
                    part = (x if at is None else x[:, at]).reshape(-1, *row)
                    if in_place:
                        self._marks.append(_in_place.store(self._chunks[c][which][g], idx, part))
                    else:
                        self._chunks[c][which][g][idx] = part

    def rows(self, layer: int, slots) -> tuple[mx.array, mx.array]:
        """One layer's K/V rows at ``slots``, ``(n, heads, dim)``."""
        self.launch_stores()
        plan = self._plan(slots)
        g, base = self._where[layer]
        out = []
        for which in (0, 1):
            parts = [
                self._chunks[c][which][g][local + base if base else local]
                for c, local, _ in plan.pieces
            ]
            x = mx.concatenate(parts) if len(parts) > 1 else parts[0]
            out.append(x if plan.order is None else x[plan.order])
        return out[0], out[1]

    def read(self, layer: int, slots) -> tuple[mx.array, mx.array]:
        """K/V at ``slots`` as contiguous ``(1, heads, L, dim)``, the layout attention expects.

        Made contiguous here: on the CPU, attention over the strided transpose is ~2.5x
        slower than the copy (0.2 ms vs 1.2 ms extra per layer at 1k tokens, 3 KV heads).
        """
        k, v = self.rows(layer, slots)
        return mx.contiguous(k.transpose(1, 0, 2))[None], mx.contiguous(v.transpose(1, 0, 2))[None]

    def layer_arrays(self, layer: int, chunk: int) -> tuple[mx.array, mx.array, int]:
        """The key and value arrays of chunk ``chunk`` that hold layer ``layer``, whole, and
        the layer's first row in them: what a kernel reading pages in place is given.

        Whole arrays rather than views of the layer's slots: on the H200, 32 rows decoding
        with views took 926 tokens/s (stock 759), with whole arrays 1,250 (stock 848), a
        device call apart (docs/benchmarking.md, "The paged decode kernel on CUDA")."""
        g, base = self._where[layer]
        return (*self.group_arrays(g, chunk), base)

    def layer_places(self) -> tuple[tuple[int, int], ...]:
        """Each layer's group (the arrays of a chunk that hold it) and its first row in
        them, in layer order."""
        return tuple(self._where)

    def group_arrays(self, group: int, chunk: int) -> tuple[mx.array, mx.array]:
        """The key and value arrays of chunk ``chunk`` that hold group ``group``'s layers."""
        self.launch_stores()
        keys, values = self._chunks[chunk]
        return keys[group], values[group]

    def flat_views(self, layer: int) -> tuple[FlatViews, FlatViews]:
        """Layer ``layer``'s K and V rows in each chunk as ``(slots * heads, dim)`` views,
        which ``HeadSlots.gather`` reads; a chunk's view is made when first read."""
        self.launch_stores()
        g, base = self._where[layer]
        return tuple(FlatViews(self._chunks, which, g, base, self.chunk_slots) for which in (0, 1))

    def copy(self, src, dst) -> None:
        """Copy slots ``src`` to ``dst`` in every layer.

        The gathered rows are evaluated before the scatter so that the scatter is
        the only reader of each array and can update it in place.
        """
        self.launch_stores()
        self.settle()
        self._scattered = True
        src, dst = self._plan(src), self._plan(dst)
        gathered = []
        for g, layers in enumerate(self.groups):
            for which in (0, 1):
                parts = []
                for c, local, _ in src.pieces:
                    array = self._chunks[c][which][g]
                    rows = array[(self._bases[g] + local).reshape(-1)]
                    parts.append(rows.reshape(len(layers), -1, *array.shape[1:]))
                x = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
                gathered.append((g, which, x if src.order is None else x[:, src.order]))
        mx.eval([x for _, _, x in gathered])
        for g, which, x in gathered:
            for c, local, at in dst.pieces:
                part = x if at is None else x[:, at]
                array = self._chunks[c][which][g]
                array[(self._bases[g] + local).reshape(-1)] = part.reshape(-1, *array.shape[1:])


class FlatViews:
    """One layer's K (or V) rows in each chunk, as ``(slots * heads, dim)`` views made on
    first read: a pass reads the chunks its slots touch, not every chunk of the pool."""

    __slots__ = ("_chunks", "_which", "_group", "_base", "_slots", "_made")

    def __init__(self, chunks: list, which: int, group: int, base: int, slots: int):
        self._chunks, self._which, self._group = chunks, which, group
        self._base, self._slots = base, slots
        self._made: dict[int, mx.array] = {}

    def __getitem__(self, chunk: int) -> mx.array:
        view = self._made.get(chunk)
        if view is None:
            a = self._chunks[chunk][self._which][self._group]
            view = a[self._base : self._base + self._slots].reshape(-1, a.shape[-1])
            self._made[chunk] = view
        return view


def page_slots(pages: Sequence[int], page_size: int) -> np.ndarray:
    """The slots of ``pages``, page after page."""
    return (np.asarray(pages, dtype=np.int64)[:, None] * page_size + np.arange(page_size)).reshape(
        -1
    )
