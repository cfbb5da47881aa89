"""How many bytes the KV pool, and MLX's cache of freed buffers, may take on this device.

Usable memory is, on Metal, the recommended working set; on CUDA, the device's free memory
plus what MLX already holds; on the CPU, the system's available RAM plus what MLX already
holds. The plan (``plan_memory``) takes the model, the batches' working memory and a
margin out of it and gives the rest to the pool as a ceiling (the pool grows to it on
demand); a share of what the model and the pool leave bounds MLX's buffer cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

# Usable bytes in place of the device's figure (tests, doctor): not a setting.
from ..config import DEVICE_MEMORY_ENV


@dataclass(frozen=True)
class DeviceMemory:
    backend: str
    usable_bytes: int
    source: str


def _system_available_bytes() -> tuple[int, str]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages, "physical RAM"


def device_memory() -> DeviceMemory:
    forced = os.environ.get(DEVICE_MEMORY_ENV)
    if forced:
        try:
            usable = int(forced)
        except ValueError:
            raise ValueError(
                f"{DEVICE_MEMORY_ENV} = {forced!r}: expected a number of bytes"
            ) from None
        backend = (
            "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "cpu"
        )
        return DeviceMemory(backend, usable, f"${DEVICE_MEMORY_ENV}")
    if mx.metal.is_available():
        info = mx.device_info()
        return DeviceMemory(
            "metal", int(info["max_recommended_working_set_size"]), "Metal recommended working set"
        )
    held = mx.get_active_memory()
    if mx.cuda.is_available():
        info = mx.device_info()
        return DeviceMemory(
            "cuda", int(info["free_memory"]) + held, "CUDA free memory + MLX active memory"
        )
    free, source = _system_available_bytes()
    return DeviceMemory("cpu", free + held, f"{source} + MLX active memory")


def pool_budget_bytes(mem_fraction: float, model_bytes: int, memory: DeviceMemory) -> int:
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction!r}")
    return int(memory.usable_bytes * mem_fraction) - model_bytes


# Left out of the pool for what no estimate covers (other processes on a shared machine,
# allocator slack): a share of usable memory, at least MIN_MARGIN_BYTES.
MARGIN_FRACTION = 0.05
MIN_MARGIN_BYTES = 512 << 20
# Context a row of the exact decode path holds in mlx-lm's batch buffer, in the estimate
# of working memory: a chat-sized context for every row of a full batch.
WORKING_CONTEXT_TOKENS = 2048
# The least a prompt pass's attention may hold in a layer's scores (half the prefill reserve
# where that is more: an 8B model's 4.3 GB). A small model's reserve is small, and blocks of a
# few queries run at a fraction of the kernels' rate: on 2 CPU cores (tiny-long, the bench's
# agent workload, two sessions on a 24,000-token prompt) the first turns' prefill took 37.9 s
# and the run 69.4 s with the reserve's half, 16.7 MB; 21.1 s and 39.6 s with this floor.
ATTENTION_MIN_BYTES = 256 << 20
# What a pool gets when the plan leaves no room: a system prompt's worth, so the radix
# path still serves (and says so) instead of falling back to stock.
MIN_POOL_TOKENS = 2048


def activation_bytes_per_token(model: object, kv_bytes_per_token: int) -> int:
    """Bytes of activations a token holds in a forward pass, float32 upper bound: a few
    hidden-sized tensors and the MLP's intermediate ones (from the model's config; 16x
    the token's K/V when the config does not say)."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    if not isinstance(hidden, int):
        return 16 * kv_bytes_per_token
    intermediate = getattr(args, "intermediate_size", None)
    intermediate = intermediate if isinstance(intermediate, int) else 4 * hidden
    return 4 * (8 * hidden + 3 * intermediate)


def buffer_reserve_bytes(kv_bytes_per_token: int, max_batch_size: int) -> int:
    """Working memory for K/V held outside the pool: the exact path's batch buffers, every
    row's context ``WORKING_CONTEXT_TOKENS`` long."""
    return max_batch_size * WORKING_CONTEXT_TOKENS * kv_bytes_per_token


