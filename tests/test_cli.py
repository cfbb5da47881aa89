"""Every mlx-radix command through click's CliRunner."""

import json

import click
import pytest
from click.testing import CliRunner
from mlx_lm_hooks import blas
from mlx_lm_hooks.hookspecs import hookimpl
from mlx_lm_hooks.plugins import make_plugin_manager

from mlx_radix_plugin.cli import build_cli, cli
from mlx_radix_plugin.config import (
    OLD_FLAGS,
    SETTINGS,
    DeprecatedName,
    render_reference,
    toml_value,
)


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in list(__import__("os").environ):
        if name.startswith("MLX_RADIX_"):
            monkeypatch.delenv(name)
    runner = CliRunner()

    def invoke(*args, group=cli):
        return runner.invoke(group, list(args), catch_exceptions=False)

    return invoke


def test_config_init_show_validate(run, tmp_path):
    path = tmp_path / "radix.toml"
    result = run("config", "init", str(path))
    assert result.exit_code == 0 and path.exists()
    assert run("config", "init", str(path)).exit_code == 2  # refuses to overwrite
    assert run("config", "init", str(path), "--force").exit_code == 0
    result = run("config", "validate", str(path))
    n = len(SETTINGS)
    assert result.exit_code == 0 and f"ok ({n} of {n} keys set)" in result.output
    path.write_text("[radix]\npage_size = 8\n")
    shown = json.loads(run("config", "show", "--config", str(path), "--json").output)
    assert shown["radix.page_size"] == {"value": 8, "source": f"file {path}"}
    assert shown["radix.eviction"] == {"value": "lru", "source": "default"}
    table = run("config", "show", "--config", str(path)).output
    assert "radix.page_size" in table and f"file {path}" in table


def test_config_init_defaults_to_user_config_dir(run, tmp_path):
    result = run("config", "init")
    assert result.exit_code == 0
    written = tmp_path / "xdg" / "mlx-radix" / "config.toml"
    assert written.exists()
    assert "file" in json.loads(run("config", "show", "--json").output)["log_level"]["source"]


