"""One folder per run: `ROOT/version_N/` holds the TensorBoard events, config.yaml and checkpoints/.

- `new_run` makes the next `version_N` folder atomically (two fits started at once get two folders).
- `find_last` is what `--ckpt_path last` means: the newest `version_*/checkpoints/last.ckpt` under
  ROOT whose model matches this config (arch, class count and every weight's shape).
- `RunLock` keeps a second `fit` out of a run that is still alive; a killed run's lock is taken over.

Checkpoints are only ever read with `torch.load(..., weights_only=True)`: reading a folder of
checkpoints must never run code from one of them.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_app.errors import UserError

RUN_PATTERN = re.compile(r"^version_(\d+)$")
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"
LOCK_NAME = ".lock"


# -- run folders ---------------------------------------------------------------------------
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


def next_version(root: str | os.PathLike) -> int:
    runs = run_dirs(root)
    return runs[-1][0] + 1 if runs else 0


def new_run(root: str | os.PathLike) -> tuple[int, Path]:
    """Create the next ROOT/version_N (mkdir is atomic: a concurrent start takes N+1)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    version = next_version(root)
    while True:
        path = root / f"version_{version}"
        try:
            path.mkdir()
            return version, path
        except FileExistsError:
            version += 1


def run_of_checkpoint(ckpt_path: str | os.PathLike) -> tuple[int, Path] | None:
    """(N, run folder) when ckpt_path lies in `<root>/version_N/checkpoints/` (or, as Lightning's
    SLURM hpc_ckpt_K.ckpt, in `<root>/version_N/` itself), else None."""
    path = Path(ckpt_path).resolve()
    run = path.parent.parent if path.parent.name == CHECKPOINTS else path.parent
    m = RUN_PATTERN.match(run.name)
    return (int(m.group(1)), run) if m else None


