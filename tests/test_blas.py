"""Fast CPU BLAS for MLX on Linux (mlx_lm_hooks.blas): the SONAME edit, the preload's rules,
the numbers MLX computes with it, and the start-up shim, doctor and notice that use it."""

import ctypes.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm_hooks import blas
from servers import REPO

LIBS = blas.cpu_wheel_libs()
needs_cpu_wheel = pytest.mark.skipif(LIBS is None, reason="needs Linux with MLX's CPU wheel")


def bundled(prefix: str) -> Path:
    (path,) = Path(LIBS).glob(prefix + "-*")
    return path


def run_python(code: str, tmp_path: Path, **env: str) -> dict:
    """``code`` in a fresh interpreter that runs this checkout, with no LD_PRELOAD, plugin or
    mlx-radix setting inherited and its own cache dir; what it prints last, as JSON."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLX_RADIX_") and k not in ("LD_PRELOAD", "MLX_LM_PLUGINS")
    }
    clean.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "hooks")]),
        MLX_RADIX_CACHE_DIR=str(tmp_path / "cache"),
    )
    clean.update(env)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# What a child reports after its preload and `import mlx.core`.
REPORT = """
import json, sys
import mlx.core as mx
maps = open("/proc/self/maps").read()
print(json.dumps({
    "loaded": status.loaded, "reason": status.reason, "advice": status.advice,
    "gfortran": status.gfortran, "provider": blas.provider(),
    "library": blas.describe(status)[0], "openblas_mapped": "libopenblas" in maps,
}))
"""
PRELOAD = "from mlx_lm_hooks import blas\nstatus = blas.preload()\n" + REPORT


@needs_cpu_wheel
def test_set_soname_changes_only_the_soname(tmp_path):
    source = bundled("libgfortran")
    assert blas.read_soname(str(source)).startswith("libgfortran-")  # auditwheel's name
    target = tmp_path / "libgfortran.so.5"
    blas.set_soname(str(source), str(target), "libgfortran.so.5")
    assert blas.read_soname(str(target)) == "libgfortran.so.5"
    assert blas.needed(str(target)) == blas.needed(str(source))
    assert any(n.startswith("libquadmath-") for n in blas.needed(str(target)))
    old, new = source.read_bytes(), target.read_bytes()
    assert len(old) == len(new)
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    assert changed and changed[-1] - changed[0] < 8  # one 8-byte d_val, nothing else
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left


@needs_cpu_wheel
def test_set_soname_refuses_a_name_it_cannot_point_at(tmp_path):
    target = tmp_path / "out.so"
    with pytest.raises(blas.ElfError, match="holds no 'libnothing.so.1' for DT_SONAME"):
        blas.set_soname(str(bundled("libgfortran")), str(target), "libnothing.so.1")
    assert list(tmp_path.iterdir()) == []


def test_elf_errors_name_the_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a library\n")
    with pytest.raises(blas.ElfError, match=f"{text}: not an ELF file"):
        blas.read_soname(str(text))
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    with pytest.raises(blas.ElfError, match="empty file"):
        blas.read_soname(str(empty))
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(Path(sys.executable).resolve().read_bytes()[:80])
    with pytest.raises(blas.ElfError, match=f"{truncated}: "):
        blas.needed(str(truncated))


@needs_cpu_wheel
def test_private_gfortran_is_made_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_RADIX_CACHE_DIR", str(tmp_path))
    path = Path(blas.private_gfortran(LIBS))
    assert path.parent.parent == tmp_path / "blas" and path.name == "libgfortran.so.5"
    assert blas.read_soname(str(path)) == "libgfortran.so.5"
    quadmath = path.parent / bundled("libquadmath").name  # what its RPATH $ORIGIN finds
    assert quadmath.read_bytes() == bundled("libquadmath").read_bytes()
    made = path.stat().st_mtime_ns
    assert blas.private_gfortran(LIBS) == str(path) and path.stat().st_mtime_ns == made
    path.write_bytes(b"half a fi")  # a damaged copy is made again
    assert blas.read_soname(blas.private_gfortran(LIBS)) == "libgfortran.so.5"


def test_cpu_wheel_is_mlx_cpu_without_a_cuda_wheel(tmp_path, monkeypatch):
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx_cpu.libs").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert blas.cpu_wheel_libs() == str(tmp_path / "mlx_cpu.libs")
    (tmp_path / "mlx_cuda_12-0.32.4.dist-info").mkdir()
    assert blas.cpu_wheel_libs() is None


def test_nothing_to_do_off_linux(monkeypatch):
    monkeypatch.setattr(blas, "_status", None)
    monkeypatch.setattr(sys, "platform", "darwin")
    status = blas.preload()
    assert not status.applies and status.loaded is None and status.advice is None
    assert "not Linux (darwin)" in status.reason
    assert blas.describe(status) == ("MLX's own (mlx-radix changes nothing here)", None)
    assert blas.preload() is status  # idempotent


@needs_cpu_wheel
def test_preload_gives_mlx_openblas_and_the_same_numbers(tmp_path):
    code = PRELOAD.replace(
        "maps = ",
        """import numpy as np
