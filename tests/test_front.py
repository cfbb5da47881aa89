"""The HTTP front in a process of its own (mlx_lm_hooks/front.py): the same answers as one
process, every route reachable through it, hang-ups and stops handled; and its pipe's
protocol, in process, without a model."""

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from queue import Queue
from types import SimpleNamespace

import pytest
from mlx_lm.server import CompletionRequest, GenerationContext, Response
from mlx_lm_hooks.front import Bridge, FrontGenerator
from mlx_lm_hooks.server import GenerationFailed, RequestRefused
from servers import (
    GREEDY,
    SYSTEM,
    Server,
    conversation,
    free_port,
    mlx_lm_server,
    same_but_rounding,
    server_env,
)

FRONT = {"MLX_RADIX_SERVER_FRONT": "on"}


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


@pytest.fixture(scope="module")
def front(model_dirs, hf_cache, tmp_path_factory):
    port = free_port()
    cmd = radix_server(model_dirs, port)
    log = tmp_path_factory.mktemp("front") / "server.log"
    with Server(cmd, server_env(hf_cache, **FRONT), port, log) as server:
        yield server
        assert "Traceback" not in server.output()


def radix_server(model_dirs, port: int) -> list[str]:
    model = str(model_dirs["llama"])
    return mlx_lm_server("--plugin", "radix", "--model", model, "--port", str(port))


def front_pids(engine_pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(engine_pid)], capture_output=True, text=True
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "mlx_lm_hooks.front" in line]


def raw_stream_then_hang_up(port: int, body: dict, read: int) -> None:
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data
        )
        got = b""
        while len(got) < read:
            got += s.recv(4096)


def test_answers_as_one_process_does(model_dirs, hf_cache, tmp_path, front):
    port = free_port()
    cmd = radix_server(model_dirs, port)
    env = server_env(hf_cache, MLX_RADIX_SERVER_FRONT="off")
    with Server(cmd, env, port, tmp_path / "one.log") as one:
        expected = conversation(one)
        assert front_pids(one.proc.pid) == []
    before = front.stats()["requests"]
    got = conversation(front)
    assert front_pids(front.proc.pid), "no front process"
    assert [g["text"] for g in got] == [e["text"] for e in expected]
    assert all(g["text"] for g in got)
    assert [g["usage"] for g in got] == [e["usage"] for e in expected]
    assert expected[-1]["logprobs"]["logprobs"]
    assert same_but_rounding(got[-1]["logprobs"], expected[-1]["logprobs"])
    after = front.stats()["requests"]
    assert after["length"] - before.get("length", 0) == len(got)


