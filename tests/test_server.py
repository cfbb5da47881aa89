"""mlx_lm.server with the radix plugin, started as users start it, against stock."""

import re
import sys

import pytest
from servers import (
    BIN,
    GREEDY,
    SYSTEM,
    Server,
    conversation,
    free_port,
    mlx_lm_server,
    run_to_exit,
    same_but_rounding,
    server_env,
)


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


@pytest.fixture
def start(model_dirs, hf_cache, tmp_path):
    def start(cmd_prefix: list[str], env_extra: dict | None = None, model: str = "llama"):
        port = free_port()
        cmd = [*cmd_prefix, "--model", str(model_dirs[model]), "--port", str(port)]
        return Server(cmd, server_env(hf_cache, **(env_extra or {})), port, tmp_path / "log")

    return start


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) mlx_radix_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        assert re.fullmatch(r'mlx_radix_\w+(\{\w+="[^"]*"\})?', name), line
        values[name] = float(value)
    return values


def test_radix_server_answers_like_stock_and_reports_hits(start):
    with start(mlx_lm_server()) as stock:
        expected = conversation(stock)
        assert stock.get("/v1/cache/stats")[0] == 404  # no plugin asked for: stock as it is
    with start(mlx_lm_server("--plugin", "radix")) as radix:
        before = radix.stats()  # the model may still be loading: counters only
        got = conversation(radix)
        after = radix.stats()
        metrics = parse_metrics(radix.get("/metrics")[1])
    assert [g["text"] for g in got] == [e["text"] for e in expected]
    assert all(len(g["text"]) > 0 for g in got)
    # Log-probabilities and the top 3 of each token, as stock reports them.
    assert expected[-1]["logprobs"]["logprobs"]
    assert same_but_rounding(got[-1]["logprobs"], expected[-1]["logprobs"])
    first, second = got[0]["usage"], got[1]["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # The second prompt shares the system prompt with the first.
    assert second["prompt_tokens_details"]["cached_tokens"] >= 12
    assert after["fallback"] is None and after["pages_total"] == 4096 // 4
    assert after["hits"] >= 3 and after["cached_tokens"] > before["cached_tokens"]
    assert after["pool_bytes_used"] > 0 and after["pages_free"] < after["pages_total"]
    assert after["requests"] == {"length": 6}
    assert metrics["mlx_radix_cached_tokens_total"] == after["cached_tokens"]
    assert metrics["mlx_radix_prompt_cache_hits_total"] == after["hits"]
    assert metrics['mlx_radix_fallback{reason=""}'] == 0
    assert metrics['mlx_radix_requests_total{finish_reason="length"}'] == 6


def short_turns(server: Server) -> list[tuple[str, int]]:
    """A chat of short turns, then a short prompt twice: (text, cached_tokens) each."""
    out = []
    messages = [{"role": "system", "content": "Be brief."}]
    for question in ("Hi", "Where is Paris?", "And Rome?", "Thanks"):
        messages.append({"role": "user", "content": question})
        r = server.post("/v1/chat/completions", {"messages": messages, **GREEDY})
        answer = r["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})
        out.append((answer, r["usage"]["prompt_tokens_details"]["cached_tokens"]))
    for _ in range(2):
        r = server.post("/v1/completions", {"prompt": "Where is Oslo?", **GREEDY})
        out.append((r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


def test_short_turns_cache_at_least_what_stock_caches(start):
    """The end of a sequence that does not fill a page is cached too (a tail): with the
    default page of 16 tokens, every request finds at least what stock's cache gives it."""
    with start(mlx_lm_server()) as stock:
        expected = short_turns(stock)
    with start(mlx_lm_server("--plugin", "radix"), {"MLX_RADIX_PAGE_SIZE": "16"}) as radix:
        got = short_turns(radix)
        stats = radix.stats()
    assert [text for text, _ in got] == [text for text, _ in expected]
    for (_, mine), (_, theirs) in zip(got, expected):
        assert mine >= theirs, (got, expected)
    # Not all of it page aligned: some hits ended inside a page.
    assert any(cached % 16 for _, cached in got), got
    assert stats["pages_locked"] == 0 and stats["page_refs"] == stats["pages_cached"]


INVOCATIONS = {
    "mlx_lm.server --plugin radix": (mlx_lm_server("--plugin", "radix"), {}),
    "mlx_lm.server --plugin=radix": (mlx_lm_server("--plugin=radix"), {}),
    "mlx_lm server --plugin radix": ([str(BIN / "mlx_lm"), "server", "--plugin", "radix"], {}),
    "python -m mlx_lm server --plugin radix": (
        [sys.executable, "-m", "mlx_lm", "server", "--plugin", "radix"],
        {},
    ),
    "repeated --plugin": (mlx_lm_server("--plugin", "radix", "--plugin", "radix"), {}),
    "MLX_LM_PLUGINS=radix": (mlx_lm_server(), {"MLX_LM_PLUGINS": "radix"}),
    "mlx-radix serve": ([str(BIN / "mlx-radix"), "serve", "--page-size", "4"], {}),
}


@pytest.mark.parametrize("form", list(INVOCATIONS))
def test_every_invocation_form_activates_the_plugin(start, form):
    cmd, env = INVOCATIONS[form]
    with start(cmd, env) as server:
        got = conversation(server)
        stats = server.stats()
    assert all(g["text"] for g in got)
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert stats["fallback"] is None and stats["hits"] >= 3 and stats["page_size"] == 4


def test_unbatched_decode_reads_the_pool_in_place(start):
    """decode.batched = false: mlx-lm's one-at-a-time path, on pool-backed caches."""
    with start(mlx_lm_server()) as stock:
        expected = conversation(stock)
    with start(mlx_lm_server("--plugin", "radix"), {"MLX_RADIX_DECODE_BATCHED": "false"}) as s:
        got = conversation(s)
        stats = s.stats()
    assert [g["text"] for g in got] == [e["text"] for e in expected]
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12
    assert stats["pages_locked"] == 0 and stats["hits"] >= 3


def test_unknown_plugin_exits_2_listing_installed(model_dirs, hf_cache):
    result = run_to_exit(
        mlx_lm_server("--plugin", "nope", "--model", str(model_dirs["llama"])),
        server_env(hf_cache),
    )
    assert result.returncode == 2
    assert "unknown plugin 'nope'; installed plugins:" in result.stderr
    assert "radix" in result.stderr and "Traceback" not in result.stderr


def test_plugin_flag_without_name_exits_2(hf_cache):
    result = run_to_exit(mlx_lm_server("--plugin"), server_env(hf_cache))
    assert result.returncode == 2 and "--plugin needs a plugin name" in result.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MLX_RADIX_PAGE_SIZE": "0"}, "$MLX_RADIX_PAGE_SIZE: expected an integer >= 1"),
        ({"MLX_RADIX_EVICTON": "lfu"}, "unknown key 'MLX_RADIX_EVICTON'"),
    ],
)
def test_bad_config_exits_2_before_serving(model_dirs, hf_cache, env, message):
    result = run_to_exit(
        mlx_lm_server("--plugin", "radix", "--model", str(model_dirs["llama"])),
        server_env(hf_cache, **env),
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_bad_config_file_exits_2(model_dirs, hf_cache, tmp_path):
    path = tmp_path / "radix.toml"
    path.write_text("[radix]\neviction = 'fifo'\n")
    result = run_to_exit(
        mlx_lm_server("--plugin", "radix", "--model", str(model_dirs["llama"])),
        server_env(hf_cache, MLX_RADIX_CONFIG=str(path)),
    )
    assert result.returncode == 2
    assert (
        "radix.eviction = 'fifo'" in result.stderr and "expected one of lru, lfu" in result.stderr
    )


def test_model_the_pool_cannot_hold_falls_back_with_reason(start):
    with start(mlx_lm_server("--plugin", "radix", "--kv-bits", "8")) as server:
        r = server.post("/v1/completions", {"prompt": SYSTEM, **GREEDY})
        assert r["choices"][0]["text"]
        stats = server.stats()
    assert "--kv-bits" in stats["fallback"] and stats["pages_total"] == 0


@pytest.mark.parametrize("arch", ["qwen3_5", "falcon_h1"])
def test_a_hybrid_model_answers_like_stock_and_resumes_from_snapshots(start, arch):
    """qwen3_5 (gated delta net and full attention layers) and falcon_h1 (a CacheList of a
    Mamba-2 state and attention K/V a layer): a chat's turns and another question on its
    system prompt, through both servers."""

    def chat(server: Server) -> list[tuple[str, int]]:
        out, messages = [], [{"role": "system", "content": SYSTEM}]
        for question in ("Where is Paris?", "And Rome?", "Thanks"):
            messages.append({"role": "user", "content": question})
            r = server.post("/v1/chat/completions", {"messages": messages, **GREEDY})
            answer = r["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            out.append((answer, r["usage"]["prompt_tokens_details"]["cached_tokens"]))
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        r = server.post("/v1/chat/completions", {"messages": other, **GREEDY})
        out.append((r["choices"][0]["message"]["content"], 0))
        return out

    with start(mlx_lm_server(), model=arch) as stock:
        expected = chat(stock)
    with start(mlx_lm_server("--plugin", "radix"), model=arch) as radix:
        got = chat(radix)
        stats = radix.stats()
        metrics = parse_metrics(radix.get("/metrics")[1])
    assert [text for text, _ in got] == [text for text, _ in expected]
    # Turns 2 and 3 resume past the turn before them (page size 4 in these tests).
    assert got[1][1] >= 20 and got[2][1] > got[1][1]
    assert stats["fallback"] is None and stats["snapshots"] > 0 and stats["snapshot_hits"] >= 3
    assert stats["pages_locked"] == 0 and stats["snapshot_bytes"] <= stats["snapshot_bytes_max"]
    assert metrics["mlx_radix_snapshot_hits_total"] == stats["snapshot_hits"]
