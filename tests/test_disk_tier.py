"""The disk tier on its own: files, checks, the index at start, the budget, the writer."""

import errno
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_radix_plugin.memory import disk_tier
from mlx_radix_plugin.memory.disk_tier import (
    DiskTier,
    DiskTierOff,
    chain_seed,
    clear_tiers,
    list_tiers,
    page_hashes,
)

PS = 4
IDENTITY = {"weights": "w0", "page_size": PS}


def page(value: float, layers: int = 2) -> dict:
    return {
        f"{w}.{i}": ("F32", np.full((PS, 2, 3), value + i, dtype=np.float32))
        for i in range(layers)
        for w in "kv"
    }


def chain(tier: DiskTier, tokens: list[int], value: float = 0.0, seed=()) -> list[str]:
    """Put every whole page of ``tokens`` and wait for the writes."""
    keys = page_hashes(chain_seed(seed), tokens, len(tokens) // PS, PS)
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else ""
        assert tier.put(key, parent, i, tokens[i * PS : (i + 1) * PS], page(value + i))
    assert tier.flush(10)
    return keys


def test_pages_survive_a_restart_and_read_back_equal(tmp_path):
    tokens = list(range(3 * PS))
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20, about={"model": "m"})
    keys = chain(tier, tokens, 1.0)
    assert tier.close(5)
    again = DiskTier(tmp_path, IDENTITY, 1 << 20)
    assert again.stored(keys) == 3 and len(again) == 3
    got = again.read(keys[1], keys[0], tokens[PS : 2 * PS])
    assert set(got) == set(page(0))
    np.testing.assert_array_equal(got["v.1"][1], page(2.0)["v.1"][1])
    assert [t["record"]["model"] for t in list_tiers(tmp_path)] == ["m"]
    assert list_tiers(tmp_path)[0]["pages"] == 3
    again.close()


def test_another_identity_sees_nothing(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, list(range(2 * PS)))
    tier.close()
    for other in ({**IDENTITY, "weights": "w1"}, {**IDENTITY, "page_size": 8}):
        foreign = DiskTier(tmp_path, other, 1 << 20)
        assert foreign.stored(keys) == 0 and len(foreign) == 0
        foreign.close()


def test_salts_start_different_chains():
    tokens = list(range(2 * PS))
    plain = page_hashes(chain_seed(()), tokens, 2, PS)
    salted = page_hashes(chain_seed((("cache_salt", "a"),)), tokens, 2, PS)
    assert not set(plain) & set(salted)
    # A page's hash covers every token before it, not only its own.
    moved = page_hashes(chain_seed(()), [99] + tokens[1:], 2, PS)
    assert moved[1] != plain[1]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "other tokens"])
def test_a_damaged_file_is_a_miss_moved_aside(tmp_path, caplog, damage):
    tokens = list(range(2 * PS))
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, tokens)
    path = tier.path_of(keys[1])
    data = bytearray(path.read_bytes())
    expect = tokens[PS:]
    if damage == "flip a byte":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        expect = [7] * PS
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "mlx_radix"):
        assert tier.read(keys[1], keys[0], expect) is None
    assert "moved aside" in caplog.text
    assert not path.exists() and (tier.dir / "quarantine" / path.name).exists()
    assert tier.stored(keys) == 1 and tier.counters.corrupt == 1
    assert tier.read(keys[0], "", tokens[:PS]) is not None
    tier.close()


@pytest.mark.parametrize("depth", [float("inf"), float("nan"), 1e400, [1], None])
def test_a_header_the_start_cannot_read_is_moved_aside_and_the_rest_served(tmp_path, depth):
    """A header of the right form whose values are not a page's (``"depth": Infinity``
    raised OverflowError, which the start did not count as a bad file: it stopped half-way,
    and the server had no disk tier, at every start)."""
    tokens = list(range(3 * PS))
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, tokens)
    tier.close()
    path = tier.path_of(keys[2])
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["depth"] = depth
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    again = DiskTier(tmp_path, IDENTITY, 1 << 20)
    assert (again.dir / "quarantine" / path.name).exists() and again.counters.corrupt == 1
    assert again.stored(keys) == 2
    assert again.read(keys[1], keys[0], tokens[PS : 2 * PS]) is not None
    again.close()


def test_only_the_servers_user_can_read_the_pages(tmp_path):
    """Folders 0700 and files 0600: the pages hold every tenant's token ids (before, 0755
    folders and 0644 files let every local user read every prompt)."""
    tier = DiskTier(tmp_path / "root", IDENTITY, 1 << 20)
    keys = chain(tier, list(range(2 * PS)))
    tier.close()
    files = [tier.path_of(k) for k in keys] + [tier.dir / "identity.json"]
    folders = [tier.dir] + [f.parent for f in files]
    assert {f.stat().st_mode & 0o777 for f in files} == {0o600}
    assert {d.stat().st_mode & 0o777 for d in folders} == {0o700}


