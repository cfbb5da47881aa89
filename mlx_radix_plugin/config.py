"""Configuration: one defaults table; CLI flag > environment > file > default.

The file is TOML (``--config FILE``, else ``$MLX_RADIX_CONFIG``, else
``config.toml`` in the user config dir). The environment variable of a key is
``MLX_RADIX_`` + the key upper-cased with dots as underscores, the ``radix.``
section dropped: ``radix.page_size`` -> ``MLX_RADIX_PAGE_SIZE``,
``decode.batched`` -> ``MLX_RADIX_DECODE_BATCHED``.
"""

from __future__ import annotations

import difflib
import os
import sys
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


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    help: str
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def env(self) -> str:
        key = self.key.removeprefix("radix.")
        return ENV_PREFIX + key.replace(".", "_").upper()

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
        "radix.pool_tokens", 0, "KV pool size in tokens; 0 sizes it from device memory", minimum=0
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
        "the pool grows, and gives memory back, in chunks of this many MiB; 0: 4,096 tokens' "
        "worth within 64 MiB to 1 GiB (on CUDA an 8th of its ceiling within 256 MiB to 16 GiB)",
        minimum=0,
    ),
    Setting(
        "radix.buffer_cache_fraction",
        0.25,
        "share of the memory left after the model, the pool and the batch buffers that MLX "
        "may keep as freed buffers for reuse; 0 leaves MLX's own limit",
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
        "radix.disk.bytes",
        0,
        "the disk tier's budget in bytes; 0: a quarter of its file system's free space at "
        "start, at most 64 GiB",
        minimum=0,
    ),
    Setting(
        "radix.disk.restore",
        "auto",
        "read pages back from disk: auto (where measured faster than computing them), always",
        choices=("auto", "always"),
    ),
    Setting(
        "radix.disk.write",
        "auto",
        "when pages go to disk: through (as they are committed), idle (when the server is "
        "idle, and at shutdown), auto (through on a CPU, idle on a GPU, where writing "
        "through slowed decode)",
        choices=("auto", "through", "idle"),
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
    ),
    Setting(
        "decode.compile",
        "auto",
        "a decode step's Llama, Qwen2 and Qwen3 layers as compiled calls around the cache and "
        "attention, so "
        "that building the step costs the host less (auto: on; off: mlx-lm's layer code; "
        "the same operations, stock's logits bitwise on the CPU)",
        choices=("auto", "off"),
    ),
    Setting(
        "decode.warmup",
        "auto",
        "at model load, run the engine's paths once on a scratch pool, so that the first "
        "requests do not build kernels (auto: on a GPU, where kernels are built at first use)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "prefill.from_pool",
        "auto",
        "a prompt batch reads its rows' cached K/V from the pool layer by layer, holding no "
        "batch copy of them (auto: on, where no layer has a sliding window; stock's logits "
        "bitwise; off: a batch buffer filled from the pool)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "prefill.attention",
        "auto",
        "a prompt pass's attention holds at most the working set's share for it, at any prompt "
        "length (auto: queries, and past that keys, in blocks where the scores would pass it; "
        "on CUDA cuDNN's causal flash attention; logits within the fidelity tolerance; "
        "off: mlx-lm's call whole, as stock, bitwise)",
        choices=("auto", "off"),
    ),
    Setting(
        "prefill.shared_prefix",
        "auto",
        "rows of a prompt batch that share a cached prefix read it once a layer, in one "
        "attention call (auto: where that holds less than each row reading its own; logits "
        "within the fidelity tolerance; off: each row reads its own, stock's logits bitwise)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "model.fuse_projections",
        "auto",
        "compute a layer's q/k/v projections as one matmul, and an MLP's gate/up as one "
        "(auto: on, where the layers allow it; off: stock's matmuls, bitwise)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "server.front",
        "auto",
        "serve HTTP from a process of its own, so that the handlers' per-token work does not "
        "share the generation thread's GIL (auto: one process, as no gain was measured on an H200; "
        "off: one process, as stock)",
        choices=("auto", "on", "off"),
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
    Setting("log_level", "INFO", "log level of mlx-radix", choices=LOG_LEVELS),
)
BY_KEY = {s.key: s for s in SETTINGS}
NOT_SETTINGS = (CONFIG_ENV, CACHE_ENV, BLAS_ENV, DEVICE_MEMORY_ENV)
BY_ENV = {s.env: s for s in SETTINGS}


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


def _check(setting: Setting, value: Any, where: str) -> Any:
    def bad() -> ConfigError:
        return ConfigError(f"{setting.key} = {value!r} in {where}: expected {setting.accepted()}")

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
    where = str(path)
    values = {}
    for key, value in _flatten(data).items():
        if key not in BY_KEY:
            raise _unknown(key, where, BY_KEY)
        values[key] = _check(BY_KEY[key], value, where)
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

    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
            continue
        if name not in BY_ENV:
            raise _unknown(name, "the environment", BY_ENV)
        setting = BY_ENV[name]
        values[setting.key] = _check(setting, _from_env_text(setting, text), f"${name}")
        sources[setting.key] = f"environment {name}"

    for key, value in (cli or {}).items():
        if value is None:
            continue
        if key not in BY_KEY:
            raise _unknown(key, "the command line", BY_KEY)
        values[key] = _check(BY_KEY[key], value, "the command line")
        sources[key] = "command line"
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
        lines.append(f"{name} = {_toml_value(s.default)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
