"""``mlx-radix``: serve, config, cache, doctor, bench, report, soak; plugins add commands."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .config import (
    BY_KEY,
    OLD_FLAGS,
    RENAMED,
    SETTINGS,
    ConfigError,
    Setting,
    default_config_path,
    default_file_text,
    deprecated,
    load_config,
    read_file,
    render_reference,
    setting_for,
    toml_value,
)
from .tools.report import command as report_command

# `mlx-radix serve`'s parameters: one a setting (Setting.flag), by the key's words...
SERVE_OPTIONS = {s.key.replace(".", "_"): s.key for s in SETTINGS}
# ...and the old flags, hidden, by their first name's.
OLD_SERVE_OPTIONS = {
    "old_" + flag.split("/")[0].removeprefix("--").replace("-", "_"): flag for flag in OLD_FLAGS
}


def _setting_option(name: str, s: Setting) -> Callable:
    if s.type is bool:
        kind: dict[str, Any] = {"default": None}
    elif s.type is list:
        kind = {"multiple": True}
    elif s.choices:
        kind = {"type": click.Choice(s.choices)}
    else:
        kind = {"type": s.type}
    # Bounds are the configuration's to check, with its messages; a choice's are the metavar.
    accepted = f"; {s.accepted()}" if s.type in (int, float) else ""
    accepted += "; repeatable" if s.type is list else ""
    extra = f"[env var: {s.env}; default: {toml_value(s.default)}]"
    return click.option(s.flag, name, help=f"{s.help}{accepted}  {extra}", **kind)


def _setting_options(command: Callable) -> Callable:
    """The options of every setting, in the table's order, then the old flags (hidden)."""
    for name, flag in reversed(OLD_SERVE_OPTIONS.items()):
        setting = setting_for(OLD_FLAGS[flag])
        kind = {"default": None} if setting.type is bool else {"type": setting.type}
        command = click.option(flag, name, hidden=True, **kind)(command)
    for name, key in reversed(SERVE_OPTIONS.items()):
        command = _setting_option(name, BY_KEY[key])(command)
    return command


def _serve_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """The settings given on the command line, by key; an old flag's value where its new
    flag is not given, converted, with a warning."""
    overrides = {}
    for name, key in SERVE_OPTIONS.items():
        value = options[name]
        if value is not None and value != ():
            overrides[key] = list(value) if isinstance(value, tuple) else value
    for name, flag in OLD_SERVE_OPTIONS.items():
        value = options[name]
        if value is None:
            continue
        new, renamed = setting_for(OLD_FLAGS[flag]), RENAMED.get(OLD_FLAGS[flag])
        if renamed is None:
            deprecated(flag, new.flag)
        else:
            value = renamed.value(value, "the command line", flag)
            deprecated(flag, f"{new.flag} {value} ({renamed.note})")
        overrides.setdefault(new.key, value)
    return overrides


def _config_or_exit(**kwargs):
    try:
        return load_config(**kwargs)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


@click.group("mlx-radix")
@click.version_option(package_name="mlx-radix")
def cli():
    """A shared radix KV-cache pool for mlx_lm.server."""


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    help="Run mlx_lm.server with the radix plugin. Every mlx_lm.server flag "
    "(--model, --port, ...) is passed through; `mlx_lm.server --help` lists them.",
)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@_setting_options
@click.option("--plugin", "plugins", multiple=True, help="Activate another plugin too.")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve(config_file, plugins, server_args, **options):
    from mlx_lm_hooks.plugins import ActivationError
    from mlx_lm_hooks.server import serve as run_server

    from .server.mlx_lm_internals import IncompatibleMlxLm

    try:
        from .server.plugin import plugin
    except IncompatibleMlxLm as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)

    try:
        overrides = _serve_overrides(options)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    _config_or_exit(cli=overrides, path=config_file)  # fail before anything starts
    plugin.configure(overrides, config_file)
    server_args = list(server_args)
    if "log_level" in overrides:
        # mlx_lm.server has a --log-level of its own (its logger and the root's): it gets
        # the value too, as it did before log_level had a flag.
        server_args += ["--log-level", overrides["log_level"]]
    if not any(a == "--model" or a.startswith("--model=") for a in server_args):
        from .models.default_model import DefaultModelError, default_model_path

        try:
            server_args += ["--model", str(default_model_path())]
        except DefaultModelError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
    try:
        run_server(["radix", *plugins], server_args)
    except ActivationError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