def test_a_tier_folder_left_open_is_closed_at_start(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    tier.close()
    tier.dir.chmod(0o755)
    DiskTier(tmp_path, IDENTITY, 1 << 20).close()
    assert tier.dir.stat().st_mode & 0o777 == 0o700


def test_a_root_others_may_write_in_or_a_linked_tier_folder_turns_the_tier_off(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(DiskTierOff, match="open to other users' writes .mode 777."):
        DiskTier(shared, IDENTITY, 1 << 20)
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    tier = DiskTier(root, IDENTITY, 1 << 20)
    tier.close()
    shutil.rmtree(tier.dir)
    tier.dir.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DiskTierOff, match="is a symbolic link"):
        DiskTier(root, IDENTITY, 1 << 20)
    assert not any(elsewhere.iterdir())


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs chown")
def test_a_root_of_another_user_turns_the_tier_off(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(DiskTierOff, match="belongs to user 12345, not this server's"):
        DiskTier(root, IDENTITY, 1 << 20)


def test_a_second_server_on_the_folder_is_refused_naming_the_first(tmp_path):
    """Two servers on one folder each counted only their own files against the budget and
    evicted each other's: the second is refused (its tier off, the reason logged). A model
    bound again in one process shares the folder with itself."""
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    again = DiskTier(tmp_path, IDENTITY, 1 << 20)  # this process: shared
    again.close()
    code = (
        "import sys; from mlx_radix_plugin.memory.disk_tier import DiskTier, DiskTierOff\n"
        "try:\n    DiskTier(sys.argv[1], {'weights': 'w0', 'page_size': 4}, 1 << 20)\n"
        "except DiskTierOff as e:\n    print(e)"
    )
    second = [sys.executable, "-c", code, str(tmp_path)]
    out = subprocess.run(second, capture_output=True, text=True)
    assert f"is in use by another server (process {os.getpid()})" in out.stdout, out
    tier.close()
    out = subprocess.run(second, capture_output=True, text=True)
    assert out.stdout == "" and out.returncode == 0, out  # free once the first has closed


def test_a_write_killed_midway_is_never_read(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    # The writer stopped between writing a page and naming it, as a kill -9 would.
    written, never = threading.Event(), threading.Event()

    def stalled_replace(src, dst):
        if str(dst).endswith(disk_tier.SUFFIX):
            written.set()
            never.wait(5)
            raise OSError(errno.EIO, "killed")
        return real_replace(src, dst)

    real_replace = disk_tier.os.replace
    monkeypatch.setattr(disk_tier.os, "replace", stalled_replace)
    keys = page_hashes(chain_seed(()), list(range(PS)), 1, PS)
    tier.put(keys[0], "", 0, list(range(PS)), page(0))
    assert written.wait(5)
    [leftover] = tier.path_of(keys[0]).parent.iterdir()
    assert ".tmp" in leftover.name and leftover.stat().st_size > 0
    assert not tier.path_of(keys[0]).exists()
    # A later start by another process (the pid in the name is gone) removes it.
    dead = leftover.with_name(leftover.name.rpartition(".tmp")[0] + ".tmp999999999")
    leftover.rename(dead)
    monkeypatch.undo()
    never.set()
    tier.close()
    again = DiskTier(tmp_path, IDENTITY, 1 << 20)
    assert again.stored(keys) == 0 and not dead.exists()
    again.close()


def test_a_start_leaves_another_live_writers_files_alone(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, list(range(PS)))
    tier.close()
    final = tier.path_of(keys[0])
    live = final.with_name(f"{final.name}.tmp{os.getpid()}")  # this process is alive
    stale = final.with_name(f"{final.name}.tmp1")
    for tmp in (live, stale):
        tmp.write_bytes(b"half a page")
    os.utime(stale, (time.time() - 2 * disk_tier.STALE_TMP_SECONDS,) * 2)
    again = DiskTier(tmp_path, IDENTITY, 1 << 20)
    assert live.exists() and not stale.exists() and again.stored(keys) == 1
    again.close()


def test_a_failing_read_is_a_miss_that_changes_nothing(tmp_path, monkeypatch, caplog):
    tokens = list(range(3 * PS))
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, tokens)
    real_read_header = disk_tier.read_header

    def too_many_open_files(path):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(disk_tier, "read_header", too_many_open_files)
    with caplog.at_level(logging.WARNING, "mlx_radix"):
        for _ in range(2):
            assert tier.read(keys[0], "", tokens[:PS]) is None
    assert caplog.text.count("a miss") == 1
    monkeypatch.setattr(disk_tier, "read_header", real_read_header)
    assert tier.stored(keys) == 3 and tier.counters.corrupt == 0
    assert all(tier.path_of(k).exists() for k in keys)
    assert tier.read(keys[0], "", tokens[:PS]) is not None
    tier.close()


def test_a_bad_file_that_cannot_be_moved_is_still_a_miss(tmp_path, monkeypatch):
    tokens = list(range(2 * PS))
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, tokens)
    tier.path_of(keys[0]).write_bytes(b"\0" * 64)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk_tier.os, "replace", read_only)
    monkeypatch.setattr(disk_tier.Path, "unlink", read_only)
    assert tier.read_chain(keys, ["", keys[0]], [tokens[:PS], tokens[PS:]]) == []
    assert tier.stored(keys) == 0 and tier.counters.corrupt == 1
    monkeypatch.undo()
    tier.close()


