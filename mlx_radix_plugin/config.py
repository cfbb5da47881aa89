"""Configuration: one defaults table; CLI flag > environment > file > default.

The file is TOML (``--config FILE``, else ``$MLX_RADIX_CONFIG``, else
``config.toml`` in the user config dir). The environment variable of a key is
``MLX_RADIX_`` + the key upper-cased with dots as underscores, the ``radix.``
section dropped: ``radix.page_size`` -> ``MLX_RADIX_PAGE_SIZE``,
``decode.batched`` -> ``MLX_RADIX_DECODE_BATCHED``; its ``mlx-radix serve`` flag is
named alike (``Setting.flag``). The table also holds each setting's reference text:
``render_reference`` makes docs/configuration.md of it.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "MLX_RADIX_"
CONFIG_ENV = "MLX_RADIX_CONFIG"
CACHE_ENV = "MLX_RADIX_CACHE_DIR"  # where the default model is kept (default_model.py)
BLAS_ENV = "MLX_RADIX_BLAS"  # "off": no OpenBLAS preload (mlx_lm_hooks.blas); not a setting
DEVICE_MEMORY_ENV = "MLX_RADIX_DEVICE_MEMORY"  # usable bytes, for the plan (budget.py); not one
APP_NAME = "mlx-radix"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def env_name(key: str) -> str:
    """A key's environment variable: ``radix.page_size`` -> ``MLX_RADIX_PAGE_SIZE``."""
    return ENV_PREFIX + key.removeprefix("radix.").replace(".", "_").upper()


