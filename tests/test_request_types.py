"""Every field of every route, given a value of the wrong kind, gets a 4xx naming it, never a
5xx, and the server goes on (issue 56: ``thinking: 5`` gave a TypeError and 500, a 100k-deep
array a RecursionError)."""

import json
import socket

from servers import NO_EOS, mlx_lm_server
from test_server import hf_cache, start  # noqa: F401 - fixtures

USER = [{"role": "user", "content": "Hi"}]
BASES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/messages": {"model": "claude", "messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "claude", "messages": USER},
    "/v1/responses": {"model": "gpt", "input": "Hi", "max_output_tokens": 2},
}
# Fields each route reads beyond its base body's, as its clients send them.
EXTRA = {
    "/v1/completions": ["stop", "temperature", "top_p", "top_k", "logit_bias", "stream", "seed"],
    "/v1/chat/completions": ["tools", "stop", "temperature", "logit_bias", "stream", "cache_salt"],
    "/v1/messages": [
        "system", "tools", "tool_choice", "thinking", "stop_sequences", "temperature", "top_p",
        "top_k", "metadata", "stream", "cache_salt", "logit_bias",
    ],
    "/v1/messages/count_tokens": ["system", "tools", "thinking"],
    "/v1/responses": [
        "instructions", "tools", "tool_choice", "reasoning", "temperature", "top_p", "stream",
        "previous_response_id", "store", "include", "text", "parallel_tool_calls",
    ],
}  # fmt: skip
WRONG = [5, -1, 2.5, float("nan"), "x", "", [], [5], [{}], {}, {"a": 5}, None, True]
DEEP = 100_000  # arrays inside arrays


def status_of(port: int, path: str, raw: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(raw)}\r\n\r\n"
        s.sendall(head.encode() + raw)
        data = s.recv(65536)
    return int(data.split(b" ", 2)[1]) if data else 0  # 0: no answer, the connection dropped


def cases() -> list[tuple[str, str]]:
    """(route, body): each field of each route given each wrong value, the Responses API's
    items with content of the wrong kind, and each route's body with a 100k-deep array."""
    out = []
    for path, base in BASES.items():
        for field in [*base, *EXTRA[path]]:
            for value in WRONG:
                # EOS banned: a request that is served runs its 2 tokens, no fewer.
                out.append((path, json.dumps({"logit_bias": NO_EOS, **base, field: value})))
        out.append((path, json.dumps(base)[:-1] + ', "deep": ' + "[" * DEEP + "]" * DEEP + "}"))
    items = [{"type": "message", "role": "user", "content": 5}, {"type": "reasoning", "content": 5}]
    out += [("/v1/responses", json.dumps({**BASES["/v1/responses"], "input": [i]})) for i in items]
    return out


def test_no_field_of_the_wrong_kind_gets_a_server_error(start):  # noqa: F811
    with start(mlx_lm_server("--plugin", "radix")) as server:
        failed = []
        for path, raw in cases():
            status = status_of(server.port, path, raw.encode())
            if status >= 500 or status == 0:
                failed.append((status, path, raw[:200]))
        assert server.get("/health")[0] == 200
        log = server.output()
    assert not failed, failed
    assert "Traceback" not in log
