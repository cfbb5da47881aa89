"""Side by side: stock ``mlx_lm.server`` and ``mlx_lm.server --plugin radix``, same model.

Both servers are up at once on 127.0.0.1 and take turns: each workload runs on one and
then on the other, the order alternating, so each has the cores to itself and a slow
spell of the machine hits both alike. Both get the same seeded requests; speed is
reported as radix/stock ratios measured in the same run.

    mlx-radix bench --preset smoke --random smollm2-135m
    python -m mlx_radix_plugin.tools.bench --preset medium --model PATH --json results.json
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import click
from mlx_lm_hooks import blas

from ...models.random_model import EOS, SHAPES, build
from .report import build_report, compare, table, write_charts, write_json
from .servers import ServerProcess, free_port
from .workloads import (
    PRESETS,
    WORKLOADS,
    Preset,
    PromptError,
    Prompts,
    Run,
    Sampling,
    Workload,
    eos_logit_bias,
    fits,
    run_workload,
    single_token_words,
    too_long,
)

__all__ = ["NO_EOS", "Requests", "ServerProcess", "command", "free_port", "run", "server_env"]

SERVER_FLAGS = {"stock": [], "radix": ["--plugin", "radix"]}  # both on the same model

# For callers that send random models word ids (gpu_bench): random weights may emit EOS
# at once; banning it keeps every output full length.
NO_EOS = {str(EOS): -100}


class Requests(random.Random):
    """A seeded stream of word ids below ``vocab`` for a random model, the same for both
    servers (gpu_bench; this benchmark draws whole words from the tokenizer instead)."""

    def __init__(self, seed: int, vocab: int):
        super().__init__(seed)
        self.vocab = vocab


class BenchError(RuntimeError):
    """A server failed to start or to answer; the message carries its log's tail."""


def server_env(hf_cache: Path, extra: dict[str, str]) -> dict[str, str]:
    """Offline, no plugin or radix setting inherited, and this benchmark's own code: the
    servers import mlx_radix_plugin and mlx_lm_hooks from where this process did (a
    checkout or the installed package)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RADIX_")}
    env.pop("MLX_LM_PLUGINS", None)
    here = [
        str(Path(importlib.util.find_spec("mlx_radix_plugin").origin).parent.parent),
        str(Path(importlib.util.find_spec("mlx_lm_hooks").origin).parent.parent),
    ]
    pythonpath = [*dict.fromkeys(here), *filter(None, [env.get("PYTHONPATH")])]
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_cache), **blas_env(), **extra)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return env


def blas_env() -> dict[str, str]:
    """Both servers get the BLAS this process got. Stock mlx_lm.server has no preload of its
    own (the start-up file acts only when a plugin is asked for), so the OpenBLAS is handed
    to both as ``LD_PRELOAD``, which the plugin's preload then leaves alone."""
    status = blas.preload()
    if status.loaded is None or os.environ.get("LD_PRELOAD"):
        return {}
    return {"LD_PRELOAD": ":".join(filter(None, [status.gfortran, status.loaded]))}


def machine(pid: int) -> dict:
    """What the numbers were measured on; ``pid`` is a server whose BLAS is looked up."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "blas": _blas(pid),
    }


def _blas(pid: int) -> str | None:
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    # The library this process preloaded, not any "openblas" (numpy's is prefixed, unused).
    loaded = blas.preload().loaded
    return loaded if loaded and loaded in maps else "MLX's bundled reference BLAS"


def _log_tail(server: ServerProcess, lines: int = 30) -> str:
    return "\n".join(server.output().splitlines()[-lines:])


class _Progress:
    """Per-run lines on stderr, with a bar of finished requests when stderr is a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def line(self, text: str) -> None:
        if self.enabled:
            click.echo(text, err=True)

    @contextlib.contextmanager
    def bar(self, label: str, total: int):
        if not self.tty:
            yield lambda: None
            return
        lock = threading.Lock()
        with click.progressbar(length=total, label=label, file=sys.stderr) as bar:

            def update() -> None:
                with lock:
                    bar.update(1)

            yield update