def test_concurrent_streams_get_what_each_gets_alone(front):
    prompts = [f"{SYSTEM} Question {i}: where is city number {i}?" for i in range(8)]
    alone = [front.post("/v1/completions", {"prompt": p, **GREEDY}) for p in prompts]
    together: list = [None] * len(prompts)

    def one(i):
        events = front.stream("/v1/completions", {"prompt": prompts[i], **GREEDY})
        together[i] = "".join(e["choices"][0]["text"] for e in events if e["choices"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == [a["choices"][0]["text"] for a in alone]


def test_every_other_route_is_the_engines(front):
    assert front.get("/health") == (200, json.dumps({"status": "ok"}))
    assert json.loads(front.get("/v1/models")[1])["object"] == "list"
    assert front.get("/metrics")[0] == 200
    assert front.get("/no/such/route")[0] == 404
    # Pins come from this machine only: the engine hears the client's address, not the front's.
    pinned = front.post("/v1/cache/pin", {"prompt": SYSTEM})
    assert pinned["pinned_tokens"] > 0
    conn = http.client.HTTPConnection("127.0.0.1", front.port)
    conn.request("DELETE", "/v1/cache/pin", json.dumps({"prompt": SYSTEM}))
    r = conn.getresponse()
    assert (r.status, json.loads(r.read())["unpinned"]) == (200, True)


@pytest.mark.parametrize("name", ["X-Mlx-Lm-Front-Client", "x-mlx-lm-front-client"])
def test_a_client_cannot_name_its_own_address_to_the_engine(front, name):
    """The front strips the header it tells the engine the client's address in, whatever its
    case (HTTP header names are case-insensitive): a client naming another address does not
    pass for it (here, a local one passing for a remote one, refused a pin)."""
    conn = http.client.HTTPConnection("127.0.0.1", front.port)
    conn.request("POST", "/v1/cache/pin", json.dumps({"prompt": SYSTEM}), {name: "203.0.113.7"})
    r = conn.getresponse()
    assert (r.status, json.loads(r.read())["pinned_tokens"] > 0) == (200, True)
    conn.request("DELETE", "/v1/cache/pin", json.dumps({"prompt": SYSTEM}))
    assert conn.getresponse().status == 200


def test_a_streamed_plugin_route_passes_through(front):
    body = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}))
    r = conn.getresponse()
    events = [line for line in r.read().decode().splitlines() if line.startswith("event: ")]
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": []}, 400, "empty conversation"),  # refused by the engine
        ({"messages": [{"role": "user", "content": "x"}], "cache_salt": 7}, 400, "cache_salt"),
    ],
)
def test_bad_requests_get_the_same_errors(front, body, status, message):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    r = conn.getresponse()
    assert r.status == status
    assert message in json.loads(r.read())["error"]