assert blas.preload() is status
rng = np.random.default_rng(0)
for m, k, n in [(1, 64, 1), (3, 5, 7), (257, 129, 65), (512, 512, 512)]:
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    ours = np.array(mx.array(a) @ mx.array(b))
    np.testing.assert_allclose(ours, a @ b, rtol=2e-4, atol=2e-4 * np.sqrt(k))
    ours_t = np.array(mx.array(b).T @ mx.array(a).T)
    np.testing.assert_allclose(ours_t, (a @ b).T, rtol=2e-4, atol=2e-4 * np.sqrt(k))
maps = """,
    )
    child = run_python(code, tmp_path)
    assert child["loaded"].endswith("cmeel.prefix/lib/libopenblas.so.0")
    assert child["reason"] == f"loaded {child['loaded']} with {child['gfortran']}"
    assert child["advice"] is None
    assert child["provider"] == child["loaded"] == child["library"]  # what MLX binds to
    assert child["openblas_mapped"]
    # A bare machine has no libgfortran.so.5: then the SONAME-edited copy in the cache dir.
    if ctypes.util.find_library("gfortran") is None:
        cached = tmp_path / "cache" / "blas" / bundled("libgfortran").name / "libgfortran.so.5"
        assert child["gfortran"] == str(cached)
    else:
        assert child["gfortran"].endswith("libgfortran.so.5")
        assert not (tmp_path / "cache").exists()


@needs_cpu_wheel
def test_preload_takes_a_libgfortran_the_loader_finds(tmp_path):
    system = tmp_path / "system"
    system.mkdir()
    target = system / "libgfortran.so.5"
    blas.set_soname(str(bundled("libgfortran")), str(target), "libgfortran.so.5")
    quadmath = bundled("libquadmath")
    (system / quadmath.name).write_bytes(quadmath.read_bytes())
    child = run_python(PRELOAD, tmp_path, LD_LIBRARY_PATH=str(system))
    assert child["gfortran"] == str(target)
    assert child["provider"] == child["loaded"] and child["openblas_mapped"]
    assert not (tmp_path / "cache").exists()  # nothing copied


@needs_cpu_wheel
@pytest.mark.parametrize(
    "env, reason, advice",
    [
        ({"MLX_RADIX_BLAS": "off"}, "MLX_RADIX_BLAS=off", "unset MLX_RADIX_BLAS (it is 'off')"),
        ({"MLX_RADIX_BLAS": "OFF"}, "MLX_RADIX_BLAS=OFF", "unset MLX_RADIX_BLAS (it is 'OFF')"),
        ({"LD_PRELOAD": "libm.so.6"}, "LD_PRELOAD=libm.so.6 is set: left to it", "LD_PRELOAD"),
    ],
)
def test_preload_leaves_blas_alone_when_told(tmp_path, env, reason, advice):
    child = run_python(PRELOAD, tmp_path, **env)
    assert child["loaded"] is None and child["reason"] == reason and advice in child["advice"]
    assert child["provider"] is None and not child["openblas_mapped"]
    assert "libblas-" in child["library"] and "reference BLAS: slow" in child["library"]
    assert not (tmp_path / "cache").exists()


@needs_cpu_wheel
@pytest.mark.skipif(ctypes.util.find_library("gfortran") is not None, reason="needs no system one")
def test_preload_that_cannot_write_its_cache_says_so(tmp_path):
    (tmp_path / "a file").write_text("")
    child = run_python(PRELOAD, tmp_path, MLX_RADIX_CACHE_DIR=str(tmp_path / "a file"))
    assert child["loaded"] is None and child["reason"].startswith("no libgfortran.so.5 for ")
    assert "Not a directory" in child["reason"] and "MLX_RADIX_CACHE_DIR" in child["advice"]
    assert child["provider"] is None and not child["openblas_mapped"]


@needs_cpu_wheel
def test_preload_after_mlx_core_is_too_late(tmp_path):
    code = "import mlx.core\nfrom mlx_lm_hooks import blas\nstatus = blas.preload()\n" + REPORT
    child = run_python(code, tmp_path)
    assert child["loaded"] is None and "mlx.core was imported first" in child["reason"]
    assert "before importing mlx.core" in child["advice"]
    assert child["provider"] is None and not child["openblas_mapped"]


@needs_cpu_wheel
@pytest.mark.parametrize("asked", [True, False])
def test_startup_shim_preloads_only_when_a_plugin_is_asked_for(tmp_path, asked):
    code = """import json, sys
