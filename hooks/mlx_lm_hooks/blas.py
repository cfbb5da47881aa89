"""Fast CPU BLAS for MLX on Linux.

MLX's Linux CPU wheel (``mlx-cpu``) bundles netlib's reference BLAS (``mlx_cpu.libs/libblas-*``):
a 1,024 x 1,024 float32 matmul runs at 2-6 GFLOP/s. ``libmlx.so`` finds its ``cblas_*``
functions through the dynamic linker, which searches the process's global scope before
libmlx's own libraries, so an OpenBLAS loaded with ``RTLD_GLOBAL`` before ``mlx.core`` is
imported is used instead. Python loads extensions with ``RTLD_NOW``: once ``mlx.core`` is
imported, its calls are bound and it is too late.

:func:`preload` loads the OpenBLAS of the ``cmeel-openblas`` wheel, which the ``cpu`` extra of
mlx-radix brings. That library needs ``libgfortran.so.5`` (for two symbols of version
``GFORTRAN_8``), which a bare machine lacks. A system ``libgfortran.so.5`` is used when the
loader finds one; otherwise a copy of the libgfortran that mlx-cpu itself bundles, kept in the
cache dir with its ``DT_SONAME`` set back to ``libgfortran.so.5`` (see :func:`set_soname`):
glibc takes an already loaded library for a ``NEEDED`` name only if that is its SONAME or
the name it was loaded by, and auditwheel renamed the bundled one's SONAME to
``libgfortran-<hash>.so.5.0.0``.

Measured on a 2-core x86_64 (AVX-512) Linux machine, mlx-cpu 0.32.4, ``mlx-radix doctor``
(1,024 x 1,024 float32): 5.2-5.3 GFLOP/s with the reference BLAS, 76-108 GFLOP/s with this
OpenBLAS, whose threads (one a core; ``OPENBLAS_NUM_THREADS`` sets how many) are left as they
are: that machine's two vCPUs give ~1.1 cores together, and there ``OPENBLAS_NUM_THREADS=1``
measures a steady 150 GFLOP/s, but a machine of real cores gains from them.

Rejected wheels: ``scipy-openblas32`` (no libgfortran, but its symbols are ``scipy_``-prefixed,
invisible to MLX), ``mkl`` (221 MB), ``ngsolve-openblas`` (needs libgfortran.so.5 too).

It applies only on Linux with mlx-cpu (not with a CUDA wheel of MLX); ``MLX_RADIX_BLAS=off``
turns it off, and a set ``LD_PRELOAD`` is left to do what the user chose. Nothing here
raises, and where it does not apply it costs a few ``stat`` calls.
"""

import os
import struct
import sys

ENV = "MLX_RADIX_BLAS"
CACHE_ENV = "MLX_RADIX_CACHE_DIR"  # as mlx_radix_plugin's cache dir, which this must not import
GFORTRAN = "libgfortran.so.5"
OPENBLAS = os.path.join("cmeel.prefix", "lib", "libopenblas.so.0")  # in cmeel-openblas
INSTALL = 'pip install "mlx-radix[cpu]"'
FASTER = "OpenBLAS: typically 10-40x faster matmuls"


class BlasStatus:
    """What :func:`preload` did.

    ``applies``: Linux with MLX's CPU wheel, whose own BLAS is the slow reference one.
    ``reason``: what happened, in words. ``loaded``: the OpenBLAS it put in the global scope.
    ``gfortran``: the ``libgfortran.so.5`` loaded for that OpenBLAS. ``advice``: what would
    bring the fast BLAS, whenever it applies and none was loaded.
    """

    __slots__ = ("applies", "reason", "loaded", "gfortran", "advice")

    def __init__(
        self,
        applies: bool,
        reason: str,
        loaded: str | None = None,
        gfortran: str | None = None,
        advice: str | None = None,
    ):
        self.applies = applies
        self.reason = reason
        self.loaded = loaded
        self.gfortran = gfortran
        self.advice = advice

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"BlasStatus({fields})"


_status: BlasStatus | None = None