# -- what a checkpoint holds ---------------------------------------------------------------
@dataclass
class ModelSignature:
    arch: str | None
    num_classes: int | None
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> ModelSignature:
        hp = getattr(module, "hparams", {})
        if not hp.get("num_classes"):  # predicting a folder without the training tree: the checkpoint's count
            return cls(hp.get("arch"), None, {})
        return cls(hp.get("arch"), hp.get("num_classes"),
                   {k: tuple(v.shape) for k, v in module.state_dict().items()})

    @classmethod
    def of_checkpoint(cls, path: str | os.PathLike) -> ModelSignature:
        """Read with weights_only=True (no code from the file runs) and mmap (no weights read)."""
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise UserError(f"cannot read checkpoint {path}: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
        hp = ckpt.get("hyper_parameters") or {}
        state = ckpt.get("state_dict") or {}
        return cls(hp.get("arch"), hp.get("num_classes"),
                   {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")})

    def describe(self) -> str:
        return f"arch {self.arch or 'unknown'} with {self.num_classes if self.num_classes is not None else '?'} classes"


def mismatch(saved: ModelSignature, config: ModelSignature) -> str | None:
    """Why a checkpoint with `saved` cannot load into the model of `config`, or None when it can."""
    classes_differ = config.num_classes is not None and saved.num_classes != config.num_classes
    if saved.arch != config.arch or classes_differ:
        return f"it holds {saved.describe()}, this config builds {config.describe()}"
    for key, shape in config.shapes.items():
        if key in saved.shapes and saved.shapes[key] != shape:
            return (f"same arch and classes, but layer {key} is {list(saved.shapes[key])} there and "
                    f"{list(shape)} here (a different --model.arch_kwargs or --data.image_size)")
    missing = [k for k in config.shapes if k not in saved.shapes]
    if saved.shapes and missing:
        return f"same arch and classes, but it lacks {len(missing)} of this model's weights, e.g. {missing[0]}"
    return None


def check_compatible(ckpt_path: str | os.PathLike, config: ModelSignature) -> None:
    """Raise a one-paragraph UserError when ckpt_path cannot load into this config's model."""
    why = mismatch(ModelSignature.of_checkpoint(ckpt_path), config)
    if why is not None:
        raise UserError(
            f"--ckpt_path {ckpt_path} does not fit this config: {why}. Pass the config the checkpoint was "
            "trained with (its run folder holds config.yaml), or --ckpt_path last to resume the newest run "
            "of this config."
        )


def find_last(root: str | os.PathLike, config: ModelSignature) -> tuple[Path | None, int]:
    """(newest compatible ROOT/version_*/checkpoints/last.ckpt or None, how many were looked at).

    Lightning's SLURM auto-requeue saves `hpc_ckpt_K.ckpt` into the trainer's default_root_dir, which
    is the run folder (lightning_app.cli): the newest of those and last.ckpt wins.
    """
    candidates = []
    for _, run in run_dirs(root):
        last = run / CHECKPOINTS / LAST
        if last.is_file():
            candidates.append(last)
        candidates += [p for p in run.glob("hpc_ckpt_*.ckpt") if p.is_file()]
    candidates.sort(key=lambda p: (p.stat().st_mtime, run_of_checkpoint(p)[0]), reverse=True)
    for last in candidates:
        try:
            saved = ModelSignature.of_checkpoint(last)
        except UserError:
            continue  # unreadable (a partial copy, say): not a run to resume
        if mismatch(saved, config) is None:
            return last, len(candidates)
    return None, len(candidates)


# -- the lock of a run folder --------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    now = _process_start(pid)
    return not (start and now and now != start)


class RunLock:
    """`version_N/.lock`: pid, host, start time and command of the fit that owns the run folder."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False
        self.took_over: dict | None = None

    def _record(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _process_start(os.getpid()),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv), **_slurm_job()}

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def acquire(self) -> RunLock:
        record = json.dumps(self._record())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._take_over_if_stale(record)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(record)
        self.held = True
        return self

    def _take_over_if_stale(self, record: str) -> None:
        owner = self.read() or {}
        pid, host = owner.get("pid"), owner.get("host")
        if _requeued_after(owner):
            pass  # SLURM requeued this very job: the owner was its previous run, which is over
        elif isinstance(pid, int) and host == socket.gethostname():
            if _alive(pid, owner.get("pid_start")):
                raise UserError(
                    f"run folder {self.path.parent} is in use by process {pid} on {host} (started "
                    f"{owner.get('started', '?')}: {owner.get('command', '?')}). Wait for it to end or stop it, "
                    "or train into a fresh run (leave out --ckpt_path)."
                )
        elif isinstance(pid, int):
            raise UserError(
                f"run folder {self.path.parent} is locked by process {pid} on host {host} (started "
                f"{owner.get('started', '?')}), which this machine cannot check. If that run is over, delete "
                f"{self.path} and start again."
            )
        # dead owner (or an unreadable lock): take it over atomically
        tmp = self.path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
        tmp.write_text(record)
        os.replace(tmp, self.path)
        if (self.read() or {}).get("pid") != os.getpid():
            raise UserError(f"run folder {self.path.parent} was just taken by another process; try again.")
        self.took_over = owner

    def release(self) -> None:
        if self.held and (self.read() or {}).get("pid") == os.getpid():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.held = False


def _slurm_job() -> dict:
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return {}
    return {"slurm_job_id": env["SLURM_JOB_ID"], "slurm_restart_count": int(env.get("SLURM_RESTART_COUNT", 0) or 0)}


def _requeued_after(owner: dict) -> bool:
    me = _slurm_job()
    return bool(me) and owner.get("slurm_job_id") == me["slurm_job_id"] and \
        int(owner.get("slurm_restart_count", 0)) < me["slurm_restart_count"]


# -- which process may touch the run folder -----------------------------------------------
def is_launch_rank_zero() -> bool:
    """True in the process that will be global rank 0, judged from the environment before any launch.

    Lightning's subprocess launcher (pytorch_lightning/strategies/launchers/subprocess_script.py)
    re-runs this same command for local ranks 1.. with LOCAL_RANK set; torchrun sets RANK; SLURM
    sets SLURM_PROCID; a second node started by hand has NODE_RANK > 0.
    """
    env = os.environ
    for name in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if env.get(name, "").isdigit():
            return int(env[name]) == 0
    node = env.get("NODE_RANK") or env.get("GROUP_RANK") or "0"
    local = env.get("LOCAL_RANK", "0")
    return node == "0" and local == "0"
