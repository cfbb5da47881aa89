"""A client that hangs up stops its request (mlx_lm_hooks' ``ClientGone``): a response that
is not streamed writes nothing until its end, so before, the request ran on to
``max_tokens`` holding its pages (90 s later on a non-streamed agent route, issue 56)."""

import json
import socket
import time

import pytest
from servers import NO_EOS, mlx_lm_server
from test_server import hf_cache, start  # noqa: F401 - fixtures

STORY = "Tell me a long story."


@pytest.mark.parametrize("front", ["off", "on"])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": STORY}),
        (
            "/v1/messages",
            {"model": "claude-test", "messages": [{"role": "user", "content": STORY}]},
        ),
    ],
)
def test_a_client_that_hangs_up_on_a_response_not_streamed_frees_its_row(start, path, body, front):  # noqa: F811,E501
    # Claude Code asks for 128,000 tokens on every request: clamped to the context, 2,048 here.
    raw = json.dumps({**body, "max_tokens": 128000, "temperature": 0.0, "logit_bias": NO_EOS})
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    # With the HTTP front, stock's routes run in the front over a pipe and the agent routes
    # are forwarded to the engine's port: both notice, each its own way.
    with start(mlx_lm_server("--plugin", "radix"), {"MLX_RADIX_SERVER_FRONT": front}) as server:
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n{raw}".encode())
        deadline = time.monotonic() + 60
        while not server.stats()["requests_holding_pages"]:  # decoding
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)
        client.close()
        left = time.monotonic()
        while server.stats()["requests_holding_pages"]:
            assert time.monotonic() - left < 1.5, "the request ran on after its client left"
            time.sleep(0.02)
        stats = server.stats()
        assert server.get("/health")[0] == 200
        log = server.output()
    assert stats["pages_locked"] == 0
    assert "hung up before its response ended" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("front", ["off", "on"])
def test_a_client_that_hangs_up_while_its_request_waits_to_start_frees_what_it_matched(
    start,  # noqa: F811
    front,
):
    """A request waiting in the queue (here behind a batch of one) has no tokens to notice a
    hang-up by: before, it held the cached pages it matched until the request ahead ended."""
    env = {"MLX_RADIX_SERVER_FRONT": front, "MLX_RADIX_DECODE_MAX_BATCH_SIZE": "1"}
    greedy = {"temperature": 0.0, "logit_bias": NO_EOS}
    ahead = {"prompt": STORY * 8, "max_tokens": 2000, "stream": True, **greedy}
    raw = json.dumps({"prompt": STORY * 8 + " And then?", "max_tokens": 8, **greedy})
    head = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with start(mlx_lm_server("--plugin", "radix"), env) as server:
        conn, first = server._request("POST", "/v1/completions", ahead)
        first.readline()  # streaming: its prompt's pages are in the tree
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n{raw}".encode())
        deadline = time.monotonic() + 30
        while server.stats()["requests_holding_pages"] < 2:  # it waits on what it matched
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client.close()
        left = time.monotonic()
        while server.stats()["requests_holding_pages"] > 1:
            assert time.monotonic() - left < 1.5, "the waiting request kept its pages"
            time.sleep(0.02)
        assert first.readline()  # the request ahead streams on
        conn.close()
        assert server.get("/health")[0] == 200
        log = server.output()
    assert "Traceback" not in log
