"""datamodules.processes.locks.file_lock: it excludes across processes and leaves no lock file behind, in the tools
and the Index cache that use it."""
from __future__ import annotations

import os
import time

from tests.helpers.processes import in_processes


def _hold(rank: int, path: str, seconds: float) -> list[tuple[int, float, str]]:
    from datamodules.processes.locks import file_lock

    with file_lock(path):
        came = (os.getpid(), time.monotonic(), "in")
        time.sleep(seconds)
        left = (os.getpid(), time.monotonic(), "out")
    return [came, left]


def test_file_lock_leaves_no_file_and_still_excludes(tmp_path):
    lock = tmp_path / ".out.lmdb.lock"
    held = in_processes(_hold, 3, str(lock), 0.3, timeout=30)
    events = sorted((event for events in held for event in events), key=lambda e: e[1])
    assert [e[2] for e in events] == ["in", "out"] * 3  # never two holders at once, although each unlinks it
    assert not lock.exists()


def test_tools_and_the_index_cache_leave_no_lock_files(tiny_data, tmp_path, monkeypatch):
    from datamodules.index import load_indexes
    from datamodules.lmdb.pack import main as pack

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    load_indexes(tiny_data)
    assert list((tmp_path / "cache").rglob("*.json")) and not list((tmp_path / "cache").rglob("*.lock"))
    pack(["--src", str(tiny_data), "--dst", str(tmp_path / "out" / "tiny.lmdb"), "--workers", "1"])
    assert (tmp_path / "out" / "tiny.lmdb").exists()
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".lock")]