def _start(
    stack: contextlib.ExitStack,
    name: str,
    model: Path,
    work: Path,
    pool_tokens: int | None,
    warmup: str,
    env: dict[str, str] | None = None,
    log: str | None = None,
) -> tuple[ServerProcess, int | None]:
    """Start ``name``'s server (with ``env`` added to its environment, its output in
    ``work/log``) and send it one request; the server and its peak memory so far (loading
    the model included)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", *SERVER_FLAGS[name], "--model", str(model)]
    cmd += ["--port", str(port)]
    # The plugin as a user runs it: its own memory plan, unless --pool-tokens says otherwise.
    extra = {"MLX_RADIX_POOL_TOKENS": str(pool_tokens)} if name == "radix" and pool_tokens else {}
    extra.update(env or {})
    server = ServerProcess(cmd, server_env(work / "hf", extra), port, work / (log or f"{name}.log"))
    try:
        stack.enter_context(server)
        with server.peak_rss(reset=False) as peak:
            # The first request compiles and warms up before anything is measured.
            server.post("/v1/completions", {"prompt": warmup, "max_tokens": 2})
    except (RuntimeError, OSError) as e:
        raise BenchError(f"{name} server failed: {e}\n{_log_tail(server)}") from e
    return server, peak.bytes


# How long a stopped server may take to exit: the plugin writes its pool out first, for up
# to radix.disk.shutdown_seconds (30 s by default).
STOP_TIMEOUT_S = 120.0


def disk_env(directory: Path, restore: str = "auto") -> dict[str, str]:
    """The plugin's disk tier on, in ``directory``, reading pages back as ``restore`` says
    (``radix.disk.restore``)."""
    return {
        "MLX_RADIX_DISK_ENABLED": "1",
        "MLX_RADIX_DISK_DIR": str(directory),
        "MLX_RADIX_DISK_RESTORE": restore,
    }


def _restart_run(
    name: str,
    model: Path,
    work: Path,
    pool_tokens: int | None,
    warmup: str,
    workload: Workload,
    prompts: Prompts,
    sampling: Sampling,
    tick,
    label: str,
    show: _Progress,
    rep: int = 0,
    on_start=lambda server: None,
    disk_restore: str = "auto",
) -> Run:
    """``workload`` (one that restarts its server) on new processes of ``name``'s server:
    one is started, sent the request before the restart and stopped with SIGTERM; the next,
    on the same disk directory, gets the measured request. ``on_start(server)`` for each;
    their logs are ``work/NAME-WORKLOAD-REP-{1,2}.log``. Each round's disk directory is new
    (under ``work/disk``): the pages found at the restart are that round's."""
    disk = work / "disk" / f"{workload.name}-{rep + 1}"
    env = disk_env(disk, disk_restore) if name == "radix" else {}
    stem = f"{name}-{workload.name}-{rep + 1}"
    current: list[ServerProcess] = []

    def start(stack: contextlib.ExitStack, part: int) -> ServerProcess:
        server, _ = _start(stack, name, model, work, pool_tokens, warmup, env, f"{stem}-{part}.log")
        current[:] = [server]
        on_start(server)
        return server

    with contextlib.ExitStack() as stack:
        first = start(stack, 1)

        def restart(server: ServerProcess) -> tuple[ServerProcess, dict]:
            t0 = time.perf_counter()
            code = server.stop(STOP_TIMEOUT_S)
            t1 = time.perf_counter()
            new = start(stack, 2)
            t2 = time.perf_counter()
            how = "was killed" if code is None else f"exit status {code}"
            show.line(f"{label}: {name} stopped in {t1 - t0:.1f} s ({how}), up in {t2 - t1:.1f} s")
            info = {"exit_code": code, "stop_s": round(t1 - t0, 3), "start_s": round(t2 - t1, 3)}
            return new, info

        try:
            return run_workload(first, name, workload, prompts, sampling, tick, restart=restart)
        except BenchError:
            raise
        except (RuntimeError, OSError) as e:
            log = _log_tail(current[0])
            raise BenchError(f"{label} failed: {e}\n{name} server log:\n{log}") from e


