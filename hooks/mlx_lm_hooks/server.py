"""Hook call sites in an unmodified mlx_lm.server.

mlx-lm has no plugin system. ``install`` swaps module globals of ``mlx_lm.server``
that it looks up at call time (``ModelProvider``, ``LRUPromptCache``,
``BatchGenerator``, ``ResponseGenerator``, ``_run_http_server``) for versions that
call the hooks and otherwise behave exactly as stock. No request handling is
copied; every stock endpoint keeps working.

Where stock 0.32.2 breaks under pressure, the versions here hold, for every plugin: an empty
prompt ends stock's generation thread (``insert_segments`` raises outside any try), so it is
refused with HTTP 400, as are a prompt longer than the model's context and one the tokenizer
rejects (stock: 404), and sampling no step could run (a ``top_k`` beyond the vocabulary, a
logit bias on an id the model has not, a NaN temperature, thousands of stop sequences:
validation.py), which in stock fails the step of every request batched with it;
``max_tokens`` is clamped to what the context leaves after the prompt (stock decodes past
it), and a client that hangs up stops its request, streamed or not (stock's non-streamed
requests ran on to ``max_tokens``); stock's listen backlog of 5 resets connections when more
clients connect at once; a client hanging up mid-stream no longer prints a traceback; a
request that arrives while a batch decodes joins it at the next step, where stock leaves it
queued until the generation thread's 0.5 s time budget runs out. Requests with the same
sampling settings share one sampler, and a logit bias is readable (sampling.py), so that a
batch can sample and bias its rows at once. A step that fails (a CUDA out-of-memory error,
say) fails the requests of its batch with HTTP 503 or an error event, where stock's
generation thread dies for good. Requests may carry vLLM's ``cache_salt`` (salt.py): only
requests with the same salt share cached prompts, and a ``messages_for(tokenizer)`` that
renders their chat messages for the tokenizer that tokenizes them (the agent APIs place
system messages by what the template renders).
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from http.server import ThreadingHTTPServer
from queue import Empty, Queue
from urllib.parse import urlsplit

import pluggy

from .front import CLIENT_HEADER, Front
from .plugins import ActivationError, activate, get_plugin_manager
from .routes import RouteRequest, RouteResponse, RouteTable
from .salt import BadSalt, SaltedPromptCache, parse_salt
from .sampling import Sampling
from .tokenizing import MAX_AHEAD, Prefetcher
from .validation import InvalidSampling, check_prompt, check_sampling, vocab_size

log = logging.getLogger("mlx_lm_hooks")


@dataclass
class RequestRecord:
    """What ``mlx_lm_request_finished`` receives."""

    model_key: tuple | None
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    finish_reason: str | None  # "stop", "length", "disconnect", "error" or None
    seconds: float


class RequestRefused(ValueError):
    """A request the server will not run; the client gets HTTP 400 and this message."""


class ModelUnavailable(LookupError):
    """The model a request names cannot be loaded; the client gets HTTP 404 (as stock)."""


class ClientGone(ConnectionResetError):
    """The client closed its connection while its request ran: the request stops there."""


# The largest request body a handler reads (``MLX_LM_MAX_BODY_BYTES``): a larger one is
# refused (413) before a byte of it is read. Claude Code's requests run to a few hundred KB;
# 1e12 bytes made stock raise MemoryError.
MAX_BODY_BYTES = int(os.environ.get("MLX_LM_MAX_BODY_BYTES", 64 << 20))
# Seconds a handler waits on its socket (headers, a body, a write) before it gives up: 300
# half-sent bodies held 300 threads for as long as their clients liked.
SOCKET_TIMEOUT_S = 120
# Connections served at once (``MLX_LM_MAX_CONNECTIONS``): each holds a handler thread, and
# stock's server started one for every connection, without bound. One past it gets 503 at
# once. Agent clients hold one or two each.
MAX_CONNECTIONS = int(os.environ.get("MLX_LM_MAX_CONNECTIONS", 256))

# How often a request's tokens look at its connection: a client that hung up is noticed
# within this of its next token, and its row leaves the batch at the next step.
HANGUP_CHECK_S = 0.25
# The connection each handler thread serves (ThreadingHTTPServer: a thread a connection).
_handling = threading.local()


def hung_up(connection: socket.socket) -> bool:
    """Whether the peer has closed ``connection``: it reads as ready with nothing to read.
    A request's body has been read by then, so nothing else is waiting there."""
    try:
        ready, _, _ = select.select([connection], [], [], 0)
        return bool(ready) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def watched(responses, connection: socket.socket | None, stop):
    """``responses`` until the client closes ``connection`` (looked at every
    ``HANGUP_CHECK_S`` as tokens come): then ``stop()`` and ``ClientGone``. A response that
    is not streamed writes nothing until its end, so nothing else notices a client that left,
    and its request ran on to ``max_tokens`` holding its pages."""
    checked = time.monotonic()
    for r in responses:
        yield r
        if connection is not None and time.monotonic() - checked >= HANGUP_CHECK_S:
            checked = time.monotonic()
            if r.finish_reason is None and hung_up(connection):
                stop()
                raise ClientGone("the client closed its connection")


