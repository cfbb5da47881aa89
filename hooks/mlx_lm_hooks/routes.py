"""Extra HTTP routes that plugins add to mlx_lm.server."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RouteRequest:
    method: str
    path: str
    query: str
    body: bytes = b""
    client: str = ""  # the client's address


@dataclass
class RouteResponse:
    status: int = 200
    body: bytes | str | dict | list = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

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
        key = (method.upper(), path)
        if key in self._routes:
            raise ValueError(f"route {method.upper()} {path} is already registered")
        self._routes[key] = handler

    def get(self, method: str, path: str) -> Handler | None:
        return self._routes.get((method.upper(), path))

    def __iter__(self):
        return iter(sorted(self._routes))
