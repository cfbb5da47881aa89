"""A request that cannot start waits ``server.queue_timeout`` at most, then gets HTTP 503 with
``Retry-After`` (an error event on a stream that began), on every route, and leaves the queue
holding nothing; the request it waited behind goes on (engine/generator.py,
``_expire_queued``)."""

import json
import threading
import time

import pytest
from servers import NO_EOS, mlx_lm_server
from test_server import hf_cache, start  # noqa: F401 - fixtures

from mlx_radix_plugin.engine.generator import RETRY_AFTER_S

GREEDY = {"temperature": 0.0, "logit_bias": NO_EOS}
# One row at a time, so a request waits for the one before it to end; it waits 0.5 s.
ONE_ROW = {"MLX_RADIX_DECODE_MAX_BATCH_SIZE": "1", "MLX_RADIX_SERVER_QUEUE_TIMEOUT": "0.5"}
HI = [{"role": "user", "content": "Hi"}]
WAITING = [
    ("/v1/completions", {"prompt": "Where is Paris?", "max_tokens": 8}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": HI}),
    ("/v1/completions", {"prompt": "Where is Rome?", "max_tokens": 8, "stream": True}),
]


@pytest.mark.parametrize("front", ["off", "on"])
def test_a_request_that_cannot_start_gets_503_with_retry_after_and_leaves_nothing(start, front):  # noqa: F811
    story = {"prompt": "Tell me a long story.", "max_tokens": 2000, **GREEDY}
    env = {**ONE_ROW, "MLX_RADIX_SERVER_FRONT": front}
    with start(mlx_lm_server("--plugin", "radix"), env) as server:
        streaming, events = threading.Event(), []

        def first():
            events.extend(server.stream("/v1/completions", story, on_first=streaming.set))
            events.append(time.monotonic())

        def waiting(i, path, body):
            conn, r = server._request("POST", path, {**body, **GREEDY})
            answers[i] = (r.status, r.getheader("Retry-After"), r.read().decode())
            conn.close()

        client = threading.Thread(target=first)
        client.start()
        assert streaming.wait(60)
        answers, started = [None] * len(WAITING), time.monotonic()
        threads = [threading.Thread(target=waiting, args=(i, *w)) for i, w in enumerate(WAITING)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        refused = time.monotonic()
        client.join(120)
        stats = json.loads(server.get("/v1/cache/stats")[1])
        log = server.output()
    (status, retry, body), (m_status, m_retry, m_body), (s_status, _, s_body) = answers
    assert status == 503 and retry == str(RETRY_AFTER_S), answers[0]
    assert "waited 0.5 s (server.queue_timeout)" in json.loads(body)["error"]
    assert m_status == 503 and m_retry == str(RETRY_AFTER_S), answers[1]
    assert json.loads(m_body)["error"]["type"] == "overloaded_error"
    assert s_status == 200 and "waited 0.5 s" in s_body  # an error event: the stream began
    assert refused - started < 5  # half a second each, not until the first request ended
    assert events.pop() > refused, "the first request ended before the others were refused"
    assert not any("error" in e for e in events) and len(events) > 100
    assert stats["pages_locked"] == stats["requests_holding_pages"] == 0, stats
    assert log.count("without starting: refused") == 3
