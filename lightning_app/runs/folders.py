"""Run folders on disk: `ROOT/version_N/` and the atomic writes every file in them gets."""
from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from lightning_app.errors import UserError

RUN_PATTERN = re.compile(r"^version_(\d+)$")
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"
HPC_GLOB = "hpc_ckpt_*.ckpt"  # Lightning's SLURM requeue save (checkpoint_connector.hpc_save_path)
PREDICTIONS_CSV = "predictions.csv"  # predict's result in its folder (lightning_app/callbacks/predictions.py writes it)


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}@{socket.gethostname()}.tmp")  # its writer: runs/lock.py
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


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes for this user on the filesystem of `path` or its nearest existing parent; None when unknown."""
    path = Path(path).absolute()
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def unwritable_root(root: str | os.PathLike, error: OSError) -> UserError:
    """A file system error while the run folder is made (a read-only mount, no permission, a full disk) as one
    paragraph (UserError: exit status 2) naming the root, the file and the reason."""
    where = error.filename or f"a file under {root}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(error.filename or root)
        reason = (f"its filesystem is full ({'over quota; ' if error.errno == errno.EDQUOT else ''}"
                  f"{'?' if free is None else f'{free:,}'} bytes free)")
        fix = "free space there"
    elif error.errno == errno.EROFS:
        reason, fix = "it is on a read-only filesystem", "mount it writable"
    elif error.errno in (errno.EACCES, errno.EPERM):
        reason, fix = "this user may not write there", "give this user write access to it"
    else:
        reason, fix = error.strerror or str(error), "check that folder"
    return UserError(f"Cannot start the run under {root}: writing {where} failed: {reason}. Train into another "
                     f"folder with --trainer.default_root_dir DIR, or {fix}.")
