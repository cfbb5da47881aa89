"""Decode attention read straight from the pool's pages: one CUDA kernel a layer.

On MLX's CUDA backend a decode step is launch-bound: the host spends about 5.5 us a graph
node encoding it, and a step of Llama-3-8B's shape has about 2,200 nodes, so a 32-row step
took 23 ms through the server where the GPU ran kernels for 6 (docs/benchmarking.md, "The
paged decode kernel on CUDA"). Attention is a large share of them: with a left-padded batch,
mlx-lm passes an array mask, and MLX's CUDA backend fuses no decode attention with one (its
vector kernel takes none), so every layer runs the unfused form (scale, scores, mask,
softmax, values, and their views and copies), after writing the step's K/V into the batch
buffer.

Here each layer is one kernel: every row attends to its own context through its page table,
reading K/V where the pool holds them (no batch buffer, no copy at admission or per step),
plus the step's own token, passed in. Rows whose page tables start with the same pages read
those pages at about the same time (a block per row and KV head, rows adjacent), so a shared
prefix comes from the L2 cache after the first reader. A row's positions may be split over
several blocks (``_splits``), whose partial softmax states a second kernel merges; one
block's warps merge theirs in shared memory. Sliding windows and attention sinks are the
same rule as mlx-lm's: a query at position ``n`` sees keys ``n - window + 1 .. n``; a sink
is one more logit a query head, with no value.

The pool's storage comes in chunks, each its own arrays (memory/pool.py), and a batch's pages
may lie in several once the pool has grown. The kernel then runs once a chunk, each call
skipping the pages of the others and one of them taking the step's token, and the merge takes
every call's partial states. Before, such a batch took the MLX-ops variants, which gather each
row's own tokens a layer: on the H200 (8B, 32 agents on an 8,192-token prefix, a pool of three
chunks), a decode step then held 16.1 GB of working memory (docs/benchmarking.md, "The paged
decode kernel on CUDA").

CUDA only, and only once ``check`` has compared it with the MLX-ops form on this device for
the model's geometry; elsewhere (Metal, the CPU) the shared path's MLX-ops variants serve.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import mlx.core as mx

from ..memory.in_place import head

log = logging.getLogger("mlx_radix")

WARPS = 4  # warps a block
# Lanes that share one position's dot product: 16 puts two positions a warp in flight, with 4
# shuffles each instead of 5. A warp waits on its loads one position at a time, so fewer lanes a
# position keep more loads in flight. The kernel alone on an H200 (8B shape, bf16, 32 layers of
# one step), 32 lanes against 16: 8 rows on a shared 24,576-token prefix + 2,048 own tokens 18.9
# against 16.9 ms; 1 row on 26,624 tokens 3.93 against 3.86; 32 rows on 2,048 7.47 against 7.10;
# 1 row on 512 1.82 against 1.91. Through the server, the agent loop (8 clients x 6 turns of
# 1,024 on a 24,576-token prompt): a decode step 31.5 against 28.9 ms, turns 2-6 TTFT p50 1.59
# against 1.29-1.33 s (``lanes32_agent_h200``, ``lanes16_agent_h200_*``).
LANES = 16
# Blocks a layer aims for (about four per multiprocessor of an H100/H200's 132): a row's
# positions are split over more blocks until the batch has that many, each split at least
# MIN_SPLIT_TOKENS of the positions its page tables' width holds (``_splits``).
TARGET_BLOCKS = 528
MIN_SPLIT_TOKENS = 64

_HEADER = """
constexpr float LOG2E = 1.4426950408889634f;
constexpr float NO_SCORE = -1e30f;  // finite: a part with no key merges with weight 0
"""

# Inputs: q (B, Hq, 1, DK), kn (B, Hkv, 1, DK), vn (B, Hkv, 1, DV): any strides; kp, vp: a
# pool array (rows, Hkv, D), contiguous; pages (B, P) int32: each row's pages, local to the
# array's chunk, -1 where a page lies in another chunk; lengths (B,) int32: positions a row
# has in the pool (the step's token is at that position); base (1,) int32: the layer's first
# row in kp/vp; scale (1,) float32; sinks (Hq,) where the model has them (the unsplit kernel:
# a split one leaves them to the merge). Template OWN: 1 where the call reads the step's token.
_ATTEND = """
constexpr int PK = (DK + LANES - 1) / LANES;
constexpr int PV = (DV + LANES - 1) / LANES;
constexpr int PER_WARP = 32 / LANES;  // positions a warp takes at once
constexpr int GROUPS = WARPS * PER_WARP;
const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
const int S = gridDim.x, Hkv = gridDim.y, Hq = Hkv * G;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int sub = lane % LANES;  // this lane's slice of a head's dimensions
const int P = pages_shape[1];
const int len = lengths[b];
const int total = len + 1;
const int first = WINDOW > 0 ? max(0, total - WINDOW) : 0;
const int per = (total - first + S - 1) / S;
const int lo = first + s * per;
const int hi = min(total, lo + per);
const float qscale = scale[0] * LOG2E;