def attention_bytes(kv_bytes_per_token: int, max_batch_size: int) -> int:
    """What one layer's attention may hold in scores in a prompt pass: half the buffer
    reserve (a pass over the pool holds no buffers), at least ``ATTENTION_MIN_BYTES``."""
    return max(buffer_reserve_bytes(kv_bytes_per_token, max_batch_size) // 2, ATTENTION_MIN_BYTES)


def working_bytes(
    model: object,
    kv_bytes_per_token: int,
    max_batch_size: int,
    prefill_step_size: int,
    recurrent_row_bytes: int = 0,
) -> int:
    """The batches' working memory: the batch buffers (``buffer_reserve_bytes``), of which a
    prompt pass's attention takes half, and more where its floor is more (``attention_bytes``),
    a prefill chunk's activations and a decode step's (logits included), and a hybrid model's
    recurrent states, ``recurrent_row_bytes`` a row: mlx-lm's batch caches hold one a row,
    and a step makes each row's next state while the last is still held, so two a row."""
    act = activation_bytes_per_token(model, kv_bytes_per_token)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    logits = 4 * vocab if isinstance(vocab, int) else 0
    buffers = buffer_reserve_bytes(kv_bytes_per_token, max_batch_size)
    buffers += attention_bytes(kv_bytes_per_token, max_batch_size) - buffers // 2
    states = 2 * max_batch_size * recurrent_row_bytes
    return buffers + prefill_step_size * act + max_batch_size * (act + logits) + states


@dataclass(frozen=True)
class MemoryPlan:
    """How device memory is shared out: the model, working memory, a margin, and the rest
    to the KV pool as the ceiling it grows to."""

    usable_bytes: int
    source: str
    model_bytes: int
    working_bytes: int
    margin_bytes: int
    pool_bytes: int
    rule: str  # what set the pool's ceiling
    warning: str | None = None
    # Of working memory, what K/V held outside the pool (batch buffers, private copies) may
    # take before the rest of it counts against the pool's ceiling; None when the user sized
    # the pool (radix.pool_tokens, radix.mem_fraction): then the buffers are theirs to plan.
    buffer_reserve_bytes: int | None = None

    def as_dict(self) -> dict:
        return {
            "usable_bytes": self.usable_bytes,
            "source": self.source,
            "model_bytes": self.model_bytes,
            "working_bytes": self.working_bytes,
            "margin_bytes": self.margin_bytes,
            "pool_max_bytes": self.pool_bytes,
            "rule": self.rule,
            "warning": self.warning,
            "buffer_reserve_bytes": self.buffer_reserve_bytes,
        }


def plan_memory(
    memory: DeviceMemory,
    *,
    model_bytes: int,
    working: int,
    kv_bytes_per_token: int,
    mem_fraction: float = 0.0,
    pool_tokens: int = 0,
    buffer_reserve: int = 0,
) -> MemoryPlan:
    """The pool's ceiling: ``pool_tokens`` if set, else ``mem_fraction`` of usable memory less
    the model if set, else usable less the model, working memory (of which ``buffer_reserve``
    for K/V outside the pool) and a margin. A ceiling below ``MIN_POOL_TOKENS`` becomes that,
    with a warning."""
    margin = max(MIN_MARGIN_BYTES, int(memory.usable_bytes * MARGIN_FRACTION))
    reserve = None
    if pool_tokens:
        pool, rule = pool_tokens * kv_bytes_per_token, "radix.pool_tokens"
    elif mem_fraction:
        pool = pool_budget_bytes(mem_fraction, model_bytes, memory)
        rule = f"radix.mem_fraction {mem_fraction}"
    else:
        pool, rule = (
            memory.usable_bytes - model_bytes - working - margin,
            "usable - model - working - margin",
        )
        reserve = buffer_reserve
    warning = None
    least = MIN_POOL_TOKENS * kv_bytes_per_token
    if pool < least and not pool_tokens:
        warning = (
            f"the model ({model_bytes / 2**30:.2f} GiB) and working memory "
            f"({working / 2**30:.2f} GiB) leave no room for a KV pool in "
            f"{memory.usable_bytes / 2**30:.2f} GiB usable ({memory.source}) by {rule}: "
            f"serving from a minimal pool of {MIN_POOL_TOKENS} tokens "
            f"({least / 2**20:.1f} MiB); set radix.pool_tokens to choose its size"
        )
        pool = least
    return MemoryPlan(
        memory.usable_bytes,
        memory.source,
        model_bytes,
        working,
        margin,
        pool,
        rule,
        warning,
        reserve,
    )


# MLX keeps freed buffers for reuse, with no bound of its own on CUDA: on an H200 (Llama-3-8B,
# bf16, 32 requests on one 4,096-token prefix, stock's batch path) live arrays stayed near
# 33 GB while the cache of freed buffers grew to 94 GB and the generation thread died on
# ``cudaMallocAsync``; a limit of 8 GB kept it at 8 GB and the run completed.
MIN_BUFFER_CACHE_BYTES = 256 << 20
# Of working memory, the share the cache may keep where the cache is the machine's memory
# (the CPU, Metal's unified memory): the plan counts it in working memory there, beside the
# calls' live temporaries, whose estimate is about twice what they hold (a 24,576-token
# prompt on the wide model of tests/test_memory.py: 149 MB live of 322 MB named).
UNIFIED_CACHE_SHARE = 0.25


def buffer_cache_limit(
    fraction: float,
    memory: DeviceMemory,
    model_bytes: int,
    pool_bytes: int,
    buffer_bytes: int = 0,
    working_bytes: int | None = None,
) -> int:
    """Bytes MLX may keep in its cache of freed buffers: ``fraction`` of what the device has
    left after the model, the pool and the batch buffers (``buffer_bytes``, the plan's reserve
    for them), at most the plan's working memory (``working_bytes``), and at least
    ``MIN_BUFFER_CACHE_BYTES`` so that a step's buffers are still reused. On the CPU and Metal
    the cache is counted in working memory: at most ``UNIFIED_CACHE_SHARE`` of it, with no
    floor, so that the server's resident memory stays within model + pool + working memory.

    A cached buffer counts in the process's resident memory: on 2 CPU cores, a burst of 8 on
    a new 1,024-token prefix (SmolLM2's shape, float32) peaked at 2.0 GB resident with 1.1 GB
    allowed and 1.5 GB with 256 MiB. The cache holds what the engine's calls freed, so more
    than their working memory keeps buffers no call reuses: where the user sized a small
    pool, a quarter of the rest was 6.2 GB, and a 24,576-token prompt on a wide tiny model
    (4 heads, 32,768-token pool, 322 MB of working memory) grew the server by 4.88 GB in
    28.1 s, against 0.78 GB in 22.4 s with 256 MiB (its passes' scores change size as the
    keys grow, so each pass's freed buffers were kept and not reused), by 0.53 GB with the
    working memory as the limit and each attention block evaluated as it is made
    (engine/prompt_attention.py), 0.2 GB of it the cache, and by 0.28 GB against 0.36 GB of
    pool and working memory with ``UNIFIED_CACHE_SHARE`` of it."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"buffer_cache_fraction must be in (0, 1], got {fraction!r}")
    left = memory.usable_bytes - model_bytes - pool_bytes - buffer_bytes
    limit = int(left * fraction)
    if working_bytes is not None:
        limit = min(limit, working_bytes)
        if memory.backend != "cuda":
            return max(0, min(limit, int(working_bytes * UNIFIED_CACHE_SHARE)))
    return max(MIN_BUFFER_CACHE_BYTES, limit)


# Chunks of the pool's storage (pool.py). A read that spans chunks costs more operations: on 2
# CPU cores, 8 x 2,048 on SmolLM2's shape decodes at 175 ms a step over two chunks against 160
# ms in one. On the H200 (Llama-3-8B, bf16, 32 requests on a 4,096-token prefix, 288 own tokens
# each, split variant), 30.1 ms a step in one chunk, 42.5 ms over chunks of 576 MB and 73.3 ms
# over chunks of 256 MB (stock: 52 ms): every layer gathers from each chunk it reads, and there
# a step costs its operations more than its bytes. So a CUDA device, whose memory is its own,
# gets a few large chunks: a share of the ceiling, within bounds. The CPU and Metal's unified
# memory, where what the server holds is taken from everything else the machine runs, get
# chunks of CHUNK_TOKENS tokens (a long system prompt spans one or two), within bounds: a burst
# that needs 50 MB of K/V then takes 190 MB (SmolLM2's shape, float32), not a 32nd of a 20 GB
# ceiling (617 MB).
CUDA_CHUNKS = (8, 256 << 20, 16 << 30)  # (share of the ceiling, least, most)
CHUNK_TOKENS, UNIFIED_CHUNKS = 4096, (64 << 20, 1 << 30)


def chunk_bytes_for(ceiling_bytes: int, bytes_per_token: int) -> int:
    if mx.cuda.is_available() and mx.default_device() == mx.gpu:
        share, least, most = CUDA_CHUNKS
        return min(most, max(least, ceiling_bytes // share))
    least, most = UNIFIED_CHUNKS
    return min(most, max(least, CHUNK_TOKENS * bytes_per_token))
