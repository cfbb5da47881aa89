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
