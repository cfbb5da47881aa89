"""The plugin host: specs, manager, call sites in a real mlx_lm.server, start-up shim."""

import ast
import http.client
import inspect
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from mlx_lm_hooks import _startup, hookspecs
from mlx_lm_hooks.plugins import UnknownPlugin, activate, make_plugin_manager
from probe_plugin import Probe
from servers import NO_EOS, Server, free_port, server_env

from mlx_radix_plugin.cli import build_cli

SPECS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("mlx_lm_") and callable(f))


def test_every_spec_is_prefixed_and_documented_in_one_line():
    assert len(SPECS) == 10
    for name in SPECS:
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and "\n" not in doc, name
    # hookspecs.py holds only markers and specs.
    tree = ast.parse(Path(hookspecs.__file__).read_text())
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert sorted(defs) == SPECS


def test_prompt_cache_and_batch_generator_have_one_answer():
    pm = make_plugin_manager()
    assert pm.hook.mlx_lm_prompt_cache.spec.opts["firstresult"]
    assert pm.hook.mlx_lm_batch_generator.spec.opts["firstresult"]


def test_activate_unknown_plugin_names_the_installed_ones():
    pm = make_plugin_manager()
    with pytest.raises(UnknownPlugin, match="unknown plugin 'nope'; installed plugins: .*radix"):
        activate(["nope"], pm)
    assert activate(["radix", "radix"], pm) == ["radix", "radix"]
    assert pm.has_plugin("radix")


@pytest.fixture(scope="module")
def probe_server(model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    port = free_port()
    cmd = [
        sys.executable,
        str(Path(__file__).parent / "probe_plugin.py"),
        "--model",
        str(model_dirs["llama"]),
        "--port",
        str(port),
    ]
    env = server_env(tmp)
    env["PYTHONPATH"] += ":" + str(Path(__file__).parent)
    with Server(cmd, env, port, tmp / "log") as server:
        yield server


def test_every_hook_is_called_by_a_real_server(probe_server):
    probe_server.post(
        "/v1/completions", {"prompt": "Paris is", "max_tokens": 3, "logit_bias": NO_EOS}
    )
    probe_server.stream(
        "/v1/completions", {"prompt": "Berlin is", "max_tokens": 2, "logit_bias": NO_EOS}
    )
    deadline = time.monotonic() + 30
    while True:  # the generation thread goes idle within 0.1 s of the last request
        status, body = probe_server.get("/probe")
        assert status == 200
        calls = json.loads(body)
        if "mlx_lm_generation_idle" in calls or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert calls["mlx_lm_server_start"] == [{"port": probe_server.port}]
    assert calls["mlx_lm_model_loaded"][0]["layers"] == 2
    assert calls["mlx_lm_prompt_cache"] == [{"size": 10}]
    assert calls["mlx_lm_http_front"] == [{"port": probe_server.port}]  # asked once, at start
    assert "completion_batch_size" in calls["mlx_lm_batch_generator"][0]["kwargs"]
    finished = calls["mlx_lm_request_finished"]
    assert [f["reason"] for f in finished] == ["length", "length"]
    assert [f["generated"] for f in finished] == [3, 2]
    assert calls["mlx_lm_generation_idle"] == [{}]
    # The CLI hook runs in the CLI, not the server.
    pm = make_plugin_manager()
    probe = Probe()
    pm.register(probe)
    build_cli(pm)
    # The last one runs when the server stops (test_sigterm_stops_the_server_...).
    assert set(calls) | set(probe.calls) | {"mlx_lm_server_stopped"} == set(SPECS)


def test_sigterm_stops_the_server_cleanly_and_tells_the_plugins(model_dirs, tmp_path):
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).parent / "probe_plugin.py")]
    cmd += ["--model", str(model_dirs["llama"]), "--port", str(port)]
    env = server_env(tmp_path, PROBE_CALLS_FILE=str(tmp_path / "calls.json"))
    env["PYTHONPATH"] += ":" + str(Path(__file__).parent)
    with Server(cmd, env, port, tmp_path / "log") as server:
        server.post("/v1/completions", {"prompt": "Paris is", "max_tokens": 2})
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls["mlx_lm_server_stopped"] == [{}]
    assert len(calls["mlx_lm_request_finished"]) == 1