def test_a_client_hanging_up_is_a_disconnect_and_the_server_goes_on(front):
    before = front.stats()["requests"].get("disconnect", 0)
    ask = {"messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 2000}
    raw_stream_then_hang_up(front.port, {**ask, "logit_bias": GREEDY["logit_bias"]}, 400)
    deadline = time.monotonic() + 30
    while front.stats()["requests"].get("disconnect", 0) == before:
        assert time.monotonic() < deadline, "the hang-up was not counted"
        time.sleep(0.2)
    assert front.post("/v1/completions", {"prompt": "Hi", **GREEDY})["choices"][0]["text"]
    assert front.stats()["pages_locked"] == 0


@pytest.mark.parametrize(
    "path, body, end",
    [
        ("/v1/messages", {"model": "claude", "max_tokens": 2000}, b'"type": "api_error"'),
        ("/v1/responses", {"model": "gpt", "max_output_tokens": 2000}, b'"code": "server_error"'),
    ],
)
def test_a_forwarded_stream_cut_short_ends_with_an_error_event(
    model_dirs, hf_cache, tmp_path, path, body, end
):
    """The engine dies mid-stream: the client's stream through the front ends with the API's
    error event, not as a whole 200 (the engine's stream ends with its connection)."""
    port = free_port()
    cmd = radix_server(model_dirs, port)
    words = {"messages": [{"role": "user", "content": "Tell me"}]} if "messages" in path else {}
    ask = {**body, **words, "input": "Tell me", "stream": True, "logit_bias": GREEDY["logit_bias"]}
    if "messages" in path:
        del ask["input"]
    data = json.dumps(ask).encode()
    with Server(cmd, server_env(hf_cache, **FRONT), port, tmp_path / "log") as server:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
            s.sendall(head.encode() + data)
            got = s.recv(65536)
            while got.count(b"data: ") < 4:
                got += s.recv(65536)
            os.kill(server.proc.pid, signal.SIGKILL)  # the engine
            while chunk := s.recv(65536):
                got += chunk
    events = got.split(b"\r\n\r\n", 1)[1].strip().split(b"\n\n")
    assert events[-1].startswith(b"event: error") and end in events[-1], events[-3:]
    assert b"engine process ended before this response did" in events[-1]


def test_sigterm_stops_both_and_a_lost_front_stops_the_engine(model_dirs, hf_cache, tmp_path):
    port = free_port()
    cmd = radix_server(model_dirs, port)
    with Server(cmd, server_env(hf_cache, **FRONT), port, tmp_path / "a.log") as server:
        [pid] = front_pids(server.proc.pid)
        assert server.stop(30) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    port = free_port()
    cmd[-1] = str(port)
    with Server(cmd, server_env(hf_cache, **FRONT), port, tmp_path / "b.log") as server:
        [pid] = front_pids(server.proc.pid)
        os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert "the HTTP front (process" in server.output()
        assert "Traceback" not in server.output()


# -- the pipe, in process ----------------------------------------------------------------------


class FakeEngine:
    """The generation thread's side of a Bridge: a script of what it puts per request."""

    def __init__(self, script):
        self.requests, self.script = Queue(), script
        self.records: list = []
        self.cli_args = SimpleNamespace()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            box, request, args = self.requests.get()
            for item in self.script(request):
                box.put(item)


def pipe(script):
    engine = FakeEngine(script)
    mine, theirs = socket.socketpair()
    lost = threading.Event()
    bridge = Bridge(engine, Connection(mine.detach()), lost.set, engine.records.append)
    front = FrontGenerator(Connection(theirs.detach()), engine.cli_args, lost.set)
    return engine, bridge, front, lost


def context():
    return GenerationContext(False, False, None, None, "normal", [1, 2, 3], 1)


def request(prompt: str) -> CompletionRequest:
    return CompletionRequest("text", prompt, [], None, None)


def responses(n):
    return [Response(f"t{i}", i, -0.5, "length" if i == n - 1 else None, ()) for i in range(n)]


def wait_for(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_pipe_carries_contexts_progress_responses_and_the_end():
    engine, _, front, _ = pipe(lambda r: [context(), (1, 3), *responses(4), None])
    progress = []
    ctx, stream = front.generate(request("a"), None, lambda *p: progress.append(p))
    assert ctx.prompt == [1, 2, 3] and ctx.prompt_cache_count == 1
    assert [r.text for r in stream] == ["t0", "t1", "t2", "t3"]
    assert progress == [(1, 3)]
    wait_for(lambda: engine.records)
    [box] = engine.records
    assert (box.generated, box.reason) == (4, "length")


def test_errors_reach_the_handler_refusals_keep_their_type():
    def script(r):
        if r.prompt == "refused":
            return [RequestRefused("the prompt is empty")]
        return [context(), KeyError("odd")]

    engine, _, front, _ = pipe(script)
    with pytest.raises(RequestRefused, match="empty"):
        front.generate(request("refused"), None)
    _, stream = front.generate(request("fails"), None)
    with pytest.raises(RuntimeError, match="odd"):
        list(stream)
    wait_for(lambda: engine.records)
    assert [b.reason for b in engine.records] == ["error"]  # a refused request is not counted


def test_a_stop_from_the_front_reaches_the_context_and_counts_a_disconnect():
    ctx = context()

    def script(r):
        yield ctx
        yield responses(2)[0]

    engine, bridge, front, _ = pipe(script)
    got, stream = front.generate(request("a"), None)
    assert next(stream).text == "t0"
    got.stop()
    wait_for(lambda: ctx._should_stop and engine.records)
    assert engine.records[0].reason == "disconnect"
    assert bridge.outboxes == {}


def test_an_item_that_does_not_pickle_fails_its_request_only():
    def script(r):
        if r.prompt == "bad":
            return [context(), Response(lambda: 0, 1, 0.0, None, ())]
        return [context(), *responses(1), None]

    _, _, front, _ = pipe(script)
    _, bad = front.generate(request("bad"), None)
    with pytest.raises(RuntimeError, match="could not reach the HTTP front"):
        list(bad)
    _, good = front.generate(request("good"), None)
    assert [r.text for r in good] == ["t0"]


def test_either_side_hears_the_other_end():
    engine, bridge, front, lost = pipe(lambda r: [context()])
    _, stream = front.generate(request("a"), None)
    bridge.close()  # the engine stopping: the front is told, the engine is not
    assert lost.wait(10)
    with pytest.raises(GenerationFailed, match="engine process ended"):
        list(stream)