@dataclass(frozen=True)
class Auto:
    """What a setting's automatic value does on each backend, and what measured it."""

    cpu: str
    metal: str
    cuda: str

    @classmethod
    def everywhere(cls, text: str) -> Auto:
        return cls(text, text, text)


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    help: str
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    auto: Auto | None = None  # where the default is a choice the server makes per backend

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def env(self) -> str:
        return env_name(self.key)

    @property
    def flag(self) -> str:
        """``mlx-radix serve``'s option: the key's words, the ``radix.`` section dropped as in
        ``env``, a switch named ``enabled`` its section's name (``--disk/--no-disk``)."""
        name = self.key.removesuffix(".enabled").removeprefix("radix.")
        name = name.replace(".", "-").replace("_", "-")
        return f"--{name}/--no-{name}" if self.type is bool else f"--{name}"

    def accepted(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.type is bool:
            return "true or false"
        if self.type is str:
            return "a string"
        if self.type is list:
            return "a list of file paths"
        kind = "an integer" if self.type is int else "a number"
        op = ">" if self.exclusive_minimum else ">="
        lo = "" if self.minimum is None else f"{op} {self.minimum}"
        hi = "" if self.maximum is None else f"<= {self.maximum}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        return f"{kind} {bounds}".strip()


SETTINGS: tuple[Setting, ...] = (
    Setting("radix.enabled", True, "serve prompts from the shared radix KV pool"),
    Setting("radix.page_size", 16, "tokens per KV page", minimum=1, maximum=4096),
    Setting(
        "radix.pool_tokens",
        0,
        "most tokens the KV pool grows to; 0: the memory plan's ceiling, usable memory less the "
        "model, the batches' working memory and a margin (see radix.mem_fraction)",
        minimum=0,
        auto=Auto(
            cpu="usable memory is the system's available memory (MemAvailable on Linux) plus "
            "what MLX holds",
            metal="usable memory is Metal's recommended working set",
            cuda="usable memory is the device's free memory plus what MLX holds",
        ),
    ),
    Setting(
        "radix.mem_fraction",
        0.0,
        "share of device memory for the model and the pool, when pool_tokens is 0; 0: usable "
        "memory less the model, the batches' working memory and a margin",
        minimum=0.0,
        maximum=1.0,
    ),
    Setting(
        "radix.chunk_mib",
        0,
        "the pool grows, and gives memory back, in chunks of this many MiB; 0: sized per backend",
        minimum=0,
        auto=Auto(
            cpu="4,096 tokens' K/V, within 64 MiB and 1 GiB: memory the server holds is taken "
            "from everything else the machine runs, and a burst that needs 50 MB of K/V then "
            "takes 190 MB, not a 32nd of a 20 GB ceiling (617 MB; SmolLM2's shape, float32). "
            "Reads across chunks cost more: 8 x 2,048 tokens decoded at 175 ms a step over two "
            "chunks, 160 ms in one (2 CPU cores)",
            metal="as on the CPU, since Metal's memory is the machine's too: borrowed from the "
            "CPU measurement, not measured on Metal",
            cuda="an 8th of the pool's ceiling, within 256 MiB and 16 GiB: H200, Llama-3-8B's "
            "shape in bf16, 32 requests on a 4,096-token prefix decoded at 30.1 ms a step in "
            "one chunk, 42.5 ms over chunks of 576 MB and 73.3 ms over chunks of 256 MB",
        ),
    ),
    Setting(
        "radix.buffer_cache_fraction",
        0.25,
        "share of the memory left after the model, the pool and the batch buffers that MLX "
        "may keep as freed buffers for reuse, at most the plan's working memory (on the CPU "
        "and Metal a quarter of it, counted in it); 0 leaves MLX's own limit",
        minimum=0.0,
        maximum=1.0,
    ),
    Setting(
        "radix.hold_to_plan",
        True,
        "hold MLX's live memory to the memory plan: MLX's memory limit is the model, the pool "
        "and the plan's working memory, and evaluation waits for the device where it would pass "
        "it",
    ),
    Setting("radix.eviction", "lru", "which cached prefixes go first", choices=("lru", "lfu")),
    Setting(
        "radix.snapshot_every",
        64,
        "hybrid models (recurrent layers): pages between snapshots of the recurrent state "
        "in a long prompt; 0: only at the system prompt's and the prompt's end",
        minimum=0,
    ),
    Setting(
        "radix.snapshot_mib",
        0,
        "hybrid models: MiB for recurrent-state snapshots, apart from the pages; 0: a quarter "
        "of the pool's memory",
        minimum=0,
    ),
    Setting(
        "radix.pin",
        [],
        "prompt files (text, or chat JSON: .json) prefilled when a model loads and never "
        "evicted while pinned",
    ),
    Setting(
        "radix.disk.enabled",
        False,
        "keep cached prompts' K/V pages on disk too: they survive restarts and eviction",
    ),
    Setting(
        "radix.disk.dir",
        "",
        "where the disk tier keeps its files; empty: disk/ in the mlx-radix cache dir",
    ),
    Setting(
        "radix.disk.mib",
        0,
        "the disk tier's budget in MiB; 0: a quarter of its file system's free space at "
        "start, at most 64 GiB",
        minimum=0,
    ),
    Setting(
        "radix.disk.restore",
        "auto",
        "read pages back from disk (auto: where measured faster than computing them; on: always)",
        choices=("auto", "on"),
        auto=Auto(
            cpu="at each start the server times a prefill of the model and a read of the pages "
            "found on disk, and reads pages back where that is faster. 2 CPU cores, SmolLM2 in "
            "float32: a prefill of 1,000 tokens took 13.9 s and reading them 0.24 s",
            metal="the same comparison, timed on the Mac at each start: no rule is borrowed",
            cuda="the same comparison. H200, Llama-3-8B's shape in bf16: reading 1,000 tokens "
            "back took 0.13-0.16 s and computing them 0.03 s, so pages are kept on disk but not "
            "read back",
        ),
    ),
    Setting(
        "radix.disk.write",
        "auto",
        "when pages go to disk: through (as they are committed), idle (when the server is "
        "idle, and at shutdown)",
        choices=("auto", "through", "idle"),
        auto=Auto(
            cpu="through: decode measured level with the tier off (43.9 against 43.5 "
            "tokens/s, 8 requests, 2 CPU cores)",
            metal="idle, as on CUDA: borrowed from the H200 measurement, not measured on Metal",
            cuda="idle: writing through cost an H200 a quarter of its decode (Llama-3.2-1B's "
            "shape in bf16, 32 requests: 1,643 tokens/s against 2,342 with the tier off); "
            "written when idle, 2,003 against 1,931",
        ),
    ),
    Setting(
        "radix.disk.preload_tokens",
        0,
        "at model load, read the most recently used prompts from disk into the pool, up to "
        "this many tokens (and half the pool); 0: none, pages are read when asked for",
        minimum=0,
    ),
    Setting(
        "radix.disk.shutdown_seconds",
        30.0,
        "on SIGTERM or Ctrl-C, how long the server may take writing out what the pool holds",
        minimum=0.0,
    ),
    Setting("decode.batched", True, "decode concurrent requests in one batch"),
    Setting("decode.max_batch_size", 32, "most requests decoded together", minimum=1, maximum=4096),
    Setting(
        "decode.shared_prefix",
        "auto",
        "read a prefix shared by several decoding requests once (auto: where measured faster; "
        "off: the exact path, stock's kernels)",
        choices=("auto", "on", "off"),
        auto=Auto(
            cpu="the shared path where a step saves at least 5,120 token reads a layer and half "
            "of the exact path's; a lone row stays exact. 2 CPU cores, SmolLM2-135M in float32, "
            "shared against exact: 0.90-1.00x the speed saving under 4k reads, 1.39-1.95x "
            "saving 6k-15k (4x2048, 16x1024, 8x2048 tokens); one row on 8,192 tokens 1.6x "
            "slower",
            metal="the shared path where a step saves at least 32,768 token reads a layer and "
            "half of the exact path's: borrowed from an H200 (CUDA) measurement of the same "
            "path (Llama-3-8B's shape in bf16: 8x1024 tokens 0.90-1.50x the exact path's speed, "
            "32x2048 1.53-1.58x, 32x4096 2.33-2.66x), not measured on Metal",
            cuda="the shared path reads pages through a kernel of its own: taken by batches of "
            "up to 8 rows whatever they save, and by any batch whose pages lie in one chunk of "
            "the pool where the pool stores in place; else as on Metal. H200, Llama-3-8B's "
            "shape in bf16, ms a step exact against shared: 8 rows 15.7-20.0 against 9.9-12.5; "
            "32 rows in one chunk 12.7 against 9.9",
        ),
    ),
    Setting(
        "decode.attention",
        "auto",
        "a decode step whose rows hold no left padding (one request, or rows of one length) "
        "attends without a mask, which it does not need (auto; off: stock's mask, an array "
        "of the batch's)",
        choices=("auto", "off"),
        auto=Auto(
            cpu="no mask where no row is padded: logits stock's bitwise (the CPU's attention "
            "is MLX's composed one either way, and an all-true mask changes nothing), the "
            "mask's select a layer fewer: a 16-layer one-row step 1,161 to 1,085 operations",
            metal="as on the CPU: one query and no mask is MLX's vector kernel, the one stock "
            "mlx-lm's single-request decode runs; not measured on Metal",
            cuda="MLX's one-query kernel, where an array mask takes its composed attention "
            "(two matmuls, a softmax, a select). H100, Llama-3.2-1B's shape in bf16, the "
            "exact path in process: 1 row 2.58-2.66 to 1.77-1.79 ms a step (719 to 467 "
            "operations), 32 rows of one length 3.64 to 2.84 ms; float32 logits within the "
            "fidelity tolerance of off's (9.7e-5 of the largest at 4 rows: off's composed "
            "attention rounds through TF32 matmuls; 1.7e-7 with TF32 off), greedy tokens "
            "equal. The shared path (most batches on CUDA) builds no mask either way",
        ),
    ),
    Setting(
        "decode.compile",
        "auto",
        "a decode step's Llama, Qwen2 and Qwen3 layers as compiled calls around the cache and "
        "attention, so "
        "that building the step costs the host less (layers: the same operations, stock's "
        "logits bitwise on the CPU; pass: the layers, and a shared decode pass through CUDA's "
        "paged kernel as one compiled call, the layer-by-layer logits bit for bit on the "
        "CPU's form of the kernel, a 16-layer tiny shape's one-row pass built in 0.61-0.70 "
        "ms against 1.04-1.06; off: mlx-lm's layer code)",
        choices=("auto", "layers", "pass", "off"),
        auto=Auto(
            cpu="layers: one row's decode step 0.86 to 0.68 ms (2 layers of a tiny shape, in "
            "process), the medium bench's decode 1.09x stock's against 1.03x before; logits "
            "bitwise the uncompiled engine's",
            metal="layers, as on the CPU and CUDA: it saves the host's work building a step, which "
            "every backend does; not measured on Metal",
            cuda="layers. H100, Llama-3.2-1B's shape in bf16: 1 request 377 to 412 tokens/s, "
            "32 requests 5,611 to 6,019; Qwen3-1.7B's shape: within the spread of five runs "
            "(1 request 178-198 tokens/s against 153-203); logits bitwise. pass, on another "
            "H100: layers' logits bit for bit, one row 1.83 against 2.13 ms a step in "
            "process, but through the server 1 request 346-380 tokens/s against 310-413",
        ),
    ),
    Setting(
        "decode.warmup",
        "auto",
        "at model load, run the engine's paths once on a scratch pool, so that the first "
        "requests do not build kernels (auto: on a GPU, where kernels are built at first use)",
        choices=("auto", "on", "off"),
        auto=Auto(
            cpu="off: the CPU's kernels are ready-made; a warm-up before the medium bench's "
            "first burst left it as it was (6.99 s against 6.97 s)",
            metal="on: Metal builds a kernel at its first launch with a new type or layout, as "
            "CUDA does; not measured on Metal",
            cuda="on. H200, Llama-3-8B's shape in bf16: the first burst of 32 requests on a new "
            "2,048-token prefix answered in 0.92 s with it, 3.06 s without (later bursts "
            "0.71-0.87 s). It also builds cuDNN's attention for a fresh prompt's passes up to "
            "the model's context (64 graphs of about 65 ms each for a 131,072-token context): "
            "on an H100 (Llama-3.1-8B) a 32,768-token first prompt took 1.9 s against 3.3-3.4, "
            "a 65,536-token one 5.0 s against 5.9-6.2 (1.5x its FLOP time, from 2.0-2.1x)",
        ),
    ),
    Setting(
        "prefill.from_pool",
        "auto",
        "a prompt batch reads its rows' cached K/V from the pool layer by layer, holding no "
        "batch copy of them (on; stock's logits bitwise either way; off: a batch buffer "
        "filled from the pool; auto: each batch as it starts, where no layer has a sliding "
        "window)",
        choices=("auto", "on", "off"),
        auto=Auto.everywhere(
            "the pool where a buffer would hold a copy nothing else needs: rows that decode "
            "on the shared path, rows whose pages other requests wait for, rows sharing a "
            "prefix that prefill.shared_prefix reads once, or a buffer that would pass the "
            "working set; else the buffer, which reads the history once where "
            "each pass over the pool gathers it again. A turn of 384 tokens over 24,000 of its "
            "own history on 2 CPU cores (tiny-long): 0.63 s with the buffer, 0.67-0.70 s from "
            "the pool"
        ),
    ),
    Setting(
        "prefill.attention",
        "auto",
        "a prompt pass's attention holds at most the working set's share for it, at any prompt "
        "length (auto: queries, and past that keys, in blocks where the scores would pass it; "
        "on CUDA cuDNN's causal flash attention; logits within the fidelity tolerance; "
        "off: mlx-lm's call whole, as stock, bitwise)",
        choices=("auto", "off"),
        auto=Auto(
            cpu="queries, and past that keys, in blocks where a layer's scores would pass the "
            "working set's share for attention, else mlx-lm's call: a bound from the memory "
            "plan, not a speed rule",
            metal="as on the CPU: a bound from Metal's memory plan, not measured on Metal",
            cuda="cuDNN's causal flash attention where it serves the shapes (float16 or "
            "bfloat16, head dims a multiple of 8 up to 128), else blocks as on the CPU. H100, "
            "one layer of Llama-3.1-8B's shape in bf16, 2,048 queries over 24,576 keys: 0.02 GB "
            "of temporaries and 1.5 ms, against 6.46 GB and 9.5 ms with stock's array mask",
        ),
    ),
    Setting(
        "prefill.shared_prefix",
        "auto",
        "rows of a prompt batch that share a cached prefix read it once a layer, in one "
        "attention call (auto: where that holds less than each row reading its own; logits "
        "within the fidelity tolerance; off: each row reads its own, stock's logits bitwise)",
        choices=("auto", "on", "off"),
        auto=Auto(
            cpu="off: a prefill there is the model's compute, and gathers are cheap. 2 CPU cores, "
            "SmolLM2-135M's shape in float32, 8 rows of 30 tokens on a cached 496-token prefix: "
            "19.2-19.5 s grouped, 18.0-18.8 s each row reading its own",
            metal="as on CUDA: a memory rule, not measured on Metal",
            cuda="grouped where the pass's temporaries come to no more than each row reading "
            "its own (a burst's followers, not rows with long contexts of their own). H200, "
            "Llama-3-8B's shape in bf16, bursts of 32 on a 2,048-token prefix: first tokens "
            "in 251 ms grouped, 318 ms each row reading its own",
        ),
    ),
    Setting(
        "model.fuse_projections",
        "auto",
        "compute a layer's q/k/v projections as one matmul, and an MLP's gate/up as one "
        "(auto: on, where the layers allow it; off: stock's matmuls, bitwise)",
        choices=("auto", "on", "off"),
        auto=Auto(
            cpu="on: logits bitwise stock's (13 architectures, and 4-bit layers); 2 CPU cores, "
            "the medium bench's decode at 8 requests 1.03x stock's against 1.00x before",
            metal="on: fewer, larger matmuls, and fewer dispatches to encode; not measured on "
            "Metal",
            cuda="on. H200, Llama-3-8B's shape in bf16: a 32-row step's launch 17.3 to 8.3 ms, "
            "32 requests decoding at 1.59-1.87x stock's against 1.22-1.48x before; logits "
            "within the fidelity tolerance",
        ),
    ),
    Setting(
        "server.front",
        "auto",
        "serve HTTP from a process of its own, so that the handlers' per-token work does not "
        "share the generation thread's GIL (auto: one process, as no gain was measured; "
        "off: one process, as stock)",
        choices=("auto", "on", "off"),
        auto=Auto(
            cpu="one process: a tiny shape's 32 streams decoded at 5,389 tokens/s with the front, "
            "5,282 without",
            metal="one process: not measured on Metal",
            cuda="one process: H200, Llama-3-8B's shape, 32 streams: 1,257 and 1,588 tokens/s "
            "with the front, 1,649 and 1,388 without, within the rounds' spread. H100, "
            "Llama-3.2-1B's shape, 32 streams: 3,784-5,481 with it (median 4,634, 9 rounds), "
            "3,492-4,253 without (3,690, 12 rounds); one stream level; the routes it forwards "
            "(agent APIs) not yet measured with it",
        ),
    ),
    Setting(
        "server.queue_timeout",
        300.0,
        "seconds a request may wait to start (for pool room or a place in the batch) before "
        "it is answered 503 with Retry-After",
        minimum=0.0,
        exclusive_minimum=True,
    ),
    Setting(
        "agents.billing_header",
        False,
        "render Claude Code's billing line (x-anthropic-billing-header, the system prompt's "
        "first block) into the prompt; false leaves it out, so a value that changes (client "
        "version, entry point) costs no cached prefix",
    ),
    Setting("metrics.enabled", True, "serve Prometheus metrics at /metrics"),
    Setting(
        "log_level",
        "INFO",
        "level of mlx-radix's loggers (mlx_radix, mlx_radix.agents, mlx_lm_hooks); "
        "`mlx-radix serve --log-level` passes it to mlx_lm.server's own --log-level too",
        choices=LOG_LEVELS,
    ),
)
BY_KEY = {s.key: s for s in SETTINGS}
NOT_SETTINGS = (CONFIG_ENV, CACHE_ENV, BLAS_ENV, DEVICE_MEMORY_ENV)
BY_ENV = {s.env: s for s in SETTINGS}


@dataclass(frozen=True)
class Renamed:
    """A key's old name (and its environment variable's), read until the next release."""

    old: str
    new: str
    unit: int  # the old key's units in one of the new key's
    note: str  # the new unit, as the warning and the reference say it

    @property
    def env(self) -> str:
        return env_name(self.old)

    def value(self, value: Any, where: str, name: str) -> int:
        """An old key's value (given as ``name``), checked, in the new key's unit."""
        # Rounded up: a small budget must not become 0, which means "sized automatically".
        return -(-_check(BY_KEY[self.new], value, where, name) // self.unit)


# Every size is in MiB: the disk tier's budget was in bytes.
RENAMED = {
    r.old: r for r in (Renamed("radix.disk.bytes", "radix.disk.mib", 1 << 20, "MiB, rounded up"),)
}
RENAMED_BY_ENV = {r.env: r for r in RENAMED.values()}
# Old values, read until the next release: a switch's words are auto, on and off.
OLD_VALUES = {"radix.disk.restore": {"always": "on"}}
# `mlx-radix serve`'s old flags, read until the next release, and the key each sets (an old
# key's value is converted).
OLD_FLAGS = {
    "--batched-decode/--no-batched-decode": "decode.batched",
    "--max-batch-size": "decode.max_batch_size",
    "--shared-prefix": "decode.shared_prefix",
    "--disk-bytes": "radix.disk.bytes",
}
# The project's loggers, which log_level sets: the plugin's (its agents' are mlx_radix.agents)
# and the hooks' (the server's HTTP front).
LOGGERS = ("mlx_radix", "mlx_lm_hooks")


def setting_for(key: str) -> Setting:
    """The setting ``key`` names, by its name or an old one."""
    return BY_KEY[RENAMED[key].new if key in RENAMED else key]


class DeprecatedName(FutureWarning):
    """An old key, environment variable, value or flag: it works until the next release."""


def deprecated(old: str, new: str) -> None:
    """Warn that ``old`` (a name, where it was given) is going; ``new`` says what replaces it."""
    # A warning is shown once per message: serve, radix and agents each read the configuration.
    message = f"{old} is deprecated and goes in the next release: use {new}"
    warnings.warn(message, DeprecatedName, stacklevel=2)


def set_log_level(level: str) -> None:
    """``log_level`` on every logger of the project."""
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level)


class ConfigError(ValueError):
    """A bad key or value; the message names it and says what is accepted."""


def exit_with_usage_error(message: str):
    """Stop before anything starts: the message on stderr, exit status 2 (as argparse)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _unknown(key: str, where: str, known) -> ConfigError:
    hint = difflib.get_close_matches(key, list(known), n=1)
    did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
    return ConfigError(f"unknown key {key!r} in {where}{did_you_mean} (known: {', '.join(known)})")


def _check(setting: Setting, value: Any, where: str, name: str | None = None) -> Any:
    """``value`` as ``setting`` takes it; ``name``: the key it was given under, if an old one."""
    name = name or setting.key

    def bad() -> ConfigError:
        return ConfigError(f"{name} = {value!r} in {where}: expected {setting.accepted()}")

    t = setting.type
    if t is bool:
        if not isinstance(value, bool):
            raise bad()
    elif t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
    elif t is list:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise bad()
        value = list(value)
    elif t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        value = float(value)
    elif not isinstance(value, t):
        raise bad()
    if setting.choices:
        if isinstance(value, str) and setting.key == "log_level":
            value = value.upper()
        new = OLD_VALUES.get(setting.key, {}).get(value)
        if new is not None:
            deprecated(f"{name} = {value!r} in {where}", repr(new))
            value = new
        if value not in setting.choices:
            raise bad()
    if setting.minimum is not None:
        if value < setting.minimum or (setting.exclusive_minimum and value == setting.minimum):
            raise bad()
    if setting.maximum is not None and value > setting.maximum:
        raise bad()
    return value


def _from_env_text(setting: Setting, text: str) -> Any:
    t = setting.type
    if t is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return text
    if t is list:  # file paths, separated as in PATH
        return [part for part in text.split(os.pathsep) if part]
    if t in (int, float):
        try:
            return t(text)
        except ValueError:
            return text
    return text


def cache_dir() -> Path:
    """``$MLX_RADIX_CACHE_DIR``, else the platform's user cache dir for mlx-radix."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / APP_NAME
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / APP_NAME / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / APP_NAME


def default_config_path() -> Path:
    import click

    return Path(click.get_app_dir(APP_NAME)) / "config.toml"


def _flatten(table: Mapping, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def read_file(path: Path) -> dict[str, Any]:
    """The settings in a TOML file, checked; raises ConfigError naming the problem."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    return _by_key(_flatten(data), str(path))


def _by_key(given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One source's values by key, checked; an old key's converted, where the new one is not
    given too."""
    values, old = {}, []
    for key, value in given.items():
        if key in RENAMED:
            old.append((RENAMED[key], value))
        elif key in BY_KEY:
            values[key] = _check(BY_KEY[key], value, where)
        else:
            raise _unknown(key, where, BY_KEY)
    for renamed, value in old:
        value = renamed.value(value, where, renamed.old)
        deprecated(f"{renamed.old} in {where}", f"{renamed.new} = {value} ({renamed.note})")
        values.setdefault(renamed.new, value)
    return values


@dataclass
class Config:
    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    file: Path | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def load_config(
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    path: str | Path | None = None,
) -> Config:
    """Resolve every setting; raises ConfigError on the first bad key or value."""
    environ = os.environ if environ is None else environ
    values = {s.key: s.default for s in SETTINGS}
    sources = {s.key: "default" for s in SETTINGS}

    file = None
    if path is not None:
        file = Path(path)
    elif environ.get(CONFIG_ENV):
        file = Path(environ[CONFIG_ENV])
    elif default_config_path().exists():
        file = default_config_path()
    if file is not None:
        for key, value in read_file(file).items():
            values[key], sources[key] = value, f"file {file}"

    old = []
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
            continue
        if name in RENAMED_BY_ENV:
            old.append((RENAMED_BY_ENV[name], name, text))
            continue
        if name not in BY_ENV:
            raise _unknown(name, "the environment", BY_ENV)
        setting = BY_ENV[name]
        values[setting.key] = _check(setting, _from_env_text(setting, text), f"${name}")
        sources[setting.key] = f"environment {name}"
    for renamed, name, text in old:
        setting = BY_KEY[renamed.new]
        value = renamed.value(_from_env_text(setting, text), f"${name}", renamed.old)
        deprecated(f"${name}", f"{setting.env}={value} ({renamed.note})")
        if setting.env not in environ:  # else the new name's value holds
            values[setting.key], sources[setting.key] = value, f"environment {name}"

    given = {k: v for k, v in (cli or {}).items() if v is not None}
    for key, value in _by_key(given, "the command line").items():
        values[key], sources[key] = value, "command line"
    _check_together(values, sources)
    return Config(values, sources, file)


def _check_together(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """What each key accepts alone can still be wrong together."""
    tokens, page = values["radix.pool_tokens"], values["radix.page_size"]
    if 0 < tokens < page:
        raise ConfigError(
            f"radix.pool_tokens = {tokens} ({sources['radix.pool_tokens']}) is less than one "
            f"page of radix.page_size = {page} ({sources['radix.page_size']}): expected 0 "
            f"(sized from memory) or at least {page}"
        )


def default_file_text() -> str:
    """A commented TOML file holding every default."""
    lines = [
        "# mlx-radix configuration. Precedence: command line > environment > this file.",
        "# Every key is shown with its default; each has an environment variable.",
        "",
    ]
    section = None
    # Keys outside any table must come before the first [table] header.
    for s in sorted(SETTINGS, key=lambda s: "." in s.key):
        head, _, name = s.key.rpartition(".")
        if head != section:
            if head:
                lines += ["", f"[{head}]"]
            section = head
        lines.append(f"# {s.help}; {s.accepted()}; env {s.env}")
        lines.append(f"{name} = {toml_value(s.default)}")
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


# Environment variables that are not settings, as the reference lists them.
OTHER_ENV = (
    ("MLX_LM_PLUGINS", "plugins to activate, as `--plugin` does (names separated by commas)"),
    (
        "MLX_LM_MAX_BODY_BYTES",
        "the largest request body a handler reads, in bytes (default 64 MiB): a larger one is "
        "refused (413) unread",
    ),
    ("MLX_LM_MAX_CONNECTIONS", "connections served at once (default 256): one more gets 503"),
    (CONFIG_ENV, "the TOML file, where `--config` does not name one"),
    (
        CACHE_ENV,
        "the cache directory: the default model, and the disk tier's `disk/` where "
        "`radix.disk.dir` is empty (default: `~/.cache/mlx-radix`, or `$XDG_CACHE_HOME/mlx-radix`, "
        "on Linux; `~/Library/Caches/mlx-radix` on macOS)",
    ),
    (
        BLAS_ENV,
        "`off`: on Linux with MLX's CPU wheel, no OpenBLAS is loaded in place of the wheel's "
        "reference BLAS (whose matmuls are about 40x slower)",
    ),
    (
        DEVICE_MEMORY_ENV,
        "usable memory in bytes, in place of the device's figure, for the memory plan (to try "
        "a plan with `mlx-radix doctor --model PATH`)",
    ),
)
BACKENDS = (("cpu", "CPU"), ("metal", "Metal"), ("cuda", "CUDA"))
TYPE_NAMES = {bool: "bool", int: "integer", float: "number", str: "string", list: "list"}

REFERENCE_HEAD = """\
# Configuration

<!-- Generated from the settings table in mlx_radix_plugin/config.py: edit it there, then run
`mlx-radix config docs > docs/configuration.md` (tests/test_configuration_doc.py checks). -->

Every setting has a key in the TOML file, an environment variable and a flag of
`mlx-radix serve`. The first of these that is given sets it:

1. the flag of `mlx-radix serve` (`--page-size 8`);
2. the environment variable (`MLX_RADIX_PAGE_SIZE=8`);
3. the TOML file: `--config FILE`, else `$MLX_RADIX_CONFIG`, else `config.toml` in the user
   config directory (`~/.config/mlx-radix/`, or `$XDG_CONFIG_HOME/mlx-radix/`, on Linux;
   `~/Library/Application Support/mlx-radix/` on macOS);
4. the default.

`mlx_lm.server --plugin radix` reads the environment and the file. A bad key or value stops
the server before it starts (exit status 2), naming it, where it came from and what is
accepted. `mlx-radix config init [PATH]` writes a file of every default, `mlx-radix config
show` prints each value and where it came from, `mlx-radix config validate FILE` checks a file.

**Names.** A key's environment variable is `MLX_RADIX_` and the key in capitals, dots as
underscores, without the `radix.` section: `radix.page_size` is `MLX_RADIX_PAGE_SIZE`,
`decode.batched` is `MLX_RADIX_DECODE_BATCHED`. Its flag is the same words with dashes
(`--page-size`, `--decode-batched`); a switch named `enabled` takes its section's name
(`--disk/--no-disk` for `radix.disk.enabled`).

**Values.** A plain switch is a bool: `--x/--no-x`, in the environment `1`, `true`, `yes`,
`on` or `0`, `false`, `no`, `off`. A choice the server makes itself defaults to `auto`; the
other values force it: `on` and `off` (only `off` where `auto` is on wherever the feature
applies, only `on` for `radix.disk.restore`, which has no off), or named ways
(`radix.disk.write`). Memory is counted in MiB (the keys ending in `mib`), time in seconds.
A list (`radix.pin`) repeats its flag, and separates its items with `:` (`;` on Windows) in
the environment.

**Backends.** CPU is MLX's CPU backend (Linux), Metal an Apple GPU, CUDA an NVIDIA GPU.
Nothing here has been measured on Metal: where Metal's automatic choice follows a rule, its
entry says which CPU or CUDA measurement the rule comes from.

## Settings
"""


def render_reference() -> str:
    """docs/configuration.md: precedence, every setting, the other environment variables and
    the deprecated names (``mlx-radix config docs``)."""
    lines = [REFERENCE_HEAD]
    for s in SETTINGS:
        lines += _reference_entry(s)
    lines += ["## Other environment variables", "", "| variable | what it does |", "|---|---|"]
    lines += [f"| `{name}` | {text} |" for name, text in OTHER_ENV]
    lines += [
        "",
        "## Deprecated names",
        "",
        "These still work, with a warning naming the new one, until the next release.",
        "",
        "| old | new |",
        "|---|---|",
    ]
    for r in RENAMED.values():
        new = BY_KEY[r.new]
        lines.append(f"| `{r.old}`, `{r.env}` | `{r.new}`, `{new.env}` ({r.note}) |")
    for key, words in OLD_VALUES.items():
        lines += [
            f"| `{key} = {toml_value(old)}` | `{toml_value(new)}` |" for old, new in words.items()
        ]
    for flag, key in OLD_FLAGS.items():
        note = f" ({RENAMED[key].note})" if key in RENAMED else ""
        lines.append(f"| `{flag}` | `{setting_for(key).flag}`{note} |")
    return "\n".join(lines) + "\n"


def _reference_entry(s: Setting) -> list[str]:
    flag = f"`{s.flag}`" + (" (repeated)" if s.type is list else "")
    lines = [
        f"### `{s.key}`",
        "",
        _sentence(s.help),
        "",
        "| type | default | environment | flag | accepts |",
        "|---|---|---|---|---|",
        f"| {TYPE_NAMES[s.type]} | `{toml_value(s.default)}` | `{s.env}` | {flag} | "
        f"{s.accepted()} |",
        "",
    ]
    if s.auto is not None:
        lines += [f"What `{s.default}` does on each backend:", ""]
        if s.auto.cpu == s.auto.metal == s.auto.cuda:
            lines.append(f"- CPU, Metal and CUDA: {_sentence(s.auto.cpu, capital=False)}")
        else:
            lines += [
                f"- {name}: {_sentence(getattr(s.auto, b), capital=False)}" for b, name in BACKENDS
            ]
        lines.append("")
    return lines


def _sentence(text: str, capital: bool = True) -> str:
    return (text[0].upper() + text[1:] if capital else text) + "."