def test_plugin_routes_and_stock_routes_side_by_side(probe_server):
    assert probe_server.get("/health") == (200, '{"status": "ok"}')
    assert probe_server.get("/v1/models")[0] == 200
    assert probe_server.get("/nowhere")[0] == 404
    status, body = probe_server.get("/probe/boom")
    assert status == 500 and "Traceback" not in body and "ZeroDivision" not in body
    conn = http.client.HTTPConnection("127.0.0.1", probe_server.port, timeout=60)
    conn.request("POST", "/probe/echo", b"ping")
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b"ping")


@pytest.mark.parametrize(
    "argv, env, names, rest",
    [
        (["--plugin", "radix", "--port", "1"], {}, ["radix"], ["--port", "1"]),
        (["--plugin=radix", "--model", "m"], {}, ["radix"], ["--model", "m"]),
        (["--plugin", "a", "--plugin=b,c"], {"MLX_LM_PLUGINS": "b, d"}, ["b", "d", "a", "c"], []),
        (["--model", "m"], {}, [], ["--model", "m"]),
    ],
)
def test_split_plugin_args(argv, env, names, rest):
    assert _startup.split_plugin_args(argv, env) == (names, rest)


@pytest.mark.parametrize("argv", [["--plugin"], ["--plugin", "--model"], ["--plugin="]])
def test_plugin_flag_without_a_name(argv):
    with pytest.raises(_startup.PluginArgumentError, match="--plugin needs a plugin name"):
        _startup.split_plugin_args(argv, {})


def test_bootstrap_does_nothing_unless_asked_and_is_idempotent(monkeypatch):
    finders = lambda: [f for f in sys.meta_path if isinstance(f, _startup._ServerFinder)]  # noqa: E731
    monkeypatch.setattr(sys, "argv", ["python", "-c", "pass"])
    monkeypatch.delenv("MLX_LM_PLUGINS", raising=False)
    before = list(sys.meta_path)
    _startup.bootstrap()
    assert sys.meta_path == before
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(
        sys, "modules", {k: v for k, v in sys.modules.items() if k != "mlx_lm.server"}
    )
    monkeypatch.setenv("MLX_LM_PLUGINS", "radix")
    _startup.bootstrap()
    _startup.bootstrap()  # a .pth seen twice
    assert len(finders()) == 1


def test_bootstrap_never_raises_and_says_in_one_line_why_plugins_are_off(monkeypatch, capsys):
    from mlx_lm_hooks import blas

    before = list(sys.meta_path)

    def broken():
        raise OSError("libopenblas.so.0: cannot open shared object file")

    monkeypatch.setattr(sys, "argv", ["mlx_lm.server", "--plugin", "radix"])
    monkeypatch.setattr(blas, "preload", broken)
    _startup.bootstrap()
    assert sys.meta_path == before  # nothing left behind
    assert capsys.readouterr().err == (
        "mlx_lm_hooks: plugins not activated: OSError: libopenblas.so.0: cannot open shared "
        "object file\n"
    )
    monkeypatch.setattr(sys, "argv", None)  # whatever state the interpreter is in
    _startup.bootstrap()
    assert sys.meta_path == before


def test_a_plugin_that_fails_to_load_stops_the_start_in_one_line(monkeypatch, capsys):
    from mlx_lm_hooks import plugins

    class EntryPoint:
        def load(self):
            raise ImportError("mlx-radix needs mlx-lm==0.32.2; found mlx-lm 0.40.0")

    monkeypatch.setattr(plugins, "installed_plugins", lambda: {"broken": EntryPoint()})
    monkeypatch.setattr(sys, "argv", ["mlx_lm.server", "--plugin", "broken"])
    main = _startup._main_with_plugins(lambda: pytest.fail("stock main must not run"))
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: plugin 'broken' could not be loaded: mlx-radix needs mlx-lm==0.32.2; "
        "found mlx-lm 0.40.0\n"
    )


