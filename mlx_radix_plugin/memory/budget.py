"""How many bytes the KV pool, and MLX's cache of freed buffers, may take on this device.

Metal: the recommended working set. CUDA: the device's free memory plus what MLX
already holds. CPU: the system's available RAM plus what MLX already holds. That
figure times ``mem_fraction``, minus the model's own bytes, is the pool's budget; a
share of what is left after the model and the pool bounds MLX's buffer cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx


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


# MLX keeps freed buffers for reuse, with no bound of its own on CUDA: on an H200 (Llama-3-8B,
# bf16, 32 requests on one 4,096-token prefix, stock's batch path) live arrays stayed near
# 33 GB while the cache of freed buffers grew to 94 GB and the generation thread died on
# ``cudaMallocAsync``; a limit of 8 GB kept it at 8 GB and the run completed.
MIN_BUFFER_CACHE_BYTES = 256 << 20


def buffer_cache_limit(
    fraction: float, memory: DeviceMemory, model_bytes: int, pool_bytes: int
) -> int:
    """Bytes MLX may keep in its cache of freed buffers: ``fraction`` of what the device has
    left after the model and the pool (the rest is the batches' working memory), and at
    least ``MIN_BUFFER_CACHE_BYTES`` so that a step's buffers are still reused."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"buffer_cache_fraction must be in (0, 1], got {fraction!r}")
    left = memory.usable_bytes - model_bytes - pool_bytes
    return max(MIN_BUFFER_CACHE_BYTES, int(left * fraction))
