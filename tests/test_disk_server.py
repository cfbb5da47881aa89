"""mlx_lm.server with the disk tier: restarts (SIGTERM and SIGKILL), a full disk, and pins."""

import http.client
import json
import os
import signal
import time

import pytest
from servers import NO_EOS, Server, free_port, mlx_lm_server, server_env

PROMPT = "You are a careful assistant who reads the whole manual first. " * 6
GREEDY = {"max_tokens": 6, "temperature": 0.0, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


@pytest.fixture
def start(model_dirs, hf_cache, tmp_path):
    def start(env_extra: dict | None = None, plugin: bool = True, model: str = "llama"):
        port = free_port()
        cmd = mlx_lm_server(*(["--plugin", "radix"] if plugin else []))
        cmd += ["--model", str(model_dirs[model]), "--port", str(port)]
        env = server_env(hf_cache, **(env_extra or {}))
        log = tmp_path / f"log-{port}"
        return Server(cmd, env, port, log)

    return start


def disk_env(path, **extra) -> dict:
    # The tiny test model computes a page faster than a file is read: ``auto`` would not
    # read (test_tiering.py checks that choice).
    return {
        "MLX_RADIX_DISK_ENABLED": "1",
        "MLX_RADIX_DISK_DIR": str(path),
        "MLX_RADIX_DISK_RESTORE": "on",
        **extra,
    }


def ask(server: Server, question: str) -> tuple[str, int]:
    r = server.post("/v1/completions", {"prompt": PROMPT + question, **GREEDY})
    details = r["usage"].get("prompt_tokens_details") or {}
    return r["choices"][0]["text"], details.get("cached_tokens", 0)


def stock_answers(start, questions) -> list[str]:
    with start(plugin=False) as stock:
        return [ask(stock, q)[0] for q in questions]


def loaded_stats(server: Server, timeout: float = 60) -> dict:
    """The stats once the model is loaded (the server answers /health before)."""
    deadline = time.monotonic() + timeout
    while (stats := server.stats())["model"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return stats


def wait_written(server: Server, pages: int = 1, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats["disk_pages"] >= pages or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_a_restart_after_sigterm_hits_on_disk_and_answers_as_stock(start, tmp_path):
    questions = ["Where is Paris?", "Where is Rome?"]
    expected = stock_answers(start, questions)
    env = disk_env(tmp_path / "disk")
    with start(env) as server:
        assert ask(server, questions[0]) == (expected[0], 0)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert "pages written at shutdown" in server.output()
    with start(env) as server:
        text, cached = ask(server, questions[1])
        stats = server.stats()
    assert text == expected[1] and cached > 0
    assert stats["disk_hits"] == 1 and stats["disk_pages_read"] * 4 >= cached
    assert stats["disk_enabled"] == 1 and stats["disk_corrupt"] == 0


@pytest.mark.parametrize("write", ["through", "idle"])
def test_after_a_kill_what_was_written_is_used(start, tmp_path, write):
    questions = ["Where is Oslo?", "Where is Bern?"]
    expected = stock_answers(start, questions)
    env = disk_env(tmp_path / "disk", MLX_RADIX_DISK_WRITE=write)
    with start(env) as server:
        ask(server, questions[0])
        written = wait_written(server)["disk_pages"]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    assert written > 0
    with start(env) as server:
        text, cached = ask(server, questions[1])
        stats = server.stats()
    assert text == expected[1] and cached > 0 and stats["disk_corrupt"] == 0


def test_a_disk_that_fails_turns_the_tier_off_and_the_server_serves(start, tmp_path):
    questions = ["Where is Lima?", "Where is Kyiv?"]
    expected = stock_answers(start, questions)
    # A file where the tier's directory should be: nothing can be written under it.
    (tmp_path / "blocked").write_text("")
    with start(disk_env(tmp_path / "blocked" / "disk")) as server:
        assert [ask(server, q)[0] for q in questions] == expected
        stats = server.stats()
        assert "disk tier off" in server.output()
    assert stats["disk_enabled"] == 0 and stats["hits"] >= 1


def post_pin(server: Server, body: dict, method: str = "POST") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(method, "/v1/cache/pin", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_pins_survive_pressure_that_evicts_everything_else(start, tmp_path):
    pinned_file = tmp_path / "system.txt"
    pinned_file.write_text(PROMPT)
    env = {"MLX_RADIX_POOL_TOKENS": "512", "MLX_RADIX_PIN": str(pinned_file)}
    with start(env) as server:
        stats = loaded_stats(server)
        assert stats["pins"] == 1 and stats["pinned_pages"] > 0
        # Other prompts, many times the pool: everything unpinned is evicted.
        for i in range(12):
            r = server.post("/v1/completions", {"prompt": f"Story {i}: " * 40, **GREEDY})
            assert r["choices"][0]["text"]
        stats = server.stats()
        assert stats["evictions"] > 0
        _, cached = ask(server, "Where is Paris?")
        assert cached >= stats["pinned_pages"] * 4 - 4
        # Unpinned, it may go; a pin that would take more than half the pool is refused.
        assert post_pin(server, {"prompt": PROMPT}, "DELETE") == (200, {"unpinned": True})
        status, body = post_pin(server, {"prompt": "Long one. " * 200})
        assert status == 409 and "at most" in body["error"]
        status, body = post_pin(server, {"messages": "nope"})
        assert status == 400 and "messages" in body["error"]
        status, body = post_pin(server, {"prompt": PROMPT})
        assert status == 200 and body["pinned_tokens"] > 0
        stats = server.stats()
        assert stats["pins"] == 1 and stats["tree_locks"] == 1
        assert stats["pages_locked"] == stats["pinned_pages"]


def test_a_bad_pin_file_is_logged_and_the_server_serves(start, tmp_path):
    env = {"MLX_RADIX_PIN": str(tmp_path / "missing.txt")}
    with start(env) as server:
        assert ask(server, "Where is Paris?")[0]
        assert server.stats()["pins"] == 0
        assert "cannot be read" in server.output()


def test_the_cache_command_lists_warms_and_clears(model_dirs, hf_cache, tmp_path, start):
    from click.testing import CliRunner

    from mlx_radix_plugin.cli import cli

    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    env = {**server_env(hf_cache), **disk_env(tmp_path / "disk")}
    for key in [k for k in os.environ if k.startswith("MLX_RADIX_")]:
        env.setdefault(key, None)
    runner = CliRunner()
    model = str(model_dirs["llama"])
    warmed = runner.invoke(cli, ["cache", "warm", str(prompt), "--model", model], env=env)
    assert warmed.exit_code == 0, warmed.output
    assert "pages on disk" in warmed.output
    listed = runner.invoke(cli, ["cache", "ls", "--json"], env=env)
    (tier,) = json.loads(listed.output)
    assert tier["pages"] > 0 and tier["record"]["model"] == model_dirs["llama"].name
    # A server on that disk tier restores the warmed prompt instead of computing it.
    with start(disk_env(tmp_path / "disk")) as server:
        _, cached = ask(server, "Where is Paris?")
        assert cached > 0 and server.stats()["disk_hits"] == 1
    cleared = runner.invoke(cli, ["cache", "clear"], env=env)
    assert cleared.exit_code == 0 and "removed 1" in cleared.output
    assert json.loads(runner.invoke(cli, ["cache", "ls", "--json"], env=env).output) == []


def test_pins_are_changed_from_this_machine_only():
    from mlx_lm_hooks.routes import RouteRequest

    from mlx_radix_plugin.server.plugin import RadixPlugin

    plugin = RadixPlugin()
    for client in ("10.0.0.5", "192.168.1.7", "not an address"):
        request = RouteRequest("POST", "/v1/cache/pin", "", b'{"prompt": "x"}', client)
        assert plugin.pin_route(request).status == 403
    request = RouteRequest("DELETE", "/v1/cache/pin", "", b'{"prompt": "x"}', "127.0.0.1")
    assert plugin.pin_route(request).status == 409  # no model yet: not refused as a stranger


def test_the_disk_tier_turns_itself_off_under_mlx_launch(loaded, tmp_path, monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import mlx.core as mx

    from mlx_radix_plugin.config import load_config
    from mlx_radix_plugin.server.server_cache import ServerPromptCache

    model, tok = loaded("llama")
    env = {**disk_env(tmp_path / "disk"), "MLX_RADIX_POOL_TOKENS": "256"}
    cache = ServerPromptCache(load_config(environ=env))
    monkeypatch.setattr(mx.distributed, "init", lambda: SimpleNamespace(size=lambda: 2))
    with caplog.at_level(logging.WARNING, "mlx_radix"):
        cache.bind(model, ("m", None, None), tokenizer=tok)
    assert cache.radix is not None and cache.radix.tiering is None
    assert "disk tier off: under mlx.launch (2 ranks)" in caplog.text
    assert not (tmp_path / "disk").exists()