float qr[G][PK], o[G][PV], m[G], l[G];
#pragma unroll
for (int g = 0; g < G; ++g) {
  const int64_t at = (int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1];
#pragma unroll
  for (int i = 0; i < PK; ++i) {
    const int d = sub * PK + i;
    qr[g][i] = d < DK ? static_cast<float>(q[at + d * q_strides[3]]) * qscale : 0.f;
  }
#pragma unroll
  for (int i = 0; i < PV; ++i) o[g][i] = 0.f;
  m[g] = NO_SCORE;
  l[g] = 0.f;
}

const int32_t* row_pages = pages + (int64_t)b * P;
const int64_t first_row = base[0];
// A warp's lane groups take adjacent positions; every lane runs every iteration, since the
// shuffles below need the whole warp, and a position a group does not read adds nothing.
for (int p0 = lo + warp * PER_WARP; p0 < hi; p0 += GROUPS) {
  const int p = p0 + lane / LANES;
  float k[PK], v[PV];
  bool live = p < hi;
  if (live && p < len) {
    const int page = row_pages[p / PS];
    live = page >= 0;  // -1: in another chunk of the pool, which another call reads
    const int64_t row = (first_row + (int64_t)max(page, 0) * PS + p % PS) * Hkv + h;
    const auto* kr = kp + row * DK;
    const auto* vr = vp + row * DV;
#pragma unroll
    for (int i = 0; i < PK; ++i) {
      const int d = sub * PK + i;
      k[i] = live && d < DK ? static_cast<float>(kr[d]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < PV; ++i) {
      const int d = sub * PV + i;
      v[i] = live && d < DV ? static_cast<float>(vr[d]) : 0.f;
    }
  } else {  // the step's own token, read by one chunk's call
    live = live && OWN != 0;
    const int64_t ka = (int64_t)b * kn_strides[0] + (int64_t)h * kn_strides[1];
    const int64_t va = (int64_t)b * vn_strides[0] + (int64_t)h * vn_strides[1];
#pragma unroll
    for (int i = 0; i < PK; ++i) {
      const int d = sub * PK + i;
      k[i] = live && d < DK ? static_cast<float>(kn[ka + d * kn_strides[3]]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < PV; ++i) {
      const int d = sub * PV + i;
      v[i] = live && d < DV ? static_cast<float>(vn[va + d * vn_strides[3]]) : 0.f;
    }
  }
  float score[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < PK; ++i) acc += qr[g][i] * k[i];
    score[g] = acc;
  }
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) score[g] += __shfl_xor_sync(0xffffffff, score[g], off);
  }
  if (!live) continue;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float top = fmaxf(m[g], score[g]);
    const float keep = exp2f(m[g] - top);
    const float e = exp2f(score[g] - top);
    m[g] = top;
    l[g] = l[g] * keep + e;
#pragma unroll
    for (int i = 0; i < PV; ++i) o[g][i] = o[g][i] * keep + e * v[i];
  }
}

// A warp's lane groups merged: each lane then holds its slice of the warp's state.
#pragma unroll
for (int off = LANES; off < 32; off <<= 1) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float mo = __shfl_xor_sync(0xffffffff, m[g], off);
    const float lo2 = __shfl_xor_sync(0xffffffff, l[g], off);
    const float top = fmaxf(m[g], mo);
    const float mine = exp2f(m[g] - top), theirs = exp2f(mo - top);
    m[g] = top;
    l[g] = l[g] * mine + lo2 * theirs;
