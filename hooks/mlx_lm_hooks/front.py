"""mlx_lm.server's HTTP front in a process of its own.

In one process, the generation thread shares the GIL with a handler thread per request.
On an H200 (Llama-3-8B's shape, 32 streams) each token woke its handler, whose state
machine, JSON and write took 60-100 us of GIL time, and the generation thread, which
launches the next step, waited behind them at each return from MLX: a 7.5 ms step in
process took 15-19 ms through the server (docs/benchmarking.md, "The HTTP front").

With the front on, the process that loads the model (the engine) keeps its generation
thread, and serves every route but completions on a loopback port of its own. The front,
a second process, listens on ``--host``/``--port``: it runs stock's handlers for
``/v1/completions`` and ``/v1/chat/completions`` over a pipe to the engine, and forwards
every other request (``/health``, ``/v1/models``, plugin routes) to the engine's port.
The engine's side puts a request on the generation thread's queue with a response queue
(``Outbox``) that does no more than append: a sender thread ships what a step put, for
every request, as one message, and the front's receiver hands each request its part. So
the engine's GIL is shared with two threads, not one a request, and the per-token work of
the handlers runs on another core. Detokenizing stays where stock does it.

Which runs is the plugins' choice (``mlx_lm_http_front``); a distributed server (under
mlx.launch) keeps one process.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from queue import Queue

log = logging.getLogger("mlx_lm_hooks")

# Stock's completion routes (``APIHandler.do_POST``): what the front serves itself.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
# The address of the client a forwarded request came from (pins check it is this machine):
# set by the front, read by the engine's handlers only when the front is on.
CLIENT_HEADER = "X-Mlx-Lm-Front-Client"
# Not forwarded: they describe one connection, and the front's own are sent.
HOP_HEADERS = frozenset(
    ("connection", "keep-alive", "transfer-encoding", "upgrade", "server", "date")
)
LISTEN_BACKLOG = 128  # as the one-process server's (server.HTTPServer)


# -- the engine's side ----------------------------------------------------------------------


class Outbox:
    """A request's response queue on the engine's side: what the generation thread puts is
    appended to the bridge's outgoing list, for the sender thread to ship with the rest."""

    def __init__(self, bridge: Bridge, rid: int):
        self.bridge, self.rid = bridge, rid
        self.ctx = None
        self.generated, self.reason, self.ended = 0, None, False
        self.start = 0.0

    def put(self, item, block=True, timeout=None) -> None:
        self.bridge.ship(self, item)

    def stop(self) -> None:
        """The front's handler is done with the request (a hang-up, or its end)."""
        if self.ctx is not None:
            self.ctx.stop()


