"""Run folders on disk: `ROOT/version_N/` and the atomic writes every file in them gets."""
from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

RUN_PATTERN = re.compile(r"^version_(\d+)$")
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"
HPC_GLOB = "hpc_ckpt_*.ckpt"  # Lightning's SLURM requeue save (checkpoint_connector.hpc_save_path)


def run_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(N, ROOT/version_N) for every run folder under root, by N."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = RUN_PATTERN.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def new_run(root: str | os.PathLike) -> tuple[int, Path]:
    """Create the next ROOT/version_N (mkdir is atomic: a concurrent start takes N+1)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    runs = run_dirs(root)
    return _mkdir_next(root, "version_{}", runs[-1][0] + 1 if runs else 0)


def new_subfolder(parent: str | os.PathLike, prefix: str) -> Path:
    """PARENT/PREFIX_K with the next free K, made atomically: every validate/test/predict gets its own."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for c in parent.iterdir() if (m := re.match(rf"^{re.escape(prefix)}_(\d+)$", c.name))]
    return _mkdir_next(parent, prefix + "_{}", max(taken) + 1 if taken else 0)[1]


def _mkdir_next(parent: Path, pattern: str, n: int) -> tuple[int, Path]:
    while True:
        path = parent / pattern.format(n)
        try:
            path.mkdir()
            return n, path
        except FileExistsError:
            n += 1


def run_of_checkpoint(ckpt_path: str | os.PathLike) -> tuple[int, Path] | None:
    """(N, run folder) when ckpt_path lies in `<root>/version_N/checkpoints/` (or, as Lightning's
    SLURM hpc_ckpt_K.ckpt, in `<root>/version_N/` itself), else None. Any root: logs follow the checkpoint."""
    path = Path(ckpt_path).resolve()
    run = path.parent.parent if path.parent.name == CHECKPOINTS else path.parent
    m = RUN_PATTERN.match(run.name)
    return (int(m.group(1)), run) if m else None


def write_atomically(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Temp file beside `path`, fsync, os.replace, fsync of the folder: a kill leaves the old file or the new
    one. `data` is the bytes, or a function that writes them into the open file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}@{socket.gethostname()}.tmp")  # its writer: runs/leftovers.py
    try:
        with open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)