print(json.dumps({"blas": "mlx_lm_hooks.blas" in sys.modules,
    "openblas_mapped": "libopenblas" in open("/proc/self/maps").read()}))"""
    env = {"MLX_LM_PLUGINS": "radix"} if asked else {}
    assert run_python(code, tmp_path, **env) == {"blas": asked, "openblas_mapped": asked}


def test_measure_reports_a_plausible_speed():
    gflops = blas.measure(256, budget_s=0.05)
    assert 0.05 < gflops < 1e5  # GFLOP/s of a 2-core laptop and of a large server, with room


@needs_cpu_wheel
def test_doctor_with_blas_off_says_what_to_do(tmp_path):
    code = "from mlx_radix_plugin.cli import main\nmain()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RADIX_")}
    clean.pop("LD_PRELOAD", None)
    clean.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "hooks")]),
        MLX_RADIX_BLAS="off",
        XDG_CONFIG_HOME=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "doctor"],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert report["blas_preload"] == "MLX_RADIX_BLAS=off"
    assert report["blas_advice"] == f"unset MLX_RADIX_BLAS (it is 'off') ({blas.FASTER})"
    assert "libblas-" in report["blas"] and "reference BLAS: slow" in report["blas"]
    assert float(report["blas_gflops"].split()[0]) > 0


def test_config_leaves_mlx_radix_blas_to_the_preload():
    from mlx_radix_plugin.config import load_config

    assert load_config(environ={"MLX_RADIX_BLAS": "off"}, path=os.devnull)["radix.enabled"]


@needs_cpu_wheel
@pytest.mark.skipif(
    os.environ.get("MLX_RADIX_BLAS", "").lower() == "off" or bool(os.environ.get("LD_PRELOAD")),
    reason="the suite runs with MLX_RADIX_BLAS=off or LD_PRELOAD",
)
def test_the_suite_runs_on_openblas():
    status = blas.preload()  # conftest's, before MLX was imported
    assert status.loaded and status.loaded.endswith("libopenblas.so.0"), status
    assert blas.provider() == status.loaded


@needs_cpu_wheel  # the CPU backend
def test_server_notice_names_the_blas_and_its_speed(caplog):
    from mlx_radix_plugin.server.plugin import blas_notice

    with caplog.at_level(logging.INFO, logger="mlx_radix"):
        blas_notice()
    (record,) = caplog.records
    library, advice = blas.describe(blas.preload())
    assert record.getMessage().startswith(f"CPU BLAS: {library}, ")
    assert " GFLOP/s (512x512 float32 matmul)" in record.getMessage()
    assert record.levelno == (logging.WARNING if advice else logging.INFO)


@needs_cpu_wheel
def test_server_notice_on_the_slow_blas_warns_quickly_with_advice(tmp_path):
    code = """import json, logging, time
from mlx_radix_plugin.server.plugin import blas_notice
import mlx.core as mx
mx.eval(mx.ones(1))
lines = []
handler = logging.Handler()
handler.emit = lambda r: lines.append((r.levelname, r.getMessage()))
logging.getLogger("mlx_radix").addHandler(handler)
start = time.perf_counter()
blas_notice()
print(json.dumps({"lines": lines, "seconds": time.perf_counter() - start}))"""
    child = run_python(code, tmp_path, MLX_RADIX_BLAS="off")
    ((level, line),) = child["lines"]
    assert level == "WARNING" and "reference BLAS: slow" in line and " GFLOP/s " in line
    assert line.endswith(f"; unset MLX_RADIX_BLAS (it is 'off') ({blas.FASTER})")
    assert child["seconds"] < 2  # ~0.1 s on a 2-core machine; generous for a loaded one
