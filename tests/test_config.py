"""One defaults table; CLI > environment > file > default; errors name key, value, accepted."""

import logging
import os
import re
from pathlib import Path

import pytest
import tomllib

from mlx_radix_plugin.agents import plugin as agents
from mlx_radix_plugin.config import (
    BY_KEY,
    LOGGERS,
    SETTINGS,
    ConfigError,
    DeprecatedName,
    default_file_text,
    load_config,
    read_file,
    set_log_level,
)

NO_ENV: dict = {}


@pytest.fixture
def toml(tmp_path):
    def write(text: str):
        path = tmp_path / "c.toml"
        path.write_text(text)
        return path

    return write


def test_defaults_come_from_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no user file
    cfg = load_config(environ=NO_ENV)
    assert cfg.values == {s.key: s.default for s in SETTINGS}
    assert set(cfg.sources.values()) == {"default"}
    assert cfg["radix.page_size"] == 16 and cfg["radix.eviction"] == "lru"


def test_precedence_cli_over_env_over_file(toml):
    path = toml("[radix]\npage_size = 8\neviction = 'lfu'\npool_tokens = 64\n")
    env = {"MLX_RADIX_PAGE_SIZE": "4", "MLX_RADIX_EVICTION": "lru"}
    cfg = load_config(cli={"radix.page_size": 2}, environ=env, path=path)
    assert cfg["radix.page_size"] == 2 and cfg.sources["radix.page_size"] == "command line"
    assert cfg["radix.eviction"] == "lru"
    assert cfg.sources["radix.eviction"] == "environment MLX_RADIX_EVICTION"
    assert cfg["radix.pool_tokens"] == 64 and cfg.sources["radix.pool_tokens"] == f"file {path}"
    assert cfg.sources["decode.batched"] == "default"


def test_file_from_environment_variable(toml):
    path = toml("log_level = 'debug'\n[decode]\nbatched = false\n")
    cfg = load_config(environ={"MLX_RADIX_CONFIG": str(path)})
    assert cfg["decode.batched"] is False and cfg["log_level"] == "DEBUG"
    assert cfg.file == path


def test_env_names_and_bool_parsing():
    names = {s.key: s.env for s in SETTINGS}
    assert names["radix.page_size"] == "MLX_RADIX_PAGE_SIZE"
    assert names["decode.max_batch_size"] == "MLX_RADIX_DECODE_MAX_BATCH_SIZE"
    assert names["log_level"] == "MLX_RADIX_LOG_LEVEL"
    for text, value in [("0", False), ("yes", True), ("False", False), ("on", True)]:
        assert load_config(environ={"MLX_RADIX_ENABLED": text})["radix.enabled"] is value


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "[radix]\npage_sise = 4\n",
            "unknown key 'radix.page_sise'.*did you mean 'radix.page_size'",
        ),
        ("[radix]\npage_size = 0\n", r"radix.page_size = 0 .*expected an integer >= 1 and <= 4096"),
        ("[radix]\npage_size = '4'\n", r"radix.page_size = '4'.*expected an integer"),
        (
            "[radix]\nmem_fraction = -0.5\n",
            r"mem_fraction = -0.5.*expected a number >= 0.0 and <= 1.0",
        ),
        ("[radix]\neviction = 'fifo'\n", r"eviction = 'fifo'.*expected one of lru, lfu"),
        ("[decode]\nbatched = 1\n", r"decode.batched = 1.*expected true or false"),
        ("[radix\n", "is not valid TOML"),
        ("[radix]\npin = 'a.txt'\n", r"radix.pin = 'a.txt'.*expected a list of file paths"),
        ("[radix.disk]\nmib = -1\n", r"radix.disk.mib = -1.*expected an integer >= 0"),
        ("[radix.disk]\nbytes = -1\n", r"radix.disk.bytes = -1.*expected an integer >= 0"),
        ("[radix.disk]\ndir = 3\n", r"radix.disk.dir = 3.*expected a string"),
        (
            "[radix]\npage_size = 32\npool_tokens = 16\n",
            r"radix.pool_tokens = 16 \(file .*\) is less than one page of radix.page_size = 32 "
            r"\(file .*\): expected 0 \(sized from memory\) or at least 32",
        ),
    ],
)
def test_bad_file_values_name_key_value_and_accepted(toml, text, message):
    path = toml(text)
    with pytest.raises(ConfigError, match=message):
        load_config(environ=NO_ENV, path=path)


def test_bad_environment_and_cli_values():
    with pytest.raises(ConfigError, match=r"\$MLX_RADIX_PAGE_SIZE.*expected an integer"):
        load_config(environ={"MLX_RADIX_PAGE_SIZE": "big"})
    with pytest.raises(ConfigError, match="unknown key 'MLX_RADIX_PAGESIZE'.*MLX_RADIX_PAGE_SIZE"):
        load_config(environ={"MLX_RADIX_PAGESIZE": "4"})
    with pytest.raises(ConfigError, match="max_batch_size = -1 in the command line"):
        load_config(cli={"decode.max_batch_size": -1}, environ=NO_ENV)