#pragma unroll
    for (int i = 0; i < PV; ++i) {
      o[g][i] = o[g][i] * mine + __shfl_xor_sync(0xffffffff, o[g][i], off) * theirs;
    }
  }
}

// The block's warps merged, one query head at a time.
__shared__ float wm[WARPS], wl[WARPS], wo[WARPS][DV];
#pragma unroll
for (int g = 0; g < G; ++g) {
  if (lane == 0) {
    wm[warp] = m[g];
    wl[warp] = l[g];
  }
  if (lane < LANES) {
#pragma unroll
    for (int i = 0; i < PV; ++i) {
      const int d = sub * PV + i;
      if (d < DV) wo[warp][d] = o[g][i];
    }
  }
  __syncthreads();
  float top = wm[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) top = fmaxf(top, wm[w]);
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) sum += wl[w] * exp2f(wm[w] - top);
  const int64_t hq = (int64_t)b * Hq + h * G + g;
  for (int d = threadIdx.x; d < DV; d += WARPS * 32) {
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) acc += wo[w][d] * exp2f(wm[w] - top);
{write}
  }
  __syncthreads();
}
"""

# What a block writes for one output element ``acc`` of query head ``hq`` (its max ``top``
# and sum ``sum``): the partial state of its split, or the output (a sink, one more logit
# a head, entering the softmax's sum only).
_WRITE = {
    "split": """
    part_o[(hq * S + s) * DV + d] = acc;
    if (d == 0) {
      part_m[hq * S + s] = top;
      part_l[hq * S + s] = sum;
    }
""",
    "out": """
    out[hq * DV + d] = static_cast<T>(sum > 0.f ? acc / sum : 0.f);
""",
    "out_sinks": """
    const float sink = static_cast<float>(sinks[h * G + g]) * LOG2E;
    const float t2 = fmaxf(top, sink);
    const float den = sum * exp2f(top - t2) + exp2f(sink - t2);
    out[hq * DV + d] = static_cast<T>(acc * exp2f(top - t2) / den);
