"""Temp files of writes whose process was killed (write_atomically's `.NAME.PID@HOST.tmp`, runs/folders.py), removed
by the process that takes the run's lock (runs/plan.py), and said once.

A temp file is removed when its writer ran on this host and that pid no longer runs. A name without a host (one
written before the host was part of it) counts as written by the lock's previous owner's host: only the lock's
holder writes into a run folder. A live pid keeps its file (it may be another process's that reused the pid: the
safe side). A file whose writer ran on another host is left: this host cannot tell whether it still runs.

A complete temp checkpoint newer than last.ckpt is removed too, never renamed into place. Its writer died before the
fsync and rename that make a save count (write_atomically): a zip directory at its end shows that torch.save
returned, not that its bytes reached the disk; last.ckpt is the state the rest of the run agrees with (the best
checkpoint beside it, the step TensorBoard purges from on resume, the loader's position); and a kill a moment
earlier would have lost the same interval. So a resume always goes on from the last save that completed.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from lightning_app.runs.folders import CHECKPOINTS
from lightning_app.runs.lock import alive

TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)(?:@(?P<host>[^/]+))?\.tmp$")


def remove_dead_writers_files(run_dir: str | os.PathLike, previous_owner_host: str | None) -> str | None:
    """Remove the temp files in the run folder and its checkpoints/ whose writer on this host has ended; the line
    that says so, or None when there were none."""
    here, removed, size = socket.gethostname(), [], 0
    run_dir = Path(run_dir)
    for folder in (run_dir, run_dir / CHECKPOINTS):
        try:
            names = [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
        except OSError:
            continue
        for path in sorted(names):
            found = TEMP_NAME.match(path.name)
            if found is None:
                continue
            pid, host = int(found["pid"]), found["host"] or previous_owner_host
            if host != here or pid == os.getpid() or alive(pid):
                continue
            try:
                size += path.stat().st_size
                path.unlink()
            except OSError:
                continue
            removed.append(f"{path.name} (pid {pid})")
    if not removed:
        return None
    return (f"removed {len(removed)} temp file{'s' if len(removed) > 1 else ''} of writes whose process ended before "
            f"renaming them into place ({size / 2**20:,.1f} MiB, in {run_dir}): {', '.join(removed)}. A save that "
            "never reached its rename is never resumed from, even a complete one (docs/clusters.md, \"Faults\").")