def run(
    model: Path,
    model_label: str,
    preset_name: str,
    *,
    seed: int = 0,
    pool_tokens: int | None = None,
    ban_eos: bool = False,
    only: tuple[str, ...] = (),
    progress: bool = True,
    disk_restore: str = "auto",
) -> dict:
    """Run ``preset_name``'s workloads (or those named in ``only``) on both servers; the
    report of ``bench_report.build_report``."""
    preset: Preset = PRESETS[preset_name]
    workloads = [w for w in preset.workloads if not only or w.name in only]
    if only:
        fits(workloads, model)
        left_out = {}
    else:
        # The preset as a whole on a model that reads less than its longest workload: the
        # rest runs, and the report says what was left out and why.
        left_out = too_long(workloads, model)
        workloads = [w for w in workloads if w.name not in left_out]
    show = _Progress(progress)
    for why in left_out.values():
        show.line(f"left out: {why}")
    sampling = Sampling(eos_logit_bias(model) if ban_eos else {})
    words = single_token_words(model)
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="mlx-radix-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        work = Path(tmp)
        (work / "hf").mkdir()
        warmup = " ".join(words[:3])
        servers: dict[str, ServerProcess] = {}
        startup_rss: dict[str, int | None] = {}
        # Started once for every workload that does not restart its own servers.
        if any(not w.restarts for w in workloads):
            for name in SERVER_FLAGS:
                t0 = time.perf_counter()
                servers[name], startup_rss[name] = _start(
                    stack, name, model, work, pool_tokens, warmup
                )
                show.line(f"{name} server up in {time.perf_counter() - t0:.1f} s")
        meta = {
            "schema": 1,
            "model": model_label,
            "preset": preset_name,
            "seed": seed,
            "pool_tokens": pool_tokens,
            "eos_banned": ban_eos,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(servers["stock"].proc.pid) if servers else None,
            "peak_rss_method": None,
            "left_out": left_out,
        }

        def note_machine(server: ServerProcess) -> None:
            if meta["machine"] is None:
                meta["machine"] = machine(server.proc.pid)

        compared = {}
        for i, workload in enumerate(workloads):
            runs: dict[str, list[Run]] = {name: [] for name in SERVER_FLAGS}
            for rep in range(workload.repeats):
                order = list(SERVER_FLAGS) if (i + rep) % 2 == 0 else list(SERVER_FLAGS)[::-1]
                for name in order:
                    label = f"[{i + 1}/{len(workloads)}] {workload.name} on {name}"
                    if workload.repeats > 1:
                        label += f", round {rep + 1}/{workload.repeats}"
                    # The same seed for both servers: the same requests.
                    prompts = Prompts(f"{seed}:{workload.name}:{rep}", words)
                    try:
                        with show.bar(label, workload.total_requests) as tick:
                            if workload.restarts:
                                r = _restart_run(
                                    name,
                                    model,
                                    work,
                                    pool_tokens,
                                    warmup,
                                    workload,
                                    prompts,
                                    sampling,
                                    tick,
                                    label,
                                    show,
                                    rep,
                                    note_machine,
                                    disk_restore,
                                )
                            else:
                                r = run_workload(
                                    servers[name], name, workload, prompts, sampling, tick
                                )
                    except BenchError:
                        raise
                    except (RuntimeError, OSError) as e:
                        log = _log_tail(servers[name])
                        raise BenchError(f"{label} failed: {e}\n{name} server log:\n{log}") from e
                    runs[name].append(r)
                    meta["peak_rss_method"] = r.peak_rss_method
                    show.line(f"{label}: {len(r.replies)} requests in {r.wall_s:.2f} s")
            compared[workload.name] = compare(workload, runs)
    meta["duration_s"] = round(time.perf_counter() - started, 1)
    return build_report(meta, compared, startup_rss)


