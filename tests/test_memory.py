"""Memory that fits the machine, through real servers: an idle server holds what stock holds,
the pool grows in chunks as requests need pages, a model that leaves no room for a pool is
still served from the pool, with a warning, and a long prompt is served within the plan."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from servers import NO_EOS, Server, free_port, mlx_lm_server, server_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GREEDY = {"max_tokens": 4, "temperature": 0.0, "logit_bias": NO_EOS}


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settled_rss(server: Server, seconds: float = 1.0, timeout: float = 60) -> int:
    """Resident memory once it has stopped moving (the model is loaded in the background
    after the server answers): two readings ``seconds`` apart within 1%."""
    deadline = time.monotonic() + timeout
    last = resident_bytes(server.proc.pid)
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = resident_bytes(server.proc.pid)
        if abs(now - last) <= 0.01 * last:
            return now
        last = now
    raise AssertionError(f"resident memory still moving after {timeout} s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A llama of 100 MB (float32): big enough that the model, not the interpreter, is most
    of what a server holds, as with a real model (the plugin's code and OpenBLAS add ~8 MB
    to stock's ~81 MB with the 0.5 MB test models)."""
    from tiny_models import build_model

    path = tmp_path_factory.mktemp("wide") / "llama"
    return build_model("llama", path, hidden_size=1024, intermediate_size=2816)


@pytest.fixture
def start(model_dir, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()

    def start(plugin: bool, **env: str) -> Server:
        port = free_port()
        args = ["--plugin", "radix"] if plugin else []
        cmd = mlx_lm_server(*args, "--model", str(model_dir), "--port", str(port))
        # The default budget: no pool size given.
        environ = server_env(hf, MLX_RADIX_POOL_TOKENS="0", **env)
        return Server(cmd, environ, port, tmp_path / f"{port}.log")

    return start


def wait_for_model(server: Server) -> dict:
    for _ in range(600):
        stats = server.stats()
        if stats["model"] is not None:
            return stats
        time.sleep(0.1)
    raise AssertionError("the model did not load")


def test_an_idle_server_holds_what_stock_holds_and_the_pool_grows_as_requests_need(start):
    with start(plugin=False) as stock:
        stock_rss = settled_rss(stock)
    with start(plugin=True, MLX_RADIX_CHUNK_MIB="1") as radix:
        before = wait_for_model(radix)
        radix_rss = settled_rss(radix)
        # 8 KiB a token (2 layers x 2 KV heads x 256 dims x K and V x 4 bytes): chunks of
        # about 128 tokens, where each prompt is several hundred.
        prompts = [" ".join(f"{name}{i}" for i in range(300)) for name in ("a", "b", "c", "d")]
        for p in prompts:
            radix.post("/v1/completions", {"prompt": p, **GREEDY})
        after = radix.stats()
        again = radix.post("/v1/completions", {"prompt": prompts[0], **GREEDY})
    assert radix_rss <= 1.10 * stock_rss, (radix_rss, stock_rss)
    assert before["pool_chunks"] == before["pool_bytes_total"] == 0
    assert before["memory_plan"]["rule"] == "usable - model - working - margin"
    assert before["pool_bytes_max"] > 1 << 30 and before["memory_plan"]["warning"] is None
    chunk = 1 << 20
    chunks, held = after["pool_chunks"], after["pool_bytes_total"]
    assert chunks >= 2 and held % chunks == 0 and chunk - 32768 <= held // chunks <= chunk
    assert after["pool_bytes_used"] > chunk and after["evictions"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_model_that_leaves_no_room_is_served_from_a_minimal_pool_with_a_warning(start):
    # 200 MB usable: the model alone is half of it.
    with start(plugin=True, MLX_RADIX_DEVICE_MEMORY=str(200 << 20)) as radix:
        stats = wait_for_model(radix)
        prompt = "You are a helpful assistant. Answer briefly. Where is Paris?"
        first = radix.post("/v1/completions", {"prompt": prompt, **GREEDY})
        second = radix.post("/v1/completions", {"prompt": prompt, **GREEDY})
        log = radix.output()
    plan = stats["memory_plan"]
    assert stats["fallback"] is None and plan["model_bytes"] > 0.4 * plan["usable_bytes"]
    assert "minimal pool of 2048 tokens" in plan["warning"]
    assert stats["pages_max"] * 4 == 2048
    assert "leave no room for a KV pool" in log
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.fixture(scope="module")
def wide_long(tmp_path_factory) -> Path:
    """A tiny model with a long context and wide attention (4 query heads over one KV head,
    131,072 tokens): a long prompt's scores are large against its K/V, which size the plan."""
    from tiny_models import build_model

    path = tmp_path_factory.mktemp("wide_long") / "llama"
    return build_model(
        "llama",
        path,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=131072,
    )


def text_of(model_dir: Path, tokens: int) -> str:
    """A text the model's tokenizer reads as ``tokens`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    words = " ".join(f"{w}{i % 97}" for i, w in enumerate(["fox", "page", "radix", "dog"] * tokens))
    return tokenizer.decode(tokenizer(words)["input_ids"][:tokens])


def test_a_long_prompt_is_served_within_the_model_the_pool_and_working_memory(wide_long, tmp_path):
    """A 24,576-token prompt on the wide model, its pool sized by the user (32,768 tokens):
    the server's resident memory grows by no more than the plan names, the pool and working
    memory (MLX's cache of freed buffers counted in it). Before the attention's blocks were
    evaluated one at a time and the cache counted, it grew by 789 MB against 356 MB named."""
    hf = tmp_path / "hf"
    hf.mkdir()
    port = free_port()
    cmd = mlx_lm_server("--plugin", "radix", "--model", str(wide_long), "--port", str(port))
    env = server_env(hf, MLX_RADIX_POOL_TOKENS="32768", MLX_RADIX_PAGE_SIZE="16")
    prompt = text_of(wide_long, 24576)
    with Server(cmd, env, port, tmp_path / "server.log") as radix:
        plan = wait_for_model(radix)["memory_plan"]
        before = settled_rss(radix)
        with radix.peak_rss() as peak:
            reply = radix.post("/v1/completions", {"prompt": prompt, **GREEDY})
        stats = radix.stats()
    assert reply["usage"]["prompt_tokens"] >= 24576
    named = plan["pool_max_bytes"] + plan["working_bytes"]
    assert stats["working_peak_prefill_bytes"] <= plan["working_bytes"]
    assert peak.bytes - before <= named, (peak.bytes - before, named)
