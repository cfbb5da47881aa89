"""Reliability under pressure (issue 6): a full pool, 16 concurrent clients that hang up,
exact repeats, bad input, binding, K/V that never crosses models, and a soak run.

Real servers on 127.0.0.1 on the tiny random models; greedy outputs are checked against
stock mlx_lm.server answering the same requests.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm_hooks.server import context_length
from servers import BIN, NO_EOS, REPO, Server, free_port, mlx_lm_server, run_to_exit, server_env
from test_batch import run_batch
from test_generation import KEY, no_eos
from tiny_models import build_model

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.server.plugin import RadixPlugin, is_loopback
from mlx_radix_plugin.tools import soak

PAGE = 4  # tokens per page in every radix server here (servers.server_env)
CLIENTS = 16
PER_CLIENT = 4
SMALL_POOL = 256  # tokens: the pressure workload needs about 50 times this
GREEDY = {"temperature": 0.0, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-cache")


@pytest.fixture(scope="module")
def serve(model_dirs, hf_cache, tmp_path_factory):
    """``serve(*flags, env=..., model=...)``: a server on 127.0.0.1 for a ``with`` block."""

    def start(*flags: str, env: dict | None = None, model: str = "llama") -> Server:
        port = free_port()
        cmd = mlx_lm_server(*flags, "--model", str(model_dirs[model]), "--port", str(port))
        log = tmp_path_factory.mktemp("server") / "log"
        return Server(cmd, server_env(hf_cache, **(env or {})), port, log)

    return start


def raw_post(port: int, path: str, body: bytes, headers: dict | None = None):
    """Status and parsed JSON (or text) of one POST with exactly ``body``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    with contextlib.closing(conn):
        conn.request("POST", path, body, headers or {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode()
    with contextlib.suppress(ValueError):
        return r.status, json.loads(data)
    return r.status, data


def completion(server: Server, prompt: str, max_tokens: int = 8, **extra) -> dict:
    return server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **GREEDY, **extra}
    )


def settled_stats(server: Server, requests: int, timeout: float = 60) -> dict:
    """Stats once ``requests`` requests have ended server-side and no page is locked (a
    hung-up request ends a moment after its client left); fails the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        violations = soak.idle_violations(stats)
        if soak.finished(stats) >= requests and not violations:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(
                f"not settled after {timeout} s: {soak.finished(stats)} of {requests} requests "
                f"ended, idle violations {violations}"
            )
        time.sleep(0.2)


def answers(outcomes: list[list[soak.Outcome]]) -> list[list[str | None]]:
    """Each client's answers in order; None for a request that hung up."""
    return [[None if o.disconnected else o.text for o in client] for client in outcomes]


def assert_all_ok(outcomes: list[list[soak.Outcome]]) -> None:
    failed = [f"{o.spec.describe()}: {o.error}" for c in outcomes for o in c if not o.ok]
    assert not failed, failed


# -- the workload on stock mlx_lm.server, for comparison -----------------------------------


@pytest.fixture(scope="module")
def never_fits() -> str:
    """A prompt of about three times the small pool (and well inside the context)."""
    return " ".join(soak.WORDS[i % len(soak.WORDS)] for i in range(3 * SMALL_POOL))


@pytest.fixture(scope="module")
def stock(serve, never_fits):
    """What stock mlx_lm.server answers to the concurrent workload and the long prompt."""
    with serve() as server:
        outcomes = soak.run_clients(
            server.port, CLIENTS, PER_CLIENT, logit_bias=NO_EOS, max_connections=4
        )
        long = completion(server, never_fits)
    assert_all_ok(outcomes)
    return SimpleNamespace(outcomes=outcomes, long=long)


def test_sixteen_clients_with_hangups_leave_no_page_held_and_match_stock(serve, stock):
    with serve("--plugin", "radix") as server:
        outcomes = soak.run_clients(server.port, CLIENTS, PER_CLIENT, logit_bias=NO_EOS)
        stats = settled_stats(server, CLIENTS * PER_CLIENT)
        assert server.get("/health")[0] == 200
    assert_all_ok(outcomes)
    specs = [o.spec for c in outcomes for o in c]
    assert {s.stream for s in specs} == {True, False} and {s.chat for s in specs} == {True, False}
    assert any(s.disconnect for s in specs) and any(s.chain for s in specs)
    assert answers(outcomes) == answers(stock.outcomes)
    assert soak.idle_violations(stats) == []
    assert soak.finished(stats) == CLIENTS * PER_CLIENT
    assert stats["hits"] > 0 and stats["pages_evictable"] > 0


