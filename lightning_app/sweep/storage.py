"""The study: one Optuna journal file in the sweep folder, shared by every worker (threads, processes, SLURM tasks).

The journal is an append-only file (optuna/storages/journal/_file.py, JournalFileBackend): each write takes a
lock, appends and fsyncs. The lock is JournalFileSymlinkLock, a symlink made with os.symlink, which is atomic on
NFS v2 and later (that file's docstrings; JournalFileOpenLock's O_EXCL needs NFSv3); a lock left by a killed
writer is broken after its grace period (30 s without a change of its mtime).

Optuna's heartbeat (optuna/storages/_heartbeat.py) exists only for RDBStorage, so the sweep keeps its own: each
sweep process touches heartbeats/<host>-<pid> every HEARTBEAT_S, and its trials carry their owner (host, pid,
SLURM job key). A trial whose owner is dead (a dead pid on this host, or a heartbeat older than `stale_s`) is
interrupted: its owner's next `--resume` finishes it from its last.ckpt, anyone else marks it failed
(`fail_stale`) so the study never waits on it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Any

from lightning_app.errors import UserError
from lightning_app.runs.identity import record_sweep_outcome
from lightning_app.runs.launch import job_key, slurm_job
from lightning_app.sweep.space import Space

JOURNAL = "journal.log"
HEARTBEATS = "heartbeats"
CLAIMS = "claims"
HEARTBEAT_S = 5.0
FINGERPRINT = "space_fingerprint"
OWNER = "owner"
RUN_DIR = "run_dir"
PRUNED_AT = "pruned_at_epoch"
FIT_ENDED = "fit_ended_at_epoch"
WORLD_SIZE = "world_size"  # the trial's ranks (pruning.py): each trial trains on the GPUs of its share
FIXED = "fixed_args"  # the configs and flags every trial gets besides the space's
SESSION = "session:"  # a study user attr per sweep process: its sampler seed
DUPLICATE_OF = "duplicate_of"

OPTUNA_MISSING = ("python -m lightning_app.sweep needs Optuna, an optional requirement (requirements-extras.txt) that "
                  "this environment lacks. Install it with `pip install 'optuna>=4.2'` (or `pip install -r "
                  "requirements-extras.txt`) and run the sweep again.")


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise UserError(OPTUNA_MISSING) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def journal_storage(folder: Path):
    import_optuna()
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock, JournalStorage

    path = str(folder / JOURNAL)
    return JournalStorage(JournalFileBackend(path, lock_obj=JournalFileSymlinkLock(path)))


def open_study(folder: Path, space: Space, sampler=None, pruner=None):
    """The study in `folder`, made on first use; one made from another space is refused."""
    optuna = import_optuna()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HEARTBEATS).mkdir(exist_ok=True)
    (folder / CLAIMS).mkdir(exist_ok=True)
    study = optuna.create_study(study_name=folder.name, storage=journal_storage(folder), load_if_exists=True,
                                direction=space.direction, sampler=sampler, pruner=pruner)
    attrs = study.user_attrs
    if FINGERPRINT not in attrs:
        study.set_user_attr(FINGERPRINT, space.fingerprint)
        study.set_user_attr("space", {k: [v.kind, v.low, v.high, list(v.choices)] for k, v in space.parameters.items()})
        study.set_user_attr("objective", space.objective)
    elif attrs[FINGERPRINT] != space.fingerprint:
        theirs = attrs.get("space", {})
        raise UserError(f"--study {folder} holds a study of another space ({sorted(theirs)}, objective "
                        f"{attrs.get('objective')}), not of {space.path} ({sorted(space.parameters)}, objective "
                        f"{space.objective}): its trials cannot be compared. Give another --study folder (or remove "
                        "that one to start over).")
    return study


def check_fixed(study, folder: Path, base_args: list[str]) -> None:
    """A study has one set of fixed settings: the configs and flags its trials get besides the space's. The first
    process records them; a later one that passes others is refused (its trials would not compare, and best.yaml,
    built from them, would not reproduce the best trial)."""
    recorded = study.user_attrs.get(FIXED)
    if recorded is None:
        study.set_user_attr(FIXED, list(base_args))
    elif list(recorded) != list(base_args):
        raise UserError(f"--study {folder} gives its trials `{shlex.join(recorded) or '(no flags)'}`, and this "
                        f"command `{shlex.join(base_args) or '(no flags)'}`: trials with other fixed settings would "
                        "not compare with its trials, nor could best.yaml train them again. Pass the same configs "
                        "and flags to continue it, or give another --study folder for the new settings.")


def session() -> str:
    """This sweep process's identity: host, pid and start time (unique, so its sampler's seed is too)."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"


