"""The real agent clients (Claude Code, Codex CLI), pinned in tests/clients/package.json, and
a recorder between them and the server.

The clients are installed with npm into tests/clients/node_modules, by ``.ci/run`` in CI
and by ``clients()`` on first use elsewhere. Where node is absent the tests that need them
skip, except where ``MLX_RADIX_AGENT_CLIENTS=required`` (CI), where that is a failure.

The recorder forwards each request to the server as it is and keeps it, with the answer,
so that tests can read what a client sent (its billing line, its usage per request) and the
shape of its requests can be written to docs/clients/ and diffed at the next upgrade.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CLIENTS = Path(__file__).resolve().parent / "clients"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "clients"
REQUIRED_ENV = "MLX_RADIX_AGENT_CLIENTS"
UPDATE_ENV = "MLX_RADIX_UPDATE_CLIENT_RECORDINGS"
# Values that are data, not the API's fields: a tool's schema, a client's own metadata.
OPAQUE = {"input_schema", "parameters", "metadata", "client_metadata", "input"}


def clients() -> dict[str, Path]:
    """The pinned clients' executables, installed on first use; skips (or fails in CI) where
    node is absent."""
    required = os.environ.get(REQUIRED_ENV) == "required"
    binaries = {name: CLIENTS / "node_modules" / ".bin" / name for name in ("claude", "codex")}
    if all(b.exists() for b in binaries.values()):
        return binaries
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        message = "node and npm are needed to run the agent clients (tests/clients)"
        if required:
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"],
        cwd=CLIENTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0 or not all(b.exists() for b in binaries.values()):
        pytest.fail(f"npm ci in {CLIENTS} failed:\n{result.stdout}\n{result.stderr}")
    return binaries


def version(name: str) -> str:
    package = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}[name]
    manifest = json.loads((CLIENTS / "package.json").read_text())
    return f"{package} {manifest['dependencies'][package]}"


@dataclass
class Exchange:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: object
    status: int
    answer: bytes

    def usage(self) -> dict:
        """The answer's usage: the last one in it (a stream's final event carries it)."""
        found: dict = {}
        for line in self.answer.decode(errors="replace").splitlines():
            text = line[len("data: ") :] if line.startswith("data: ") else line
            try:
                data = json.loads(text)
            except ValueError:
                continue
            for holder in (data, data.get("message"), data.get("response")):
                if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                    found = holder["usage"]
        return found


class Recorder:
    """An HTTP server on loopback that forwards to ``upstream`` and records each exchange;
    ``rewrite(body) -> body``, when set, changes a JSON body on its way (a client's value
    that a test varies)."""

    def __init__(self, upstream: int):
        self.exchanges: list[Exchange] = []
        self.rewrite = None
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                size = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(size) if size else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                if recorder.rewrite is not None and isinstance(body, dict):
                    body = recorder.rewrite(body)
                    raw = json.dumps(body).encode()
                skip = ("host", "content-length", "accept-encoding", "connection")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=600)
                try:
                    conn.request(self.command, self.path, body=raw, headers=headers)
                    response = conn.getresponse()
                    answer = response.read()
                    passed = [
                        (k, v)
                        for k, v in response.getheaders()
                        if k.lower() not in ("transfer-encoding", "content-length", "connection")
                    ]
                finally:
                    conn.close()
                url = urlsplit(self.path)
                recorder.exchanges.append(
                    Exchange(
                        self.command,
                        url.path,
                        url.query,
                        dict(self.headers),
                        body,
                        response.status,
                        answer,
                    )
                )
                self.send_response(response.status)
                for k, v in passed:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_POST = do_HEAD = _forward

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]


# --- the shape of a client's requests: field names and JSON types, no values ---------------


def shape(value: object, key: str | None = None) -> object:
    """``value``'s shape: objects by field, lists by their items' shapes (items with a
    ``type`` or ``role`` by that value), scalars by JSON type."""
    if isinstance(value, dict):
        if key in OPAQUE:
            return "object"
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        merged: dict = {}
        for item in value:
            tag = item.get("type") or item.get("role") if isinstance(item, dict) else None
            label = f"<{tag}>" if isinstance(tag, str) else "<item>"
            merged[label] = merge(merged.get(label), shape(item))
        return {"[]": dict(sorted(merged.items()))}
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return "string"


def merge(a: object, b: object) -> object:
    """Two shapes as one: objects by the union of their fields, lists by their items', and
    shapes of different kinds as ``{"one of": [...]}``."""
    if a is None or b is None:
        return b if a is None else a
    kinds = _alternatives(a) + _alternatives(b)
    out: list = sorted({k for k in kinds if isinstance(k, str)})
    objects = [k for k in kinds if isinstance(k, dict) and "[]" not in k]
    lists = [k["[]"] for k in kinds if isinstance(k, dict) and "[]" in k]
    if objects:
        out.append(functools.reduce(_fields, objects))
    if lists:
        out.append({"[]": functools.reduce(_fields, lists)})
    return out[0] if len(out) == 1 else {"one of": out}


def _alternatives(value: object) -> list:
    return value["one of"] if isinstance(value, dict) and "one of" in value else [value]


def _fields(a: dict, b: dict) -> dict:
    return {k: merge(a.get(k), b.get(k)) for k in sorted(set(a) | set(b))}


def recording(name: str, exchanges: list[Exchange]) -> dict:
    """What ``name`` sent: per route, its queries, header names, the values of headers that
    name API features (anthropic-beta), and its bodies' merged shape."""
    routes: dict[str, dict] = {}
    for e in exchanges:
        route = routes.setdefault(
            f"{e.method} {e.path}",
            {"requests": 0, "queries": [], "headers": [], "anthropic-beta": [], "body": None},
        )
        route["requests"] += 1
        route["queries"] = sorted(set(route["queries"]) | ({e.query} if e.query else set()))
        route["headers"] = sorted(set(route["headers"]) | {h.lower() for h in e.headers})
        betas = e.headers.get("anthropic-beta", "")
        route["anthropic-beta"] = sorted(
            set(route["anthropic-beta"]) | {b.strip() for b in betas.split(",") if b.strip()}
        )
        route["body"] = merge(route["body"], shape(e.body))
    for route in routes.values():
        route["requests"] = "several" if route["requests"] > 1 else "one"
        if not route["anthropic-beta"]:
            del route["anthropic-beta"]
    return {"client": version(name), "routes": dict(sorted(routes.items()))}


def check_recording(name: str, exchanges: list[Exchange]) -> None:
    """The recording matches docs/clients/NAME.json (with ``MLX_RADIX_UPDATE_CLIENT_RECORDINGS=1``:
    rewrite it). A client upgrade shows up here as a diff of what it sends."""
    path = DOCS / f"{name}.json"
    recorded = recording(name, exchanges)
    text = json.dumps(recorded, indent=1) + "\n"
    if os.environ.get(UPDATE_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    kept = path.read_text() if path.exists() else ""
    assert text == kept, (
        f"{version(name)} sends requests of another shape than {path} records; review the "
        f"difference (git diff after running the test with {UPDATE_ENV}=1), and keep it"
    )