def awaited(queue: Queue, connection: socket.socket | None, stop, alive=lambda: True):
    """The next item of a request's response ``queue``, looking at the client every
    ``HANGUP_CHECK_S`` while none comes: a client that left gets ``stop()`` and
    ``ClientGone``. ``watched`` looks only as tokens come, and a request waiting in the queue
    for pool room or a place in the batch has none: it kept what it matched until it
    started. ``alive()`` false: the generation thread died (stock's ``RuntimeError``)."""
    while True:
        try:
            return queue.get(timeout=HANGUP_CHECK_S)
        except Empty:
            if not alive():
                raise RuntimeError("generation thread died") from None
            if connection is not None and hung_up(connection):
                stop()
                raise ClientGone("the client closed its connection") from None


class GenerationFailed(RuntimeError):
    """A step of the batch this request was in failed; the client gets HTTP 503 (or an error
    event on a stream) and the server goes on serving."""


class RowFailed(GenerationFailed):
    """This request's own work (a logits processor, its sampler) failed in a step; the
    rest of its batch went on."""


class Overloaded(GenerationFailed):
    """The request waited its time in the queue without starting; the client gets HTTP 503
    with ``Retry-After: retry_after`` (an error event on a stream that began)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):  # across the front's pipe, with its delay
        return type(self), (str(self), self.retry_after)


class _RequestQueue(Queue):
    """The generation thread's queue of requests, remembering each one's response queue
    (while its handler still holds it) so that a failed step can answer them."""

    def __init__(self):
        super().__init__()
        self.responses: weakref.WeakSet = weakref.WeakSet()
        self._of: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Told of each request as it is queued (the generator's ``_tokenize_ahead``).
        self.on_put: Callable[[tuple], None] | None = None

    def put(self, item, block=True, timeout=None):
        if isinstance(item, tuple):  # (response queue, request, arguments)
            self.responses.add(item[0])
            self._of[id(item[1])] = item[0]
            # Before it is queued: once queued, the generation thread may take it first.
            if self.on_put is not None:
                try:
                    self.on_put(item)
                except Exception:  # a worker that cannot start: it is tokenized when taken
                    log.debug("tokenizing a request ahead failed", exc_info=True)
        super().put(item, block, timeout)

    def responses_of(self, request) -> Queue | None:
        """The response queue of ``request`` while its handler holds it."""
        return self._of.get(id(request))


# The response queue and context of the request the generation thread is taking: stock's
# loop tokenizes it, makes its context, then inserts its row, on this thread
# (``_RowErrors.insert_segments``).
_joining = threading.local()


def _context_class(stock):
    class GenerationContext(stock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _joining.context = self

        def __reduce__(self):  # across the front's pipe as stock's, by its fields
            return _context, ({f.name: getattr(self, f.name) for f in fields(self)},)

    return GenerationContext


def _context(values: dict):
    import mlx_lm.server as server

    return _Installed.stock.get("GenerationContext", server.GenerationContext)(**values)


@dataclass
class _Left:
    """A prompt response for a request the generator dropped (``failed_rows``): stock's loop
    reads it, sees the request stopped and forgets it, as a stopped request's."""

    uid: int
    progress: tuple = (0, 0)
    end_of_segment: bool = False
    end_of_prompt: bool = False