def record_session(study, session_id: str, seed: int | None) -> None:
    """The process and the sampler seed it draws with, into the journal (the study's user attrs)."""
    study.set_user_attr(f"{SESSION}{session_id}", {"seed": seed, "job": job_key(slurm_job()),
                                                   "at": datetime.datetime.now().astimezone().isoformat()})


def same_settings(study, params: dict) -> Any:
    """A finished trial (COMPLETE or PRUNED) with exactly these settings, or None."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if trial.params == params:
            return trial
    return None


def load_study_for_trial(folder: Path, study_name: str, pruner):
    """The study as a trial's own process sees it (to report and ask the pruner); no sampler is made."""
    optuna = import_optuna()
    return optuna.load_study(study_name=study_name, storage=journal_storage(folder),
                             sampler=optuna.samplers.RandomSampler(), pruner=pruner)


# -- owners and heartbeats -----------------------------------------------------------------------------------
def me() -> dict[str, Any]:
    """Who runs trials here: this host and process, and the SLURM job key (an array task is ARRAYJOB_TASK)."""
    job = slurm_job()
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_key(job),
            "restart": int(job.get("restart_count", 0)) if job else 0}


def heartbeat_file(folder: Path, owner: dict) -> Path:
    return folder / HEARTBEATS / f"{owner['host']}-{owner['pid']}"


class Heartbeat:
    """Touches this process's heartbeat file every HEARTBEAT_S from a daemon thread, while the sweep runs."""

    def __init__(self, folder: Path) -> None:
        self.path = heartbeat_file(folder, me())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="sweep-heartbeat")

    def __enter__(self) -> Heartbeat:  # noqa: PYI034 - a final class
        self.path.touch()
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                self.path.touch()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_dead(folder: Path, owner: dict, stale_s: float) -> bool:
    """Whether the process that ran a trial is gone: a dead pid on this host, a SLURM job that has been requeued
    since (this process is its later incarnation), or a heartbeat older than stale_s."""
    mine = me()
    if owner.get("host") == mine["host"] and not _pid_alive(int(owner.get("pid", -1))):
        return True
    if owner.get("job") and owner.get("job") == mine["job"] and owner.get("restart", 0) < mine["restart"]:
        return True
    try:
        age = time.time() - heartbeat_file(folder, owner).stat().st_mtime
    except OSError:
        age = float("inf")
    return age > stale_s


def is_mine(owner: dict | None) -> bool:
    """A trial this process may resume: the same SLURM job (array task), or outside SLURM the same host."""
    mine = me()
    if not owner:
        return False
    if mine["job"]:
        return owner.get("job") == mine["job"]
    return owner.get("host") == mine["host"] and not owner.get("job")


def claim(folder: Path, trial_number: int, what: str) -> bool:
    """True for exactly one caller per (trial, what): an O_EXCL create (atomic on NFSv3+, as the journal lock)."""
    try:
        os.close(os.open(folder / CLAIMS / f"{trial_number}.{what}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def interrupted(study, folder: Path, stale_s: float) -> list:
    """RUNNING trials whose owner is gone. One with no owner yet is being asked for right now (study.ask writes the
    trial, then each parameter; the owner follows): gone only once older than stale_s."""
    from optuna.trial import TrialState

    def gone(trial) -> bool:
        owner = trial.user_attrs.get(OWNER)
        if owner is None:  # datetime_start: naive local time (optuna/storages/journal/_storage.py)
            return (datetime.datetime.now() - trial.datetime_start).total_seconds() > stale_s
        return owner_dead(folder, owner, stale_s)

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if gone(t)]


def ranks_of(trial: Any) -> dict:
    """The trial's world size for its run.json, once its fit recorded one (pruning.py)."""
    return {"world_size": trial.user_attrs[WORLD_SIZE]} if WORLD_SIZE in trial.user_attrs else {}


def fail_stale(study, folder: Path, stale_s: float) -> list[int]:
    """Marks failed every RUNNING trial whose owner is gone (a `--resume` has claimed its own ones before), in the
    study and in its run folder's run.json; their numbers. The claim makes one process the one that tells."""
    from optuna.trial import TrialState

    failed = []
    for trial in interrupted(study, folder, stale_s):
        if claim(folder, trial.number, "failed"):
            with contextlib.suppress(Exception):  # finished meanwhile (optuna's UpdateFinishedTrialError)
                study.tell(trial.number, state=TrialState.FAIL)
                failed.append(trial.number)
            if trial.number in failed and trial.user_attrs.get(RUN_DIR):
                with contextlib.suppress(OSError):
                    record_sweep_outcome(trial.user_attrs[RUN_DIR], "fail", **ranks_of(trial))
    return failed


def count(study) -> dict[str, int]:
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    return {s.name.lower(): states.count(s) for s in TrialState}