""",
}

# Inputs: part_o (B, Hq, S, DV), part_m and part_l (B, Hq, S) float32; sinks (Hq,) when a
# model has them. One thread an output element.
_MERGE = """
const int d = blockIdx.x * blockDim.x + threadIdx.x;
const int hq = blockIdx.y, b = blockIdx.z;
const int Hq = gridDim.y;
const int S = part_m_shape[2];
if (d >= DV) return;
const int64_t at = (int64_t)b * Hq + hq;
float top = NO_SCORE;
for (int s = 0; s < S; ++s) top = fmaxf(top, part_m[at * S + s]);
float den = 0.f;
{sink}
float acc = 0.f;
for (int s = 0; s < S; ++s) {
  const float w = exp2f(part_m[at * S + s] - top);
  den += part_l[at * S + s] * w;
  acc += part_o[(at * S + s) * DV + d] * w;
}
out[at * DV + d] = static_cast<T>(den > 0.f ? acc / den : 0.f);
"""
_MERGE_SINK = """
const float sink = static_cast<float>(sinks[hq]) * LOG2E;
top = fmaxf(top, sink);
den = exp2f(sink - top);
"""

_kernels: dict[tuple, object] = {}
_constants: dict[tuple, mx.array] = {}


def _kernel(split: bool, sinks: bool, merge: bool = False):
    key = (split, sinks, merge)
    k = _kernels.get(key)
    if k is None:
        tail = ["sinks"] if sinks else []
        if merge:
            inputs, outputs = ["part_o", "part_m", "part_l", *tail], ["out"]
            source = _MERGE.replace("{sink}", _MERGE_SINK if sinks else "")
        else:
            inputs = ["q", "kn", "vn", "kp", "vp", "pages", "lengths", "base", "scale"]
            if split:
                outputs, write = ["part_o", "part_m", "part_l"], _WRITE["split"]
            else:
                inputs += tail
                outputs, write = ["out"], _WRITE["out_sinks" if sinks else "out"]
            source = _ATTEND.replace("{write}", write)
        name = "radix_paged_" + ("merge" if merge else "split" if split else "attend")
        k = _kernels[key] = mx.fast.cuda_kernel(
            name=name + ("_sinks" if sinks else ""),
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=_HEADER,
            ensure_row_contiguous=False,
        )
    return k


def _constant(value, dtype: mx.Dtype) -> mx.array:
    """A one-element array made once: an input of every call, not a new node each."""
    key = (value, dtype)
    a = _constants.get(key)
    if a is None:
        a = _constants[key] = mx.array([value], dtype=dtype)
        mx.eval(a)
    return a


def _splits(rows: int, kv_heads: int, positions: int) -> int:
    """Blocks a row's positions are split over: enough for ``TARGET_BLOCKS`` in all, each
    at least ``MIN_SPLIT_TOKENS`` of ``positions``, those the page tables' width holds (and
    the step's own): a function of the tables' shape, so a call's splits change only when
    its tables widen (a bucket of pages) and its compiled form is replayed until then; each
    block takes an equal share of its row's actual positions."""
    want = -(-TARGET_BLOCKS // max(1, rows * kv_heads))
    return max(1, min(want, -(-positions // MIN_SPLIT_TOKENS)))


@dataclass(frozen=True)
class PagedLayer:
    """Where one layer's K/V lie in one chunk of the pool for a decode step, and how it
    attends to them."""

    keys: mx.array  # a pool array (rows, Hkv, DK) holding the layer's rows from ``base``
    values: mx.array  # its value array (rows, Hkv, DV)
    base: int
    pages: mx.array  # (B, P) int32: each row's pages in that array's chunk, -1 in another
    lengths: mx.array  # (B,) int32: the positions each row has there
    page_size: int
    scale: float
    window: int | None = None  # a sliding window's size
    sinks: mx.array | None = None  # (Hq,): one more logit a query head
    # One-row views of ``keys`` and ``values`` (``in_place.head``) made once for a step's
    # layers; else made at each call.
    heads: tuple[mx.array, mx.array] | None = None


def _parts(at: PagedLayer | Sequence[PagedLayer]) -> list[PagedLayer]:
    return [at] if isinstance(at, PagedLayer) else list(at)


def paged_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    at: PagedLayer | Sequence[PagedLayer],
) -> mx.array:
    """One decode step's attention, ``(B, Hq, 1, DV)``: ``queries`` ``(B, Hq, 1, DK)`` over
    each row's positions in the pool and the step's own ``keys``/``values``
    ``(B, Hkv, 1, D)``; ``at`` one layer per chunk the rows' pages lie in."""
    parts = _parts(at)
    at = parts[0]
    B = queries.shape[0]
    S = _splits(B, keys.shape[1], at.pages.shape[1] * at.page_size + 1)
    sinks = at.sinks is not None
    inputs = [queries, keys, values]
    for part in parts:
        # One-row views: the kernel addresses rows from the array's start, and a whole pool
        # array as an input ended MLX's command graph at every layer (in_place.head).
        inputs += part.heads or (head(part.keys), head(part.values))
        inputs += [
            part.pages,
            part.lengths,
            _constant(part.base, mx.int32),
            _constant(float(part.scale), mx.float32),
        ]
    if sinks:
        inputs.append(at.sinks)
    # The rest of the inputs' shapes follow from the model and the batch's rows.
    key = (S, len(parts), sinks, at.page_size, at.window or 0, queries.dtype, B, at.pages.shape)
    call = _calls.pop(key, None)
    if call is None:
        call = mx.compile(partial(_attend, S, len(parts), sinks, at.page_size, at.window or 0))
    _calls[key] = call  # most recently used last
    if len(_calls) > MAX_CALLS:
        del _calls[next(iter(_calls))]
    return call(*inputs)


# A layer's kernel calls, compiled once for each launch shape (splits, chunks, the batch's
# and its page tables' shapes) and replayed: a call of ``mx.fast.cuda_kernel`` builds the
# kernel's whole source from its template at every call (mlx/backend/cuda/custom_kernel.cpp),
# where a replay builds nothing. Page tables come in bucketed widths (shared_batch.py), so a
# replay lasts while rows grow. Each entry holds its trace; the least recently used go. On
# an H100 (Llama-3.2-1B's shape, one row) the shared step built in 0.78 ms against 0.85-0.88
# with this and compiled_layers.py's 2-D residual stream and joint RoPE together
# (docs/benchmarking.md, "Compiled decode layers"); this call's share was not measured apart.
MAX_CALLS = 256
_calls: dict[tuple, object] = {}


def _attend(
    S: int, chunks: int, sinks: bool, page_size: int, window: int, *inputs: mx.array
) -> mx.array:
    """``paged_attention``'s kernels over its flattened inputs: the queries and the step's
    K/V, then for each chunk its two pool views, pages, lengths, base and scale, then the
    sinks where the model has them."""
    queries, keys, values = inputs[:3]
    per_chunk = [list(inputs[3 + 6 * i : 9 + 6 * i]) for i in range(chunks)]
    tail = list(inputs[3 + 6 * chunks :])
    B, Hq, _, DK = queries.shape
    Hkv, DV = keys.shape[1], values.shape[-1]
    template = [
        ("T", queries.dtype),
        ("G", Hq // Hkv),
        ("DK", DK),
        ("DV", DV),
        ("PS", page_size),
        ("WINDOW", window),
        ("WARPS", WARPS),
        ("LANES", LANES),
    ]
    own = [queries, keys, values]
    grid, group = (WARPS * 32 * S, Hkv, B), (WARPS * 32, 1, 1)
    if S == 1 and chunks == 1:
        return _kernel(False, sinks)(
            inputs=own + per_chunk[0] + tail,
            template=template + [("OWN", 1)],
            grid=grid,
            threadgroup=group,
            output_shapes=[(B, Hq, 1, DV)],
            output_dtypes=[queries.dtype],
        )[0]
    states = [
        _kernel(True, sinks)(
            inputs=own + chunk,
            template=template + [("OWN", int(i == 0))],
            grid=grid,
            threadgroup=group,
            output_shapes=[(B, Hq, S, DV), (B, Hq, S), (B, Hq, S)],
            output_dtypes=[mx.float32] * 3,
        )
        for i, chunk in enumerate(per_chunk)
    ]
    part_o, part_m, part_l = (
        states[0] if len(states) == 1 else [mx.concatenate(x, axis=2) for x in zip(*states)]
    )
    width = min(128, 32 * -(-DV // 32))
    return _kernel(False, sinks, merge=True)(
        inputs=[part_o, part_m, part_l, *tail],
        template=[("T", queries.dtype), ("DV", DV)],
        grid=(width * -(-DV // width), Hq, B),
        threadgroup=(width, 1, 1),
        output_shapes=[(B, Hq, 1, DV)],
        output_dtypes=[queries.dtype],
    )[0]


def reference(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    at: PagedLayer | Sequence[PagedLayer],
) -> mx.array:
    """``paged_attention`` in MLX operations (a gather of each row's positions in each chunk,
    a mask, and MLX's fused attention): what ``check`` compares the kernel with."""
    parts = _parts(at)
    at = parts[0]
    B = queries.shape[0]
    n = at.lengths[:, None]
    ks, vs, seen = [], [], []
    for part in parts:
        P, ps = part.pages.shape[1], part.page_size
        pos = mx.arange(P * ps)
        page = part.pages[:, pos // ps]
        rows = part.base + mx.maximum(page, 0) * ps + pos % ps  # (B, P * ps)
        ks.append(part.keys[rows].transpose(0, 2, 1, 3))
        vs.append(part.values[rows].transpose(0, 2, 1, 3))
        # Column j holds position j, in this chunk where its page is (-1: another's).
        visible = (pos[None] < n) & (page >= 0)
        if at.window:
            visible = visible & (pos[None] >= n + 1 - at.window)
        seen.append(visible)
    k = mx.concatenate([*ks, keys], axis=2)
    v = mx.concatenate([*vs, values], axis=2)
    # The step's token, at position n, is seen whatever the window.
    mask = mx.concatenate([*seen, mx.ones((B, 1), dtype=mx.bool_)], axis=1).reshape(B, 1, 1, -1)
    return mx.fast.scaled_dot_product_attention(
        queries, k, v, scale=at.scale, mask=mask, sinks=at.sinks
    ).astype(queries.dtype)


# Geometries ``check`` has run: (dtype, G, DK, DV, page size, window, sinks) -> passed.
_checked: dict[tuple, bool] = {}


def check(
    dtype: mx.Dtype,
    query_heads: int,
    kv_heads: int,
    k_dim: int,
    v_dim: int,
    page_size: int,
    window: int | None = None,
    sinks: bool = False,
) -> bool:
    """Whether the kernel runs here and gives ``reference``'s output (to the dtype's
    rounding) for this geometry, on random data with a split and an unsplit case; once per
    geometry. False, with one log line, where it fails or CUDA is not the device."""
    key = (dtype, query_heads, kv_heads, k_dim, v_dim, page_size, window, sinks)
    if key in _checked:
        return _checked[key]
    ok = False
    if mx.cuda.is_available() and mx.default_device() == mx.gpu:
        try:
            ok = _compare(*key)
        except Exception as e:  # the kernel did not build or run here: the MLX-ops path
            log.warning("paged decode attention unavailable (%s): %s", type(e).__name__, e)
        else:
            if not ok:
                log.warning(
                    "paged decode attention differs from MLX's here (%s, %d/%d heads, dims "
                    "%d/%d): not used",
                    dtype,
                    query_heads,
                    kv_heads,
                    k_dim,
                    v_dim,
                )
    _checked[key] = ok
    return ok


def _compare(dtype, Hq, Hkv, DK, DV, ps, window, sinks) -> bool:
    key = mx.random.key(7)
    worst = 0.0
    for B, lengths in ((3, [5, 37, 70]), (2, [300, 1500])):
        ks = mx.random.split(key, 8)
        pages_per_row = -(-max(lengths) // ps) + 1
        total_pages = B * pages_per_row + 3
        base = 2 * ps  # the layer's rows start after another's
        rows = base + total_pages * ps
        k_pool = mx.random.normal((rows, Hkv, DK), key=ks[0]).astype(dtype)
        v_pool = mx.random.normal((rows, Hkv, DV), key=ks[1]).astype(dtype)
        perm = mx.random.permutation(total_pages, key=ks[2])[: B * pages_per_row]
        pages = perm.reshape(B, pages_per_row).astype(mx.int32)
        q = mx.random.normal((B, 1, Hq, DK), key=ks[3]).astype(dtype).transpose(0, 2, 1, 3)
        kn = mx.random.normal((B, Hkv, 1, DK), key=ks[4]).astype(dtype)
        vn = mx.random.normal((B, Hkv, 1, DV), key=ks[5]).astype(dtype)
        s = mx.random.normal((Hq,), key=ks[6]).astype(dtype) if sinks else None
        n = mx.array(lengths, dtype=mx.int32)
        at = PagedLayer(k_pool, v_pool, base, pages, n, ps, DK**-0.5, window, s)
        # The same rows with their pages over two chunks, the second with arrays of its own.
        other = mx.random.bernoulli(key=ks[7], shape=pages.shape)
        two = [
            replace(at, pages=mx.where(other, -1, pages)),
            replace(at, keys=-k_pool, values=0.5 * v_pool, pages=mx.where(other, pages, -1)),
        ]
        for layout in (at, two):
            got = paged_attention(q, kn, vn, layout).astype(mx.float32)
            want = reference(q, kn, vn, layout).astype(mx.float32)
            err = mx.abs(got - want).max().item()
            if not math.isfinite(err):
                return False
            worst = max(worst, err / max(mx.abs(want).max().item(), 1e-6))
        key = mx.random.split(ks[7])[0]
    # bf16 rounds at 2^-8 of a value; fp16 at 2^-11; float32 sums differ by far less.
    return worst <= {mx.float32: 1e-4, mx.float16: 4e-3}.get(dtype, 2e-2)
