"""Real small filesystems for the faults a disk makes: a tmpfs of a few hundred KiB (full soon), or read-only.
Mounting needs root; without it (or where the container forbids mount) the test is skipped with the reason."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(folder: Path, size: str = "512k", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `folder` (made), read-only if asked; always unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs (mount -t tmpfs) for a real full or read-only disk")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave: int = 0) -> None:
    """Write a file into `folder` until its filesystem has no more than `leave` bytes free."""
    with open(folder / "filler", "wb") as f:
        chunk = b"\0" * 4096
        try:
            while os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize > leave + len(chunk):
                f.write(chunk)
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
