"""Requests waiting in the generation thread's queue, tokenized side by side.

Stock mlx_lm.server tokenizes each request on the generation thread, one after another, and
runs no step until its queue is drained: a burst's first forward pass waits for every prompt
of the burst to be tokenized. On the H200 host, 32 prompts of 2,080 tokens took 4.1 ms each
there, and the first pass of a burst of 32 began 186 ms after it arrived (docs/benchmarking.md,
"Tokenizing ahead"). A byte-level BPE's encoding runs in the tokenizers library with
the GIL released (a thread counting beside it ran at 85% of its idle pace), so the prompts
waiting behind the one being tokenized can be encoded on other cores meanwhile.

A request is started on a worker as it is queued (``offer``), not only once the generation
thread takes the one before it: agents' turns arrive together but not at once, and each
found the queue empty, so each was tokenized on the generation thread in turn. On 2 CPU
cores, 8 agents' turns over a 24,576-token prompt (two encodings of about 25 ms each a
request) reached their prompt pass 362 ms after the last step, one after another.

The generation thread keeps its order: it still takes requests one at a time, and each
request's tokens are what stock's ``_tokenize`` returns for it (it runs stock's code, on a
worker thread), errors included, which reach the generation thread as stock's would.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

# At most this many worker threads, and one core left for the generation thread.
MAX_WORKERS = 8
# A queue longer than this is tokenized as the generation thread reaches it: a flood of
# requests does not hold tokenized prompts for all of them.
MAX_AHEAD = 64


class _Ahead:
    """A request's tokenization started ahead: ``missed``, the last look at the queue did
    not see it."""

    __slots__ = ("request", "args", "tokenizer", "future", "missed")

    def __init__(self, request, args, tokenizer, future: Future):
        self.request, self.args, self.tokenizer, self.future = request, args, tokenizer, future
        self.missed = False


class Prefetcher:
    """Tokenizes, on worker threads, requests as they are queued (``offer``) and those
    waiting behind the one the generation thread takes; ``take`` hands the generation
    thread a request's result, and meanwhile has it tokenize what no worker has started."""

    def __init__(self, tokenize: Callable, workers: int | None = None):
        """``tokenize(tokenizer, request, args)``: stock's ``_tokenize``, bound."""
        self._tokenize = tokenize
        # The cores this process may run on (a container's limit), not the host's.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = cores or os.cpu_count() or 1
        self.workers = workers if workers is not None else min(MAX_WORKERS, cores - 1)
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        # id(request) -> its work ahead (the request is kept so that its id is not reused by
        # another while its result waits here).
        self._ahead: dict[int, _Ahead] = {}
        self._lock = threading.Lock()

    def take(self, tokenizer, request, args, waiting: list[tuple]):
        """``request``'s tokenization: the one done ahead if there is one for this
        tokenizer, else done now. ``waiting``: ``(request, args)`` of the requests behind it
        that the generation thread will tokenize with the same tokenizer, started on the
        workers first; what was done ahead for a request that two such looks at the queue
        in a row did not see is dropped."""
        with self._lock:
            ahead = self._ahead.pop(id(request), None)
            if self.workers > 0 and not self._closed:
                self._start(tokenizer, waiting)
        if ahead is not None:
            future = ahead.future
            # Cancelled where no worker has started it (every one busy, or the pool shut
            # down): this thread does it now, as it does one done with another tokenizer.
            if not future.cancel() and ahead.request is request and ahead.tokenizer is tokenizer:
                # While a worker runs it, this thread takes on requests no worker has started.
                while not future.done() and self._help(tokenizer):
                    pass
                return future.result()  # stock's exception, if it raised one
        return self._tokenize(tokenizer, request, args)

    def _help(self, tokenizer) -> bool:
        """Tokenize here one request started ahead with ``tokenizer``, still seen in the
        queue, that no worker has started; False where there is none."""
        with self._lock:
            entry = next(
                (
                    e
                    for e in self._ahead.values()
                    if e.tokenizer is tokenizer and not e.missed and e.future.cancel()
                ),
                None,
            )
        if entry is None:
            return False
        request = entry.request
        done: Future = Future()
        try:
            done.set_result(self._tokenize(tokenizer, request, entry.args))
        except Exception as e:  # noqa: BLE001 - the request's own error, for its take
            done.set_exception(e)
        with self._lock:
            if self._ahead.get(id(request)) is entry:
                entry.future = done
        return True

    def offer(self, tokenizer, request, args) -> None:
        """``request`` as it is queued: tokenized on a worker from now, with ``tokenizer``
        (the one the generation thread took the last request with)."""
        with self._lock:
            if self.workers > 0 and not self._closed:
                self._start(tokenizer, [(request, args)], look=False)

    def _start(self, tokenizer, waiting: list[tuple], look: bool = True) -> None:
        """Called with the lock held. ``look``: ``waiting`` is a look at the whole queue; what
        two looks in a row did not see left it (a request queued after a look began is in
        the next)."""
        kept = {id(request) for request, _ in waiting}
        for key in [k for k in self._ahead if look and k not in kept]:
            if self._ahead[key].missed:
                self._ahead.pop(key).future.cancel()
            else:
                self._ahead[key].missed = True
        for key in kept & self._ahead.keys():
            self._ahead[key].missed = False
        for request, args in waiting:
            if len(self._ahead) >= MAX_AHEAD:
                break
            if id(request) in self._ahead:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, "tokenize-ahead")
            future = self._pool.submit(self._tokenize, tokenizer, request, args)
            self._ahead[id(request)] = _Ahead(request, args, tokenizer, future)

    def close(self) -> None:
        """No more work ahead; ``take`` tokenizes on the caller from now on."""
        with self._lock:
            self._closed = True
            self._ahead.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