def test_a_pool_fifty_times_too_small_evicts_and_still_answers_like_stock(serve, stock, never_fits):
    env = {"MLX_RADIX_POOL_TOKENS": str(SMALL_POOL)}
    with serve("--plugin", "radix", env=env) as server:
        outcomes = soak.run_clients(server.port, CLIENTS, PER_CLIENT, logit_bias=NO_EOS)
        busy = settled_stats(server, CLIENTS * PER_CLIENT)
        # Larger than the whole pool: served from the batch buffer, nothing cached.
        long = completion(server, never_fits)
        after = settled_stats(server, CLIENTS * PER_CLIENT + 1)
        again = completion(server, "the cache page tree")
        assert server.get("/health")[0] == 200
    assert_all_ok(outcomes)
    assert busy["prompt_tokens"] >= 50 * SMALL_POOL
    assert busy["pages_total"] == SMALL_POOL // PAGE and busy["evictions"] > busy["pages_total"]
    # Evicting a page some running request still read would change its answer.
    assert answers(outcomes) == answers(stock.outcomes)
    assert long["usage"]["prompt_tokens"] > SMALL_POOL
    # At most the matched part of one page, copied at fetch when a page is free for it; the
    # rest is computed (stock reported 2 here too).
    assert long["usage"]["prompt_tokens_details"]["cached_tokens"] < PAGE
    assert long["choices"][0]["text"] == stock.long["choices"][0]["text"]
    assert soak.idle_violations(busy) == [] and soak.idle_violations(after) == []
    assert again["choices"][0]["text"]


def test_unbatched_prompt_larger_than_the_pool_is_answered_uncached(serve, stock, never_fits):
    """decode.batched = false: the one-at-a-time path serves it from a private buffer."""
    env = {"MLX_RADIX_POOL_TOKENS": str(SMALL_POOL), "MLX_RADIX_DECODE_BATCHED": "false"}
    body = json.dumps({"prompt": never_fits, "max_tokens": 8, **GREEDY}).encode()
    with serve("--plugin", "radix", env=env) as server:
        try:
            status, data = raw_post(server.port, "/v1/completions", body)
        except (ConnectionError, http.client.HTTPException) as e:
            pytest.fail(f"the server dropped the connection ({e!r}):\n{server.output()[-3000:]}")
        stats = settled_stats(server, 1)
        assert server.get("/health")[0] == 200
    assert status == 200, data
    assert data["choices"][0]["text"] == stock.long["choices"][0]["text"]
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert soak.idle_violations(stats) == []


def test_a_request_left_one_token_outlives_the_request_it_waited_for(loaded):
    """In-flight sharing, then the producer hangs up before its prefill: the dependent,
    which had only its last prompt token left, computes the shared span itself."""
    model, tok = loaded("llama")
    prefix = tok.encode("You are a helpful assistant. " * 8)[: 10 * PAGE]
    prompts = [prefix + tok.encode(" Where is Paris?"), prefix + tok.encode(" Who")[:1]]
    expected = run_batch(model, tok, prompts[1:])
    rpc = RadixPromptCache(KVPool.for_model(model, page_size=PAGE, pool_tokens=4096))
    gen = RadixBatchGenerator(model, rpc, completion_batch_size=8, prefill_batch_size=4)
    fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
    assert [len(rest) for _, rest in fetched][1] == 1  # all but one token shared in flight
    uids = gen.insert_segments(
        [[rest] for _, rest in fetched],
        max_tokens=[8, 8],
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(rest)] for p, (_, rest) in zip(prompts, fetched)],
        logits_processors=[[no_eos(tok.eos_token_ids)]] * 2,
    )
    del fetched
    gen.remove([uids[0]])
    gc.collect()
    tokens = []
    while len(tokens) < 8:
        tokens += [r.token for r in gen.next()[1]]
    gen.close()
    assert [tokens] == expected


# -- exact repeats -------------------------------------------------------------------------