def _model_choice(model: str | None, random_shape: str | None, dtype: str, tmp: Path):
    """The model directory to serve and how the report names it."""
    if model and random_shape:
        raise click.UsageError("pass --model or --random, not both")
    if random_shape:
        path = build(random_shape, tmp / "model", dtype=dtype)
        return path, f"random {random_shape} ({dtype})"
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise click.BadParameter(
                f"{model!r} is not an mlx-lm model directory (no config.json)",
                param_hint="--model",
            )
        return path, str(path)
    from ...models.default_model import DefaultModelError, default_model_path

    try:
        path = default_model_path(progress=True)
    except DefaultModelError as e:
        raise click.ClickException(str(e)) from e
    return path, f"default ({path.name})"


@click.command(
    "bench",
    help="Benchmark stock mlx_lm.server against mlx_lm.server --plugin radix on the same "
    "model: shared prefix, burst, prefix repetition, multi-turn chat, decode, decode on a "
    "shared prefix, memory and warm restart workloads, side by side. Prints a table, writes "
    "a JSON report and (with matplotlib) PNG charts. With neither --model nor --random it "
    "uses the default model.",
)
@click.option(
    "--preset",
    type=click.Choice(list(PRESETS)),
    default="small",
    show_default=True,
    help="Workload sizes: smoke (CI, tiny), small, medium.",
)
@click.option("--model", help="An mlx-lm model directory.")
@click.option(
    "--random",
    "random_shape",
    type=click.Choice(sorted(SHAPES)),
    help="Random weights of this shape.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="dtype of a --random model.",
)
@click.option(
    "--workload",
    "only",
    multiple=True,
    type=click.Choice(WORKLOADS),
    help="Run only this workload (repeatable; default: all).",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of every request stream."
)
@click.option(
    "--pool-tokens",
    type=click.IntRange(min=1),
    help="The plugin's pool ceiling in tokens (default: its memory plan, as a user gets).",
)
@click.option(
    "--ban-eos/--allow-eos",
    default=None,
    help="Ban EOS so outputs run to full length (default: banned for --random models).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Report file (default: bench-results/PRESET-TIME.json). Charts go next to it.",
)
@click.option(
    "--disk-restore",
    type=click.Choice(["auto", "on"]),
    default="auto",
    show_default=True,
    help="The plugin's radix.disk.restore in the restart workload (on: read pages back "
    "even where computing them is measured faster, as on a tiny model).",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
def command(
    preset,
    model,
    random_shape,
    dtype,
    only,
    seed,
    pool_tokens,
    ban_eos,
    disk_restore,
    json_path,
    quiet,
):
    with tempfile.TemporaryDirectory(prefix="mlx-radix-model-") as tmp:
        path, label = _model_choice(model, random_shape, dtype, Path(tmp))
        try:
            report = run(
                path,
                label,
                preset,
                seed=seed,
                pool_tokens=pool_tokens,
                ban_eos=bool(random_shape) if ban_eos is None else ban_eos,
                only=only,
                progress=not quiet,
                disk_restore=disk_restore,
            )
        except (BenchError, PromptError) as e:
            raise click.ClickException(str(e)) from e
    # The command that made the report, as typed (``mlx-radix bench`` or ``python -m ...``).
    args = sys.argv[1:]
    args = args[1:] if args[:1] == ["bench"] else args
    command_path = click.get_current_context().command_path
    report["command"] = " ".join([command_path, *map(shlex.quote, args)])
    if json_path is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        json_path = Path("bench-results") / f"{preset}-{stamp}.json"
    click.echo(table(report))
    write_json(report, json_path)
    click.echo(f"\nreport: {json_path}")
    try:
        charts = write_charts(report, json_path.with_suffix(""))
    except ImportError:
        click.echo("charts: skipped, matplotlib is not installed (pip install 'mlx-radix[bench]')")
    else:
        click.echo("charts: " + ", ".join(str(c) for c in charts))


def main() -> None:
    command(prog_name="python -m mlx_radix_plugin.tools.bench")
