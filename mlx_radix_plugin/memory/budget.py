"""How many bytes the KV pool may take on this device.

Metal: the recommended working set. CUDA: the device's free memory plus what MLX
already holds. CPU: the system's available RAM plus what MLX already holds. That
figure times ``mem_fraction``, minus the model's own bytes, is the pool's budget.
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