@cli.group()
def config():
    """Show, create and check configuration files."""


@config.command("show")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def config_show(config_file, as_json):
    """The effective configuration and where each value came from."""
    cfg = _config_or_exit(path=config_file)
    if as_json:
        rows = {k: {"value": cfg[k], "source": cfg.sources[k]} for k in cfg.values}
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(k) for k in cfg.values)
    for key, value in cfg.values.items():
        click.echo(f"{key:<{width}}  {json.dumps(value):<8}  {cfg.sources[key]}")


@config.command("init")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def config_init(path, force):
    """Write a commented file of the defaults (default: the user config dir)."""
    target = Path(path) if path else default_config_path()
    if target.exists() and not force:
        click.echo(f"error: {target} exists; --force overwrites it", err=True)
        sys.exit(2)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(default_file_text())
    click.echo(f"wrote {target}")


@config.command("docs")
def config_docs():
    """The configuration reference, docs/configuration.md, made from the settings table."""
    click.echo(render_reference(), nl=False)


@config.command("validate")
@click.argument("path", type=click.Path(dir_okay=False))
def config_validate(path):
    """Check a file: exit 0 if valid, 2 with the problem otherwise."""
    try:
        values = read_file(Path(path))
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(f"{path}: ok ({len(values)} of {len(SETTINGS)} keys set)")


@cli.group()
def cache():
    """The disk tier: what it holds, per model; drop it; fill it ahead of time."""


def _disk_root(config_file) -> Path:
    from .config import cache_dir

    cfg = _config_or_exit(path=config_file)
    return Path(cfg["radix.disk.dir"] or cache_dir() / "disk").expanduser()


@cache.command("ls")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def cache_ls(config_file, as_json):
    """Each model's pages on disk (one directory per model identity)."""
    from .memory.disk_tier import list_tiers

    root = _disk_root(config_file)
    tiers = list_tiers(root)
    if as_json:
        click.echo(json.dumps(tiers, indent=2))
        return
    if not tiers:
        click.echo(f"{root}: nothing cached on disk")
        return
    for t in tiers:
        ident, record = t["record"].get("identity", {}), t["record"]
        click.echo(
            f"{t['id']}  {record.get('model')}  {t['pages']} pages  "
            f"{t['bytes'] / 2**20:.1f} MiB  page_size={ident.get('page_size')}  "
            f"{ident.get('kv_dtype')}"
        )


@cache.command("clear")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--model", "model", help="Only this model's (its directory name, or an id).")
def cache_clear(config_file, model):
    """Delete what the disk tier holds (every model's, or one's)."""
    from .memory.disk_tier import clear_tiers

    removed = clear_tiers(_disk_root(config_file), model)
    click.echo(f"removed {len(removed)} model(s): {' '.join(removed) or '-'}")


@cache.command("warm")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--model", "model_path", help="Model directory or hub name (default model).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
def cache_warm(files, model_path, config_file):
    """Prefill prompt files (text, or chat JSON) into the disk tier ahead of time: a
    server started on it then restores them instead of computing them."""
    from mlx_lm import load

    from .server.pins import PinError, read_pin_file
    from .server.server_cache import ServerPromptCache

    cfg = _config_or_exit(cli={"radix.disk.enabled": True}, path=config_file)
    if model_path is None:
        from .models.default_model import default_model_path

        model_path = str(default_model_path())
    model, tokenizer = load(model_path)
    cache = ServerPromptCache(cfg)
    cache.bind(model, (model_path, None, None), tokenizer=tokenizer)
    if cache.radix is None or cache.radix.tiering is None:
        click.echo(f"error: no disk tier for this model: {cache.fallback or 'see the log'}")
        sys.exit(1)
    for path in files:
        try:
            pinned = cache.pin(read_pin_file(tokenizer, path))
        except PinError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        click.echo(f"{path}: {pinned} tokens")
    disk = cache.radix.tiering.disk
    cache.shutdown(seconds=600)
    click.echo(f"{len(disk)} pages on disk ({disk.nbytes / 2**20:.1f} MiB) in {disk.dir}")