def test_config_errors_exit_2_with_the_message(run, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[radix]\neviction = 'fifo'\n")
    result = run("config", "validate", str(bad))
    assert result.exit_code == 2 and "eviction = 'fifo'" in result.output
    assert "expected one of lru, lfu" in result.output
    assert run("config", "show", "--config", str(bad)).exit_code == 2
    missing = run("config", "validate", str(tmp_path / "missing.toml"))
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_serve_rejects_bad_values_before_starting(run):
    result = run("serve", "--page-size", "0", "--model", "whatever")
    assert result.exit_code == 2
    assert "radix.page_size = 0 in the command line" in result.output
    result = run("serve", "--mem-fraction", "2", "--model", "whatever")
    assert result.exit_code == 2 and "mem_fraction" in result.output


def test_plugins_lists_installed_plugins_as_json(run):
    listed = json.loads(run("plugins").output)
    radix = next(p for p in listed if p["name"] == "radix")
    assert radix["entry_point"] == "mlx_radix_plugin.server.plugin:plugin"
    assert radix["package"] == "mlx-radix"


def test_doctor_reports_backend_memory_and_model(run, model_dirs):
    result = run("doctor")
    assert "backend" in result.output and "memory_usable_bytes" in result.output
    report = dict(line.split(None, 1) for line in result.output.splitlines())
    gflops, what = report["blas_gflops"].split(None, 1)
    assert float(gflops) > 0 and what == "(1024x1024 float32 matmul on the CPU)"
    status = blas.preload()  # what conftest did, before MLX was imported
    assert report["blas_preload"] == status.reason
    if status.loaded:  # Linux with mlx-cpu: the OpenBLAS, named by its path
        assert report["blas"] == status.loaded and "blas_advice" not in report
    else:
        assert report["blas"] == blas.describe(status)[0]
    result = run("doctor", "--model", str(model_dirs["gemma3_text"]))
    assert result.exit_code == 0
    report = dict(line.split(None, 1) for line in result.output.splitlines())
    assert report["radix_path"] == "True" and report["sliding_window_layers"] == "2"
    # 4 layers x 1 KV head x (16 + 16) dims x 4 bytes
    assert report["kv_bytes_per_token"] == str(4 * 1 * 32 * 4)
    assert report["kv_dtype"] == "mlx.core.float32"
    # The plan: what the pool may grow to, after the model, working memory and a margin.
    plan = [int(report[k]) for k in ("plan_working_bytes", "plan_margin_bytes", "pool_max_bytes")]
    assert all(n > 0 for n in plan) and "plan_warning" not in report
    assert report["plan_rule"] == "usable - model - working - margin"
    assert int(report["pool_max_bytes"]) <= int(report["memory_usable_bytes"]) - sum(plan[:2])
    assert "recurrent_layers" not in report
    # A hybrid model: its recurrent layers and the snapshots' budget, beside the pages'.
    result = run("doctor", "--model", str(model_dirs["qwen3_5"]))
    report = dict(line.split(None, 1) for line in result.output.splitlines())
    assert report["radix_path"] == "True" and report["recurrent_layers"] == "2"
    # 2 attention layers x 2 KV heads x (16 + 16) dims x 4 bytes
    assert report["kv_bytes_per_token"] == str(2 * 2 * 32 * 4)
    assert 0 < int(report["snapshot_max_bytes"]) < int(report["pool_max_bytes"])
    # falcon_h1: a CacheList of a Mamba-2 state and attention K/V on every layer.
    result = run("doctor", "--model", str(model_dirs["falcon_h1"]))
    report = dict(line.split(None, 1) for line in result.output.splitlines())
    assert report["radix_path"] == "True" and report["recurrent_layers"] == "2"
    assert report["kv_bytes_per_token"] == str(2 * 2 * 32 * 4)


def test_register_commands_hook_adds_commands():
    class Extra:
        @hookimpl
        def mlx_lm_register_commands(self, cli):
            @cli.command()
            def hello():
                click.echo("hello from a plugin")

    pm = make_plugin_manager()
    pm.register(Extra(), name="extra")
    group = build_cli(pm)
    result = CliRunner().invoke(group, ["hello"])
    assert result.exit_code == 0 and result.output == "hello from a plugin\n"
    assert "hello" not in cli.commands  # the base group stays as it was


@pytest.fixture
def served(run, monkeypatch):
    """``mlx-radix serve`` up to the server's start: what the plugin and the server get."""
    import mlx_lm_hooks.server

    from mlx_radix_plugin.server.plugin import plugin

    got = {}
    monkeypatch.setattr(plugin, "configure", lambda overrides, path: got.update(cli=overrides))
    monkeypatch.setattr(
        mlx_lm_hooks.server, "serve", lambda names, args: got.update(names=names, args=args)
    )

    def serve(*args):
        got.clear()
        result = run("serve", "--model", "m", *args)
        assert result.exit_code == 0, result.output
        return got

    return serve


def _other_value(s):
    """A value of ``s`` other than its default, and the flag's arguments that give it."""
    name = s.flag.split("/")[0]
    if s.type is bool:
        return not s.default, [name if not s.default else s.flag.split("/")[1]]
    if s.type is list:
        return ["a.txt", "b.json"], [name, "a.txt", name, "b.json"]
    if s.choices:
        value = next(c for c in s.choices if c != s.default)
        return value, [name, value]
    if s.type is int:
        value = s.default * 2 or 64  # pool_tokens at least a page
    elif s.type is float:
        value = min(s.default + 0.5, s.maximum or float("inf"))
    else:
        value = "/somewhere"
    return value, [name, str(value)]


def test_every_setting_has_a_serve_flag_named_after_its_key(served):
    expected, args = {}, []
    for s in SETTINGS:
        expected[s.key], flag_args = _other_value(s)
        args += flag_args
    got = served(*args)
    assert got["cli"] == expected
    assert got["names"] == ["radix"]
    # mlx_lm.server's own --log-level gets the value too.
    assert got["args"] == ["--model", "m", "--log-level", expected["log_level"]]
    assert served()["cli"] == {}  # no flag: the environment, the file, the defaults


def test_old_serve_flags_still_work_with_a_warning(served):
    with pytest.warns(DeprecatedName) as warned:
        got = served(
            "--shared-prefix", "off", "--max-batch-size", "8", "--no-batched-decode",
            "--disk-bytes", "3000000",
        )  # fmt: skip
    assert got["cli"] == {
        "decode.shared_prefix": "off",
        "decode.max_batch_size": 8,
        "decode.batched": False,
        "radix.disk.mib": 3,
    }
    messages = " ".join(str(w.message) for w in warned)
    for new in ("--decode-shared-prefix", "--decode-max-batch-size", "--decode-batched"):
        assert f"use {new}" in messages
    assert "--disk-bytes is deprecated and goes in the next release: use --disk-mib 3" in messages
    with pytest.warns(DeprecatedName):  # the new flag wins where both are given
        got = served("--shared-prefix", "off", "--decode-shared-prefix", "on")
    assert got["cli"] == {"decode.shared_prefix": "on"}


def test_old_serve_flags_values_are_checked(run):
    result = run("serve", "--model", "m", "--disk-bytes", "-1")
    assert result.exit_code == 2
    assert "--disk-bytes = -1 in the command line: expected an integer >= 0" in result.output


def test_serve_help_shows_each_flag_default_and_environment_variable(run):
    result = run("serve", "--help")
    text = " ".join(result.output.split())
    for s in SETTINGS:
        assert f"{s.flag.replace('/', ' / ')} " in text, s.flag
        assert f"[env var: {s.env}; default: {toml_value(s.default)}]" in text, s.key
    for old in OLD_FLAGS:  # hidden
        assert f" {old.split('/')[0]} " not in text


def test_config_docs_prints_the_reference(run):
    assert run("config", "docs").output == render_reference()