def test_install_changes_nothing_in_a_server_that_lacks_what_it_swaps(monkeypatch):
    import mlx_lm.server as server
    from mlx_lm_hooks import server as hooks_server

    stock, pm = server.ModelProvider, hooks_server._Installed.pm
    monkeypatch.delattr(server, "TimeBudget")
    with pytest.raises(hooks_server.IncompatibleServer, match="has no TimeBudget: the plugin"):
        hooks_server.install(make_plugin_manager())
    assert server.ModelProvider is stock and hooks_server._Installed.pm is pm


def test_startup_module_imports_nothing_heavy():
    source = Path(_startup.__file__).read_text()
    top = [n for n in ast.parse(source).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert sorted(a.name for n in top for a in n.names) == ["os", "sys"]


def test_other_mlx_lm_is_refused_naming_the_pin_and_what_it_lacks(monkeypatch):
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    from mlx_radix_plugin.server import mlx_lm_internals

    mlx_lm_internals.check()  # this one is right
    monkeypatch.setattr(mlx_lm, "__version__", "0.33.0")
    with pytest.raises(mlx_lm_internals.IncompatibleMlxLm) as refused:
        mlx_lm_internals.check()
    assert "needs mlx-lm==0.32.2" in str(refused.value) and "found mlx-lm 0.33.0." in str(
        refused.value
    )
    monkeypatch.delattr(BatchGenerator, "_find_uids")
    with pytest.raises(mlx_lm_internals.IncompatibleMlxLm, match="lacks BatchGenerator._find_uids"):
        mlx_lm_internals.check()


def test_every_hook_is_documented_where_the_readme_points():
    root = Path(__file__).parent.parent
    assert "docs/architecture.md#the-hooks-server" in (root / "README.md").read_text()
    architecture = (root / "docs" / "architecture.md").read_text()
    for name in SPECS:
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"`{name}({params})`" in architecture, name


def test_a_waiting_request_ends_the_decode_budget_after_one_step():
    """Stock decodes for 0.5 s between looks at its queue; the host's server looks every step."""
    import mlx_lm.server as server
    from mlx_lm_hooks.server import install, uninstall

    class Provider:  # what the generation thread touches while no request comes
        def load_default(self):
            pass

        def reset(self):
            pass

    install(make_plugin_manager())
    try:
        generator = server.ResponseGenerator(Provider(), None)
        generator.stop_and_join()
    finally:
        uninstall()
    budget = generator._time_budget
    steps = 0
    for _ in budget:  # nothing waiting: steps go on until the 0.5 s are spent
        steps += 1
        if steps == 5:
            break
    assert steps == 5
    generator.requests.put("a request")
    assert sum(1 for _ in budget) == 1
    assert sum(1 for _ in budget) == 1  # each look at the queue runs one step first


@pytest.mark.parametrize("plugins", [[], ["radix"]])
def test_a_failed_step_fails_its_batch_and_the_server_goes_on(model_dirs, tmp_path, plugins):
    """Stock's generation thread dies with the first exception in a step, and every later
    request gets "generation thread died"; here that batch's requests get an error (an
    error event on a stream, 503 otherwise), what they held is given back, and the next
    requests are served."""
    from boom_plugin import ARMED_MAX_TOKENS, FAIL_AFTER

    port = free_port()
    script = str(Path(__file__).parent / "boom_plugin.py")
    cmd = [sys.executable, script, *[",".join(plugins)] * bool(plugins)]
    cmd += ["--model", str(model_dirs["llama"]), "--port", str(port)]
    env = server_env(tmp_path)
    env["PYTHONPATH"] += ":" + str(Path(__file__).parent)
    greedy = {"temperature": 0.0, "logit_bias": NO_EOS}
    with Server(cmd, env, port, tmp_path / "log") as server:
        ok = {"prompt": "Where is Paris?", "max_tokens": 8, **greedy}
        before = server.post("/v1/completions", ok)["choices"][0]["text"]
        armed = {"prompt": "Tell me a story.", "max_tokens": ARMED_MAX_TOKENS, **greedy}
        events = server.stream("/v1/completions", armed)
        texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
        assert len(texts) == FAIL_AFTER
        assert "injected failure in a decode step" in events[-1]["error"]
        assert "send it again" in events[-1]["error"]
        with pytest.raises(RuntimeError, match="503 .*injected failure in a decode step"):
            server.post("/v1/completions", armed)
        # The server goes on: healthy, and the same answers as before the failures.
        assert server.get("/health")[0] == 200
        assert server.post("/v1/completions", ok)["choices"][0]["text"] == before
        if plugins:  # the failed requests' pages went back: nothing holds any
            stats = json.loads(server.get("/v1/cache/stats")[1])
            assert stats["fallback"] is None and stats["hits"] >= 1  # the radix engine ran
            assert stats["pages_locked"] == stats["requests_holding_pages"] == 0, stats
        log = server.output()
    assert log.count("a generation step failed") == 2
    assert "Exception occurred during processing of request" not in log  # no handler died


def test_a_row_whose_own_work_fails_is_failed_alone_and_its_batch_goes_on(model_dirs, tmp_path):
    """A logits processor that raises in a step (the graph of one row) fails that request
    alone on the radix engine: it gets the error (an event on a stream, 503 otherwise),
    the stream beside it in the same batch goes on to the answer it gets alone, and the
    failed row's pages go back."""
    import threading

    from boom_plugin import ARMED_ROW_MAX_TOKENS, FAIL_AFTER, ROW_FAILURE

    port = free_port()
    script = str(Path(__file__).parent / "boom_plugin.py")
    cmd = [sys.executable, script, "radix", "--model", str(model_dirs["llama"])]
    cmd += ["--port", str(port)]
    env = server_env(tmp_path)
    env["PYTHONPATH"] += ":" + str(Path(__file__).parent)
    greedy = {"temperature": 0.0, "logit_bias": NO_EOS}
    story = {"prompt": "Tell me a long story.", "max_tokens": 300, **greedy}
    armed = {"prompt": "Where is Paris?", "max_tokens": ARMED_ROW_MAX_TOKENS, **greedy}
    with Server(cmd, env, port, tmp_path / "log") as server:
        alone = server.post("/v1/completions", story)["choices"][0]["text"]
        streaming, events = threading.Event(), []

        def good():
            events.extend(server.stream("/v1/completions", story, on_first=streaming.set))
            events.append(time.monotonic())

        client = threading.Thread(target=good)
        client.start()
        assert streaming.wait(60)
        failed = server.stream("/v1/completions", armed)
        with pytest.raises(RuntimeError, match=f"503 .*{ROW_FAILURE}"):
            server.post("/v1/completions", armed)
        both_failed = time.monotonic()
        client.join(120)
        assert events.pop() > both_failed  # the story was streaming all along
        assert server.get("/health")[0] == 200
        stats = json.loads(server.get("/v1/cache/stats")[1])
        log = server.output()
    texts = [e["choices"][0]["text"] for e in failed if e.get("choices")]
    assert len(texts) <= FAIL_AFTER
    assert ROW_FAILURE in failed[-1]["error"] and "went on" in failed[-1]["error"]
    assert not any("error" in e for e in events)  # still streaming when the rows failed
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == alone
    assert stats["pages_locked"] == stats["requests_holding_pages"] == 0, stats
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"], stats
    assert "a generation step failed" not in log  # no batch failed
    assert log.count("a logits processor of request") == 2


@pytest.mark.parametrize("plugins", [[], ["radix"]])
def test_an_allocation_failure_in_a_prompt_pass_leaves_the_server_serving(
    model_dirs, tmp_path, plugins
):
    """A prompt pass that fails as MLX's allocator does (out of memory, in the pass's
    evaluation, its first pass's pages written and the second's K/V staged): the request gets
    the error, the server answers the next requests as before, and no page stays held."""
    from boom_plugin import ARMED_PROMPT_MAX_TOKENS, OUT_OF_MEMORY

    port = free_port()
    script = str(Path(__file__).parent / "boom_plugin.py")
    cmd = [sys.executable, script, *[",".join(plugins)] * bool(plugins)]
    cmd += ["--model", str(model_dirs["llama"]), "--port", str(port), "--prefill-step-size", "32"]
    env = server_env(tmp_path)
    env["PYTHONPATH"] += ":" + str(Path(__file__).parent)
    greedy = {"temperature": 0.0, "logit_bias": NO_EOS}
    story = "Once upon a time, in a quiet town by the sea, there lived an old keeper. " * 3
    with Server(cmd, env, port, tmp_path / "log") as server:
        ok = {"prompt": story + "Where is Paris?", "max_tokens": 8, **greedy}
        before = server.post("/v1/completions", ok)["choices"][0]["text"]
        # Nothing of it cached: its prompt takes several passes of 32 tokens.
        armed = {"prompt": "Tell me more. " + story * 2, "max_tokens": ARMED_PROMPT_MAX_TOKENS}
        with pytest.raises(RuntimeError, match="503 .*out of memory"):
            server.post("/v1/completions", {**armed, **greedy})
        events = server.stream("/v1/completions", {**armed, **greedy})
        assert OUT_OF_MEMORY in events[-1]["error"]
        assert server.get("/health")[0] == 200
        assert server.post("/v1/completions", ok)["choices"][0]["text"] == before
        other = {"prompt": "A different prompt, with nothing cached.", "max_tokens": 8, **greedy}
        assert server.post("/v1/completions", other)["choices"][0]["text"]
        if plugins:
            stats = json.loads(server.get("/v1/cache/stats")[1])
            assert stats["fallback"] is None
            assert stats["pages_locked"] == stats["requests_holding_pages"] == 0, stats
            # Every page is free or in the tree: none leaked with the failed requests.
            assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"], stats
        log = server.output()
    assert log.count("a generation step failed") == 2
    assert "Exception occurred during processing of request" not in log


def test_a_route_served_by_two_plugins_is_one_route_and_a_clash_is_refused():
    from mlx_lm_hooks.routes import RouteResponse, RouteTable

    def handler(request):
        return RouteResponse(200, {})

    table = RouteTable()
    table.register("post", "/v1/messages", handler)
    table.register("POST", "/v1/messages", handler)  # the agents plugin and radix, say
    assert list(table) == [("POST", "/v1/messages")]
    with pytest.raises(ValueError, match="already registered"):
        table.register("POST", "/v1/messages", lambda request: RouteResponse(200, {}))


def test_the_idle_hook_runs_before_the_generation_thread_waits(monkeypatch):
    """What a plugin leaves for idle time (a finished request's commit) runs before the
    wait for the next request, not after an empty one; a queued request is served first."""
    import queue

    from mlx_lm_hooks import server as hooks_server

    events = []

    class Stock:
        _is_distributed = False

        def _next_request(self, timeout=None):
            events.append(("look", timeout))
            try:
                return self.requests.get(timeout=timeout) if timeout else self.requests.get_nowait()
            except queue.Empty:
                return None

    class Hook:
        def mlx_lm_generation_idle(self):
            events.append(("idle",))
            generator.requests.put("next turn")  # a client answered meanwhile

    monkeypatch.setattr(hooks_server, "_hook", Hook)
    cls = hooks_server._response_generator_class(Stock, None)
    generator = cls.__new__(cls)
    generator.requests = queue.Queue()
    assert generator._next_request(timeout=0.1) == "next turn"
    assert events == [("look", None), ("idle",), ("look", 0.1)]
    events.clear()
    generator.requests.put("queued")
    assert generator._next_request(timeout=0.1) == "queued"
    assert events == [("look", None)]