def exact_repeats(server: Server, tokenizer, rounds: int) -> list[dict]:
    """Send a prompt, then that prompt plus its completion, ``rounds`` times.

    The completion is pinned to one whole-word token (" fox"), so prompt + completion
    tokenizes to exactly the tokens the server cached (the test checks it).
    """
    fox = tokenizer.encode(" fox")
    assert len(fox) == 1
    bias = {**NO_EOS, str(fox[0]): 100}
    prompt, out = "The quick brown fox jumps over the lazy dog.", []
    for i in range(rounds):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logit_bias": bias}
        text = None
        with contextlib.suppress(RuntimeError, ConnectionError, http.client.HTTPException):
            if i % 2:
                events = server.stream("/v1/completions", body)
                text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            else:
                text = server.post("/v1/completions", body)["choices"][0]["text"]
        out.append({"prompt": prompt, "text": text, "health": server.get("/health")[0]})
        if out[-1]["health"] != 200:
            break
        prompt = f"{prompt} {text}"  # the server's text drops the first token's space
    return out


def test_exact_repeats_stop_stock_but_never_the_plugin(serve, loaded):
    _, tokenizer = loaded("llama")
    with serve() as server:
        stock_run = exact_repeats(server, tokenizer, 2)
    # The reproducer: stock 0.32.2's generation thread dies on the first exact repeat.
    assert [r["health"] for r in stock_run] == [200, 503]
    with serve("--plugin", "radix") as server:
        run = exact_repeats(server, tokenizer, 8)
        same = [completion(server, run[-1]["prompt"], 6)["usage"] for _ in range(3)]
        stats = settled_stats(server, 11)
    assert [r["health"] for r in run] == [200] * 8
    assert all(r["text"] == "fox fox fox fox fox fox" for r in run)
    fox = tokenizer.encode(" fox")
    for before, now in zip(run, run[1:]):
        assert tokenizer.encode(now["prompt"]) == tokenizer.encode(before["prompt"]) + fox * 6
    # The same exact repeat again and again: served from the cache each time.
    for usage in same:
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - PAGE
    assert soak.idle_violations(stats) == []


# -- bad input -----------------------------------------------------------------------------

BAD_REQUESTS = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "hi",', 400, "Invalid JSON"),
    "JSON that is no object": ("/v1/completions", b"[1, 2]", 400, "JSON dictionary"),
    "no prompt": ("/v1/completions", {"max_tokens": 4}, 400, "did not contain a prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "the prompt is empty"),
    "empty prompt, streamed": (
        "/v1/completions",
        {"prompt": "", "stream": True},
        400,
        "the prompt is empty",
    ),
    "prompt that is no string": ("/v1/completions", {"prompt": 5}, 400, "must be of type"),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "empty conversation"),
    "max_tokens 0": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "at least 1"),
    "max_tokens -3": ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "at least 1"),
    "prompt longer than the context": (
        "/v1/completions",
        {"prompt": "the " * 2100},
        400,
        "this model reads at most 2048",
    ),
    "cache_salt that is no string": (
        "/v1/completions",
        {"prompt": "hi", "cache_salt": 7},
        400,
        "cache_salt must be a non-empty string of at most 1024 characters, got 7",
    ),
    "empty cache_salt, chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""},
        400,
        "cache_salt must be a non-empty string",
    ),
    "unknown model": (
        "/v1/completions",
        {"prompt": "hi", "model": "no-such-org/no-such-model"},
        404,
        "model 'no-such-org/no-such-model' could not be loaded",
    ),
}


@pytest.fixture(scope="module")
def radix_server(serve):
    with serve("--plugin", "radix") as server:
        yield server


