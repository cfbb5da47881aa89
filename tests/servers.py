"""Real mlx_lm.server processes on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlx_radix_plugin.tools.bench.command import ServerProcess, free_port  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Greedy output of a random model may hit EOS at once; banning it keeps outputs long.
NO_EOS = {"2": -100}

SYSTEM = "You are a helpful assistant. Answer the question briefly and politely. "
GREEDY = {"max_tokens": 8, "temperature": 0.0, "logit_bias": NO_EOS}


def server_env(hf_cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a test server: offline, no plugin or radix setting inherited."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLX_RADIX_") and k != "MLX_LM_PLUGINS"
    }
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(hf_cache),
        # The source tree, ahead of the installed copy: the installed .pth and entry
        # points then run this checkout's code.
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "hooks")]),
        MLX_RADIX_POOL_TOKENS="4096",
        MLX_RADIX_PAGE_SIZE="4",
    )
    env.update(extra)
    return env


# The benchmark's server process, with a name that reads well in tests.
Server = ServerProcess


def mlx_lm_server(*args: str) -> list[str]:
    return [str(BIN / "mlx_lm.server"), *args]


def run_to_exit(cmd: list[str], env: dict[str, str], timeout: int = 120):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def conversation(server: Server) -> list[dict]:
    """The same requests against any server: texts and usage, in order."""
    out = []
    for prompt in (SYSTEM + "Where is Paris?", SYSTEM + "Where is Berlin?"):
        r = server.post("/v1/completions", {"prompt": prompt, **GREEDY})
        out.append({"text": r["choices"][0]["text"], "usage": r["usage"]})
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]}
    r = server.post("/v1/chat/completions", {**chat, **GREEDY})
    out.append({"text": r["choices"][0]["message"]["content"], "usage": r["usage"]})
    events = server.stream("/v1/chat/completions", {**chat, **GREEDY})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    out.append({"text": text, "usage": None})
    events = server.stream("/v1/completions", {"prompt": SYSTEM + "Where is Rome?", **GREEDY})
    out.append({"text": "".join(e["choices"][0]["text"] for e in events), "usage": None})
    asked = {"prompt": SYSTEM + "Where is Oslo?", "logprobs": True, "top_logprobs": 3, **GREEDY}
    r = server.post("/v1/completions", asked)
    out.append({"text": r["choices"][0]["text"], "usage": None, "logprobs": r["choices"][0]})
    return out


def same_but_rounding(a, b, tolerance=1e-4) -> bool:
    """Equal JSON, floats to ``tolerance`` (the pool's prefill splits the prompt elsewhere)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tolerance * max(1.0, abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_but_rounding(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_but_rounding, a, b))
    return a == b
