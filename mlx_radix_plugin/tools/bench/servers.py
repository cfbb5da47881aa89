"""An ``mlx_lm.server`` subprocess on 127.0.0.1 as the benchmark and the tests see it: its
HTTP endpoints, and the CPU time and peak memory the process spends on a piece of work."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LINUX = sys.platform.startswith("linux")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1 (a server's HTTP port and the
    ports ``mlx.launch``'s ring backend takes, one a rank from ``--starting-port`` up)."""
    while True:
        start = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(start, start + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except (OSError, OverflowError):  # taken, or past 65535
                continue
        return start


def event_text(event: dict) -> str:
    """The text one streamed event carries: ``text`` of a completion, ``delta.content`` of a
    chat completion, a ``text_delta`` of the Messages API."""
    if event.get("type") == "content_block_delta":
        return event["delta"].get("text") or ""
    if not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def openai_usage(usage: dict) -> dict:
    """A streamed response's usage in chat completions' terms (the Messages API counts
    input tokens read from the cache apart from the rest)."""
    if "input_tokens" not in usage:
        return usage
    cached = usage.get("cache_read_input_tokens") or 0
    return {
        "prompt_tokens": usage["input_tokens"] + cached,
        "completion_tokens": usage["output_tokens"],
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ServerProcess:
    """An mlx_lm.server subprocess on 127.0.0.1, up once /health answers."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log: Path, cwd=None):
        self.cmd, self.env, self.port, self.log, self.cwd = cmd, env, port, log, cwd
        self.proc: subprocess.Popen | None = None

    # Start the process in a session of its own (a launcher and the ranks it starts, which
    # ``Launched`` then stops together).
    new_session = False
    stdin: int | None = None  # the Popen ``stdin`` of the process

    def __enter__(self) -> ServerProcess:
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=self.cwd,
            stdin=self.stdin,
            stdout=self._out,
            stderr=self._out,
            start_new_session=self.new_session,
        )
        try:
            self._wait_up()
        except BaseException:
            # No ``with`` block will stop it: a server that never answered (or a launcher
            # whose other ranks still run) must not outlive this call.
            self.__exit__()
            raise
        return self

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, and wait up to ``timeout`` seconds for the process to end: its exit
        status, or None when it had to be killed. Leaving the ``with`` block after it is
        harmless."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()

    def output(self) -> str:
        if not self._out.closed:  # closed once stopped, a failed start included
            self._out.flush()
        return self.log.read_text(errors="replace")

    def _request(self, method: str, path: str, body: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1800)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        return conn, conn.getresponse()

    def get(self, path: str) -> tuple[int, str]:
        conn, r = self._request("GET", path)
        with contextlib.closing(conn):
            return r.status, r.read().decode()

    def post(self, path: str, body: dict) -> dict:
        conn, r = self._request("POST", path, body)
        with contextlib.closing(conn):
            data = r.read().decode()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: {r.status} {data}")
        return json.loads(data)

    def stream(self, path: str, body: dict, on_first=None) -> list[dict]:
        """The JSON events of a streamed response; ``on_first()`` at the first text."""
        conn, r = self._request("POST", path, {**body, "stream": True})
        with contextlib.closing(conn):
            if r.status != 200:
                raise RuntimeError(f"POST {path}: {r.status} {r.read().decode()}")
            events = []
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if on_first and event_text(event):
                    on_first()
                    on_first = None
                events.append(event)
        return events

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the server has used (Linux), steadier than wall time
        on a shared machine."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stats(self) -> dict | None:
        """``/v1/cache/stats``, or None from a server without the plugin."""
        status, body = self.get("/v1/cache/stats")
        return json.loads(body) if status == 200 else None

    def peak_rss(self, reset: bool = True) -> PeakRSS:
        return PeakRSS(self.proc.pid, reset)


# What a server needs in its environment (as server_env sets it), handed to every rank by
# mlx.launch's --env, with every variable of RANK_ENV_PREFIXES: the plugin's settings, and
# NCCL's (a host whose GPUs others share must keep NVLink multicast off: NCCL_NVLS_ENABLE=0).
# MLX_LM_PLUGINS: the plugins the start-up shim activates.
RANK_ENV = ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "PYTHONPATH", "LD_PRELOAD", "MLX_LM_PLUGINS")
RANK_ENV_PREFIXES = ("MLX_RADIX_", "NCCL_")


def mlx_launch(
    command: list[str], env: dict[str, str], ranks: int, backend: str, port: int
) -> list[str]:
    """``command`` under ``mlx.launch``, ``ranks`` ranks on 127.0.0.1, tensor parallel.

    ``port`` and the ``ranks - 1`` ports after it must be free: the ring backend listens on
    one a rank, NCCL meets on the first (mlx.launch's fixed default, 12345, would be the
    same for both servers side by side). For NCCL, mlx.launch itself sets
    CUDA_VISIBLE_DEVICES to the rank's number on each rank: rank r runs on GPU r.
    """
    # The venv's bin dir first; PATH after, for an MLX installed with pip --target.
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    launcher = shutil.which("mlx.launch", path=search)
    if launcher is None:
        raise RuntimeError(f"no mlx.launch beside {sys.executable} or on PATH")
    cmd = [launcher, "--hosts", "127.0.0.1", "-n", str(ranks), "--backend", backend]
    cmd += ["--starting-port", str(port), "--nccl-port", str(port)]
    # Ranks on 127.0.0.1 inherit the launcher's environment anyway; --env is what a rank
    # gets wherever it runs.
    for key in (*RANK_ENV, *sorted(k for k in env if k.startswith(RANK_ENV_PREFIXES))):
        if key in env:
            cmd += ["--env", f"{key}={env[key]}"]
    return [*cmd, *command]


class Launched(ServerProcess):
    """``mlx.launch`` and its ranks in a process group of their own: stopping it stops them
    all (rank 0 serves HTTP). ``cpu_seconds`` and ``peak_rss`` are the launcher's."""

    new_session = True
    stdin = subprocess.PIPE

    # mlx.launch (MLX 0.32) polls each rank's stdin pipe for writability with select(), which
    # an empty pipe always passes: one launcher spins more than a core for as long as it runs.
    # Its own stdin is copied to every rank; a rank never reads it, so this many bytes (past
    # a pipe's 64 KiB) fill each rank's pipe, and the launcher sleeps in select() instead.
    STDIN_FILL = 256 << 10

    def _wait_up(self) -> None:
        super()._wait_up()
        self.proc.stdin.write(b"\n" * self.STDIN_FILL)
        self.proc.stdin.flush()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The launcher and its ranks stopped (SIGSTOP) for the block: idle, a rank still
        burns CPU waiting in the request-sharing collective (a third of a core on the ring
        backend), which a server measured on the same CPU would lose."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdin.close()
        self._out.close()


class PeakRSS:
    """The most resident memory a process held while the ``with`` block ran, in bytes.

    Linux: the kernel's high-water mark (``VmHWM`` of ``/proc/PID/status``), reset on
    entry by writing 5 to ``/proc/PID/clear_refs``; with ``reset=False``, or if the kernel
    refuses the reset, the mark counts from the process's start (``method`` says so).
    Elsewhere: ``ps -o rss=`` sampled every 50 ms, which can miss a shorter spike.
    """

    SAMPLE_S = 0.05

    def __init__(self, pid: int, reset: bool = True):
        self.pid, self.reset = pid, reset
        self.bytes: int | None = None
        self.method = "VmHWM" if LINUX else "ps rss sampled 50 ms"
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        if self.method != "VmHWM":
            self.bytes = _ps_rss(self.pid)
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
            return self
        try:
            if self.reset:
                Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            else:
                self.method = "VmHWM since start"
        except OSError:
            self.method = "VmHWM since start"
        return self

    def __exit__(self, *exc) -> None:
        if self._sampler is None:
            self.bytes = _vm_hwm(self.pid)
        else:
            self._stop.set()
            self._sampler.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            rss = _ps_rss(self.pid)
            if rss is not None:
                self.bytes = max(self.bytes or 0, rss)


def _vm_hwm(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def _ps_rss(pid: int) -> int | None:
    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
        return int(out.stdout.strip()) * 1024  # KiB
    except (OSError, ValueError):
        return None