def test_cache_salt_keeps_tenants_apart(radix_server):
    """Only requests with the same cache_salt share cached pages; requests without one
    share with each other, as before."""
    prompt = "Tenant isolation: " + " ".join(soak.WORDS[i % len(soak.WORDS)] for i in range(60))

    def cached(**extra) -> int:
        r = completion(radix_server, prompt, **extra)
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached(cache_salt="tenant-a") > 32
    assert cached() > 32
    chat = {"messages": [{"role": "user", "content": prompt}], **GREEDY, "max_tokens": 4}
    usage = [
        radix_server.post("/v1/chat/completions", {**chat, "cache_salt": salt})["usage"]
        for salt in ("tenant-c", "tenant-d", "tenant-c")
    ]
    assert [u["prompt_tokens_details"]["cached_tokens"] > 32 for u in usage] == [
        False,
        False,
        True,
    ]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error_and_the_server_stays_up(radix_server, case):
    path, body, status, message = BAD_REQUESTS[case]
    if isinstance(body, dict):
        body = json.dumps({"max_tokens": 4, **body}).encode()
    got, data = raw_post(radix_server.port, path, body)
    assert got == status, data
    assert isinstance(data, dict) and message in data["error"], data
    assert "Traceback" not in data["error"]
    assert radix_server.get("/health")[0] == 200
    assert completion(radix_server, "the cache page tree", 3)["choices"][0]["text"]


def test_bad_content_length_and_wrong_method(radix_server):
    headers = {"Content-Type": "application/json", "Content-Length": "many"}
    status, data = raw_post(radix_server.port, "/v1/completions", b"{}", headers)
    assert status == 400 and "Content-Length" in data["error"]
    assert raw_post(radix_server.port, "/v1/cache/stats", b"{}")[0] == 404  # GET only
    assert radix_server.get("/health")[0] == 200


def test_an_empty_prompt_stops_stock_but_not_the_plugin(serve, radix_server):
    body = json.dumps({"prompt": "", "max_tokens": 4}).encode()
    with serve() as server:
        with contextlib.suppress(ConnectionError, http.client.HTTPException):
            raw_post(server.port, "/v1/completions", body)
        assert server.get("/health")[0] == 503  # stock's generation thread died
    assert raw_post(radix_server.port, "/v1/completions", body)[0] == 400
    assert radix_server.get("/health")[0] == 200


def test_max_tokens_past_the_context_is_clamped_to_it(radix_server):
    """The model reads 2,048 tokens: a request asking for a million more than its prompt
    leaves gets what the context holds, and ends with "length"."""
    prompt = " ".join(soak.WORDS[i % len(soak.WORDS)] for i in range(760))
    r = completion(radix_server, prompt, 1_000_000)
    usage = r["usage"]
    assert 1900 <= usage["prompt_tokens"] < 2048, usage
    assert usage["completion_tokens"] == 2048 - usage["prompt_tokens"] + 1
    assert r["choices"][0]["finish_reason"] == "length"
    assert "clamped to" in radix_server.output()


def test_context_length_reads_the_config_and_its_rope_scaling():
    def model(**args):
        return SimpleNamespace(args=SimpleNamespace(**args))

    assert context_length(model(max_position_embeddings=2048)) == 2048
    # Qwen's YaRN: the config's length is before scaling.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(model(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    # Llama 3.1: the config's length is after scaling.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert context_length(model(max_position_embeddings=131072, rope_scaling=llama3)) == 131072
    assert context_length(model()) is None and context_length(object()) is None


# -- bad configuration: exit 2 before serving, with the problem named -------------------------


