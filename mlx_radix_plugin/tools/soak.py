"""Soak: many concurrent clients against ``mlx_lm.server --plugin radix`` for minutes, with
the pool's invariants checked through ``/v1/cache/stats`` as it runs.

    mlx-radix soak --model PATH --minutes 2

Each client sends completions and chat completions, streamed or not, on a few shared
prefixes (system prompts); some continue their previous prompt with its completion (an
exact repeat of what the cache holds), and one request in ten disconnects after its first
streamed token. Every few seconds the clients pause, and once the server is idle the pool
must be too: no page locked or held by a finished request, every used page cached. With
``--adversaries N``, N more clients send, at random, requests no server should run (sampling
no batch can run, broken framing, bad field types) and requests whose clients hang up before
their answer, beside the others: each must be refused with its 4xx, and the rest must hold. In
between, the server must answer ``/health`` and its counters must add up. Greedy decoding
must give one answer per prompt, however the batches were made up. One line says whether
everything held; the exit status is 0 if it did, 1 if not.

    mlx-radix soak --model PATH --minutes 3 --restart-every 60

With restarts, the server runs on the disk tier (a temporary directory, or ``--disk-dir``)
and is killed (SIGKILL) every so many seconds, mid-traffic, then started again on the same
disk. Requests in flight at the kill, and those sent while the server is down, are lost,
not violations (the clients pause a moment and go on). Each new server must come up idle,
answer every prompt as before (the workload's greedy answers and a few probe prompts asked
before the first kill), and read pages back from disk: a soak in which no restart hit the
disk fails. The disk tier must stay on, within its budget, and never find a corrupt file
(a write is renamed into place only once complete).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..config import BY_KEY
from .bench.servers import ServerProcess, event_text, free_port

# Prompts are made of plain words: every tokenizer reads them, and shared prefixes stay
# shared token for token.
WORDS = (
    "the a of and to in is you that it he was for on are as with his they at be this from "
    "have or by one had not but what all were when we there can an your which their said if "
    "do will each about how up out them then she many some so these would other into has more "
    "cache page tree prefix model token batch pool radix memory answer question system"
).split()
DISCONNECT_EVERY = 10  # one request in ten closes its connection after the first token
CONTINUE_CHANCE = 0.15  # a client sends its previous prompt plus that prompt's completion
MAX_CHAIN = 3  # continuations in a row before a client starts afresh
CUT_PAUSE = 0.25  # seconds a client waits after a request the server did not answer
PROBES = 4  # prompts asked before the first restart and again after each
# What an adversary sends: (route, the request's head after its first line, body, the
# statuses that are right). Each of these failed another client's request, held a handler
# or a page, or dropped a connection with a traceback before issue 56.
_USER = [{"role": "user", "content": "Tell me about the cache."}]
_ASK = {"model": "m", "max_tokens": 4, "messages": _USER}
_DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
ADVERSARIAL: list[tuple[str, str | None, dict | bytes, tuple[int, ...]]] = [
    ("/v1/completions", None, {"prompt": "Hi", "top_k": 100000, "temperature": 0.5}, (400,)),
    ("/v1/completions", None, {"prompt": "Hi", "logit_bias": {"100000": 1}}, (400,)),
    ("/v1/completions", None, {"prompt": "Hi", "temperature": float("nan")}, (400,)),
    ("/v1/chat/completions", None, {"messages": _USER, "stop": ["x"] * 300}, (400,)),
    ("/v1/messages", None, {**_ASK, "top_k": 10**6}, (400,)),
    ("/v1/messages", None, {**_ASK, "thinking": 5}, (400,)),
    ("/v1/responses", None, {"model": "m", "input": [{"type": "reasoning", "content": 5}]}, (400,)),
    ("/v1/completions", "Content-Length: abc\r\n", b"{}", (400,)),
    ("/v1/completions", "Content-Length: -1\r\n", b"{}", (400,)),
    ("/v1/messages", "Content-Length: 1000000000000\r\n", b"{}", (413,)),
    ("/v1/completions", None, b"\xff\xfe", (400,)),
    ("/v1/chat/completions", None, _DEEP, (400,)),
]  # fmt: skip
HANG_UP_CHANCE = 0.25  # an adversary's request that hangs up before its answer instead
PROBE_TOKENS = 16


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class Spec:
    """One request: a system prompt shared with other requests, then a user part."""

    chat: bool
    system: str
    user: str
    max_tokens: int
    stream: bool
    disconnect: bool  # close the connection after the first streamed token
    chain: int = 0  # continuations of an earlier prompt this one is made of

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, logit_bias: dict | None) -> dict:
        body: dict = {"max_tokens": self.max_tokens, "temperature": 0.0, "stream": self.stream}
        if self.chat:
            body["messages"] = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self.user},
            ]
        else:
            body["prompt"] = f"{self.system} {self.user}"
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if logit_bias:
            body["logit_bias"] = logit_bias
        return body

    def describe(self) -> str:
        kind = "streamed" if self.stream else "plain"
        hangup = ", hanging up" if self.disconnect else ""
        return f"{kind} {self.path} ({self.max_tokens} tokens{hangup})"

    def key(self) -> tuple:
        """Requests with equal keys must get equal greedy answers."""
        return (self.chat, self.system, self.user, self.max_tokens)


@dataclass
class Outcome:
    spec: Spec
    ok: bool
    text: str = ""
    usage: dict | None = None
    disconnected: bool = False
    error: str | None = None
    # No whole answer came: refused, reset or cut short, as when the server went away.
    cut: bool = False


def send(port: int, spec: Spec, logit_bias: dict | None = None, timeout: float = 600) -> Outcome:
    """Send ``spec``; a streamed request marked ``disconnect`` hangs up after its first token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            spec.path,
            json.dumps(spec.body(logit_bias)),
            {"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        if r.status != 200:
            return Outcome(spec, False, error=f"HTTP {r.status}: {r.read()[:300]!r}")
        if not spec.stream:
            data = json.loads(r.read())
            choice = data["choices"][0]
            text = choice["message"]["content"] if spec.chat else choice["text"]
            return Outcome(spec, True, text or "", data.get("usage"))
        text, usage, done = [], None, False
        for raw in r:
            if not raw.endswith(b"\n"):
                break  # a line cut short: the server went away while writing it
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: ") or done:
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:  # the server's word that the request failed
                return Outcome(spec, False, error=f"error event: {str(event['error'])[:300]}")
            usage = event.get("usage") or usage
            text.append(event_text(event))
            if spec.disconnect and text[-1]:
                return Outcome(spec, True, "".join(text), disconnected=True)
        if not done:
            return Outcome(spec, False, error="the stream ended before data: [DONE]", cut=True)
        return Outcome(spec, True, "".join(text), usage)
    except (OSError, http.client.HTTPException) as e:
        return Outcome(spec, False, error=f"{type(e).__name__}: {e}", cut=True)
    except (ValueError, KeyError) as e:
        return Outcome(spec, False, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


class Client:
    """One client's stream of requests, the same for a given seed whatever server answers.

    A continuation depends on the previous answer; greedy answers are the same on every
    correct server, so two servers still see the same requests.
    """

    def __init__(self, seed: int, prefixes: list[str], questions: list[str]):
        self.rng = random.Random(seed)
        self.prefixes, self.questions = prefixes, questions
        self.last: Outcome | None = None

    def next_spec(self) -> Spec:
        rng = self.rng
        disconnect = rng.randrange(DISCONNECT_EVERY) == 0
        stream = disconnect or rng.random() < 0.5
        # Requests that hang up get more tokens to hang up in the middle of.
        max_tokens = rng.randrange(48, 64) if disconnect else rng.randrange(4, 24)
        last = self.last
        if rng.random() < CONTINUE_CHANCE and last and last.ok and not last.disconnected:
            prev = last.spec
            if prev.chain < MAX_CHAIN:
                # The previous prompt plus its completion: what the cache was given last.
                sep = "" if last.text[:1].isspace() else " "
                user = prev.user + sep + last.text
                return Spec(
                    prev.chat, prev.system, user, max_tokens, stream, disconnect, prev.chain + 1
                )
        system = rng.choice(self.prefixes)
        return Spec(
            rng.random() < 0.3, system, rng.choice(self.questions), max_tokens, stream, disconnect
        )

    def run_one(self, port: int, logit_bias: dict | None = None, timeout: float = 600) -> Outcome:
        self.last = send(port, self.next_spec(), logit_bias, timeout)
        return self.last


def prompt_sets(seed: int, prefixes: int = 6, questions: int = 12) -> tuple[list[str], list[str]]:
    """Shared system prompts (40-120 words) and user questions (3-20 words)."""
    rng = random.Random(seed)
    return (
        [words(rng, rng.randrange(40, 120)) for _ in range(prefixes)],
        [words(rng, rng.randrange(3, 20)) for _ in range(questions)],
    )


def clients(seed: int, n: int) -> list[Client]:
    prefixes, questions = prompt_sets(seed)
    return [Client(seed * 1000 + i, prefixes, questions) for i in range(n)]


def probe_specs(seed: int, n: int = PROBES) -> list[Spec]:
    """Greedy completions of their own (no prefix shared with the clients' prompts), asked
    before the first restart and again after each: a new server can only have them from
    disk."""
    rng = random.Random(f"probes {seed}")
    return [
        Spec(False, words(rng, rng.randrange(60, 120)), words(rng, 8), PROBE_TOKENS, False, False)
        for _ in range(n)
    ]


def adversarial(port: int, rng: random.Random, timeout: float = 120) -> str | None:
    """One adversary's request; what went wrong, or None where the server answered rightly
    (a refusal with its status, or nothing to a client that hung up)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if rng.random() < HANG_UP_CHANCE:
            # Not streamed, so nothing is written before the end: only a server that looks
            # at the connection notices it went (its pages must come back: the idle checks).
            body = {"prompt": words(rng, 40), "max_tokens": 4096, "logit_bias": {"0": -100}}
            raw = json.dumps(body).encode()
            s.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Length: {len(raw)}"
                f"\r\n\r\n".encode()
                + raw
            )
            time.sleep(rng.uniform(0.05, 0.5))
            return None
        path, head, body, right = rng.choice(ADVERSARIAL)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = head or f"Content-Length: {len(raw)}\r\n"
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: soak\r\n{head}\r\n".encode() + raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None
    if status not in right:
        return f"{path} ({head.strip()}, {raw[:60]!r}) got {status}, not {right}: {data[-200:]!r}"
    return None


def cached_tokens(usage: dict | None) -> int:
    """The prompt tokens a response says came from the cache."""
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def run_clients(
    port: int,
    n_clients: int,
    per_client: int,
    seed: int = 0,
    logit_bias: dict | None = None,
    max_connections: int | None = None,
) -> list[list[Outcome]]:
    """``per_client`` requests from each of ``n_clients`` concurrent clients, in order.

    ``max_connections`` caps the requests open at once (stock mlx_lm.server's listen
    backlog of 5 resets connections beyond it).
    """
    out: list[list[Outcome]] = [[] for _ in range(n_clients)]
    gate = threading.BoundedSemaphore(max_connections or n_clients)

    def work(i: int, client: Client) -> None:
        for _ in range(per_client):
            with gate:
                out[i].append(client.run_one(port, logit_bias))

    threads = [
        threading.Thread(target=work, args=(i, c)) for i, c in enumerate(clients(seed, n_clients))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- invariants -------------------------------------------------------------------------


def live_violations(stats: dict) -> list[str]:
    """What must hold of ``/v1/cache/stats`` at any moment, busy or not."""
    bad = []
    parts = ("pages_free", "pages_locked", "pages_evictable")
    if any(stats[k] < 0 for k in parts):
        bad.append(f"a negative page count: {_pages(stats)}")
    if sum(stats[k] for k in parts) != stats["pages_total"]:
        bad.append(f"free + locked + evictable pages != pages_total: {_pages(stats)}")
    if stats["cached_tokens"] > stats["prompt_tokens"]:
        bad.append(f"more tokens cached than looked up: {stats}")
    if stats["requests"].get("error"):
        bad.append(f"{stats['requests']['error']} requests ended in an error")
    if stats["snapshot_bytes"] > stats["snapshot_bytes_max"]:
        bad.append(
            f"snapshots of {stats['snapshot_bytes']} bytes over their budget of "
            f"{stats['snapshot_bytes_max']}"
        )
    if stats["snapshots"] > stats["pages_cached"]:
        # A snapshot hangs on a cached node, which holds a page at least.
        bad.append(f"{stats['snapshots']} snapshots on {stats['pages_cached']} cached pages")
    return bad


def idle_violations(stats: dict) -> list[str]:
    """What must hold once every request has finished: no page locked or held by a request,
    so every page is free or cached (and evictable)."""
    bad = live_violations(stats)
    if stats["pages_locked"]:
        bad.append(f"{stats['pages_locked']} pages still locked with no request running")
    if stats["pages_free"] + stats["pages_evictable"] != stats["pages_total"]:
        bad.append(f"free + cached pages != pages_total when idle: {_pages(stats)}")
    if stats["page_refs"] != stats["pages_cached"]:
        # Each cached page is referenced by the tree alone; one more leaks it past eviction.
        bad.append(f"{stats['page_refs']} page references for {stats['pages_cached']} cached pages")
    for key in ("tree_locks", "requests_holding_pages"):
        if stats[key]:
            bad.append(f"{key}={stats[key]} with no request running")
    return bad


def disk_violations(stats: dict, required: bool = False) -> list[str]:
    """What must hold of the disk tier at any moment; ``required``: it must be on."""
    if not stats.get("disk_enabled"):
        if required:
            return ["the disk tier is off (a disk that failed, or mlx.launch: see the log)"]
        return []
    bad = []
    if stats["disk_bytes"] > stats["disk_bytes_max"]:
        bad.append(
            f"{stats['disk_bytes']} bytes on disk over the budget of {stats['disk_bytes_max']}"
        )
    if stats["disk_corrupt"]:
        # A page is renamed into place once complete: no kill may leave a bad one.
        bad.append(f"{stats['disk_corrupt']} files on disk failed their check")
    return bad


def _pages(stats: dict) -> str:
    keys = ("pages_total", "pages_free", "pages_locked", "pages_evictable")
    return ", ".join(f"{k}={stats[k]}" for k in keys)


def finished(stats: dict) -> int:
    return sum(stats["requests"].values())


# -- the soak run ---------------------------------------------------------------------


@dataclass
class Report:
    seconds: float = 0.0
    requests: int = 0
    streamed: int = 0
    disconnected: int = 0
    continued: int = 0
    refused: int = 0  # adversaries' requests answered rightly
    idle_checks: int = 0
    live_checks: int = 0
    violations: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # the last stats read
    log: Path | None = None  # a failed soak's server output (of its last life)
    logs: list[Path] = field(default_factory=list)  # every life's, in order
    # Restarts: each server life's last stats (its counters start from 0), the restarts
    # done, requests lost to them, restarts whose new server read pages from disk, and
    # the probes asked after restarts and those whose prompt came back from disk.
    disk: bool = False
    lives: list[dict] = field(default_factory=list)
    restarts: int = 0
    lost: int = 0
    restarts_hit: int = 0
    probes: int = 0
    probes_hit: int = 0

    def total(self, key: str, lives: slice = slice(None)) -> int:
        """``key`` summed over the server's lives (the last stats, without restarts)."""
        return sum(s.get(key, 0) for s in (self.lives or [self.stats])[lives])

    def verdict(self) -> str:
        hit = self.total("cached_tokens") / max(1, self.total("prompt_tokens"))
        summary = (
            f"{self.seconds:.0f} s, {self.requests} requests ({self.streamed} streamed, "
            f"{self.disconnected} disconnected, {self.continued} continuations, "
            f"{self.refused} adversarial), "
            f"{self.idle_checks} idle + {self.live_checks} live checks, "
            f"{self.total('evictions')} pages evicted, {hit:.0%} of prompt tokens cached"
        )
        if self.restarts:
            summary += (
                f"; {self.restarts} restarts (SIGKILL, {self.lost} requests lost), "
                f"{self.total('disk_hits', slice(1, None))} disk hits after them "
                f"({self.restarts_hit} of {self.restarts} restarts hit), "
                f"{self.probes_hit} of {self.probes} probes read back"
            )
        if self.disk:
            last = self.stats
            summary += (
                f"; disk: {self.total('disk_hits')} hits, "
                f"{self.total('disk_pages_read')} pages read, "
                f"{self.total('disk_pages_written')} written, {last.get('disk_pages', 0)} "
                f"stored ({last.get('disk_bytes', 0) / 2**20:.1f} MiB)"
            )
        if not self.violations:
            return f"soak PASS: {summary}"
        return (
            f"soak FAIL: {len(self.violations)} violations; first: {self.violations[0]} ({summary})"
        )


class Lives:
    """The soak's server, killed and started again on one port: a process a life, each
    with its log (``server.log``, then ``server.1.log``, ...) in ``log_dir``."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log_dir: Path):
        self.cmd, self.env, self.port, self.log_dir = cmd, env, port, log_dir
        self.server: ServerProcess | None = None
        self.logs: list[Path] = []

    def start(self) -> None:
        """Start a life and wait for ``/health``; RuntimeError if it does not come up."""
        name = f"server.{len(self.logs)}.log" if self.logs else "server.log"
        self.logs.append(self.log_dir / name)
        server = ServerProcess(self.cmd, self.env, self.port, self.logs[-1])
        try:
            server.__enter__()
        except BaseException:
            if server.proc is not None:
                server.__exit__(None, None, None)
            raise
        self.server = server

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, nothing written out; the next life gets whatever
        the disk tier had renamed into place."""
        server, self.server = self.server, None
        server.proc.kill()
        server.proc.wait()
        server.__exit__(None, None, None)

    def stop(self) -> int | None:
        """Stop the server cleanly (SIGTERM); its exit status if it had exited on its own."""
        server, self.server = self.server, None
        if server is None:
            return None
        code = server.proc.poll()
        server.__exit__(None, None, None)
        return code


class Soak:
    """Drive ``n_clients`` clients against a running server on ``port`` for ``seconds``.

    With ``lives`` (the server) and ``restart_every``, the server is killed and started
    again every ``restart_every`` seconds; ``disk``: its disk tier must be on.
    """

    def __init__(
        self,
        port: int,
        seconds: float,
        n_clients: int = 16,
        seed: int = 0,
        check_every: float = 10.0,
        idle_timeout: float = 60.0,
        request_timeout: float = 300.0,
        *,
        lives: Lives | None = None,
        restart_every: float | None = None,
        disk: bool = False,
        adversaries: int = 0,
    ):
        self.port, self.seconds, self.check_every = port, seconds, check_every
        self.adversaries = [random.Random(f"adversary {seed} {i}") for i in range(adversaries)]
        self.idle_timeout, self.request_timeout = idle_timeout, request_timeout
        self.clients = clients(seed, n_clients)
        self.report = Report(disk=disk)
        self.answers: dict[tuple, str] = {}
        self.lives = lives if restart_every else None
        self.restart_every = restart_every
        self.probes = probe_specs(seed) if self.lives else []
        self.probe_answers: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self._go = threading.Event()  # set: clients may send
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._accepted = 0  # requests the server's current life took (HTTP 200)
        self._stop = False
        self._epoch = 0  # the server's life: one more at each restart
        self._down = False  # from just before a kill until the new server answers

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        with contextlib.closing(conn):
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode()

    def _stats(self) -> dict:
        status, body = self.get("/v1/cache/stats")
        if status != 200:
            raise RuntimeError(f"/v1/cache/stats answered {status}: {body[:200]}")
        return json.loads(body)

    def violation(self, message: str) -> None:
        with self._lock:
            self.report.violations.append(message)

    def _turn(self) -> tuple[int, bool] | None:
        """Wait until clients may send, then count one request in flight: the server's life
        and whether it was down then, or None once the soak stops."""
        while True:
            self._go.wait()
            with self._lock:
                if self._stop:
                    return None
                if self._go.is_set():
                    self._in_flight += 1
                    return self._epoch, self._down

    def _client(self, client: Client) -> None:
        while (turn := self._turn()) is not None:
            epoch, down = turn
            outcome = client.run_one(self.port, timeout=self.request_timeout)
            with self._lock:
                self._record(outcome, epoch, down)
                self._in_flight -= 1
                self._idle.notify_all()
            if outcome.cut:
                time.sleep(CUT_PAUSE)  # the server is down: no busy loop of refusals

    def _adversary(self, rng: random.Random) -> None:
        while (turn := self._turn()) is not None:
            epoch, down = turn
            try:
                wrong = adversarial(self.port, rng, self.request_timeout)
            except OSError as e:
                wrong = f"an adversarial request got no answer: {type(e).__name__}: {e}"
            with self._lock:
                if wrong is None:
                    self.report.refused += 1
                elif down or self._down or epoch != self._epoch:
                    self.report.lost += 1  # a restart, not the request
                else:
                    self.report.violations.append(wrong)
                self._in_flight -= 1
                self._idle.notify_all()

    def _record(self, o: Outcome, epoch: int = 0, down: bool = False) -> None:
        """File a request's outcome; ``epoch`` and ``down``: the server's life and whether
        it was down when the request was sent."""
        spec, r = o.spec, self.report
        if o.cut and (down or self._down or epoch != self._epoch):
            r.lost += 1  # in flight at a kill, or sent while the server was down
            return
        r.requests += 1
        r.streamed += spec.stream
        r.continued += spec.chain > 0
        if not o.ok:
            r.violations.append(f"{spec.describe()} failed: {o.error}")
            return
        if epoch == self._epoch:
            self._accepted += 1  # else the last life took it, and is gone
        if o.disconnected:
            r.disconnected += 1
            return
        seen = self.answers.setdefault(spec.key(), o.text)
        if seen != o.text:
            r.violations.append(f"greedy answer changed for one prompt: {seen!r} then {o.text!r}")

    def _quiesce(self, when: str | None = None) -> None:
        """Stop the clients, wait for their requests and the server to finish; check idle."""
        when = when or f"after {self.report.requests} requests"
        self._go.clear()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)
            accepted = self._accepted
        # A hung-up request ends on the server a moment after the client left.
        deadline = time.monotonic() + self.idle_timeout
        while True:
            stats = self._stats()
            bad = idle_violations(stats)
            # Waiting settles what only holds once requests are done, not the rest.
            live = live_violations(stats)
            if finished(stats) >= accepted and all(v in live for v in bad):
                break
            if time.monotonic() > deadline:
                bad = bad or [f"{accepted - finished(stats)} accepted requests never finished"]
                break
            time.sleep(0.2)
        for v in bad:
            self.violation(f"idle {when}: {v}")
        for v in disk_violations(stats, self.report.disk):
            self.violation(f"{when}: {v}")
        self.report.idle_checks += 1
        self.report.stats = stats

    def _live_check(self) -> None:
        status, body = self.get("/health")
        if status != 200:
            self.violation(f"/health answered {status}: {body[:200]}")
        stats = self._stats()
        for v in live_violations(stats) + disk_violations(stats, self.report.disk):
            self.violation(v)
        self.report.live_checks += 1

    def _probe(self, restart: int = 0) -> None:
        """Ask the probe prompts, clients paused: before the first restart, their answers;
        after restart ``restart``, the same answers, and whether they came from disk."""
        for spec in self.probes:
            o = send(self.port, spec, timeout=self.request_timeout)
            if not o.ok:
                self.violation(f"probe {spec.describe()} failed: {o.error}")
                continue
            with self._lock:
                self._accepted += 1
            seen = self.probe_answers.setdefault(spec.key(), o.text)
            if seen != o.text:
                self.violation(
                    f"greedy answer of a probe changed after restart {restart}: "
                    f"{seen!r} then {o.text!r}"
                )
            if restart:
                self.report.probes += 1
                # A new server's pool is empty: what it had cached came from disk.
                self.report.probes_hit += cached_tokens(o.usage) > 0

    def _ready(self) -> bool:
        """Wait until the server has bound its model: it answers ``/health`` while the
        model loads on its generation thread, and its stats show no pool until then."""
        deadline = time.monotonic() + self.idle_timeout
        while not self._stats().get("model"):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def _restart(self) -> None:
        """Kill the server (SIGKILL) with requests in flight, start it again on the same
        disk tier; then, clients paused, it must be idle, answer the probes as before and
        have read pages back from disk."""
        n = self.report.restarts + 1
        before = self._stats()
        self.report.lives.append(before)  # the dying life's counters, near enough
        with self._lock:
            self._down = True
        self.lives.kill()
        with self._lock:
            self._epoch += 1
            self._accepted = 0
        try:
            self.lives.start()
        except RuntimeError as e:
            self.violation(f"the server did not come back after restart {n}: {str(e)[-600:]}")
            return
        with self._lock:
            self._down = False
        self.report.restarts = n
        if not self._ready():
            self.violation(f"no model loaded {self.idle_timeout:g} s after restart {n}")
            return
        self._quiesce(f"after restart {n}")
        kept, had = self.report.stats.get("disk_pages", 0), before.get("disk_pages", 0)
        if not kept:
            self.violation(f"the disk tier was empty after restart {n}")
        elif (
            kept < had
            and not before.get("disk_writes_dropped")
            and before.get("disk_bytes", 0) < 0.8 * before.get("disk_bytes_max", 0)
        ):
            # Nothing was evicted or dropped: every page renamed into place must be found.
            self.violation(f"{kept} pages on disk after restart {n}, of {had} before the kill")
        self._probe(n)
        self._quiesce(f"after restart {n} and the probes")
        if self.report.stats.get("disk_hits"):
            self.report.restarts_hit += 1

    def run(self) -> Report:
        threads = [threading.Thread(target=self._client, args=(c,)) for c in self.clients]
        threads += [threading.Thread(target=self._adversary, args=(r,)) for r in self.adversaries]
        for t in threads:
            t.start()
        start = time.monotonic()
        end = start + self.seconds
        # Restarts at every ``restart_every`` seconds from the start, none in the last one.
        every = self.restart_every if self.lives else None
        restart_at = start + every if every else float("inf")
        try:
            if not self._ready():
                self.violation(f"no model loaded {self.idle_timeout:g} s after the start")
            elif self.probes:
                self._probe()  # the answers every restart must give again
            while time.monotonic() < end and not self.report.violations:
                self._go.set()
                until = min(end, time.monotonic() + self.check_every)
                restart = False
                while time.monotonic() < until:
                    wake = min(until, restart_at)
                    time.sleep(min(2.0, max(0.0, wake - time.monotonic())))
                    if time.monotonic() >= restart_at and restart_at < end - 1:
                        restart = True
                        break
                    self._live_check()
                if restart:
                    self._restart()
                    # At least half a period of traffic after a restart that ran long.
                    restart_at = max(restart_at + every, time.monotonic() + every / 2)
                else:
                    self._quiesce()
        except (OSError, http.client.HTTPException, RuntimeError) as e:
            self.violation(f"the server stopped answering: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._stop = True
            self._go.set()
            for t in threads:
                t.join()
            self.report.seconds = time.monotonic() - start
        self.report.lives.append(self.report.stats)
        if self.report.restarts and not self.report.restarts_hit:
            self.violation(f"none of {self.report.restarts} restarts read a page from disk")
        return self.report


def soak_server(
    model: str,
    minutes: float,
    *,
    clients: int = 16,
    pool_tokens: int = 1024,
    page_size: int = 4,
    seed: int = 0,
    check_every: float = 10.0,
    env: dict[str, str] | None = None,
    restart_every: float | None = None,
    disk_dir: str | Path | None = None,
    disk_mib: int = 0,
    adversaries: int = 0,
) -> Report:
    """Start ``mlx_lm.server --plugin radix`` on ``model`` (127.0.0.1) and soak it.

    The pool is small on purpose: the workload keeps it full, so eviction runs all along.
    ``restart_every`` seconds: kill the server (SIGKILL) that often and start it again, on
    the disk tier. ``disk_dir`` turns the disk tier on there (default with restarts: a
    temporary directory); ``disk_mib`` is its budget (0: the server's default). The servers'
    logs and the temporary disk tier lie in a temporary directory, removed after a soak that
    passed and named in the report of one that failed.
    """
    if restart_every is not None and not 0 < restart_every < minutes * 60:
        raise ValueError(f"restarts every {restart_every} s in a soak of {minutes * 60:g} s")
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--plugin", "radix"]
    cmd += ["--model", model, "--port", str(port)]
    env = dict(os.environ if env is None else env)
    env.update(MLX_RADIX_POOL_TOKENS=str(pool_tokens), MLX_RADIX_PAGE_SIZE=str(page_size))
    run_dir = Path(tempfile.mkdtemp(prefix="mlx-radix-soak-"))
    disk = restart_every is not None or disk_dir is not None
    if disk:
        env.update(
            MLX_RADIX_DISK_ENABLED="1",
            MLX_RADIX_DISK_DIR=str(disk_dir or run_dir / "disk"),
            MLX_RADIX_DISK_MIB=str(disk_mib),
        )
        # Read pages back even where computing them is measured faster (a small model):
        # the soak is there to check what comes back from disk.
        env.setdefault(BY_KEY["radix.disk.restore"].env, "on")
    lives = Lives(cmd, env, port, run_dir)
    lives.start()
    try:
        soak = Soak(
            port,
            minutes * 60,
            clients,
            seed,
            check_every,
            lives=lives,
            restart_every=restart_every,
            disk=disk,
            adversaries=adversaries,
        )
        report = soak.run()
    finally:
        status = lives.stop()
    if status is not None:
        report.violations.append(f"the server exited with status {status}")
    if report.violations:
        report.log, report.logs = lives.logs[-1], lives.logs
    else:
        # The logs are kept for a soak that failed, where its verdict names them; a soak
        # that passed leaves no directory behind (a test suite runs several).
        shutil.rmtree(run_dir, ignore_errors=True)
    return report


def lines(report: Report) -> Iterator[str]:
    """The verdict; after a failure, a few more violations and where the server log is."""
    yield report.verdict()
    if report.violations:
        for v in report.violations[1:6]:
            yield f"  also: {v}"
        yield f"  server log: {report.log}"
        if len(report.logs) > 1:
            yield f"  earlier lives' logs: {', '.join(p.name for p in report.logs[:-1])}"