class _RowErrors:
    """A batch generator that can fail or refuse a request alone (``failed_rows``: the radix
    engine), seen by stock's loop: after each step, each such request gets its error before
    the loop hands on that step's responses, is stopped and forgotten, and the rest of the
    batch goes on."""

    def __init__(self, generator):
        self._generator = generator
        self._rows: dict[int, tuple] = {}  # uid -> (response queue, context)
        self._looked = time.monotonic()  # when stopped rows were last looked for

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def insert_segments(self, segments, *args, **kwargs):
        uids = self._generator.insert_segments(segments, *args, **kwargs)
        queue, _joining.queue = getattr(_joining, "queue", None), None
        context, _joining.context = getattr(_joining, "context", None), None
        if queue is not None and context is not None and len(uids) == 1:  # stock: one a call
            self._rows[uids[0]] = (queue, context)
        return uids

    def next(self):
        prompt_responses, responses = self._generator.next()
        for uid, error in self._generator.failed_rows().items():
            row = self._rows.pop(uid, None)
            if row is None:
                continue
            queue, context = row
            if not isinstance(error, GenerationFailed):
                error = RowFailed(f"this request failed in a generation step ({error})")
            queue.put(error)
            context.stop()
            prompt_responses = [*prompt_responses, _Left(uid)]
        for r in responses:
            if r.finish_reason is not None:
                self._rows.pop(r.uid, None)
        # A request stopped before its row made a response (its client left while it waited
        # to start) is forgotten now: stock's loop looks at a request's stop only as its
        # responses come, and until then it held what it matched. Looked for as often as a
        # hang-up is (``HANGUP_CHECK_S``), not at every step: it reads every row.
        if time.monotonic() - self._looked < HANGUP_CHECK_S:
            return prompt_responses, responses
        self._looked = time.monotonic()
        stopped = [uid for uid, (_, context) in self._rows.items() if context._should_stop]
        for uid in stopped:
            del self._rows[uid]
        if stopped:
            prompt_responses = [*prompt_responses, *map(_Left, stopped)]
        return prompt_responses, responses

    def remove(self, uids, *args, **kwargs):
        for uid in uids:
            self._rows.pop(uid, None)
        return self._generator.remove(uids, *args, **kwargs)


