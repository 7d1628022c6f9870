"""file_lock: an exclusive lock across processes (DDP ranks, tools started at once) that leaves no file behind."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: callers rely on atomic renames only
    fcntl = None


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive lock held across processes (DDP ranks starting at once) while the block runs.

    The lock file is removed when the block ends, so no empty `.lock` stays beside a tool's output or an
    Index cache entry. Removing a lock file another process is waiting on would let a third process lock
    a new file of the same name at the same time; so a process that gets the lock checks that its open
    file is still the one at `path` (same inode) and otherwise opens `path` again. The holder unlinks
    the file while it still holds the lock, and only then releases it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    while True:
        f = open(path, "a")  # noqa: SIM115 - closed below, after the lock is released
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(current, os.fstat(f.fileno())):
                break  # the file at `path` is the one locked: ours
        except BaseException:
            f.close()
            raise
        f.close()  # the holder before us removed it: lock the file now at `path`
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
