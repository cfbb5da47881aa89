"""Requests waiting in the generation thread's queue, tokenized ahead on worker threads
(mlx_lm_hooks/tokenizing.py): the same results as stock's ``_tokenize`` in the same order,
errors included."""

import threading
import time
from types import SimpleNamespace

import pytest
from mlx_lm.server import CompletionRequest, ResponseGenerator
from mlx_lm.utils import load_tokenizer
from mlx_lm_hooks.tokenizing import Prefetcher


class Recorder:
    """A tokenize that records which thread tokenized which request."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, tokenizer, request, args):
        self.release.wait(10)
        self.calls.append((request.prompt, threading.current_thread().name))
        if request.prompt == "bad":
            raise ValueError("a bad prompt")
        return [ord(c) for c in request.prompt], tokenizer


def req(text: str) -> CompletionRequest:
    return CompletionRequest("text", text, [], None, None)


def until(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_requests_behind_are_tokenized_on_workers_and_taken_in_order():
    tokenize, tok = Recorder(), object()
    pre = Prefetcher(tokenize, workers=2)
    a, b, c = req("a"), req("bc"), req("def")
    assert pre.take(tok, a, None, [(b, None), (c, None)]) == ([97], tok)
    until(lambda: len(tokenize.calls) == 3)  # the workers have run
    assert pre.take(tok, b, None, [(c, None)]) == ([98, 99], tok)
    assert pre.take(tok, c, None, []) == ([100, 101, 102], tok)
    pre.close()
    threads = dict(tokenize.calls)
    assert len(tokenize.calls) == 3  # each once
    assert threads["a"] == threading.current_thread().name
    assert threads["bc"].startswith("tokenize-ahead") and threads["def"].startswith(
        "tokenize-ahead"
    )


def test_an_error_reaches_the_generation_thread_as_stock_s_would():
    pre = Prefetcher(Recorder(), workers=2)
    tok, first, bad = object(), req("x"), req("bad")
    pre.take(tok, first, None, [(bad, None)])
    with pytest.raises(ValueError, match="a bad prompt"):
        pre.take(tok, bad, None, [])
    pre.close()


def test_what_left_the_queue_or_another_tokenizer_is_not_used():
    tokenize = Recorder()
    pre = Prefetcher(tokenize, workers=2)
    tok, other = object(), object()
    a, b, c = req("a"), req("b"), req("c")
    pre.take(tok, a, None, [(b, None), (c, None)])
    # b left the queue another way (a model switch, a hang-up); c is taken with another
    # tokenizer: both are tokenized again, by the caller.
    pre.take(tok, req("z"), None, [(c, None)])
    assert pre.take(other, c, None, []) == ([99], other)
    assert pre.take(tok, b, None, []) == ([98], tok)
    pre.close()
    mine = threading.current_thread().name
    assert [p for p, t in tokenize.calls if t == mine] == ["a", "z", "c", "b"]


def test_a_request_offered_as_it_is_queued_is_tokenized_before_it_is_taken():
    """A burst's requests arrive while the generation thread takes the first: each is started
    on a worker as it is queued (``offer``), and kept while a look at the queue began before
    it was queued; two looks in a row that do not see it drop it."""
    tokenize, tok = Recorder(), object()
    pre = Prefetcher(tokenize, workers=2)
    a, b, c = req("a"), req("b"), req("c")
    pre.offer(tok, b, None)
    pre.offer(tok, c, None)
    until(lambda: len(tokenize.calls) == 2)
    # a's look at the queue was made before b and c were queued: they are kept.
    assert pre.take(tok, a, None, []) == ([97], tok)
    assert pre.take(tok, b, None, [(c, None)]) == ([98], tok)
    # c is not seen by two looks in a row: it left the queue, and is tokenized again.
    pre.take(tok, req("y"), None, [])
    pre.take(tok, req("z"), None, [])
    assert pre.take(tok, c, None, []) == ([99], tok)
    pre.close()
    mine = threading.current_thread().name
    assert [p for p, t in tokenize.calls if t == mine] == ["a", "y", "z", "c"]
    assert [p for p, t in tokenize.calls if t != mine] == ["b", "c"]


def test_a_request_no_worker_has_started_is_tokenized_by_the_caller():
    """The generation thread does not wait behind busy workers for a request they have not
    started: it tokenizes it itself."""
    recorder, tok, started, release = Recorder(), object(), threading.Event(), threading.Event()

    def tokenize(tokenizer, request, args):
        if request.prompt == "a":  # the only worker is busy with a until released
            started.set()
            release.wait(10)
        return recorder(tokenizer, request, args)

    pre = Prefetcher(tokenize, workers=1)
    a, b = req("a"), req("b")
    pre.offer(tok, a, None)
    pre.offer(tok, b, None)
    started.wait(10)
    try:
        assert pre.take(tok, b, None, [(a, None)]) == ([98], tok)
    finally:
        release.set()
        pre.close()
    assert recorder.calls[0] == ("b", threading.current_thread().name)


def test_waiting_for_a_worker_the_caller_tokenizes_what_no_worker_has_started():
    """On few cores a burst outnumbers the workers: while the generation thread waits for the
    request it takes, it tokenizes those queued behind it that no worker has started."""
    recorder, tok, started, release = Recorder(), object(), threading.Event(), threading.Event()

    def tokenize(tokenizer, request, args):
        if request.prompt == "a":  # the only worker is busy with a until c is done
            started.set()
            release.wait(10)
        out = recorder(tokenizer, request, args)
        if request.prompt == "c":
            release.set()
        return out

    pre = Prefetcher(tokenize, workers=1)
    a, b, c, bad = req("a"), req("b"), req("c"), req("bad")
    for r in (a, b, bad, c):
        pre.offer(tok, r, None)
    started.wait(10)
    queued = [(b, None), (bad, None), (c, None)]
    assert pre.take(tok, a, None, queued) == ([97], tok)
    assert pre.take(tok, b, None, queued[1:]) == ([98], tok)
    with pytest.raises(ValueError, match="a bad prompt"):
        pre.take(tok, bad, None, queued[2:])
    assert pre.take(tok, c, None, []) == ([99], tok)
    pre.close()
    mine = threading.current_thread().name
    assert recorder.calls[:3] == [("b", mine), ("bad", mine), ("c", mine)]
    assert recorder.calls[3][0] == "a" and recorder.calls[3][1].startswith("tokenize-ahead")


def test_no_workers_tokenizes_on_the_caller_only():
    tokenize = Recorder()
    pre = Prefetcher(tokenize, workers=0)
    pre.take(object(), req("a"), None, [(req("b"), None)])
    assert tokenize.calls == [("a", threading.current_thread().name)]


def test_stock_tokenize_ahead_gives_stock_s_tokens(model_dirs):
    """Stock's own ``_tokenize`` run on the workers, chat and text requests, with a real
    tokenizer: the tokens and segments it gives on the generation thread."""
    tokenizer = load_tokenizer(model_dirs["llama"])
    provider = SimpleNamespace(processor=None, cli_args=SimpleNamespace(chat_template_args={}))
    generator = SimpleNamespace(model_provider=provider)

    def stock(tok, request, args):
        return ResponseGenerator._tokenize(generator, tok, request, args)

    args = SimpleNamespace(chat_template_kwargs=None)
    requests = [
        CompletionRequest(
            "chat",
            "",
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Hi {i}"}],
            None,
            None,
        )
        for i in range(6)
    ] + [req(f"Once upon a time {i}") for i in range(6)]
    expected = [stock(tokenizer, r, args) for r in requests]
    pre = Prefetcher(stock, workers=3)
    got = [
        pre.take(tokenizer, r, args, [(w, args) for w in requests[i + 1 :]])
        for i, r in enumerate(requests)
    ]
    pre.close()
    assert got == expected


def test_after_close_everything_is_tokenized_on_the_caller():
    """The server stops: work not yet started is dropped, and a request still taken after it
    is tokenized by the caller, with no worker started again."""
    tokenize = Recorder()
    tokenize.release.clear()  # the first worker job blocks until released
    pre = Prefetcher(tokenize, workers=1)
    tok, a, b, c = object(), req("a"), req("b"), req("c")
    taking = threading.Thread(target=pre.take, args=(tok, a, None, [(b, None), (c, None)]))
    taking.start()
    pre.close()
    tokenize.release.set()
    taking.join(10)
    assert pre.take(tok, c, None, [(req("d"), None)]) == ([99], tok)
    mine = threading.current_thread().name
    assert ("c", mine) in tokenize.calls
    assert all(p != "d" for p, _ in tokenize.calls)  # nothing started after close