def context_length(model: object) -> int | None:
    """Most tokens ``model`` reads, from its config (None when the config does not say).

    ``max_position_embeddings`` is sometimes the length before RoPE scaling (Qwen's YaRN)
    and sometimes after it (Llama 3.1): the larger of the two readings is used, so that a
    prompt a model can read is never refused.
    """
    args = getattr(model, "args", None)
    limit = getattr(args, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    scaling = getattr(args, "rope_scaling", None)
    if isinstance(scaling, dict) and isinstance(scaling.get("factor"), (int, float)):
        original = scaling.get("original_max_position_embeddings") or limit
        limit = max(limit, int(original * scaling["factor"]))
    return limit


class _Installed:
    pm: pluggy.PluginManager | None = None
    stock: dict = {}
    routes: RouteTable | None = None
    cli_args = None
    front = None  # the HTTP front's handle (front.py) while one serves


def _hook():
    return _Installed.pm.hook


# What install() swaps or wraps in mlx_lm.server (0.32.2's names): checked before anything is.
SERVER_NAMES = (
    "ModelProvider",
    "LRUPromptCache",
    "BatchGenerator",
    "ResponseGenerator",
    "_run_http_server",
    "APIHandler",
    "TimeBudget",
    "_make_sampler",
    "_make_logits_processors",
    "GenerationContext",
)


class IncompatibleServer(ActivationError):
    """This mlx_lm.server lacks what the hooks swap: nothing was changed."""


def install(pm: pluggy.PluginManager) -> None:
    """Point mlx_lm.server at the hook call sites; calling it again only swaps ``pm``.

    Raises ``IncompatibleServer``, having changed nothing, when a name it swaps is missing.
    """
    import mlx_lm
    import mlx_lm.server as server

    missing = [name for name in SERVER_NAMES if not hasattr(server, name)]
    if missing:
        raise IncompatibleServer(
            f"mlx_lm.server of mlx-lm {mlx_lm.__version__} has no {', '.join(missing)}: "
            "the plugin hooks were written for mlx-lm 0.32.2"
        )
    _Installed.pm = pm
    routes = RouteTable()
    pm.hook.mlx_lm_register_routes(register=routes.register)
    _Installed.routes = routes
    if _Installed.stock:
        return
    _Installed.stock = {
        name: getattr(server, name) for name in SERVER_NAMES if name != "TimeBudget"
    }
    server.ModelProvider = _model_provider_class(_Installed.stock["ModelProvider"])
    server.LRUPromptCache = _prompt_cache
    server.BatchGenerator = _batch_generator
    server.ResponseGenerator = _response_generator_class(
        _Installed.stock["ResponseGenerator"], _waiting_budget_class(server.TimeBudget)
    )
    server._run_http_server = _run_http_server
    server.GenerationContext = _context_class(_Installed.stock["GenerationContext"])
    # Requests with the same sampling settings share a sampler, and a logit bias is readable,
    # so that a batch can sample and bias its rows at once (sampling.py).
    sampling = Sampling(
        _Installed.stock["_make_sampler"], _Installed.stock["_make_logits_processors"]
    )
    server._make_sampler = sampling.sampler
    server._make_logits_processors = sampling.logits_processors


def uninstall() -> None:
    """Restore stock mlx_lm.server (tests)."""
    import mlx_lm.server as server

    for name, value in _Installed.stock.items():
        setattr(server, name, value)
    _Installed.stock = {}
    _Installed.pm = None
    _Installed.routes = None


def _model_provider_class(stock):
    class ModelProvider(stock):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            _Installed.cli_args = cli_args
            _hook().mlx_lm_server_start(cli_args=cli_args)

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            try:
                super()._load(model_path, adapter_path, draft_model_path)
            except Exception as e:
                # The request's answer (HTTP 404) names what it asked for.
                raise ModelUnavailable(
                    f"model {model_path!r}"
                    + (f" with adapter {adapter_path!r}" if adapter_path else "")
                    + (f" and draft model {draft_model_path!r}" if draft_model_path else "")
                    + f" could not be loaded: {e}"
                ) from e
            _hook().mlx_lm_model_loaded(
                model=self.model,
                tokenizer=self.tokenizer,
                model_key=self.model_key,
                draft_model=self.draft_model,
                cli_args=self.cli_args,
                model_provider=self,
            )

    return ModelProvider


def _prompt_cache(*args, **kwargs):
    cache = _hook().mlx_lm_prompt_cache(cli_args=_Installed.cli_args)
    if cache is None:
        cache = _Installed.stock["LRUPromptCache"](*args, **kwargs)
    return SaltedPromptCache(cache)


def _batch_generator(model, **kwargs):
    generator = _hook().mlx_lm_batch_generator(model=model, kwargs=kwargs)
    if generator is None:
        generator = _Installed.stock["BatchGenerator"](model, **kwargs)
    return _RowErrors(generator) if hasattr(generator, "failed_rows") else generator


def _waiting_budget_class(stock):
    class TimeBudget(stock):
        """Stock's budget of steps between looks at the request queue, which also ends
        once a step has run and a request is waiting."""

        def __init__(self, waiting, **kwargs):
            super().__init__(**kwargs)
            self._waiting = waiting
            self._stepped = False

        def __iter__(self):
            self._stepped = False
            return super().__iter__()

        def __next__(self):
            if self._stepped and self._waiting():
                raise StopIteration
            self._stepped = True
            return super().__next__()

    return TimeBudget


def _response_generator_class(stock, budget):
    from mlx_lm.server import _image_parts

    class ResponseGenerator(stock):
        def __init__(self, model_provider, prompt_cache):
            super().__init__(model_provider, prompt_cache)
            # Stock decodes for 0.5 s between looks at the queue, so a request arriving
            # mid-batch waited up to that long before it was even tokenized (on an H200,
            # 1B x 8 requests: the late ones' first token came 430-520 ms after the others').
            # Distributed ranks keep stock's budget. There it counts steps, not seconds, and
            # resets the count from an all_sum of every rank's time, so every rank leaves the
            # decode loop after the same step and shares the queue (a collective) together.
            # A look at the queue is rank 0's alone (only it hears HTTP): rank 0 would leave
            # the loop to share a request while the others ran the next step's collectives.
            if not self._is_distributed:
                self._time_budget = budget(lambda: not self.requests.empty())
            # Set before any request can arrive: the HTTP server starts after this.
            self.requests = _RequestQueue()
            # Distributed ranks tokenize in step with rank 0's queue, as stock does.
            self._prefetcher = Prefetcher(
                partial(_tokenize_rendered, stock._tokenize, self),
                workers=0 if self._is_distributed else None,
            )
            # The tokenizer and model the generation thread took the last request with.
            self._last_taken: tuple | None = None
            self.requests.on_put = self._tokenize_ahead

        def _run_generate(self):
            # Stock lets an exception in a step (a CUDA out-of-memory error, say) end this
            # thread, and every later request gets "generation thread died". Here the requests
            # the failed loop held get an error, what it held is freed, and a new loop serves
            # the queue. Distributed ranks keep stock's behaviour: they would have to agree.
            if self._is_distributed:
                return super()._run_generate()
            while not self._stop:
                try:
                    self._generate()
                    return
                except Exception as e:
                    log.exception("a generation step failed; its requests get an error")
                    error = f"{type(e).__name__}: {e}"
                # Out of the except block: the failed loop's frames (its batch, its caches)
                # went with the exception's traceback, and can be collected now.
                self._fail_taken_requests(error)

        def _next_request(self, timeout=None):
            # Stock waits ``timeout`` for a request only when nothing is being generated:
            # the idle time plugins may use (on the generation thread, where no graph is
            # being built). It comes before the wait, so what a plugin leaves for then (a
            # finished request's commit) runs while its client sends the next turn, not
            # 0.1 s later. Distributed ranks look after the wait, all at the same (shared)
            # answer, as stock's collectives expect one look a call.
            if timeout is None:
                return super()._next_request(timeout)
            if not self._is_distributed:
                request = super()._next_request()
                if request is not None:
                    return request
                self._idle()
                return super()._next_request(timeout)
            request = super()._next_request(timeout)
            if request is None:
                self._idle()
            return request

        @staticmethod
        def _idle() -> None:
            try:
                _hook().mlx_lm_generation_idle()
            except Exception:
                log.exception("a mlx_lm_generation_idle hook failed")

        def _fail_taken_requests(self, error: str) -> None:
            """Answer every request the failed loop had taken from the queue with an error,
            then free what it held (its batch, its caches: their pages go back)."""
            # Remembered first, then queued: a request arriving in between is in both, and
            # one arriving after is in neither; either way it is served, not failed.
            remembered = list(self.requests.responses)
            with self.requests.mutex:
                waiting = {id(item[0]) for item in self.requests.queue}
            failed = GenerationFailed(
                f"the batch this request was in failed ({error}); the server goes on: send it again"
            )
            for response_queue in remembered:
                if id(response_queue) not in waiting:
                    response_queue.put(failed)
            gc.collect()
            import mlx.core as mx  # not at the top: MLX is imported after blas.preload()

            mx.clear_cache()

        def _tokenize(self, tokenizer, request, args):
            # Runs on the generation thread, inside the try that turns an exception into
            # this request's error; what is refused here never reaches insert_segments.
            self._last_taken = (tokenizer, args.model)
            try:
                prompt, *rest = self._prefetcher.take(tokenizer, request, args, self._waiting(args))
            except (TypeError, ValueError) as e:
                # A prompt that is no string, an empty conversation: the request's fault.
                raise RequestRefused(str(e)) from e
            if not prompt:
                raise RequestRefused("the prompt is empty: send at least one token of text")
            model = self.model_provider.model
            try:
                check_prompt(prompt, vocab_size(model))
                check_sampling(args, vocab_size(model), getattr(request, "param_names", None))
            except InvalidSampling as e:
                raise RequestRefused(str(e)) from e
            limit = context_length(model)
            if limit is not None and len(prompt) > limit:
                raise RequestRefused(
                    f"the prompt is {len(prompt)} tokens long; this model reads at most "
                    f"{limit} (max_position_embeddings in its config)"
                )
            if limit is not None:
                _clamp_max_tokens(args, limit - len(prompt) + 1, len(prompt), limit)
            # Stock fetches this request's cache next, on this thread, then inserts its row.
            _joining.queue = self.requests.responses_of(request)
            if isinstance(self.prompt_cache, SaltedPromptCache):
                self.prompt_cache.salt = getattr(request, "cache_salt", None)
            return (prompt, *rest)

        def _waiting(self, args) -> list[tuple]:
            """``(request, args)`` of the first queued requests that stock's loop will
            tokenize with this request's tokenizer: batchable, for the same model, without
            images. Only the head of the queue is read (a flood is not scanned at each
            request), and a request the look cannot read is left to its own turn."""
            if not self._prefetcher.workers:
                return []
            with self.requests.mutex:
                items = list(itertools.islice(self.requests.queue, MAX_AHEAD))
            return [item[1:] for item in items if self._batches_with(item, args.model)]

        def _batches_with(self, item, model) -> bool:
            """Whether queued ``item`` is one stock's loop will tokenize with the tokenizer
            of ``model``: batchable, for that model, without images. An item this cannot
            read is left to its own turn."""
            try:
                _, request, args = item
                return (
                    args.model == model
                    and self._is_batchable(args)
                    and not any(_image_parts(request.messages))
                )
            except Exception:
                return False

        def _tokenize_ahead(self, item: tuple) -> None:
            """A request as its handler queues it: tokenized on a worker from now, where it
            is for the model the generation thread took the last request for."""
            last = self._last_taken
            if last is not None and self._prefetcher.workers and self._batches_with(item, last[1]):
                self._prefetcher.offer(last[0], item[1], item[2])

        def stop_and_join(self):
            super().stop_and_join()
            self._prefetcher.close()

        def generate(self, request, generation_args, progress_callback=None):
            _handling.ctx = None  # the first item is the context: it comes within a step
            ctx, responses = super().generate(request, generation_args, progress_callback)
            _handling.ctx = ctx
            connection = getattr(_handling, "connection", None)
            return ctx, self._observed(ctx, watched(responses, connection, ctx.stop))

        def _await_response(self, response_queue):
            # On a handler's thread, once its request's context is in hand.
            ctx = getattr(_handling, "ctx", None)
            connection = getattr(_handling, "connection", None)
            if ctx is None or connection is None:
                return super()._await_response(response_queue)
            return awaited(response_queue, connection, ctx.stop, self.generation_available)

        def _observed(self, ctx, responses):
            start, generated, reason = time.perf_counter(), 0, None
            try:
                for r in responses:
                    generated += 1
                    reason = r.finish_reason or reason
                    yield r
            except (GeneratorExit, ClientGone):
                reason = "disconnect"
                raise
            except Exception:
                reason = "error"
                raise
            finally:
                if reason is None and generated:
                    reason = "disconnect"
                _finished(self, ctx, generated, reason, time.perf_counter() - start)

    return ResponseGenerator


def _tokenize_rendered(stock_tokenize, generator, tokenizer, request, args):
    """Stock's ``_tokenize``, after a request that renders its messages for the tokenizer
    (``request.messages_for(tokenizer)``: the agent APIs place system messages by what the
    model's chat template can render) has rendered them for this one."""
    messages_for = getattr(request, "messages_for", None)
    if messages_for is not None:
        request.messages = messages_for(tokenizer)
    return stock_tokenize(generator, tokenizer, request, args)


_clamps_told = itertools.count()


def _clamp_max_tokens(args, room: int, prompt_tokens: int, limit: int) -> None:
    """``max_tokens`` within what the context leaves after the prompt (``room``: the last
    token generated is never read back), so that no request decodes past the positions the
    model was trained for (Claude Code asks for 128,000 on every request). The first clamp is
    logged at INFO, later ones at DEBUG."""
    if args.max_tokens <= room:
        return
    level = logging.INFO if next(_clamps_told) == 0 else logging.DEBUG
    log.log(
        level,
        "max_tokens %d clamped to %d: the prompt's %d tokens leave that many of the model's "
        "%d-token context",
        args.max_tokens,
        room,
        prompt_tokens,
        limit,
    )
    args.max_tokens = room


def _finished(generator, ctx, generated: int, reason: str | None, seconds: float) -> None:
    """Tell the plugins a request ended (``mlx_lm_request_finished``)."""
    record = RequestRecord(
        model_key=generator.model_provider.model_key,
        prompt_tokens=len(ctx.prompt),
        cached_tokens=max(ctx.prompt_cache_count, 0),
        generated_tokens=generated,
        finish_reason=reason,
        seconds=seconds,
    )
    try:
        _hook().mlx_lm_request_finished(record=record)
    except Exception:
        log.exception("a mlx_lm_request_finished hook failed")


def _handler_class():
    stock = _Installed.stock["APIHandler"]

    class APIHandler(stock):
        timeout = SOCKET_TIMEOUT_S

        def body_length(self, required: bool) -> int | None:
            """The request body's ``Content-Length``, checked before anything reads it; None
            once the request is answered with the error (411 where ``required`` and absent,
            400 where it is no count of bytes, 413 past ``MAX_BODY_BYTES``)."""
            value = self.headers.get("Content-Length")
            if value is None and not required:
                return 0
            if value is None:
                self._send_error(411, "Content-Length is required")
            elif not value.strip().isdigit():
                self._send_error(400, f"Content-Length must be a count of bytes, got {value!r}")
            elif int(value) > MAX_BODY_BYTES:
                self._send_error(
                    413,
                    f"the request body is {int(value)} bytes; this server reads at most "
                    f"{MAX_BODY_BYTES} (MLX_LM_MAX_BODY_BYTES)",
                )
            else:
                return int(value)
            self.close_connection = True  # a body left unread cannot be skipped
            return None

        def _plugin_route(self, method: str) -> bool:
            url = urlsplit(self.path)
            handler = _Installed.routes.get(method, url.path) if _Installed.routes else None
            if handler is None:
                return False
            body = b""
            if method in ("POST", "DELETE"):
                length = self.body_length(required=method == "POST")
                if length is None:
                    return True
                body = self.rfile.read(length)
            try:
                request = RouteRequest(
                    method,
                    url.path,
                    url.query,
                    body,
                    self._client(),
                    generator=self.response_generator,
                )
                response = handler(request)
            except ConnectionResetError:
                self.close_connection = True
                log.info("client %s hung up before its response ended", self.client_address[0])
                return True
            except Exception:
                log.exception("plugin route %s %s failed", method, url.path)
                response = RouteResponse(500, {"error": "internal error in a plugin route"})
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            if response.stream is not None:
                self.send_header("Cache-Control", "no-cache")
            else:
                payload = response.payload()
                self.send_header("Content-Length", str(len(payload)))
            for k, v in response.headers.items():
                self.send_header(k, v)
            self._set_cors_headers()
            try:
                self.end_headers()
                if response.stream is None:
                    self.wfile.write(payload)
                    return True
                self.close_connection = True
                response.stream(self._write_flushed)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                log.info("client %s hung up before its response ended", self.client_address[0])
            except Exception:
                # The status went out already: the stream just ends (the closed connection
                # tells the client), and the log has what happened.
                log.exception("plugin route %s %s failed mid-stream", method, url.path)
            return True

        def log_message(self, format, *args):
            # Behind the HTTP front, the front logs each request as stock's server does.
            if _Installed.front is None:
                super().log_message(format, *args)

        def _client(self) -> str:
            """The client's address; behind the HTTP front, the one the front heard."""
            if _Installed.front is not None:
                return self.headers.get(CLIENT_HEADER) or self.client_address[0]
            return self.client_address[0]

        def _write_flushed(self, data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        def _set_completion_headers(self, status_code: int = 200):
            # Stock answers 404 to whatever stops a request before its first token; a
            # refused request is the client's error, a failed step the server's (retry).
            # It is the exception being handled.
            if status_code == 404:
                error = sys.exc_info()[1]
                if isinstance(error, RequestRefused):
                    status_code = 400
                elif isinstance(error, GenerationFailed):
                    status_code = 503
            super()._set_completion_headers(status_code)
            error = sys.exc_info()[1]
            if status_code == 503 and isinstance(error, Overloaded):
                self.send_header("Retry-After", str(error.retry_after))

        def handle_completion(self, request, stop_words):
            try:
                request.cache_salt = parse_salt(self.body)
            except BadSalt as e:
                self._send_error(400, str(e))
                return
            try:
                super().handle_completion(request, stop_words)
            except (BrokenPipeError, ConnectionResetError):
                # The client hung up; stock has already told the generation thread to stop.
                self.close_connection = True
                log.info("client %s hung up before its response ended", self.client_address[0])
            except GenerationFailed as e:
                self._answer_failure(e)

        def _answer_failure(self, error: GenerationFailed) -> None:
            """A step failed after this response began: a stream gets an error event; a
            response whose headers are still buffered becomes a 503."""
            self.close_connection = True
            if self.stream:
                self.wfile.write(f"data: {json.dumps({'error': str(error)})}\n\n".encode())
                self.wfile.flush()
                return
            self._headers_buffer = []  # the 200 stock prepared was never sent
            self._send_error(503, str(error))

        def _send_error(self, status: int, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if not self._plugin_route("GET"):
                super().do_GET()

        def do_POST(self):
            _handling.connection = self.connection
            length = self.body_length(required=True)
            if length is None:
                return
            # The body is read and its nesting checked once, here: Python's JSON reader
            # raises RecursionError past about a thousand levels, which stock's handler
            # does not catch (the connection dropped with a traceback) and a plugin's
            # route answered with a 500. Stock's handler and the routes read it again.
            raw = self.rfile.read(length)
            try:
                json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:  # stock's handler let it end the connection
                self._send_error(400, f"the request body is not UTF-8 text: {e}")
                return
            except RecursionError:
                self._send_error(400, "the request body nests too deep for a JSON reader")
                return
            except ValueError:
                pass  # stock's handler and the routes say what is wrong with it
            self.rfile, stream = io.BytesIO(raw), self.rfile
            try:
                self._post()
            finally:
                self.rfile = stream

        def _post(self) -> None:
            if not self._plugin_route("POST"):
                super().do_POST()

        def do_DELETE(self):
            if not self._plugin_route("DELETE"):
                self._send_error(404, f"no route DELETE {urlsplit(self.path).path}")

    return APIHandler


class HTTPServer(ThreadingHTTPServer):
    # socketserver's default backlog of 5 resets connections beyond it: 16 clients
    # connecting at once lose some. The kernel caps this at its own somaxconn.
    request_queue_size = 128

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request) -> None:
        """503 on a connection past ``MAX_CONNECTIONS``, written from the listening thread
        without reading the request (a second at most), then closed."""
        body = json.dumps(
            {
                "error": f"the server serves {MAX_CONNECTIONS} connections at once "
                "(MLX_LM_MAX_CONNECTIONS): try again shortly"
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        try:
            request.settimeout(1)
            request.sendall(head.encode() + body)
        except OSError:
            pass
        self.shutdown_request(request)


def _run_http_server(host, port, response_generator, server_class=None, handler_class=None):
    stock = _Installed.stock["_run_http_server"]
    # Stock stops cleanly on Ctrl-C only (KeyboardInterrupt: the HTTP server shuts down, the
    # generation thread is joined); SIGTERM, what service managers and `kill` send, ended
    # the process where it stood. It takes the same way out here, and then the plugins
    # are told, with no generation running (their state written out, say).
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    front = _front(host, port, response_generator)
    if front is not None:
        # Clients reach the front; this process serves it (and every route but
        # completions) on a loopback port of its own.
        host, port = "127.0.0.1", 0
    try:
        stock(
            host,
            port,
            response_generator,
            server_class=_server_class(front, server_class or HTTPServer),
            handler_class=_handler_class(),
        )
        if front is not None and front.lost:
            # Stock joins the generation thread on Ctrl-C only; a lost front ends the
            # server the same way.
            response_generator.stop_and_join()
    finally:
        if front is not None:
            front.stop()
            _Installed.front = None
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    try:
        _hook().mlx_lm_server_stopped()
    except Exception:
        log.exception("a mlx_lm_server_stopped hook failed")
    # Stock returns here only once stopped, and the process then ends in the interpreter's
    # finalization, where MLX 0.32 on Linux aborts once a generation thread has run
    # ("terminate called without an active exception", exit status 134 after a Ctrl-C of
    # stock mlx_lm.server): a clean stop ends with status 0 instead, its output flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if front is not None and front.lost else 0)


def _front(host, port, response_generator):
    """The HTTP front's handle when the plugins ask for one (front.py), else None."""
    if response_generator._is_distributed:
        return None  # every rank runs the same loop; only rank 0 serves HTTP
    if not _hook().mlx_lm_http_front(cli_args=_Installed.cli_args):
        return None

    def record(box):
        _finished(
            response_generator, box.ctx, box.generated, box.reason, time.perf_counter() - box.start
        )

    _Installed.front = Front(host, port, response_generator, record)
    return _Installed.front


def _server_class(front, base):
    """``base``, or with the front on, ``base`` that starts the front once it listens (a
    server class a caller passed must not leave the front unstarted)."""
    if front is None:
        return base

    class EngineServer(base):
        def server_activate(self):
            super().server_activate()
            front.start(self)  # listening: the front may forward to it now

    return EngineServer


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def serve(plugin_names: list[str], argv: list[str] | None = None, pm=None):
    """Run mlx_lm.server's own main() with the named plugins active."""
    import mlx_lm.server as server

    pm = pm or get_plugin_manager()
    activate(plugin_names, pm)
    install(pm)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    # The startup shim may have wrapped main(); the original is what runs here.
    return getattr(server.main, "__wrapped__", server.main)()
