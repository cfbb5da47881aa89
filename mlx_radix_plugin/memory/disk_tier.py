"""The disk tier: K/V pages on disk under a byte budget, found by a hash of their prefix.

One file a page: the page's K/V for every layer, in safetensors layout, named by the page's
*chain hash*, a hash of the hash before it and the page's tokens (vLLM's block hash), so a
prompt's pages are looked up page by page from its start, and a page is stored once
whatever prompts share it. The chain starts from a seed per namespace (what a request's
key adds to the model's: its cache salt), so salts never share on disk either.

Every entry lives under a directory named by the *identity* of what computed it: a
fingerprint of the weights, the K/V dtype, the page size, the layer geometry and this
format's version. Another model, quantization or page size looks in another directory and
sees nothing. The header of each file repeats its identity, hash, parent, depth and tokens,
and a CRC-32 of its data: a file that is truncated, corrupt or foreign fails the check, is
logged once, moved aside (``quarantine/``) and served as a miss.

A hybrid model's recurrent state at the end of a page is an entry of its own (``state``),
named by a hash of that page's, with the page as its parent and no tokens: a leaf that
eviction takes before its page, and that no chain's tokens include.

Writes run on a thread of their own, from host (numpy) arrays the caller hands over: no
MLX work, and a queue bounded in bytes that drops a write rather than wait. A file is
written under a temporary name and renamed when complete, so a process killed mid-write
leaves no file that reads as valid (the leftovers are removed at the next start). A full or
read-only disk turns the tier off with one warning; the server goes on without it.

The index is the files' own headers, read at start (about 20 us a file), plus the files'
modification times for the LRU order, which a hit refreshes. Eviction takes the least
recently used page that no stored page follows, as the radix tree does, so a chain is
never broken by it; a page that is lost otherwise (a corrupt file) takes the pages after
it along, since no lookup could reach them again.

The files hold every tenant's token ids: folders are made 0700 and files 0600, a folder of
the server's user open to others is closed to them at start, and a root owned by another
user, or a tier folder that is a symbolic link, turns the tier off with a clear error
(before, every local user could read every prompt, and writes followed links).

Pure Python and numpy (no MLX): tested on its own.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISLNK

import numpy as np

log = logging.getLogger("mlx_radix")

FORMAT = "mlx-radix-page/1"
SUFFIX = ".safetensors"
# safetensors dtype names of the K/V dtypes, and the numpy type their bytes are held in
# (numpy has no bfloat16: its bits travel as uint16).
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
# Bytes of pages waiting to be written before more are dropped: a burst of prefills
# outruns a disk, and a step must never wait for one.
QUEUE_BYTES = 256 << 20
# Threads reading a chain's pages at once: a read is I/O and a CRC-32, both without the GIL
# (on the H200's host a single reader restored 8B's pages at 0.56 GB/s).
READERS = min(8, os.cpu_count() or 1)
# When the budget is exceeded, entries go until this share of it is used, so that a full
# tier does not evict on every write.
LOW_WATER = 0.9
# A use refreshes a file's modification time (the LRU order a restart reads) once in this
# long: a prompt's hit touches each of its pages, thousands for a long one.
SYNC_SECONDS = 60.0
# Files kept in ``quarantine/`` (a flaky disk must not fill it): the oldest go first.
QUARANTINE_MOST = 64
# A temporary file older than this is a write a kill interrupted, whatever process named it
# (a live write takes milliseconds; another live process's is left alone, see ``_scan``).
STALE_TMP_SECONDS = 60
# What a header that fails its checks raises: not a page, a miss (an OSError is the disk's,
# not the file's: a miss too, but the file stays).
# (ArithmeticError: a depth of Infinity, which JSON's reader takes, is an OverflowError in int.)
BAD_FILE = (ValueError, KeyError, TypeError, RecursionError, ArithmeticError)


# What ``DiskTier.stats`` reports (the server's stats and metrics show them).
DISK_STATS = (
    "disk_enabled",
    "disk_hits",
    "disk_pages_read",
    "disk_pages_written",
    "disk_writes_dropped",
    "disk_corrupt",
    "disk_pages",
    "disk_states",
    "disk_bytes",
    "disk_bytes_max",
    "disk_restore_seconds",
)


class DiskTierOff(RuntimeError):
    """The tier was turned off (a full or read-only disk); ``str()`` says why."""


def own_root(root: Path) -> None:
    """Make the tier's root folder if need be (0700); ``DiskTierOff`` if it is another
    user's, or others may write in it (they could put a link where a tier's folder goes).
    A root that exists is left as it is: it may be a folder of the user's choosing."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise DiskTierOff(
            f"{root} belongs to user {st.st_uid}, not this server's ({os.getuid()}): its pages "
            "would be another user's to read and change; choose a folder of your own"
        )
    if st.st_mode & 0o022:
        raise DiskTierOff(
            f"{root} is open to other users' writes (mode {st.st_mode & 0o7777:o}): "
            f"`chmod go-w {root}` or choose another folder"
        )


