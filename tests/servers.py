"""Real mlx_lm.server processes on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Greedy output of a random model may hit EOS at once; banning it keeps outputs long.
NO_EOS = {"2": -100}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(hf_cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a test server: offline, no plugin or radix setting inherited."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLX_RADIX_") and k != "MLX_LM_PLUGINS"
    }
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(hf_cache),
        # The source tree, ahead of the installed copy: the installed .pth and entry
        # points then run this checkout's code.
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "hooks")]),
        MLX_RADIX_POOL_TOKENS="4096",
        MLX_RADIX_PAGE_SIZE="4",
    )
    env.update(extra)
    return env


class Server:
    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log: Path, cwd=None):
        self.cmd, self.env, self.port, self.log, self.cwd = cmd, env, port, log, cwd
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=self.cwd, stdout=self._out, stderr=self._out
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.get("/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def get(self, path: str) -> tuple[int, str]:
        conn = self._conn()
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()

    def post(self, path: str, body: dict) -> dict:
        conn = self._conn()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode()
        assert r.status == 200, (r.status, data)
        return json.loads(data)

    def stream(self, path: str, body: dict) -> list[dict]:
        """The JSON events of a streamed response."""
        conn = self._conn()
        conn.request("POST", path, json.dumps({**body, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200
        events = []
        for raw in r.read().decode().splitlines():
            if raw.startswith("data: ") and raw != "data: [DONE]":
                events.append(json.loads(raw[len("data: ") :]))
        return events

    def stats(self) -> dict:
        status, body = self.get("/v1/cache/stats")
        assert status == 200, body
        return json.loads(body)


def mlx_lm_server(*args: str) -> list[str]:
    return [str(BIN / "mlx_lm.server"), *args]


def run_to_exit(cmd: list[str], env: dict[str, str], timeout: int = 120):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