@cli.command("plugins")
def plugins_command():
    """Installed mlx-lm plugins and their hooks, as JSON."""
    from mlx_lm_hooks.plugins import describe

    click.echo(json.dumps(describe(), indent=2))


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,  # --help reaches the benchmark's own command
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args):
    """Benchmark against stock mlx_lm.server, side by side (`mlx-radix bench --help`)."""
    from .tools.bench.command import command  # imports MLX: only when benchmarking

    command.main(list(args), prog_name="mlx-radix bench")


cli.add_command(report_command)  # pure Python: imports no MLX


@cli.command()
@click.option("--model", "model_path", help="Also check this model's architecture.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
def doctor(model_path, config_file):
    """MLX, backend, BLAS, memory, pool size, and whether a model takes the radix path."""
    import mlx.core as mx
    import mlx_lm

    from .memory.budget import device_memory
    from .server.mlx_lm_internals import MLX_LM_VERSION, missing

    cfg = _config_or_exit(path=config_file)
    mem = device_memory()
    report = {
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_lm_ok": mlx_lm.__version__ == MLX_LM_VERSION and not missing(),
        "backend": mem.backend,
        "device": str(mx.default_device()),
        "memory_usable_bytes": mem.usable_bytes,
        "memory_source": mem.source,
        **_blas_report(),
    }
    if model_path:
        report.update(_model_report(model_path, cfg, mem))
    width = max(map(len, report))
    for k, v in report.items():
        click.echo(f"{k:<{width}}  {v}")
    if not report["mlx_lm_ok"]:
        click.echo(f"mlx-radix needs mlx-lm=={MLX_LM_VERSION}", err=True)
        sys.exit(1)


def _blas_report() -> dict:
    """The BLAS that MLX's CPU matmuls use, measured; advice only when it is the slow one."""
    from mlx_lm_hooks import blas

    n = 1024
    status = blas.preload()  # main() ran it first; this is its status
    library, advice = blas.describe(status)
    report = {
        "blas": library,
        "blas_gflops": f"{blas.measure(n):.1f} ({n}x{n} float32 matmul on the CPU)",
        "blas_preload": status.reason,
    }
    if advice:
        report["blas_advice"] = advice
    return report


def _model_report(model_path, cfg, mem) -> dict:
    """Whether the model takes the radix path, and the memory plan: usable memory, the
    model, working memory, the margin and the pool's ceiling (what the server will do)."""
    from mlx_lm import load

    from .memory.pool import KVPool, UnsupportedModel, model_nbytes

    model, _ = load(model_path)
    out = {"model": model_path, "model_bytes": model_nbytes(model)}
    try:
        pool = KVPool.for_model(
            model,
            page_size=cfg["radix.page_size"],
            pool_tokens=cfg["radix.pool_tokens"] or None,
            mem_fraction=cfg["radix.mem_fraction"],
            memory=mem,
            max_batch_size=cfg["decode.max_batch_size"],
            chunk_bytes=cfg["radix.chunk_mib"] << 20 or None,
            snapshot_bytes=cfg["radix.snapshot_mib"] << 20 or None,
        )
    except UnsupportedModel as e:
        return {**out, "radix_path": False, "why_not": str(e)}
    plan = pool.plan
    out.update(
        radix_path=True,
        kv_dtype=str(pool.dtype),
        kv_bytes_per_token=pool.bytes_per_token,
        sliding_window_layers=sum(s.window is not None for s in pool.specs),
        plan_working_bytes=plan.working_bytes,
        plan_margin_bytes=plan.margin_bytes,
        plan_rule=plan.rule,
        pool_max_tokens=pool.max_pages * pool.page_size,
        pool_max_bytes=pool.max_nbytes,
        pool_chunk_bytes=pool.chunk_slots * pool.bytes_per_token,
        # What a prefill reading the pool may hold in temporaries between evaluations.
        prefill_working_bytes=pool.prefill_working_bytes,
    )
    if pool.recurrent:
        # A hybrid: its recurrent layers resume from snapshots (memory/snapshots.py).
        out["recurrent_layers"] = len(pool.recurrent)
        out["snapshot_max_bytes"] = pool.snapshot_budget
    if plan.buffer_reserve_bytes is not None:
        # K/V outside the pool beyond this is taken from the pool's room
        out["plan_buffer_reserve_bytes"] = plan.buffer_reserve_bytes
    if plan.warning:
        out["plan_warning"] = plan.warning
    return out


@cli.command()
@click.option("--model", "model_path", required=True, help="Model directory or hub name.")
@click.option(
    "--minutes", type=click.FloatRange(min=0, min_open=True), default=2.0, help="How long."
)
@click.option("--clients", type=click.IntRange(min=1), default=16, help="Concurrent clients.")
@click.option(
    "--pool-tokens", type=click.IntRange(min=1), default=1024, help="Small, so eviction runs."
)
@click.option("--page-size", type=click.IntRange(min=1), default=4, help="Tokens per KV page.")
@click.option("--check-every", type=click.FloatRange(min=1), default=10.0, help="Seconds.")
@click.option("--seed", type=int, default=0, help="Seed of the clients' requests.")
@click.option(
    "--restart-every",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds: kill the server (SIGKILL) this often and start it again on the same disk "
    "tier, which this turns on; answers must not change and pages must come back from disk.",
)
@click.option(
    "--disk-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Run on the disk tier in this directory [default with --restart-every: a temporary "
    "one, removed after a pass].",
)
@click.option(
    "--disk-mib",
    type=click.IntRange(min=0),
    default=0,
    help="The disk tier's budget in MiB [default 0: the server's own].",
)
@click.option(
    "--adversaries",
    type=click.IntRange(min=0),
    default=0,
    help="More clients sending requests the server must refuse, or hanging up before "
    "their answers [default 0].",
)
def soak(
    model_path,
    minutes,
    clients,
    pool_tokens,
    page_size,
    check_every,
    seed,
    restart_every,
    disk_dir,
    disk_mib,
    adversaries,
):
    """Concurrent clients against mlx_lm.server --plugin radix, invariants checked as it
    runs; one line of verdict, exit status 0 if everything held."""
    from .tools.soak import lines, soak_server

    if restart_every is not None and restart_every >= minutes * 60:
        raise click.BadParameter(
            f"{restart_every:g} s is not shorter than the soak ({minutes * 60:g} s)",
            param_hint="--restart-every",
        )
    report = soak_server(
        model_path,
        minutes,
        clients=clients,
        pool_tokens=pool_tokens,
        page_size=page_size,
        seed=seed,
        check_every=check_every,
        restart_every=restart_every,
        disk_dir=disk_dir,
        disk_mib=disk_mib,
        adversaries=adversaries,
    )
    for line in lines(report):
        click.echo(line)
    sys.exit(1 if report.violations else 0)


def build_cli(pm=None) -> click.Group:
    """The CLI plus the commands of every plugin in ``pm`` (default: all installed)."""
    from mlx_lm_hooks.plugins import load_plugins

    if pm is None:
        pm = load_plugins()
    group = click.Group(cli.name, commands=dict(cli.commands), params=cli.params, help=cli.help)
    pm.hook.mlx_lm_register_commands(cli=group)
    return group


def main() -> None:
    from mlx_lm_hooks import blas

    blas.preload()  # before the plugins, which import mlx.core
    build_cli()()