def private_dir(path: Path) -> None:
    """Make ``path``, a folder of the tier's own, one only this user can enter (0700, closed
    to others if it was open); ``DiskTierOff`` if it is a symbolic link or another user's."""
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if S_ISLNK(st.st_mode):
        raise DiskTierOff(f"{path} is a symbolic link: the disk tier writes in folders of its own")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise DiskTierOff(f"{path} belongs to user {st.st_uid}, not this server's ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


# Tier folders this process holds the lock of, and how many of its tiers use each: a model
# bound again in the same process shares the folder with itself.
_held: dict[Path, list] = {}
_held_lock = threading.Lock()


def hold_folder(folder: Path) -> None:
    """Take ``folder``'s lock (``lock``, holding the holder's pid) for this process, or raise
    ``DiskTierOff`` naming the process that has it: two servers on one folder each counted
    only their own files against the budget and evicted each other's."""
    try:
        import fcntl
    except ImportError:  # no advisory locks here: as before
        return
    with _held_lock:
        if folder in _held:
            _held[folder][1] += 1
            return
        lock = folder / "lock"
        f = os.fdopen(
            os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600), "r+"
        )
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = f.read().strip() or "unknown"
            f.close()
            raise DiskTierOff(
                f"{folder} is in use by another server (process {holder}); give this one "
                "another radix.disk.dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _held[folder] = [f, 1]


def release_folder(folder: Path) -> None:
    with _held_lock:
        held = _held.get(folder)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _held[folder]
            held[0].close()  # the lock goes with the file


def _create_private(path: Path):
    """A new file at ``path`` that only this user can read, never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    path.unlink(missing_ok=True)  # a leftover of a process with this pid
    return os.fdopen(os.open(path, flags, 0o600), "wb")


def identity_id(identity: Mapping) -> str:
    """The directory name of an identity: a hash of its canonical JSON."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def chain_seed(extra: Hashable) -> bytes:
    """Where the chain of a namespace starts: ``extra`` is what its key adds to the model's."""
    return hashlib.blake2b(repr(extra).encode(), digest_size=16).digest()


def state_key(page_key: str) -> str:
    """The key of a hybrid model's recurrent state at the end of page ``page_key``."""
    return hashlib.blake2b(f"{page_key}/state".encode(), digest_size=16).hexdigest()


def page_hashes(seed: bytes, tokens: Sequence[int], n_pages: int, page_size: int) -> list[str]:
    """The chain hashes of the first ``n_pages`` whole pages of ``tokens``."""
    out, h = [], seed
    data = np.asarray(tokens[: n_pages * page_size], dtype="<i8").tobytes()
    step = page_size * 8
    for i in range(n_pages):
        h = hashlib.blake2b(h + data[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(h.hex())
    return out


@dataclass
class Entry:
    parent: str
    depth: int  # pages before this one in its chain
    nbytes: int
    stamp: float  # last use
    synced: float = 0.0  # the last use the file's modification time says
    # A hybrid model's recurrent state at the end of its parent page, not a page: a leaf
    # that goes before its page, and no part of a chain's tokens.
    state: bool = False


@dataclass
class DiskCounters:
    hits: int = 0  # fetches that read at least one page back
    pages_read: int = 0
    pages_written: int = 0
    writes_dropped: int = 0  # the queue was full
    corrupt: int = 0  # files that failed their check, moved aside
    restore_seconds: float = 0.0


def _encode(tensors: Mapping[str, tuple[str, np.ndarray]], metadata: dict) -> tuple[bytes, list]:
    """The safetensors header (CRC-32 of the data in the metadata) and the data pieces."""
    header, pieces, offset, crc = {}, [], 0, 0
    for name, (dtype, array) in tensors.items():
        a = np.ascontiguousarray(array)
        n = a.nbytes
        header[name] = {
            "dtype": dtype,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + n],
        }
        view = memoryview(a).cast("B")
        crc = zlib.crc32(view, crc)
        pieces.append(view)
        offset += n
    header["__metadata__"] = {**metadata, "crc32": str(crc)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, pieces


def read_header(path: Path) -> tuple[dict, int]:
    """A file's safetensors header and where its data starts; ValueError if malformed."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a header")
        (n,) = struct.unpack("<Q", head)
        if n > 1 << 24:
            raise ValueError(f"header of {n} bytes")
        text = f.read(n)
    if len(text) != n:
        raise ValueError("truncated header")
    header = json.loads(text)
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("no metadata")
    return header, 8 + n


def _unlink(paths: Sequence[Path]) -> None:
    """Delete ``paths``; one that cannot be deleted stays (the index has let go of it)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def _abandoned(tmp: Path) -> bool:
    """Whether temporary file ``tmp`` (``NAME.tmpPID``) is a write that will never finish:
    its process is gone, or it is old. Another process's live write (``mlx-radix cache
    warm`` beside a server) is left alone."""
    try:
        if time.time() - tmp.stat().st_mtime > STALE_TMP_SECONDS:
            return True
        os.kill(int(tmp.name.rpartition(".tmp")[2]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):  # PermissionError: alive, another user's
        return False
    return False


class DiskTier:
    def __init__(
        self,
        root: Path | str,
        identity: Mapping,
        budget_bytes: int,
        about: Mapping | None = None,
    ):
        """Pages of ``identity`` under ``root``, at most ``budget_bytes`` of them;
        ``about`` (the model's name, say) is written beside them for ``list_tiers``, and is
        no part of the identity.

        Raises ``DiskTierOff`` if the directory cannot be made or written."""
        self.identity = dict(identity)
        self.id = identity_id(self.identity)
        self.dir = Path(root).expanduser() / self.id
        self.budget_bytes = budget_bytes
        self.counters = DiskCounters()
        self.off_reason: str | None = None
        self._entries: dict[str, Entry] = {}
        self._children: dict[str, set[str]] = {}
        self._bytes = 0
        self._states = 0  # entries that are recurrent states
        self._lock = threading.Lock()
        self._queue: deque[tuple] = deque()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._busy = False
        self._closing = False
        self._touched: dict[str, float] = {}  # stamps refreshed in memory, not yet on disk
        self._read_failing = False  # an OSError on a read has been logged
        try:
            own_root(self.dir.parent)
            private_dir(self.dir)
            hold_folder(self.dir)
            self._record = json.dumps({"identity": self.identity, **dict(about or {})}, indent=1)
            if about is not None or not (self.dir / "identity.json").exists():
                self._write_atomic(self.dir / "identity.json", self._record)
            self._scan()
        except OSError as e:
            release_folder(self.dir)
            raise DiskTierOff(f"{self.dir} cannot be written: {e.strerror or e}") from None
        self._thread = threading.Thread(target=self._writer, name="mlx-radix-disk", daemon=True)
        self._thread.start()

    # -- sizes -----------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def has_states(self) -> bool:
        """Whether any recurrent state (a hybrid model's) is stored."""
        return self._states > 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def has(self, key: str) -> bool:
        """Whether page ``key`` is stored or queued to be."""
        with self._lock:
            return key in self._entries or key in self._queued

    def sample(self, n: int) -> list[str]:
        """Up to ``n`` of the most recently used pages."""
        with self._lock:
            pages = [k for k, e in self._entries.items() if not e.state]
            return heapq.nlargest(n, pages, key=lambda k: self._entries[k].stamp)

    def recent_leaves(self) -> list[str]:
        """The pages no stored page follows (sequences' ends), most recently used first."""
        with self._lock:
            leaves = [
                k
                for k, e in self._entries.items()
                if not e.state and all(self._entries[c].state for c in self._children.get(k, ()))
            ]
            return sorted(leaves, key=lambda k: -self._entries[k].stamp)

    def chain_tokens(self, key: str) -> list[int] | None:
        """Every token up to the end of page ``key``, from the headers of its chain; None if
        the chain is broken."""
        runs = []
        while key:
            parent, tokens = self.chain_of(key)
            if not tokens:
                return None
            runs.append(tokens)
            key = parent
        return [t for run in reversed(runs) for t in run]

    def chain_of(self, key: str) -> tuple[str, list[int]]:
        """Page ``key``'s parent and tokens, from its file's header (for reads outside a
        lookup, which knows them)."""
        try:
            meta = read_header(self.path_of(key))[0]["__metadata__"]
            parent, tokens = meta["parent"], json.loads(meta["tokens"])
            if not isinstance(parent, str) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("not a page's header")
            return parent, tokens
        except (OSError, *BAD_FILE):
            return "", []

    def path_of(self, key: str) -> Path:
        return self.dir / key[:2] / (key + SUFFIX)

    # -- start: the index from the files --------------------------------------------

    def _scan(self) -> None:
        for sub in sorted(p for p in self.dir.iterdir() if p.is_dir() and len(p.name) == 2):
            for path in sub.iterdir():
                if path.suffix != SUFFIX:
                    if ".tmp" in path.name and _abandoned(path):
                        path.unlink(missing_ok=True)
                    continue
                try:
                    header, _ = read_header(path)
                    meta = header["__metadata__"]
                    if meta.get("format") != FORMAT or meta.get("identity") != self.id:
                        raise ValueError("not a page of this identity")
                    key = meta["hash"]
                    if path.name != key + SUFFIX:
                        raise ValueError("named for another hash")
                    stat = path.stat()
                    parent = meta["parent"]
                    if not isinstance(parent, str) or not isinstance(key, str):
                        raise ValueError("hashes are not strings")
                    mtime = stat.st_mtime
                    state = meta.get("kind") == "state"
                    entry = Entry(parent, int(meta["depth"]), stat.st_size, mtime, mtime, state)
                except (OSError, *BAD_FILE) as e:
                    self._quarantine(path, f"unreadable at start ({e})")
                    continue
                self._add(key, entry)
        self._drop_orphans()
        _unlink(self._evict_over_budget())

    def _add(self, key: str, entry: Entry) -> None:
        self._entries[key] = entry
        self._children.setdefault(entry.parent, set()).add(key)
        self._bytes += entry.nbytes
        self._states += entry.state

    # -- lookups and reads (the generation thread) ------------------------------------

    def stored(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are on disk."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._entries:
                    break
                n += 1
        return n

    def read(
        self, key: str, parent: str, tokens: Sequence[int]
    ) -> dict[str, tuple[str, np.ndarray]] | None:
        """The tensors of page ``key``, which must follow ``parent`` and hold ``tokens``;
        None (and the file moved aside) if it fails its check."""
        path = self.path_of(key)
        try:
            header, start = read_header(path)
            meta = header.pop("__metadata__")
            if (
                meta.get("format") != FORMAT
                or meta.get("identity") != self.id
                or meta.get("hash") != key
                or meta.get("parent") != parent
                or json.loads(meta.get("tokens", "null")) != list(tokens)
            ):
                raise ValueError("its header names another page")
            data = np.fromfile(path, dtype=np.uint8, offset=start)
            if zlib.crc32(data) != int(meta["crc32"]):
                raise ValueError("checksum mismatch")
            out = {}
            for name, spec in header.items():
                lo, hi = spec["data_offsets"]
                if not 0 <= lo <= hi <= data.size:
                    raise ValueError(f"tensor {name} runs past the file")
                out[name] = (
                    spec["dtype"],
                    data[lo:hi].view(DTYPES[spec["dtype"]]).reshape(spec["shape"]),
                )
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            # The disk's trouble, not the file's (too many open files, an I/O error): a
            # miss that changes nothing on disk, logged once.
            if not self._read_failing:
                self._read_failing = True
                log.warning("disk tier: reading %s failed (%s): a miss", path.name, e)
            return None
        except BAD_FILE as e:
            self._quarantine(path, str(e))
            self._forget(key)
            return None
        self.touch([key])
        return out

    def read_chain(
        self, keys: Sequence[str], parents: Sequence[str], tokens: Sequence[Sequence[int]]
    ) -> list[dict]:
        """The pages ``keys`` in order, read by up to ``READERS`` threads (file reads and
        CRC-32 let go of the GIL), up to the first that fails its check."""
        if len(keys) < 2:
            pages = [self.read(k, p, t) for k, p, t in zip(keys, parents, tokens)]
        else:
            with ThreadPoolExecutor(min(READERS, len(keys))) as pool:
                pages = list(pool.map(self.read, keys, parents, tokens))
        n = next((i for i, page in enumerate(pages) if page is None), len(pages))
        return pages[:n]

    def _quarantine(self, path: Path, why: str) -> None:
        self.counters.corrupt += 1
        log.warning("disk tier: %s is not a valid page (%s): moved aside, a miss", path.name, why)
        aside = self.dir / "quarantine"
        try:
            private_dir(aside)
            os.replace(path, aside / path.name)
            # By the time each was moved aside (a move keeps a file's modification time).
            kept = sorted(aside.iterdir(), key=lambda p: p.stat().st_ctime)
            _unlink(kept[:-QUARANTINE_MOST])
        except OSError:
            _unlink([path])  # where it cannot be moved either, the index forgets it

    def _forget(self, key: str) -> None:
        with self._lock:
            doomed = self._drop(key, unlink=False)
        _unlink(doomed)

    def touch(self, keys: Sequence[str]) -> None:
        """Mark the stored ``keys`` as just used (pages the pool hit, a read): in the LRU
        order now, on disk (the files' times) by the writer."""
        now = time.time()
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.stamp = now
                    if now - entry.synced > SYNC_SECONDS:
                        entry.synced = now
                        self._touched[key] = now
            if self._touched:
                self._wake.notify()

    # -- writes ----------------------------------------------------------------------

    def put(
        self,
        key: str,
        parent: str,
        depth: int,
        tokens: Sequence[int],
        tensors: Mapping[str, tuple[str, np.ndarray]],
        state: bool = False,
    ) -> bool:
        """Queue page ``key`` for writing (``state``: a recurrent state at the end of page
        ``parent``, with no tokens); False if it was dropped (the queue is full or the tier
        is off). Already stored or queued: True, nothing queued."""
        nbytes = sum(a.nbytes for _, a in tensors.values())
        with self._lock:
            if self.off_reason is not None:
                return False
            if key in self._entries or key in self._queued:
                return True
            if self._queued_bytes + nbytes > QUEUE_BYTES and self._queue:
                self.counters.writes_dropped += 1
                return False
            self._queue.append((key, parent, depth, list(tokens), dict(tensors), nbytes, state))
            self._queued.add(key)
            self._queued_bytes += nbytes
            self._wake.notify()
        return True

    def queue_empty(self) -> bool:
        with self._lock:
            return not self._queue

    def chain_pages(self, page_bytes: int) -> int:
        """The most pages of one chain worth writing, ``page_bytes`` of K/V each: half the
        budget, counting the files as large as those stored (headers included), so that a
        chain does not evict its own start as it is written."""
        with self._lock:
            file_bytes = max(page_bytes, self._bytes // max(1, len(self._entries)))
        return int(self.budget_bytes * LOW_WATER / 2 // file_bytes)

    def count_dropped(self, n: int) -> None:
        """Count ``n`` pages whose writes were dropped before they reached the queue."""
        with self._lock:
            self.counters.writes_dropped += n

    def has_room(self) -> bool:
        """Whether the write queue is under half full (and the tier on)."""
        with self._lock:
            return self.off_reason is None and self._queued_bytes < QUEUE_BYTES // 2

    def set_budget(self, budget_bytes: int) -> None:
        """Hold at most ``budget_bytes`` from now on, evicting what is over it."""
        with self._lock:
            self.budget_bytes = budget_bytes
            doomed = self._evict_over_budget()
        _unlink(doomed)

    def room(self) -> int:
        """Bytes the write queue takes before it drops writes (0 with the tier off)."""
        with self._lock:
            return 0 if self.off_reason is not None else max(0, QUEUE_BYTES - self._queued_bytes)

    def wait_for_room(self, deadline: float) -> bool:
        """Wait until the write queue is at most half full, or until ``deadline``
        (``time.monotonic()``); whether it is (and the tier on)."""
        with self._lock:
            while self.off_reason is None and self._queued_bytes > QUEUE_BYTES // 2:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._room.wait(left)
            return self.off_reason is None and self._queued_bytes <= QUEUE_BYTES // 2

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (for at most ``timeout`` seconds), then stop the writer."""
        done = self.flush(timeout)
        with self._lock:
            self._closing = True
            self._queue.clear()
            self._queued.clear()
            self._queued_bytes = 0
            self._wake.notify()
        self._thread.join(timeout=5)
        release_folder(self.dir)
        return done

    def _writer(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._touched and not self._closing:
                    self._idle.notify_all()
                    self._wake.wait()
                if self._closing:
                    self._idle.notify_all()
                    return
                touched, self._touched = self._touched, {}
                job = self._queue.popleft() if self._queue else None
                # A page whose parent went (the budget evicted it while this one waited)
                # could never be reached: not written.
                orphan = job is not None and job[1] and job[1] not in self._entries
                orphan = orphan and job[1] not in self._queued
                self._busy = True
            for key, stamp in touched.items():
                try:
                    os.utime(self.path_of(key), (stamp, stamp))  # the LRU order survives a restart
                except OSError:
                    pass
            doomed, size, lost = [], None, orphan
            if job is not None and not orphan:
                key, parent, depth, tokens, tensors, nbytes, state = job
                try:
                    size = self._write_page(key, parent, depth, tokens, tensors, state)
                except FileNotFoundError as e:
                    if self.dir.parent.is_dir():
                        # Our temporary file was removed under us (``cache clear`` while
                        # serving): this write is lost, the tier is not at fault.
                        lost = True
                    else:  # the tier's root went (a volume unmounted)
                        self._turn_off(f"{self.dir.parent} is gone: {e.strerror or e}")
                except Exception as e:  # a full or read-only disk, or anything unforeseen
                    why = e.strerror if isinstance(e, OSError) and e.strerror else e
                    self._turn_off(f"writing {self.path_of(key)} failed: {why}")
            with self._lock:
                self._busy = False
                if job is not None:
                    key, parent, depth, _, _, nbytes, state = job
                    self._queued.discard(key)
                    self._queued_bytes -= nbytes
                    self._room.notify_all()
                    if lost:
                        self.counters.writes_dropped += 1
                    if size is not None and self.off_reason is None:
                        now = time.time()
                        self._add(key, Entry(parent, depth, size, now, now, state))
                        self.counters.pages_written += 1
                        doomed = self._evict_over_budget()
                if not self._queue:
                    self._idle.notify_all()
            # Deleted outside the lock: thousands of unlinks would hold up the generation
            # thread's lookups (612 took 38 ms). Only this thread writes files, and a page
            # dropped here is no longer stored, so no write of it can be under way.
            _unlink(doomed)

    def _write_page(self, key, parent, depth, tokens, tensors, state=False) -> int:
        metadata = {
            "format": FORMAT,
            "identity": self.id,
            "hash": key,
            "parent": parent,
            "depth": str(depth),
            "tokens": json.dumps(list(tokens)),
            **({"kind": "state"} if state else {}),
        }
        head, pieces = _encode(tensors, metadata)
        path = self.path_of(key)
        if not path.parent.is_dir():
            # The tier's own directory was removed (``cache clear`` while serving): made
            # again, but not its root, which may be a volume no longer mounted.
            private_dir(self.dir)
            private_dir(path.parent)
            if not (self.dir / "identity.json").exists():
                self._write_atomic(self.dir / "identity.json", self._record)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with _create_private(tmp) as f:
                f.write(head)
                for piece in pieces:
                    f.write(piece)
            os.replace(tmp, path)
        except BaseException:
            _unlink([tmp])  # a full disk keeps no half-written page
            raise
        return len(head) + sum(p.nbytes for p in pieces)

    def _write_atomic(self, path: Path, text: str) -> None:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with _create_private(tmp) as f:
            f.write(text.encode())
        os.replace(tmp, path)

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self.off_reason is not None:
                return
            self.off_reason = why
            self._queue.clear()
            self._queued.clear()
            self._queued_bytes = 0
            self._room.notify_all()
        log.warning("disk tier off: %s; the server goes on without it", why)

    # -- budget ----------------------------------------------------------------------

    def _evict_over_budget(self) -> list[Path]:
        """Drop the least recently used leaves (a page no stored page follows), and the
        pages they leave as leaves, down to ``LOW_WATER`` of the budget: as the radix tree
        evicts, so a page never goes before the pages after it. Called with the lock held;
        returns the files to delete."""
        doomed: list[Path] = []
        if self._bytes <= self.budget_bytes:
            return doomed
        target = self.budget_bytes * LOW_WATER
        heap = [(e.stamp, k) for k, e in self._entries.items() if k not in self._children]
        heapq.heapify(heap)
        while heap and self._bytes > target:
            _, key = heapq.heappop(heap)
            parent = self._entries[key].parent
            doomed += self._drop(key, unlink=True)
            if parent in self._entries and parent not in self._children:
                heapq.heappush(heap, (self._entries[parent].stamp, parent))
        return doomed

    def _drop_orphans(self) -> None:
        """Drop the pages whose chain is broken (a page before them is gone): no lookup
        can reach them."""
        reachable, stack = set(), list(self._children.get("", ()))
        while stack:
            key = stack.pop()
            reachable.add(key)
            stack.extend(self._children.get(key, ()))
        for key in [k for k in self._entries if k not in reachable]:
            _unlink(self._drop(key, unlink=True))

    def _drop(self, key: str, unlink: bool) -> list[Path]:
        """Remove ``key`` and the pages after it from the index; returns their files to
        delete (``key``'s too if ``unlink``)."""
        doomed, stack = [], [(key, unlink)]
        while stack:
            k, remove = stack.pop()
            entry = self._entries.pop(k, None)
            if entry is None:
                continue
            self._bytes -= entry.nbytes
            self._states -= entry.state
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(k)
                if not siblings:
                    del self._children[entry.parent]
            stack.extend((child, True) for child in self._children.pop(k, ()))
            if remove:
                doomed.append(self.path_of(k))
        return doomed

    # -- whole tiers (the CLI) --------------------------------------------------------

    def stats(self) -> dict:
        c = self.counters
        return {
            "disk_enabled": int(self.enabled),
            "disk_hits": c.hits,
            "disk_pages_read": c.pages_read,
            "disk_pages_written": c.pages_written,
            "disk_writes_dropped": c.writes_dropped,
            "disk_corrupt": c.corrupt,
            "disk_pages": len(self._entries) - self._states,
            "disk_states": self._states,
            "disk_bytes": self._bytes,
            "disk_bytes_max": self.budget_bytes,
            "disk_restore_seconds": round(c.restore_seconds, 6),
        }


def list_tiers(root: Path | str) -> list[dict]:
    """Every identity under ``root``: its identity record, its pages and their bytes."""
    root = Path(root).expanduser()
    out = []
    if not root.is_dir():
        return out
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            record = json.loads((d / "identity.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        sizes = _page_sizes(d)
        tier = {"id": d.name, "dir": str(d), "record": record}
        out.append({**tier, "pages": len(sizes), "bytes": sum(sizes)})
    return out


def _page_sizes(tier_dir: Path) -> list[int]:
    """The sizes of the page files under one identity's directory. A running server adds
    and evicts files while this reads: what is gone is skipped."""
    sizes = []
    try:
        subs = [sub for sub in tier_dir.iterdir() if sub.is_dir() and len(sub.name) == 2]
    except OSError:
        return sizes
    for sub in subs:
        try:
            files = list(sub.glob("*" + SUFFIX))
        except OSError:
            continue
        for f in files:
            try:
                sizes.append(f.stat().st_size)
            except OSError:
                pass
    return sizes


def clear_tiers(root: Path | str, model: str | None = None) -> list[str]:
    """Delete the tiers under ``root`` (only those whose identity's model ends with
    ``model``'s name, if given); returns the ids removed."""
    removed = []
    for tier in list_tiers(root):
        name = str(tier["record"].get("model") or "")
        if model is not None and Path(name).name != Path(model).name and tier["id"] != model:
            continue
        shutil.rmtree(tier["dir"], ignore_errors=True)
        removed.append(tier["id"])
    return removed
