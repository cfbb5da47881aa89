"""Soak: many concurrent clients against ``mlx_lm.server --plugin radix`` for minutes, with
the pool's invariants checked through ``/v1/cache/stats`` as it runs.

    mlx-radix soak --model PATH --minutes 2

Each client sends completions and chat completions, streamed or not, on a few shared
prefixes (system prompts); some continue their previous prompt with its completion (an
exact repeat of what the cache holds), and one request in ten disconnects after its first
streamed token. Every few seconds the clients pause, and once the server is idle the pool
must be too: no page locked or held by a finished request, every used page cached. In
between, the server must answer ``/health`` and its counters must add up. Greedy decoding
must give one answer per prompt, however the batches were made up. One line says whether
everything held; the exit status is 0 if it did, 1 if not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

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
        text, usage = [], None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            text.append(event_text(event))
            if spec.disconnect and text[-1]:
                return Outcome(spec, True, "".join(text), disconnected=True)
        return Outcome(spec, True, "".join(text), usage)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
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
    idle_checks: int = 0
    live_checks: int = 0
    violations: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    log: Path | None = None  # the server's output

    def verdict(self) -> str:
        s = self.stats
        hit = s.get("cached_tokens", 0) / max(1, s.get("prompt_tokens", 0))
        summary = (
            f"{self.seconds:.0f} s, {self.requests} requests ({self.streamed} streamed, "
            f"{self.disconnected} disconnected, {self.continued} continuations), "
            f"{self.idle_checks} idle + {self.live_checks} live checks, "
            f"{s.get('evictions', 0)} pages evicted, {hit:.0%} of prompt tokens cached"
        )
        if not self.violations:
            return f"soak PASS: {summary}"
        return (
            f"soak FAIL: {len(self.violations)} violations; first: {self.violations[0]} ({summary})"
        )


class Soak:
    """Drive ``n_clients`` clients against a running server on ``port`` for ``seconds``."""

    def __init__(
        self,
        port: int,
        seconds: float,
        n_clients: int = 16,
        seed: int = 0,
        check_every: float = 10.0,
        idle_timeout: float = 60.0,
        request_timeout: float = 300.0,
    ):
        self.port, self.seconds, self.check_every = port, seconds, check_every
        self.idle_timeout, self.request_timeout = idle_timeout, request_timeout
        self.clients = clients(seed, n_clients)
        self.report = Report()
        self.answers: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self._go = threading.Event()  # set: clients may send
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._accepted = 0  # requests the server took (HTTP 200)
        self._stop = False

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

    def _client(self, client: Client) -> None:
        while True:
            self._go.wait()
            with self._lock:
                if self._stop:
                    return
                if not self._go.is_set():
                    continue
                self._in_flight += 1
            outcome = client.run_one(self.port, timeout=self.request_timeout)
            with self._lock:
                self._record(outcome)
                self._in_flight -= 1
                self._idle.notify_all()

    def _record(self, o: Outcome) -> None:
        spec, r = o.spec, self.report
        r.requests += 1
        r.streamed += spec.stream
        r.continued += spec.chain > 0
        if not o.ok:
            r.violations.append(f"{spec.describe()} failed: {o.error}")
            return
        self._accepted += 1
        if o.disconnected:
            r.disconnected += 1
            return
        seen = self.answers.setdefault(spec.key(), o.text)
        if seen != o.text:
            r.violations.append(f"greedy answer changed for one prompt: {seen!r} then {o.text!r}")

    def _quiesce(self) -> None:
        """Stop the clients, wait for their requests and the server to finish; check idle."""
        self._go.clear()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)
            accepted = self._accepted
        # A hung-up request ends on the server a moment after the client left.
        deadline = time.monotonic() + self.idle_timeout
        while True:
            stats = self._stats()
            if finished(stats) >= accepted and not idle_violations(stats):
                break
            if time.monotonic() > deadline:
                for v in idle_violations(stats) or [
                    f"{accepted - finished(stats)} accepted requests never finished"
                ]:
                    self.violation(f"idle after {self.report.requests} requests: {v}")
                break
            time.sleep(0.2)
        self.report.idle_checks += 1
        self.report.stats = stats

    def _live_check(self) -> None:
        status, body = self.get("/health")
        if status != 200:
            self.violation(f"/health answered {status}: {body[:200]}")
        for v in live_violations(self._stats()):
            self.violation(v)
        self.report.live_checks += 1

    def run(self) -> Report:
        threads = [threading.Thread(target=self._client, args=(c,)) for c in self.clients]
        for t in threads:
            t.start()
        start = time.monotonic()
        end = start + self.seconds
        try:
            while time.monotonic() < end and not self.report.violations:
                self._go.set()
                until = min(end, time.monotonic() + self.check_every)
                while time.monotonic() < until:
                    time.sleep(min(2.0, max(0.0, until - time.monotonic())))
                    self._live_check()
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
) -> Report:
    """Start ``mlx_lm.server --plugin radix`` on ``model`` (127.0.0.1) and soak it.

    The pool is small on purpose: the workload keeps it full, so eviction runs all along.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--plugin", "radix"]
    cmd += ["--model", model, "--port", str(port)]
    env = dict(os.environ if env is None else env)
    env.update(MLX_RADIX_POOL_TOKENS=str(pool_tokens), MLX_RADIX_PAGE_SIZE=str(page_size))
    log = Path(tempfile.mkdtemp(prefix="mlx-radix-soak-")) / "server.log"
    with ServerProcess(cmd, env, port, log) as server:
        report = Soak(port, minutes * 60, clients, seed, check_every).run()
        if server.proc.poll() is not None:
            report.violations.append(f"the server exited with status {server.proc.returncode}")
    report.log = log
    return report


def lines(report: Report) -> Iterator[str]:
    """The verdict; after a failure, a few more violations and where the server log is."""
    yield report.verdict()
    if report.violations:
        for v in report.violations[1:6]:
            yield f"  also: {v}"
        yield f"  server log: {report.log}"
