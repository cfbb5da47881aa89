import os
import sys
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

# The installed start-up file (mlx_lm_hooks.pth) imported mlx_lm_hooks from site-packages
# before pytest put this checkout on sys.path: forget it, so tests import the checkout's.
# (The checkout's own folder, not the checkout: CI's .venv lies inside the checkout.)
for _name in [m for m in sys.modules if m.split(".")[0] == "mlx_lm_hooks"]:
    if not sys.modules[_name].__file__.startswith(str(Path(__file__).parent.parent / "hooks")):
        del sys.modules[_name]

# The fidelity tests hold float32 logits to 1e-4 of their largest: on CUDA, MLX's float32
# matmuls round through TF32 by default, which alone moved a shared-prefix step's logits from
# stock's by 0.006-0.007 on an H100. Set before anything imports mlx.core.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# Before anything imports mlx.core (tiny_models does): on Linux with mlx-cpu, OpenBLAS instead
# of the bundled reference BLAS, as every entry point of mlx-radix does.
from mlx_lm_hooks import blas  # noqa: E402

blas.preload()

from tiny_models import ARCHS, HYBRID_ARCHS, build_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch) for arch in ARCHS + HYBRID_ARCHS}


@pytest.fixture(scope="session")
def loaded(model_dirs):
    """``loaded(arch) -> (model, tokenizer)``, each loaded once per session."""
    from mlx_lm import load

    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load(str(model_dirs[arch]))
        return cache[arch]

    return get


@pytest.fixture(params=["one chunk", "a chunk a page"])
def chunking(request, monkeypatch):
    """Pools that ``KVPool.for_model`` builds in one chunk (what the tests' small pools get)
    or in a chunk a page, so that every read of several pages spans chunks."""
    if request.param == "a chunk a page":
        from mlx_radix_plugin.memory import pool

        monkeypatch.setattr(pool, "chunk_bytes_for", lambda ceiling, per_token: 1)
    return request.param


@pytest.fixture(autouse=True)
def mlx_memory_limit():
    """MLX's memory limit as each test found it: it is the process's, and binding a server
    cache sets it to the memory plan's (memory/working_set.py)."""
    import mlx.core as mx

    before = mx.get_memory_limit()
    yield
    mx.set_memory_limit(before)