def written(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


RADIX = ["--plugin", "radix"]
# case -> (server flags, environment given a scratch directory, what stderr must say)
BAD_CONFIGS = {
    "config file is a directory": (
        RADIX,
        lambda tmp: {"MLX_RADIX_CONFIG": str(tmp)},
        "cannot be read",
    ),
    "config file missing": (
        RADIX,
        lambda tmp: {"MLX_RADIX_CONFIG": str(tmp / "missing.toml")},
        "does not exist",
    ),
    "config file not TOML": (
        RADIX,
        lambda tmp: {"MLX_RADIX_CONFIG": written(tmp / "a.toml", "[radix\npage_size = 4\n")},
        "is not valid TOML",
    ),
    "value of the wrong type": (
        RADIX,
        lambda tmp: {"MLX_RADIX_CONFIG": written(tmp / "a.toml", '[radix]\npage_size = "big"\n')},
        "radix.page_size = 'big'",
    ),
    "mem_fraction 1.5": (
        RADIX,
        lambda tmp: {"MLX_RADIX_MEM_FRACTION": "1.5"},
        "expected a number >= 0.0 and <= 1.0",
    ),
    "a pool smaller than a page": (
        RADIX,
        lambda tmp: {"MLX_RADIX_POOL_TOKENS": "3", "MLX_RADIX_PAGE_SIZE": "4"},
        "radix.pool_tokens = 3 (environment MLX_RADIX_POOL_TOKENS) is less than one page",
    ),
    "unknown plugin from the environment": (
        [],
        lambda tmp: {"MLX_LM_PLUGINS": "nope"},
        "unknown plugin 'nope'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_configuration_exits_2_naming_the_problem(model_dirs, hf_cache, tmp_path, case):
    flags, env, message = BAD_CONFIGS[case]
    cmd = mlx_lm_server(*flags, "--model", str(model_dirs["llama"]))
    result = run_to_exit(cmd, server_env(hf_cache, **env(tmp_path)))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_serve_flag_out_of_range_exits_2(model_dirs, hf_cache):
    cmd = [str(BIN / "mlx-radix"), "serve", "--pool-tokens", "-5", "--model", "x"]
    result = run_to_exit(cmd, server_env(hf_cache))
    assert result.returncode == 2
    assert "radix.pool_tokens = -5" in result.stderr and "Traceback" not in result.stderr


# -- security --------------------------------------------------------------------------------


def outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if is_loopback(address) else address


def test_binds_loopback_by_default(serve):
    address = outside_address()
    with serve("--plugin", "radix") as server:
        assert server.get("/health")[0] == 200
        if address is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, server.port), timeout=5).close()
        assert "Starting httpd at 127.0.0.1" in server.output()
    if address is None:
        pytest.skip("no address other than loopback to try from")


@pytest.mark.parametrize(
    "host, warns",
    [("127.0.0.1", False), ("localhost", False), ("127.0.0.2", False), ("0.0.0.0", True)],
)
def test_warns_when_bound_beyond_loopback(monkeypatch, caplog, host, warns):
    for name in list(os.environ):
        if name.startswith("MLX_RADIX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    with caplog.at_level("WARNING", logger="mlx_radix"):
        RadixPlugin().mlx_lm_server_start(SimpleNamespace(host=host))
    assert ("reachable from other machines" in caplog.text) is warns


# What would run code or build objects from bytes or text: unpickling and its kin, eval and
# exec (not MLX's mx.eval / async_eval), a shell, yaml's object-building loader.
UNSAFE = re.compile(
    r"pickle|marshal\.load|shelve|\bdill\b|joblib|torch\.load|(?<![\w.])(?:eval|exec)\(|"
    r"shell\s*=\s*True|yaml\.(?:unsafe_)?load\(|os\.system\("
)


def unsafe_uses(text: str) -> list[str]:
    return [m.group(0) for m in UNSAFE.finditer(text)]


# The HTTP front and its engine pickle what they pass each other over a socket pair the engine
# makes for the front it starts (and the front's settings over its stdin): nothing read from
# disk or the network. Only pickling is allowed there.
PRIVATE_PIPES = {"hooks/mlx_lm_hooks/front.py": {"pickle"}}


def test_no_code_here_runs_or_unpickles_what_it_reads():
    """Cached K/V lives only in memory; nothing evaluates, unpickles or shells out."""
    sources = [*(REPO / "mlx_radix_plugin").rglob("*.py"), *(REPO / "hooks").rglob("*.py")]
    assert len(sources) > 10
    found = [
        f"{name}: {u}"
        for p in sources
        for name in [p.relative_to(REPO).as_posix()]
        for u in unsafe_uses(p.read_text())
        if u not in PRIVATE_PIPES.get(name, ())
    ]
    assert found == []


def test_the_unsafe_code_check_finds_what_it_names():
    planted = (
        "x = pickle.loads(b)\nnp.load(f, allow_pickle=True)\neval(text)\nexec(code)\n"
        "subprocess.run(cmd, shell=True)\nyaml.load(s)\nos.system(c)\nmarshal.loads(b)\n"
    )
    assert len(unsafe_uses(planted)) == 8  # pickle twice, then one each
    assert unsafe_uses("mx.eval(a)\nmx.async_eval(b)\nyaml.safe_load(s)\nshell=False\n") == []


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    """The same architecture and tokenizer as ``llama``, other weights: a prompt cached
    for one would match token for token in the other if the cache were not per model."""
    return build_model("llama", tmp_path_factory.mktemp("models") / "llama-b", seed=1)


def test_cached_kv_never_crosses_models(serve, model_dirs, second_model):
    prompt = "You are a helpful assistant. Answer the question briefly and politely. Where?"
    other = {"model": str(second_model)}
    with serve() as server:
        expected = [
            completion(server, prompt)["choices"][0]["text"],
            completion(server, prompt, **other)["choices"][0]["text"],
        ]
    with serve("--plugin", "radix") as server:
        got = [
            completion(server, prompt),
            completion(server, prompt),  # a hit on the first model
            completion(server, prompt, **other),  # same tokens, other model: a miss
            completion(server, prompt, **other),  # a hit on its own cache
            completion(server, prompt),  # back: the first model's pool was given up
        ]
        stats = server.stats()
    cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
    assert cached[0] == 0 and cached[1] > 0
    assert cached[2] == 0 and cached[3] > 0
    assert cached[4] == 0
    texts = [g["choices"][0]["text"] for g in got]
    assert texts == [expected[0], expected[0], expected[1], expected[1], expected[0]]
    assert expected[0] != expected[1]
    # By name: the stats are readable cross-origin, the local path stays private.
    assert stats["model"] == [model_dirs["llama"].name, None, None]
    assert str(model_dirs["llama"].parent) not in json.dumps(stats)
    # Three loads, each on an empty pool: the start's, the other model's, and back.
    assert stats["model_loads"] == 3


# -- soak ------------------------------------------------------------------------------------


def test_idle_checks_catch_a_held_page_and_bad_counts():
    stats = {
        "pages_total": 10,
        "pages_free": 6,
        "pages_locked": 0,
        "pages_evictable": 4,
        "pages_cached": 4,
        "page_refs": 4,
        "tree_locks": 0,
        "requests_holding_pages": 0,
        "prompt_tokens": 9,
        "cached_tokens": 4,
        "requests": {"length": 3},
        "snapshots": 2,
        "snapshot_bytes": 100,
        "snapshot_bytes_max": 100,
    }
    assert soak.idle_violations(stats) == []
    over = {**stats, "snapshots": 5, "snapshot_bytes": 101}
    assert soak.live_violations(over) == [
        "snapshots of 101 bytes over their budget of 100",
        "5 snapshots on 4 cached pages",
    ]
    held = {**stats, "pages_locked": 1, "pages_evictable": 3}
    assert soak.live_violations(held) == []  # fine while requests run
    assert "1 pages still locked" in soak.idle_violations(held)[0]
    leaked = {**stats, "page_refs": 5, "tree_locks": 1, "requests_holding_pages": 1}
    assert soak.idle_violations(leaked) == [
        "5 page references for 4 cached pages",
        "tree_locks=1 with no request running",
        "requests_holding_pages=1 with no request running",
    ]
    broken = {**stats, "pages_evictable": 5, "requests": {"error": 1}}
    assert len(soak.live_violations(broken)) == 2


def test_disk_checks():
    stats = {"disk_enabled": 1, "disk_bytes": 10, "disk_bytes_max": 10, "disk_corrupt": 0}
    assert soak.disk_violations(stats, required=True) == []
    assert soak.disk_violations({**stats, "disk_bytes": 11, "disk_corrupt": 2}) == [
        "11 bytes on disk over the budget of 10",
        "2 files on disk failed their check",
    ]
    assert soak.disk_violations({"disk_enabled": 0}) == []  # off, and not asked for
    assert "the disk tier is off" in soak.disk_violations({"disk_enabled": 0}, True)[0]


@pytest.mark.parametrize(
    "body, cut",
    [
        (b'data: {"choices": [{"text": "a"}]}\n\n', True),  # no data: [DONE]
        (b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi', True),  # a line cut short
        (b'data: {"error": "the batch failed"}\n\n', False),  # the server's own error
    ],
)
def test_a_stream_cut_short_is_told_from_a_failed_one(body, cut):
    """What a server killed mid-stream leaves is a cut (lost at a restart), not an answer."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + body)
            self.close_connection = True

        def log_message(self, *args):
            pass

    with HTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.handle_request)
        thread.start()
        spec = soak.Spec(False, "system", "user", 8, stream=True, disconnect=False)
        out = soak.send(server.server_address[1], spec, timeout=10)
        thread.join()
    assert not out.ok and out.cut == cut, out


def test_requests_a_restart_cut_are_lost_not_violations():
    run = soak.Soak(port=1, seconds=0, n_clients=1)
    spec = soak.Spec(False, "system", "user", 4, stream=False, disconnect=False)
    refused = soak.Outcome(spec, False, error="ConnectionRefusedError", cut=True)
    run._record(refused, epoch=0, down=True)  # sent while the server was down
    run._epoch = 1
    run._record(refused, epoch=0)  # in flight at the kill
    assert run.report.lost == 2 and run.report.requests == 0 and not run.report.violations
    run._record(refused, epoch=1)  # the server is up again
    run._record(soak.Outcome(spec, False, error="HTTP 503"), epoch=0)  # an answer: an error
    assert len(run.report.violations) == 2 and run.report.requests == 2
    run._record(soak.Outcome(spec, True, "text"), epoch=0)  # the killed server took it
    run._record(soak.Outcome(spec, True, "text"), epoch=1)
    assert run._accepted == 1  # what the server now running must have finished


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_soak(model_dirs, hf_cache, arch):
    """The soak command for a minute (RADIX_SOAK_MINUTES sets another length locally), on
    an attention model and a hybrid one, with two adversaries beside the clients (requests
    the server must refuse, clients that hang up before their answers). A minute on the
    2-core CPU sent about 2,500 requests, 1,500 of them adversarial; two took 4 of the
    suite's 17 minutes."""
    minutes = os.environ.get("RADIX_SOAK_MINUTES", "1")
    cmd = [str(BIN / "mlx-radix"), "soak", "--model", str(model_dirs[arch])]
    cmd += ["--minutes", minutes, "--check-every", "10", "--adversaries", "2"]
    result = run_to_exit(cmd, server_env(hf_cache), timeout=int(float(minutes) * 60) + 300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    verdict = result.stdout.splitlines()[0]
    counts = re.search(r"(\d+) requests \((\d+) streamed, (\d+) disconnected", verdict)
    adversarial = re.search(r"(\d+) adversarial\)", verdict)
    idle_checks = re.search(r"(\d+) idle \+", verdict)
    assert verdict.startswith("soak PASS") and counts and idle_checks, verdict
    assert adversarial and int(adversarial.group(1)) > 100, verdict
    requests, streamed, disconnected = map(int, counts.groups())
    assert requests > 100 and 0 < disconnected < streamed < requests
    assert int(idle_checks.group(1)) >= float(minutes) * 3  # every 10 s, plus settling


RESTARTS = re.compile(
    r"(\d+) restarts \(SIGKILL, \d+ requests lost\), (\d+) disk hits after them "
    r"\((\d+) of \d+ restarts hit\), (\d+) of (\d+) probes read back; "
    r"disk: \d+ hits, (\d+) pages read, (\d+) written"
)


@pytest.mark.slow
def test_soak_with_restarts(model_dirs, hf_cache, tmp_path):
    """A minute of soak on the disk tier, the server killed (SIGKILL) every 20 s mid-traffic
    and started again on the same disk: idle and answering as before after each restart,
    with pages read back from disk, and no file on disk that fails its check."""
    disk, tmp = tmp_path / "disk", tmp_path / "tmp"
    tmp.mkdir()
    cmd = [str(BIN / "mlx-radix"), "soak", "--model", str(model_dirs["llama"])]
    cmd += ["--minutes", "1", "--check-every", "10", "--restart-every", "20"]
    cmd += ["--disk-dir", str(disk)]
    result = run_to_exit(cmd, server_env(hf_cache, TMPDIR=str(tmp)), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    verdict = result.stdout.splitlines()[0]
    found = RESTARTS.search(verdict)
    assert verdict.startswith("soak PASS") and found, verdict
    restarts, hits, restarts_hit, probes_hit, probes, read, written = map(int, found.groups())
    assert restarts >= 2 and restarts_hit == restarts and hits > 0, verdict
    assert probes == restarts * soak.PROBES and probes_hit == probes, verdict
    assert read > 0 and written > 0, verdict
    # The last server stopped cleanly: its pages are there, and no write was left half done.
    assert list(disk.glob("*/*/*.safetensors")) and not list(disk.glob("*/*/*.tmp*"))
    assert not list(tmp.glob("mlx-radix-soak-*"))  # the servers' logs go with a soak that passed