class Bridge:
    """The engine's end of the pipe: requests from the front onto the generation thread's
    queue, their responses back, one message a batch."""

    def __init__(self, generator, conn: Connection, on_lost, on_record):
        from mlx_lm.server import GenerationContext

        from .server import GenerationFailed, ModelUnavailable, RequestRefused

        self._context = GenerationContext
        self._kept = (RequestRefused, ModelUnavailable, GenerationFailed)
        self.generator, self.conn = generator, conn
        self.on_lost, self.on_record = on_lost, on_record
        self.outboxes: dict[int, Outbox] = {}
        self._pending: list[tuple[int, object]] = []
        self._records: list[Outbox] = []
        self._cond = threading.Condition()
        self._closed = False
        for target, name in ((self._receive, "front-receive"), (self._send, "front-send")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def ship(self, box: Outbox, item) -> None:
        """``box.put(item)``: on the generation thread (or a failed loop's cleanup)."""
        ended = False
        if isinstance(item, self._context):
            box.ctx, box.start = item, time.perf_counter()
        elif isinstance(item, BaseException):
            if not isinstance(item, self._kept):
                # The front's handler tells the client the message (stock's: a 404 with
                # str(e)); an arbitrary exception's type may not unpickle there.
                item = RuntimeError(str(item))
            box.reason, ended = "error", True
        elif item is None:
            ended = True
        elif not isinstance(item, tuple):  # a Response (a tuple is prompt progress)
            box.generated += 1
            box.reason = item.finish_reason or box.reason
        with self._cond:
            self._pending.append((box.rid, item))
            if ended:
                self._end(box)
            self._cond.notify()

    def _end(self, box: Outbox) -> None:
        """Called with the lock held: the request is over, counted once."""
        if box.ended:
            return
        box.ended = True
        self.outboxes.pop(box.rid, None)
        if box.ctx is not None:
            self._records.append(box)

    def _receive(self) -> None:
        try:
            while True:
                kind, rid, *rest = self.conn.recv()
                if kind == "generate":
                    box = self.outboxes[rid] = Outbox(self, rid)
                    request, args = rest
                    self.generator.requests.put((box, request, args))
                elif kind == "stop":
                    box = self.outboxes.get(rid)
                    if box is not None:
                        box.stop()
                        with self._cond:
                            # Its handler let go before the end: a hang-up.
                            box.reason = box.reason or "disconnect"
                            self._end(box)
                            self._cond.notify()
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("the engine's end of the front's pipe failed")
        if not self._closed:
            self.on_lost()

    def _send(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._records:
                    self._cond.wait()
                items, self._pending = self._pending, []
                records, self._records = self._records, []
            if items:
                try:
                    self._send_items(items)
                except OSError:
                    return  # the front is gone: the receiver saw it too
            for box in records:
                self.on_record(box)

    def _send_items(self, items: list) -> None:
        try:
            data = pickle.dumps(items, pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            # One item would not pickle (a tool parser that is a closure, say): that request
            # fails with the reason, the others go on.
            log.warning("a response could not be sent to the HTTP front: %s", e)
            data = pickle.dumps([_picklable(item) for item in items], pickle.HIGHEST_PROTOCOL)
        self.conn.send_bytes(data)

    def close(self) -> None:
        """End the pipe: the front hears it at once (a shutdown, where closing the descriptor
        would leave this side's receiver blocked on it and the front none the wiser)."""
        self._closed = True
        try:
            sock = socket.socket(fileno=self.conn.fileno())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()
        except OSError:
            pass
        self.conn.close()


def _picklable(pair):
    rid, item = pair
    try:
        pickle.dumps(item)
        return pair
    except Exception as e:
        return rid, RuntimeError(f"the response could not reach the HTTP front: {e}")


class Front:
    """The engine's handle on the front process: started, watched, stopped."""

    def __init__(self, host: str, port: int, generator, on_record):
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        # Bound here, so that a port in use fails the server's start as stock's does.
        self.public = socket.socket(family, socket.SOCK_STREAM)
        self.public.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.public.bind(address)
        self.public.listen(LISTEN_BACKLOG)
        self.address = (host, port)
        self.generator, self.on_record = generator, on_record
        self.lost = False
        self.engine_server = None  # the engine's own HTTP server, once it listens
        self.proc: subprocess.Popen | None = None
        self.bridge: Bridge | None = None

    def start(self, engine_server) -> None:
        """Start the front once the engine's own server listens (``engine_server``)."""
        self.engine_server = engine_server
        mine, theirs = socket.socketpair()
        config = {
            "socket": self.public.fileno(),
            "bridge": theirs.fileno(),
            "engine": engine_server.server_address[:2],
            "cli_args": self.generator.cli_args,
            "log_level": logging.getLogger().getEffectiveLevel(),
            # A plugin may set this package's logger apart (the radix plugin's log_level).
            "hooks_log_level": log.getEffectiveLevel(),
        }
        # The front imports this package as the engine did, from a checkout on sys.path too.
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm_hooks.front"],
            stdin=subprocess.PIPE,
            pass_fds=(self.public.fileno(), theirs.fileno()),
            env=env,
        )
        self.proc.stdin.write(pickle.dumps(config))
        self.proc.stdin.close()
        theirs.close()
        self.public.close()  # the front holds it now
        conn = Connection(mine.detach())
        self.bridge = Bridge(self.generator, conn, self._lost, self.on_record)
        log.info(
            "HTTP front (process %d) on %s port %d; engine routes on %s port %d",
            self.proc.pid,
            *self.address,
            *engine_server.server_address[:2],
        )

    def _lost(self) -> None:
        status = None
        if self.proc is not None:
            try:
                status = self.proc.wait(1)
            except subprocess.TimeoutExpired:
                pass  # its end of the pipe closed first
        log.error(
            "the HTTP front (process %s) ended (status %s): the server stops",
            self.proc.pid if self.proc else "?",
            status,
        )
        self.lost = True
        if self.engine_server is not None:
            threading.Thread(target=self.engine_server.shutdown, daemon=True).start()

    def stop(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
        if self.proc is None:
            self.public.close()
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the front's side -----------------------------------------------------------------------


class FrontGenerator:
    """What stock's handlers use of the ResponseGenerator (``generate``, ``cli_args``), over
    the pipe to the engine."""

    def __init__(self, conn: Connection, cli_args, on_lost):
        self.cli_args = cli_args
        self._conn, self._on_lost = conn, on_lost
        self._send_lock = threading.Lock()
        self._queues: dict[int, Queue] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._receive, name="engine-receive", daemon=True).start()

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def generate(self, request, generation_args, progress_callback=None):
        rid, queue = next(self._ids), Queue()
        self._queues[rid] = queue
        try:
            self._send(("generate", rid, request, generation_args))
        except OSError as e:
            self._queues.pop(rid, None)
            raise RuntimeError("the engine process is gone") from e
        ctx = queue.get()
        if isinstance(ctx, BaseException):
            raise ctx
        ctx.stop = partial(self._stop, rid)
        from .server import _handling, awaited, watched

        connection = getattr(_handling, "connection", None)

        def responses():
            while True:
                item = awaited(queue, connection, ctx.stop)
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple):
                    if progress_callback is not None:
                        progress_callback(*item)
                    continue
                yield item

        return ctx, watched(responses(), connection, ctx.stop)

    def _stop(self, rid: int) -> None:
        if self._queues.pop(rid, None) is None:
            return  # already ended: nothing runs for it
        try:
            self._send(("stop", rid))
        except OSError:
            pass

    def _receive(self) -> None:
        try:
            while True:
                for rid, item in self._conn.recv():
                    queue = self._queues.get(rid)
                    if queue is None:
                        continue  # stopped by its handler
                    if item is None or isinstance(item, BaseException):
                        self._queues.pop(rid, None)
                    queue.put(item)
        except (EOFError, OSError):
            pass
        from .server import GenerationFailed

        gone = GenerationFailed("the server's engine process ended")
        for rid in list(self._queues):
            queue = self._queues.pop(rid, None)
            if queue is not None:
                queue.put(gone)
        self._on_lost()


# What a forwarded stream ends with when its route ended it: each API's last event, or its
# error event (chat completions' streams are the front's own, over the pipe).
STREAM_ENDS = (
    b"message_stop",
    b"response.completed",
    b"response.incomplete",
    b"response.failed",
    b"[DONE]",
    b"event: error",
)
CUT_SHORT = "the server's engine process ended before this response did; send it again"


def cut_short_event(path: str) -> bytes:
    """The error event that ends a forwarded stream cut short, in the shape of its API."""
    if path.startswith("/v1/messages"):
        error = {"type": "error", "error": {"type": "api_error", "message": CUT_SHORT}}
    elif path.startswith("/v1/responses"):
        error = {"type": "error", "code": "server_error", "message": CUT_SHORT, "param": None}
        error["sequence_number"] = 0  # as the route's own error events (agents/responses.py)
    else:
        return f"data: {json.dumps({'error': CUT_SHORT})}\n\n".encode()
    return f"event: error\ndata: {json.dumps(error)}\n\n".encode()


def _front_handler_class(engine: tuple[str, int]):
    from .server import HANGUP_CHECK_S, _handler_class, hung_up

    base = _handler_class()

    class FrontHandler(base):
        def do_GET(self):
            self._forward("GET")

        def do_POST(self):
            if self.path in COMPLETION_PATHS:
                super().do_POST()  # stock's, over FrontGenerator
            else:
                self._forward("POST")

        def do_DELETE(self):
            self._forward("DELETE")

        def _forward(self, method: str) -> None:
            length = self.body_length(required=method == "POST") if method != "GET" else 0
            if length is None:
                return
            body = self.rfile.read(length) if length else None
            # Header names are case-insensitive: a client's own client header, in any case,
            # would otherwise reach the engine ahead of the front's, and be believed.
            ours = {*HOP_HEADERS, CLIENT_HEADER.lower()}
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ours}
            headers[CLIENT_HEADER] = self.client_address[0]
            upstream = http.client.HTTPConnection(*engine)
            try:
                try:
                    upstream.request(method, self.path, body, headers)
                    # A response not streamed comes whole at its end: until then, a client
                    # that leaves is noticed here, and closing the engine's connection
                    # stops its request there (server.watched).
                    while not select.select([upstream.sock], [], [], HANGUP_CHECK_S)[0]:
                        if hung_up(self.connection):
                            self.close_connection = True
                            log.info(
                                "client %s hung up before its response began",
                                self.client_address[0],
                            )
                            return
                    answer = upstream.getresponse()
                except OSError as e:
                    self._send_error(502, f"the server's engine process did not answer: {e}")
                    return
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                if answer.getheader("Content-Length") is None:
                    self.close_connection = True
                self.end_headers()
                streamed = "text/event-stream" in (answer.getheader("Content-Type") or "")
                tail = b""
                try:
                    while True:
                        try:
                            chunk = answer.read1(65536)
                        except (http.client.HTTPException, OSError):
                            chunk = b""  # the engine went mid-response: as its end, below
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        tail = (tail + chunk)[-512:]
                    if streamed and not any(end in tail for end in STREAM_ENDS):
                        # The engine's stream ends with the connection: one cut short (the
                        # engine died) would reach the client as a whole 200 with no error.
                        self.wfile.write(cut_short_event(self.path))
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    # Closing the engine's connection tells its route the client is gone.
                    self.close_connection = True
                    log.info("client %s hung up before its response ended", self.client_address[0])
            finally:
                upstream.close()

    return FrontHandler


