"""The entry-point path through a real, non-editable install into a fresh venv."""

import json
import os
import site
import subprocess
import sys
import venv

import pytest
from servers import REPO, Server, free_port, server_env


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("mlx_radix-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    # mlx, mlx-lm and the rest come from this interpreter (no network needed): its
    # site-packages go on the new venv's path after the venv's own.
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    with open(os.path.join(purelib, "zz_test_deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return env_dir


def clean_env(hf_cache):
    env = server_env(hf_cache)
    env.pop("PYTHONPATH")  # the installed copy, not this checkout
    return env


@pytest.mark.slow
def test_installed_files_and_plugin_listing(fresh_venv, tmp_path):
    bin_dir = fresh_venv / "bin"
    py = str(bin_dir / "python")
    where = subprocess.check_output(
        [py, "-c", "import mlx_radix_plugin, mlx_lm_hooks; print(mlx_radix_plugin.__file__)"],
        text=True,
        env=clean_env(tmp_path),
        cwd=tmp_path,  # not this checkout: `python -c` puts the cwd first on sys.path
    )
    assert where.startswith(str(fresh_venv))
    listed = json.loads(
        subprocess.check_output(
            [str(bin_dir / "mlx-radix"), "plugins"], env=clean_env(tmp_path), cwd=tmp_path
        )
    )
    assert [p["name"] for p in listed] == ["agents", "radix"]
    assert {p["package"] for p in listed} == {"mlx-radix"}
    purelib = next((fresh_venv / "lib").glob("python*/site-packages"))
    assert (purelib / "mlx_lm_hooks.pth").exists() and (purelib / "mlx_lm_hooks.start").exists()


@pytest.mark.slow
def test_installed_shim_starts_the_plugin(fresh_venv, model_dirs, tmp_path):
    port = free_port()
    cmd = [
        str(fresh_venv / "bin" / "python"),
        "-m",
        "mlx_lm",
        "server",
        "--plugin",
        "radix",
        "--model",
        str(model_dirs["llama"]),
        "--port",
        str(port),
    ]
    with Server(cmd, clean_env(tmp_path), port, tmp_path / "log", cwd=tmp_path) as server:
        server.post("/v1/completions", {"prompt": "Paris is", "max_tokens": 2})
        stats = server.stats()
    assert stats["fallback"] is None and stats["misses"] == 1