def test_lists_and_nested_tables(toml):
    cfg = load_config(environ={"MLX_RADIX_PIN": "a.txt:b.json", "MLX_RADIX_DISK_ENABLED": "1"})
    assert cfg["radix.pin"] == ["a.txt", "b.json"] and cfg["radix.disk.enabled"] is True
    path = toml("[radix]\npin = ['s.txt']\n[radix.disk]\ndir = '/d'\nmib = 1024\n")
    cfg = load_config(environ=NO_ENV, path=path)
    assert (cfg["radix.pin"], cfg["radix.disk.dir"], cfg["radix.disk.mib"]) == (
        ["s.txt"],
        "/d",
        1024,
    )


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_file(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot be read"):
        read_file(tmp_path)  # a directory


def test_default_file_is_valid_toml_holding_every_default(toml):
    text = default_file_text()
    assert all(s.env in text for s in SETTINGS)
    tomllib.loads(text)
    values = read_file(toml(text))
    assert values == {s.key: s.default for s in SETTINGS}


def test_sizes_are_in_mib():
    assert [s.key for s in SETTINGS if s.key.endswith("_bytes") or s.key.endswith(".bytes")] == []
    assert {"radix.chunk_mib", "radix.snapshot_mib", "radix.disk.mib"} <= set(BY_KEY)


def test_an_old_key_is_read_converted_with_a_warning(toml):
    path = toml("[radix.disk]\nbytes = 3000000\n")
    warned = r"radix.disk.bytes in .* is deprecated.*use radix.disk.mib = 3 \(MiB, rounded up\)"
    with pytest.warns(DeprecatedName, match=warned):
        cfg = load_config(environ=NO_ENV, path=path)
    assert cfg["radix.disk.mib"] == 3 and cfg.sources["radix.disk.mib"] == f"file {path}"
    assert "radix.disk.bytes" not in cfg.values
    with pytest.warns(DeprecatedName):  # the new key wins where a file has both
        cfg = load_config(environ=NO_ENV, path=toml("[radix.disk]\nbytes = 1\nmib = 7\n"))
    assert cfg["radix.disk.mib"] == 7
    with pytest.warns(DeprecatedName, match="radix.disk.bytes in the command line"):
        assert load_config(cli={"radix.disk.bytes": 1}, environ=NO_ENV)["radix.disk.mib"] == 1


def test_an_old_environment_variable_is_read_converted_with_a_warning():
    warned = r"\$MLX_RADIX_DISK_BYTES is deprecated.*use MLX_RADIX_DISK_MIB=2 \(MiB, rounded up\)"
    with pytest.warns(DeprecatedName, match=warned):
        cfg = load_config(environ={"MLX_RADIX_DISK_BYTES": str(2 << 20)})
    assert cfg["radix.disk.mib"] == 2
    assert cfg.sources["radix.disk.mib"] == "environment MLX_RADIX_DISK_BYTES"
    with pytest.warns(DeprecatedName):  # the new name wins where both are set
        cfg = load_config(environ={"MLX_RADIX_DISK_BYTES": "1", "MLX_RADIX_DISK_MIB": "5"})
    assert cfg["radix.disk.mib"] == 5
    with pytest.raises(ConfigError, match=r"radix.disk.bytes = 'big' in \$MLX_RADIX_DISK_BYTES"):
        load_config(environ={"MLX_RADIX_DISK_BYTES": "big"})


def test_an_old_value_is_read_as_the_new_one_with_a_warning(toml):
    warned = r"radix.disk.restore = 'always' in \$MLX_RADIX_DISK_RESTORE is deprecated.*'on'"
    with pytest.warns(DeprecatedName, match=warned):
        cfg = load_config(environ={"MLX_RADIX_DISK_RESTORE": "always"})
    assert cfg["radix.disk.restore"] == "on"
    with pytest.warns(DeprecatedName, match=r"radix.disk.restore = 'always' in .*c.toml"):
        assert read_file(toml("[radix.disk]\nrestore = 'always'\n")) == {"radix.disk.restore": "on"}


def test_switches_read_alike():
    """A plain switch is a bool; a choice the server makes itself is auto (its default) and
    the words on and off, unless its ways are named (radix.disk.write, decode.compile)."""
    for s in SETTINGS:
        if s.default == "auto" and s.key not in ("radix.disk.write", "decode.compile"):
            assert set(s.choices) in ({"auto", "on", "off"}, {"auto", "off"}, {"auto", "on"})
        assert "always" not in s.choices and "never" not in s.choices


def test_log_level_sets_every_logger_of_the_project(monkeypatch, tmp_path):
    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("mlx_radix_plugin/**/*.py"), *root.glob("hooks/mlx_lm_hooks/*.py")]
    names = {n for p in sources for n in re.findall(r'getLogger\("([\w.]+)"\)', p.read_text())}
    assert {"mlx_radix", "mlx_radix.agents", "mlx_lm_hooks"} <= names
    assert all(n.split(".")[0] in LOGGERS for n in names), names
    levels = {n: logging.getLogger(n).level for n in LOGGERS}
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no user file
    for name in [n for n in os.environ if n.startswith("MLX_RADIX_")]:
        monkeypatch.delenv(name)  # the suite's own (MLX_RADIX_AGENT_CLIENTS in CI)
    monkeypatch.setenv("MLX_RADIX_LOG_LEVEL", "debug")
    try:
        agents.plugin.mlx_lm_server_start(cli_args=None)  # as the radix plugin's start does
        assert {logging.getLogger(n).getEffectiveLevel() for n in names} == {logging.DEBUG}
        set_log_level("ERROR")
        assert {logging.getLogger(n).getEffectiveLevel() for n in names} == {logging.ERROR}
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
