"""mlx_lm.server under ``mlx.launch`` (two ranks over the ring backend on 127.0.0.1), tensor
parallel, with the plugin on every rank, against stock."""

import concurrent.futures
import os
import signal

import pytest
from servers import BIN, NO_EOS, Server, free_port, mlx_lm_server, server_env

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer the question briefly and politely. " * 2
QUESTIONS = ["Where is Paris?", "Where is Berlin?", "Where is Rome?", "Where is Oslo?"]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "logit_bias": NO_EOS}


class Launched(Server):
    """``mlx.launch`` and its ranks in a process group of their own: stopping it stops them
    all (rank 0 serves HTTP)."""

    new_session = True

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._out.close()


@pytest.fixture
def launch(model_dirs, tmp_path):
    def launch(plugin: bool) -> Launched:
        port = free_port()
        env = server_env(tmp_path / "hf")
        (tmp_path / "hf").mkdir(exist_ok=True)
        cmd = [str(BIN / "mlx.launch"), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring"]
        cmd += ["--starting-port", str(free_port())]
        for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "PYTHONPATH") + tuple(
            k for k in env if k.startswith("MLX_RADIX_")
        ):
            cmd += ["--env", f"{key}={env[key]}"]
        if plugin:
            cmd += ["--env", "MLX_LM_PLUGINS=radix"]
        cmd += [str(BIN / "mlx_lm.server"), "--model", str(model_dirs["llama"])]
        cmd += ["--port", str(port)]
        return Launched(cmd, env, port, tmp_path / f"launch-{port}.log")

    return launch


def answers(server: Server) -> list[tuple[str, int]]:
    """The questions two at a time on one system prompt: texts and cached tokens."""

    def ask(question: str) -> tuple[str, int]:
        r = server.post("/v1/completions", {"prompt": SYSTEM + question, **GREEDY})
        details = r["usage"].get("prompt_tokens_details") or {}
        return r["choices"][0]["text"], details.get("cached_tokens", 0)

    out = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for pair in (QUESTIONS[:2], QUESTIONS[2:], QUESTIONS[:2]):
            out += list(pool.map(ask, pair))
    return out


def test_tensor_parallel_ranks_answer_as_stock_and_hit(launch, model_dirs, tmp_path):
    port = free_port()
    cmd = mlx_lm_server("--model", str(model_dirs["llama"]), "--port", str(port))
    with Server(cmd, server_env(tmp_path / "hf1"), port, tmp_path / "stock.log") as stock:
        alone = [text for text, _ in answers(stock)]
    with launch(plugin=False) as stock:
        distributed = [text for text, _ in answers(stock)]
    with launch(plugin=True) as radix:
        got = answers(radix)
        stats = radix.stats()
        log = radix.output()
    assert [text for text, _ in got] == distributed == alone
    assert sum(cached for _, cached in got[2:]) > 0  # the system prompt, from the pool
    assert log.count("radix KV pool: up to") == 2  # each rank built its own pool
    assert stats["hits"] > 0 and stats["fallback"] is None
    assert stats["pages_locked"] == stats["tree_locks"] == stats["requests_holding_pages"] == 0
    assert stats["page_refs"] == stats["pages_cached"]