def serve_front(config: dict) -> None:
    """The front process: stock's HTTP server over the engine's pipe, until either ends."""
    import mlx_lm.server as server

    from . import server as hooks_server
    from .server import HTTPServer

    logging.basicConfig(
        level=config["log_level"], format="%(asctime)s - %(levelname)s - %(message)s"
    )
    log.setLevel(config["hooks_log_level"])
    # The hooks' handler over stock's (salt, refusals as 400, failed steps as 503, hang-ups
    # as one line); no plugin routes here: they are the engine's.
    hooks_server._Installed.stock = {"APIHandler": server.APIHandler}
    hooks_server._Installed.routes = None
    listening = socket.socket(fileno=config["socket"])
    handler = _front_handler_class(tuple(config["engine"]))
    httpd = HTTPServer(listening.getsockname()[:2], None, bind_and_activate=False)
    httpd.socket.close()
    httpd.socket, httpd.address_family = listening, listening.family
    httpd.server_address = listening.getsockname()

    def lost() -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    generator = FrontGenerator(Connection(config["bridge"]), config["cli_args"], lost)
    fingerprint = server.get_system_fingerprint()
    httpd.RequestHandlerClass = lambda *a, **k: handler(
        generator, *a, system_fingerprint=fingerprint, **k
    )
    # Ctrl-C reaches the whole process group: the engine stops, then stops this process
    # (SIGTERM), so that requests in flight end as the engine ends them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    httpd.server_close()
    logging.shutdown()
    os._exit(0)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    serve_front(pickle.loads(sys.stdin.buffer.read()))