def test_a_tier_whose_directory_was_removed_writes_again(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20, about={"model": "m"})
    first = chain(tier, list(range(PS)))
    assert clear_tiers(tmp_path) == [tier.id]  # ``mlx-radix cache clear`` while serving
    assert tier.read(first[0], "", list(range(PS))) is None and tier.enabled
    keys = chain(tier, list(range(100, 100 + PS)))
    assert tier.enabled and tier.path_of(keys[0]).exists()
    assert [t["record"]["model"] for t in list_tiers(tmp_path)] == ["m"]
    tier.close()


def test_a_tier_whose_root_is_gone_turns_off(tmp_path, caplog):
    # A volume unmounted under the server: its mount point stays, the tier's root does not.
    # The tier must not make its root again on whatever file system is left there.
    tier = DiskTier(tmp_path / "volume" / "disk", IDENTITY, 1 << 20)
    chain(tier, list(range(PS)))
    shutil.rmtree(tmp_path / "volume" / "disk")
    keys = page_hashes(chain_seed(()), list(range(100, 100 + PS)), 1, PS)
    with caplog.at_level(logging.WARNING, "mlx_radix"):
        tier.put(keys[0], "", 0, list(range(100, 100 + PS)), page(0))
        tier.flush(5)
    assert not tier.enabled and "is gone" in tier.off_reason
    assert not (tmp_path / "volume" / "disk").exists()
    tier.close()


