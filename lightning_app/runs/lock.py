"""`version_N/.lock`: the one process that may write into a run folder, and how a dead owner's lock is taken.

The lock is written complete into a temp file, then hard-linked into place (`os.link` fails when the
name exists, so two launches at the same instant cannot both hold it). While the run lives a thread
refreshes the lock's mtime (its heartbeat). A lock is taken over, with one line saying so, when
- its owner ran on this host and that process is gone;
- SLURM requeued the job that holds it (the previous attempt is over);
- torchrun restarted the worker group that holds it (the agents stop every worker of the group before the next
  rendezvous, torch/distributed/elastic/agent/server/api.py `_restart_workers`, so its owner is gone even on
  another host);
- its heartbeat is older than STALE_S, from any host (a restarted pod, a node that died).
Ages are measured against a file written just now in the same folder, so only the file server's clock counts.

The process that takes the lock also removes the temp files (write_atomically's `.NAME.PID@HOST.tmp`) of writes
whose process was killed, and says so once (`remove_dead_writers_files`, below). A temp file is removed when its
writer ran on this host and that pid no longer runs. A name without a host (one written before the host was part of
it) counts as written by the lock's previous owner's host: only the lock's holder writes into a run folder. A live
pid keeps its file (it may be another process's that reused the pid: the safe side). A file whose writer ran on
another host is left: this host cannot tell whether it still runs.

A complete temp checkpoint newer than last.ckpt is removed too, never renamed into place. Its writer died before the
fsync and rename that make a save count (write_atomically): a zip directory at its end shows that torch.save
returned, not that its bytes reached the disk; last.ckpt is the state the rest of the run agrees with (the best
checkpoint beside it, the step TensorBoard purges from on resume, the loader's position); and a kill a moment
earlier would have lost the same interval. So a resume always goes on from the last save that completed.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
from pathlib import Path

from lightning_app.errors import UserError
from lightning_app.runs.folders import CHECKPOINTS, fsync_dir
from lightning_app.runs.launch import Launch, this_process

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` of this host is alive (and, given its start time, the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    current = _process_start(pid)
    return not (start and current and current != start)


class RunLock:
    """pid, host, start time, command and SLURM job of the fit that owns the run folder."""

    def __init__(self, run_dir: str | os.PathLike, launch: Launch | None = None) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.launch = launch  # this process (runs/launch.py); read at acquire() when not given
        self.held = False
        self.took_over: dict | None = None  # the previous owner's record when its lock was taken over
        self.took_over_because = ""
        self._stop = threading.Event()

    def _record(self) -> dict:
        me = self.launch
        slurm = {"slurm_job_id": me.slurm_key, "slurm_restart_count": me.slurm["restart_count"]} if me.slurm else {}
        return {"pid": me.pid, "host": me.host, "pid_start": _process_start(me.pid), "started": me.started,
                "command": me.command, **slurm,
                **({"torchelastic": me.elastic_key, "torchelastic_restart_count": me.elastic["restart_count"]}
                   if me.elastic_key else {})}

    def read(self, path: Path | None = None) -> dict | None:
        try:
            record = json.loads((path or self.path).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def acquire(self) -> RunLock:
        self.launch = self.launch or this_process()
        tmp = self.path.with_name(f"{LOCK_NAME}.{socket.gethostname()}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        try:
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                self._take_over_if_stale(tmp)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        self.held = True
        self._stop.clear()
        threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True).start()
        return self

    def _take_over_if_stale(self, tmp: Path) -> None:
        try:
            seen = self.path.read_bytes()
            age = tmp.stat().st_mtime - self.path.stat().st_mtime
        except FileNotFoundError:  # released between our link and now: try once more
            os.link(tmp, self.path)
            return
        owner = self.read() or {}
        pid, host = owner.get("pid"), owner.get("host")
        who = f"process {pid} on host {host}" if pid else "an unreadable lock"
        if _requeued_after(owner, self.launch):
            because = f"the previous attempt of SLURM job {owner.get('slurm_job_id')}, which SLURM requeued"
        elif _restarted_after(owner, self.launch):
            because = (f"attempt {owner.get('torchelastic_restart_count')} of the torchrun worker group "
                       f"{owner.get('torchelastic')}, which torchrun restarted")
        elif isinstance(pid, int) and host == socket.gethostname():
            if alive(pid, owner.get("pid_start")):
                raise UserError(
                    f"run folder {self.path.parent} is in use by process {pid} on {host} (started "
                    f"{owner.get('started', '?')}: {owner.get('command', '?')}). Wait for it to end or stop it, "
                    "or train into a fresh run (leave out --ckpt_path).")
            because = f"{who}, which is no longer running"
        elif age > STALE_S:
            because = (f"{who}, whose heartbeat stopped {age / 60:.0f} min ago (a lock from another host is taken "
                       f"over after {STALE_S / 60:.0f} min without a heartbeat)")
        else:
            raise UserError(
                f"run folder {self.path.parent} is locked by {who} (started {owner.get('started', '?')}; "
                f"heartbeat {max(age, 0):.0f} s ago), which this machine cannot check. If that run is over, its lock "
                f"is taken over once the heartbeat is {STALE_S / 60:.0f} min old; or delete {self.path} and start "
                "again.")
        # Move the stale lock aside (only one taker's rename succeeds), check it was the one judged stale,
        # then link ours into place.
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            raise UserError(f"run folder {self.path.parent} was just taken by another process; try again.") from None
        if aside.read_bytes() != seen:  # another taker replaced it meanwhile: put theirs back
            try:
                os.link(aside, self.path)
            finally:
                aside.unlink(missing_ok=True)
            raise UserError(f"run folder {self.path.parent} was just taken by another process; try again.")
        aside.unlink(missing_ok=True)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            raise UserError(f"run folder {self.path.parent} was just taken by another process; try again.") from None
        self.took_over, self.took_over_because = owner, because

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._mine():
                return
            try:
                os.utime(self.path)
            except OSError:
                return

    def _mine(self) -> bool:
        record = self.read() or {}
        return record.get("pid") == os.getpid() and record.get("host") == socket.gethostname()

    def release(self) -> None:
        self._stop.set()
        if self.held and self._mine():
            self.path.unlink(missing_ok=True)
        self.held = False


def _requeued_after(owner: dict, me: Launch) -> bool:
    return me.requeued and owner.get("slurm_job_id") == me.slurm_key and \
        int(owner.get("slurm_restart_count", 0) or 0) < me.slurm["restart_count"]


def _restarted_after(owner: dict, me: Launch) -> bool:
    return me.elastic_restart and me.elastic_key is not None and owner.get("torchelastic") == me.elastic_key and \
        int(owner.get("torchelastic_restart_count", 0) or 0) < me.elastic["restart_count"]


def take(run_dir: Path, launch: Launch) -> tuple[RunLock, list[str]]:
    """The run folder locked for this process, with what its dead writers left removed; and the lines saying so."""
    lock = RunLock(run_dir, launch).acquire()
    lines = [f"took over the lock of {run_dir} from {lock.took_over_because}."] if lock.took_over is not None else []
    removed = remove_dead_writers_files(run_dir, (lock.took_over or {}).get("host"))
    return lock, lines + ([removed] if removed else [])


# -- what dead writers left ------------------------------------------------------------------
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
