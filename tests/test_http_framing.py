"""A request's framing is checked before its body is read (mlx_lm_hooks' ``body_length``):
a ``Content-Length`` that is no count of bytes gets 400 (before: a dropped connection and a
traceback, or, at -1, a handler waiting for the client to leave), one past the server's limit
413 without a byte read (before: MemoryError at 1e12), none on a POST 411; on stock's routes
and the plugins', in one process and behind the HTTP front."""

import socket
import time

import pytest
from servers import mlx_lm_server
from test_server import hf_cache, start  # noqa: F401 - fixtures

CASES = [
    ("Content-Length: abc\r\n", 400, b"Content-Length must be a count of bytes, got 'abc'"),
    ("Content-Length: -1\r\n", 400, b"got '-1'"),
    ("Content-Length: 1e12\r\n", 400, b"got '1e12'"),
    ("Content-Length: 1000000000000\r\n", 413, b"this server reads at most 67108864"),
    ("", 411, b"Content-Length is required"),
]


def answer(port: int, path: str, header: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\n{header}\r\n{{}}".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
    status = int(data.split(b" ", 2)[1])
    return status, data


@pytest.mark.parametrize("front", ["off", "on"])
def test_a_body_the_server_cannot_frame_is_refused_before_it_is_read(start, front):  # noqa: F811
    with start(mlx_lm_server("--plugin", "radix"), {"MLX_RADIX_SERVER_FRONT": front}) as server:
        got = [
            (path, header, *answer(server.port, path, header))
            for path in ("/v1/completions", "/v1/messages")
            for header, _, _ in CASES
        ]
        assert server.get("/health")[0] == 200
        log = server.output()
    expected = [(status, message) for _ in range(2) for _, status, message in CASES]
    for (path, header, status, data), (want, message) in zip(got, expected):
        assert status == want and message in data, (path, header, data)
    assert "Traceback" not in log


@pytest.mark.parametrize("front", ["off", "on"])
def test_connections_past_the_bound_get_503_and_the_bound_frees_as_they_close(start, front):  # noqa: F811
    """Each connection holds a handler thread; stock started one for any number of them.
    Past ``MLX_LM_MAX_CONNECTIONS`` a connection gets 503 with ``Retry-After`` at once."""
    env = {"MLX_RADIX_SERVER_FRONT": front, "MLX_LM_MAX_CONNECTIONS": "4"}
    with start(mlx_lm_server("--plugin", "radix"), env) as server:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
        for s in held:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # half a request: its thread waits
        status, data = answer(server.port, "/v1/completions", "Content-Length: 2\r\n")
        for s in held:
            s.close()
        healthy = False
        for _ in range(50):  # their threads see the closed sockets and end
            healthy = server.get("/health")[0] == 200
            if healthy:
                break
            time.sleep(0.1)
    assert healthy
    assert status == 503 and b"Retry-After: 1" in data, data
    assert b"serves 4 connections at once (MLX_LM_MAX_CONNECTIONS)" in data