def preload() -> BlasStatus:
    """Load OpenBLAS ahead of MLX's reference BLAS where that applies (see the module's doc).

    Call it before anything imports ``mlx.core``. Idempotent: later calls return the first
    call's status. Never raises.
    """
    global _status
    if _status is None:
        try:
            _status = _preload()
        except Exception as e:  # noqa: BLE001 - a BLAS must never stop a program from starting
            _status = BlasStatus(
                True,
                f"preloading OpenBLAS failed: {e!r}",
                advice="LD_PRELOAD an OpenBLAS",
            )
    return _status


def _preload() -> BlasStatus:
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, f"not Linux ({sys.platform}): MLX uses the platform's BLAS")
    libs = cpu_wheel_libs()
    if libs is None:
        return BlasStatus(False, "MLX is not the CPU wheel (mlx-cpu): nothing to replace")
    setting = os.environ.get(ENV, "")
    if setting.strip().lower() == "off":
        return BlasStatus(True, f"{ENV}={setting}", advice=f"unset {ENV} (it is {setting!r})")
    ld_preload = os.environ.get("LD_PRELOAD", "")
    if ld_preload.strip():
        return BlasStatus(
            True,
            f"LD_PRELOAD={ld_preload} is set: left to it",
            advice="unset LD_PRELOAD (mlx-radix then loads one) or add an OpenBLAS to it",
        )
    openblas = _find(OPENBLAS)
    if openblas is None:
        return BlasStatus(True, "cmeel-openblas is not installed", advice=INSTALL)

    import ctypes

    try:
        # Another copy of this module (the start-up shim's, say) may have loaded it already.
        ctypes.CDLL(openblas, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        return BlasStatus(True, f"{openblas} was already loaded", loaded=openblas)
    except OSError:
        pass
    if "mlx.core" in sys.modules:
        return BlasStatus(
            True,
            "mlx.core was imported first: its BLAS calls are already bound",
            advice="call mlx_lm_hooks.blas.preload() before importing mlx.core",
        )
    try:
        gfortran = _load_gfortran(libs)
    except (OSError, ElfError) as e:
        return BlasStatus(
            True,
            f"no libgfortran.so.5 for {openblas}: {e}",
            advice=f"install a libgfortran.so.5 (Debian, Ubuntu: apt-get install libgfortran5) "
            f"or set {CACHE_ENV} to a writable folder",
        )
    try:
        ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return BlasStatus(
            True,
            f"could not load {openblas}: {e}",
            advice="LD_PRELOAD an OpenBLAS (Debian, Ubuntu: libopenblas0-pthread)",
        )
    return BlasStatus(
        True, f"loaded {openblas} with {gfortran}", loaded=openblas, gfortran=gfortran
    )


def cpu_wheel_libs() -> str | None:
    """mlx-cpu's ``mlx_cpu.libs`` folder beside the ``mlx`` package on ``sys.path``; None if
    there is none, or if a CUDA wheel of MLX (``mlx_cuda*``) is installed there too."""
    for entry in sys.path:
        libs = os.path.join(entry, "mlx_cpu.libs")
        if os.path.isdir(libs) and os.path.isdir(os.path.join(entry, "mlx")):
            if any(name.startswith("mlx_cuda") for name in os.listdir(entry or ".")):
                return None
            return libs
    return None


def _find(relative: str) -> str | None:
    for entry in sys.path:
        path = os.path.join(entry, relative)
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def _load_gfortran(libs: str) -> str:
    """Load a ``libgfortran.so.5`` globally: the system's, else a private copy of mlx-cpu's."""
    import ctypes

    try:
        ctypes.CDLL(GFORTRAN, mode=ctypes.RTLD_GLOBAL)
        return provider("_gfortran_etime") or GFORTRAN
    except OSError:
        pass
    path = private_gfortran(libs)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def cache_dir() -> str:
    """``$MLX_RADIX_CACHE_DIR``, else ``$XDG_CACHE_HOME/mlx-radix`` (``~/.cache/mlx-radix``)."""
    if os.environ.get(CACHE_ENV):
        return os.path.expanduser(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mlx-radix")


def private_gfortran(libs: str) -> str:
    """A copy of the libgfortran in ``libs`` whose SONAME is ``libgfortran.so.5``, with the
    libraries it needs from ``libs`` beside it (its RPATH is ``$ORIGIN``), made once in
    ``cache_dir()/blas/<its file name>/``; its path. Raises OSError, ElfError."""
    names = sorted(n for n in os.listdir(libs) if n.startswith("libgfortran"))
    if not names:
        raise OSError(f"no libgfortran in {libs}")
    source = os.path.join(libs, names[0])
    folder = os.path.join(cache_dir(), "blas", names[0])  # auditwheel's name carries a hash
    target = os.path.join(folder, GFORTRAN)
    try:
        if read_soname(target) == GFORTRAN:
            return target
    except (OSError, ElfError):
        pass
    os.makedirs(folder, exist_ok=True)
    # The copy appears last, so that a copy found above always has what it needs beside it.
    for name in needed(source):
        sibling = os.path.join(libs, name)
        if os.path.isfile(sibling):
            with open(sibling, "rb") as f:
                _write_atomically(os.path.join(folder, name), f.read())
    set_soname(source, target, GFORTRAN)
    return target


def provider(symbol: str = "cblas_sgemm") -> str | None:
    """The file that defines ``symbol`` in this process's global scope, the first place MLX
    looks for its BLAS; None if no global library defines it (MLX then uses the BLAS its
    wheel bundles) or off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p)
    except AttributeError:
        return None
    info = DlInfo()
    # libdl.so.2 has dladdr before glibc 2.34 and forwards to libc's after.
    if not ctypes.CDLL("libdl.so.2").dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def describe(status: BlasStatus) -> tuple[str, str | None]:
    """(the BLAS that MLX's CPU matmuls use, what to do when that is the slow bundled one)."""
    if not status.applies:
        return "MLX's own (mlx-radix changes nothing here)", None
    used = provider()
    if used is not None:
        return used, None
    libs = cpu_wheel_libs()
    bundled = sorted(n for n in os.listdir(libs) if n.startswith("libblas")) if libs else []
    where = os.path.join(libs, bundled[0]) if bundled else "mlx-cpu's bundled libblas"
    return f"{where} (reference BLAS: slow)", f"{status.advice} ({FASTER})"


def measure(n: int = 1024, budget_s: float = 0.5) -> float:
    """GFLOP/s of an ``n`` x ``n`` float32 matmul on MLX's CPU: the best of up to 10 runs,
    fewer once ``budget_s`` is spent (an OpenBLAS run waits for its threads to get a core)."""
    import time

    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((n, n), key=mx.random.key(0))
        b = mx.random.normal((n, n), key=mx.random.key(1))
        mx.eval(a, b)
        best = float("inf")
        start = time.perf_counter()
        for _ in range(10):
            t = time.perf_counter()
            mx.eval(a @ b)
            now = time.perf_counter()
            best = min(best, now - t)
            if now - start >= budget_s:
                break
        del a, b
    mx.clear_cache()  # the measurement's 12 MiB go back, not into MLX's cache of free buffers
    return 2 * n**3 / best / 1e9


# --- The SONAME edit: ELF64 little-endian shared objects only (x86_64, aarch64). ---

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME = 0, 1, 5, 10, 14
_ET_DYN = 3


class ElfError(ValueError):
    """A file is not the ELF shared object an edit expects; the message names it and why."""


class _Dynamic:
    """The dynamic section of an ELF64 little-endian shared object: ``entries`` as (tag,
    value, file offset of the entry), and the string table its names point into."""

    def __init__(self, data, path: str):
        try:
            self._parse(data, path)
        except struct.error as e:
            raise ElfError(f"{path}: truncated or malformed ELF file ({e})") from None

    def _parse(self, data, path: str) -> None:
        if data[:4] != b"\x7fELF":
            raise ElfError(f"{path}: not an ELF file")
        if data[4] != 2 or data[5] != 1:
            raise ElfError(f"{path}: not ELF64 little-endian (class {data[4]}, data {data[5]})")
        (e_type,) = struct.unpack_from("<H", data, 0x10)
        if e_type != _ET_DYN:
            raise ElfError(f"{path}: not a shared object (e_type {e_type})")
        (phoff,) = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        loads, dynamic = [], None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize
            )
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (p_offset, p_offset + p_filesz)
        if dynamic is None:
            raise ElfError(f"{path}: no dynamic section (PT_DYNAMIC)")
        self.entries = []
        offset, end = dynamic
        while offset + 16 <= end:
            tag, value = struct.unpack_from("<qQ", data, offset)
            if tag == _DT_NULL:
                break
            self.entries.append((tag, value, offset))
            offset += 16
        strtab, strsz = self._one(_DT_STRTAB, path), self._one(_DT_STRSZ, path)
        # DT_STRTAB is an address: the load segment that maps it gives its file offset.
        mapped = [off + strtab - va for va, off, size in loads if va <= strtab < va + size]
        start = mapped[0] if mapped else None
        if start is None or start + strsz > len(data):
            raise ElfError(f"{path}: its string table (DT_STRTAB {strtab:#x}) is not in the file")
        self.strtab = bytes(data[start : start + strsz])

    def _one(self, tag: int, path: str) -> int:
        values = self.values(tag)
        if len(values) != 1:
            raise ElfError(f"{path}: {len(values)} dynamic entries of tag {tag}, expected 1")
        return values[0]

    def values(self, tag: int) -> list[int]:
        return [value for t, value, _ in self.entries if t == tag]

    def string(self, offset: int) -> str:
        end = self.strtab.find(b"\0", offset)
        if offset >= len(self.strtab) or end < 0:
            raise ElfError(f"string offset {offset} is outside the string table")
        return self.strtab[offset:end].decode()


def _read_dynamic(path: str) -> _Dynamic:
    import mmap

    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ElfError(f"{path}: empty file") from None
        with data:
            return _Dynamic(data, path)


def read_soname(path: str) -> str | None:
    """The SONAME of shared object ``path``; None if it has none. Raises OSError, ElfError."""
    dynamic = _read_dynamic(path)
    names = dynamic.values(_DT_SONAME)
    return dynamic.string(names[0]) if names else None


def needed(path: str) -> list[str]:
    """The ``DT_NEEDED`` names of shared object ``path``. Raises OSError, ElfError."""
    dynamic = _read_dynamic(path)
    return [dynamic.string(offset) for offset in dynamic.values(_DT_NEEDED)]


def set_soname(source: str, target: str, soname: str) -> None:
    """Write a copy of shared object ``source`` to ``target`` whose SONAME is ``soname``.

    Only the 8-byte value of the ``DT_SONAME`` entry changes: it is pointed at ``soname``
    where the string table already holds it, so that no string, section or offset moves. A
    library linked with a version script (libgfortran is) names itself there in its base
    version definition, and auditwheel's rename left that name in place. The copy is written
    beside ``target`` and renamed over it only once its SONAME reads back as ``soname``.
    Raises ElfError when ``source`` has no ``DT_SONAME`` or no such string, OSError.
    """
    with open(source, "rb") as f:
        data = bytearray(f.read())
    dynamic = _Dynamic(data, source)
    entries = [offset for tag, _, offset in dynamic.entries if tag == _DT_SONAME]
    if not entries:
        raise ElfError(f"{source}: no DT_SONAME entry to point at {soname!r}")
    at = dynamic.strtab.find(b"\0" + soname.encode() + b"\0")
    if at < 0:
        raise ElfError(f"{source}: its string table holds no {soname!r} for DT_SONAME")
    for offset in entries:
        struct.pack_into("<Q", data, offset + 8, at + 1)
    _write_atomically(target, data, check=lambda path: read_soname(path) == soname)


def _write_atomically(target: str, data: bytes, check=None) -> None:
    """``data`` into ``target`` by a rename, so that no reader sees half a file; ``check``
    (the written file's path -> bool) must pass before the rename."""
    temporary = f"{target}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.chmod(temporary, 0o755)
        if check is not None and not check(temporary):
            raise ElfError(f"{temporary}: the written copy does not read back as intended")
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
