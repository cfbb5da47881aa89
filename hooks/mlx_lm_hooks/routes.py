"""Extra HTTP routes that plugins add to mlx_lm.server."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Write = Callable[[bytes], None]


@dataclass
class RouteRequest:
    method: str
    path: str
    query: str
    body: bytes = b""
    client: str = ""  # the client's address
    # The server's ResponseGenerator: a route runs requests with its ``generate``, on the
    # same generation thread, model and prompt cache as chat completions.
    generator: Any = None


@dataclass
class RouteResponse:
    status: int = 200
    body: bytes | str | dict | list = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    # A streamed answer: called with a ``write`` that sends and flushes bytes, after the status
    # and headers (no Content-Length; the connection closes at its end). A client that hangs
    # up makes ``write`` raise ``BrokenPipeError`` or ``ConnectionResetError``: let it pass,
    # after freeing what the stream holds (``finally``); the host logs one line.
    stream: Callable[[Write], None] | None = None

    def payload(self) -> bytes:
        if isinstance(self.body, (dict, list)):
            return json.dumps(self.body).encode()
        if isinstance(self.body, str):
            return self.body.encode()
        return self.body


Handler = Callable[[RouteRequest], RouteResponse]


class RouteTable:
    def __init__(self):
        self._routes: dict[tuple[str, str], Handler] = {}

    def register(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``method path`` with ``handler``; registering the same handler again is a
        no-op (two plugins of one distribution may both serve a route), another is an error."""
        key = (method.upper(), path)
        if self._routes.get(key) is handler:
            return
        if key in self._routes:
            raise ValueError(f"route {method.upper()} {path} is already registered")
        self._routes[key] = handler

    def get(self, method: str, path: str) -> Handler | None:
        return self._routes.get((method.upper(), path))

    def __iter__(self):
        return iter(sorted(self._routes))