def test_pages_in_use_outlast_idle_ones_and_no_orphan_is_written(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    hot = chain(tier, list(range(2 * PS)))
    cold = chain(tier, list(range(100, 100 + 2 * PS)))
    one = tier.nbytes // 4
    tier.touch(hot)  # the pool served a prompt through them
    tier.budget_bytes = 5 * one
    chain(tier, list(range(200, 200 + 2 * PS)))
    assert tier.stored(hot) == 2 and tier.stored(cold) < 2
    # A page whose parent the budget evicted while it waited is not written.
    gone = cold[tier.stored(cold)]
    orphan = page_hashes(chain_seed(()), list(range(100, 100 + 3 * PS)), 3, PS)[2]
    assert gone in (cold[0], cold[1])
    tier.put(orphan, cold[1], 2, list(range(100 + 2 * PS, 100 + 3 * PS)), page(0))
    assert tier.flush(5) and orphan not in tier and not tier.path_of(orphan).exists()
    tier.close()


def test_the_budget_drops_least_recent_pages_from_the_ends_of_chains(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    old = chain(tier, list(range(3 * PS)))
    one = tier.nbytes // 3  # a page's file, header and all
    tier.budget_bytes = 5 * one
    new = chain(tier, list(range(100, 100 + 2 * PS)))
    assert tier.stored(old) == 3 and tier.stored(new) == 2
    for i in range(3):  # the old chain is used again
        tier.read(old[i], old[i - 1] if i else "", list(range(i * PS, (i + 1) * PS)))
    chain(tier, list(range(200, 200 + 2 * PS)))
    assert tier.nbytes <= 5 * one
    # The least recent chain went from its end: its first page went last, if at all.
    assert tier.stored(old) == 3 and tier.stored(new) < 2
    assert all(k in tier for k in new[: tier.stored(new)])
    assert len(tier) < 7
    tier.close()


def test_pages_a_lost_page_cut_off_are_dropped_at_start(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, list(range(3 * PS)))
    tier.close()
    tier.path_of(keys[0]).unlink()
    again = DiskTier(tmp_path, IDENTITY, 1 << 20)
    assert len(again) == 0 and not tier.path_of(keys[2]).exists()
    again.close()


def test_a_full_disk_turns_the_tier_off_once(tmp_path, caplog, monkeypatch):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier, "_write_page", full)
    keys = page_hashes(chain_seed(()), list(range(2 * PS)), 2, PS)
    with caplog.at_level(logging.WARNING, "mlx_radix"):
        tier.put(keys[0], "", 0, list(range(PS)), page(0))
        tier.flush(5)
        assert not tier.put(keys[1], keys[0], 1, list(range(PS, 2 * PS)), page(1))
    assert not tier.enabled and "No space left" in tier.off_reason
    assert caplog.text.count("disk tier off") == 1
    tier.close()


def test_an_unwritable_place_refuses_to_start(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierOff, match="cannot be written"):
        DiskTier(tmp_path / "file", IDENTITY, 1 << 20)


def test_a_full_queue_drops_writes_instead_of_waiting(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 30)
    gate = threading.Event()
    write = tier._write_page
    monkeypatch.setattr(tier, "_write_page", lambda *a: gate.wait(10) and write(*a))
    monkeypatch.setattr(disk_tier, "QUEUE_BYTES", 2 * sum(a.nbytes for _, a in page(0).values()))
    keys = page_hashes(chain_seed(()), list(range(6 * PS)), 6, PS)
    accepted = [tier.put(k, "", i, [i] * PS, page(i)) for i, k in enumerate(keys)]
    assert not all(accepted) and tier.counters.writes_dropped >= 1
    gate.set()
    assert tier.flush(10)
    assert tier.counters.pages_written == sum(accepted)
    tier.close()


def test_clear_drops_one_models_tiers(tmp_path):
    for name, weights in (("a", "w0"), ("b", "w1")):
        DiskTier(tmp_path, {**IDENTITY, "weights": weights}, 1 << 20, about={"model": name}).close()
    assert len(clear_tiers(tmp_path, "a")) == 1
    assert [t["record"]["model"] for t in list_tiers(tmp_path)] == ["b"]
    clear_tiers(tmp_path)
    assert list_tiers(tmp_path) == []


class DiskMachine(RuleBasedStateMachine):
    """Chains put, read, restarted and damaged against a reference of what was put: a read
    gives what was put or nothing, never another page; the budget holds; no orphan."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.root = tempfile.mkdtemp()
        self.one = sum(a.nbytes for _, a in page(0, 1).values()) + 1024
        self.tier = DiskTier(self.root, IDENTITY, 6 * self.one)
        self.put_pages: dict[str, tuple[str, list[int], float]] = {}

    @rule(start=st.integers(0, 3), length=st.integers(1, 4), value=st.floats(0, 100))
    def put_chain(self, start, length, value):
        tokens = [start] * PS + list(range(length * PS))[PS:]
        keys = page_hashes(chain_seed(()), tokens, length, PS)
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else ""
            if not self.tier.has(key):  # new, or lost (damaged, evicted): written again
                self.put_pages[key] = (parent, tokens[i * PS : (i + 1) * PS], value + i)
            self.tier.put(key, parent, i, tokens[i * PS : (i + 1) * PS], page(value + i, 1))
        self.tier.flush(10)

    @precondition(lambda self: self.put_pages)
    @rule(data=st.data())
    def read(self, data):
        key = data.draw(st.sampled_from(sorted(self.put_pages)))
        parent, tokens, _ = self.put_pages[key]
        got = self.tier.read(key, parent, tokens)
        assert got is None or set(got) == {"k.0", "v.0"}
        if got is not None:
            # The value last written under this hash: a stored page is never rewritten.
            assert got["k.0"][1][0, 0, 0] == np.float32(self.put_pages[key][2])

    @rule()
    def restart(self):
        self.tier.close(10)
        self.tier = DiskTier(self.root, IDENTITY, 6 * self.one)

    @precondition(lambda self: len(self.tier))
    @rule(data=st.data())
    def damage(self, data):
        key = data.draw(st.sampled_from(sorted(self.tier._entries)))
        path = self.tier.path_of(key)
        path.write_bytes(path.read_bytes()[:-3])

    @invariant()
    def within_budget_and_no_orphans(self):
        assert self.tier.nbytes <= self.tier.budget_bytes
        for entry in self.tier._entries.values():
            assert entry.parent == "" or entry.parent in self.tier._entries

    def teardown(self):
        self.tier.close(5)


TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


def test_a_budget_set_after_start_evicts_from_the_ends_of_chains(tmp_path):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20)
    keys = chain(tier, list(range(3 * PS)))
    tier.set_budget(tier.nbytes // 3 * 2)
    assert tier.stored(keys) == 1 and len(tier) == 1
    assert not tier.path_of(keys[2]).exists() and tier.path_of(keys[0]).exists()
    tier.close()
