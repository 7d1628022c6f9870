"""Where a subcommand writes and what it loads, decided once before the trainer is made.

fit: a fresh ROOT/version_N (made, with its run.json, by the one launch-rank-zero process, which also takes
its lock), or the run of the resolved checkpoint wherever its root is. validate/test/predict: a folder of
their own, `<run>/<subcommand>_K`, under the checkpoint's run (ROOT/<subcommand>_K for a checkpoint outside
any run), printed in one line. One that fails before writing a result removes that folder again
(discard_evaluation_folder), so the next one takes its name.

One pass, top to bottom: this process read from its environment (launch.this_process), `--ckpt_path` resolved to a
plain answer (resolve.resolve: the file, its run, why), then the folder made or taken (lock.take) and run.json
written. tests/helpers/runs_trace.py counts the files it enters.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_app.runs import launch
from lightning_app.runs.folders import (
    PREDICTIONS_CSV,
    RUN_PATTERN,
    new_run,
    new_subfolder,
    unwritable_root,
    write_atomically,
)
from lightning_app.runs.identity import RUN_JSON
from lightning_app.runs.lock import RunLock, take
from lightning_app.runs.resolve import Resolved, resolve
from lightning_app.runs.signature import ModelSignature


@dataclass
class RunPlan:
    ckpt_path: str | None  # what the trainer loads
    log_parent: Path  # TensorBoardLogger(save_dir=log_parent, name="", version=version)
    version: int | str | None
    run_dir: Path | None = None
    purge_step: int | None = None  # a run started again: TensorBoard drops all its stopped attempt logged
    lock: RunLock | None = None
    made_here: bool = False  # a fresh run this process made (removed again if it fails before a checkpoint)
    # what every rank must have resolved alike, for the run guard (lightning_app/runs/guard.py, RunGuard(**agreement))
    agreement: dict[str, Any] | None = None
    lines: list[str] = field(default_factory=list)  # said once, by rank 0, before the trainer is made
    evaluation_folder: Path | None = None  # validate/test/predict's own <subcommand>_K, made by this process


def plan_run(subcommand: str, ckpt_path: str | None, root: Path, training: dict, signature: ModelSignature,
             resume_or_fail: bool = False) -> RunPlan:
    try:
        return _plan_run(subcommand, ckpt_path, root, training, signature, resume_or_fail)
    except FileExistsError:
        raise
    except OSError as error:  # a read-only, unwritable or full root: one paragraph, exit status 2
        raise unwritable_root(root, error) from None


def _plan_run(subcommand: str, ckpt_path: str | None, root: Path, training: dict,
              signature: ModelSignature, resume_or_fail: bool) -> RunPlan:
    here = launch.this_process()
    resolved = resolve(ckpt_path, root, training, subcommand, here, signature, resume_or_fail)
    lines = [line for line in resolved.lines if line]
    if subcommand != "fit":
        parent = resolved.run_dir or root
        if not here.rank_zero:
            return RunPlan(resolved.checkpoint, parent, None, resolved.run_dir)
        folder = new_subfolder(parent, subcommand)
        if subcommand != "predict":  # predict's line names its images too (lightning_app/callbacks/predictions.py)
            lines.append(f"{subcommand}: {_what(resolved.checkpoint)}; results in {folder}")
        return RunPlan(resolved.checkpoint, parent, folder.name, resolved.run_dir, lines=lines,
                       evaluation_folder=folder)

    plan = RunPlan(resolved.checkpoint, root, None, resolved.run_dir, lines=lines)
    record = resolved.record
    if resolved.run_dir is not None:
        plan.version = int(RUN_PATTERN.match(resolved.run_dir.name).group(1))
        plan.log_parent = resolved.run_dir.parent
        if not resolved.checkpoint:  # started again: TensorBoard drops everything the stopped attempt logged
            plan.purge_step = 0
        if here.rank_zero:
            plan.lock, taken = take(resolved.run_dir, here)
            lines += taken
            record = _record_resume(resolved, training, here)
    elif here.rank_zero:
        plan.version, plan.run_dir = new_run(root)
        plan.made_here = True
        try:
            plan.lock, taken = take(plan.run_dir, here)
            lines += taken
            record = write_new_run(plan.run_dir, training, here)
        except OSError:  # a full disk: no half-made run folder is left for `--ckpt_path last` to find
            if plan.lock is not None:
                plan.lock.release()
            shutil.rmtree(plan.run_dir, ignore_errors=True)
            raise
    plan.agreement = {
        "checkpoint": resolved.checkpoint, "fingerprint": resolved.fingerprint,
        "run_dir": os.path.realpath(plan.run_dir) if plan.run_dir else None, "run_id": (record or {}).get("run_id"),
        "made_here": plan.made_here, "resumed": bool(resolved.checkpoint and resolved.run_dir)}
    return plan


# -- run.json: written by the process that holds the run's lock ------------------------------------------
def _attempt(here: launch.Launch, checkpoint: str | None, changed: list | None = None) -> dict:
    attempt = {"at": here.started, "host": here.host, "pid": here.pid, "command": here.command,
               "checkpoint": checkpoint, "slurm": here.slurm}
    if here.elastic:
        attempt["torchelastic"] = here.elastic
    if here.sweep:
        attempt["sweep"] = here.sweep
    if changed:
        attempt["changed"] = [{"key": k, "from": o, "to": n} for k, o, n in changed]
    return attempt


def write_new_run(run_dir: str | os.PathLike, training: dict, here: launch.Launch | None = None) -> dict:
    """A fresh run's run.json: its training settings, where and when it started, its first attempt."""
    here = here or launch.this_process()
    cluster = {**({"torchelastic": here.elastic} if here.elastic else {}),
               **({"sweep": here.sweep} if here.sweep else {})}
    record = {"run_id": uuid.uuid4().hex, "created": here.started, "host": here.host, "slurm": here.slurm, **cluster,
              "training": training, "attempts": [_attempt(here, None)]}
    write_atomically(Path(run_dir) / RUN_JSON, json.dumps(record, indent=1).encode())
    return record


def _record_resume(resolved: Resolved, training: dict, here: launch.Launch) -> dict:
    """Append this attempt; the training settings become this config's (a resumed fit may change lr, say)."""
    record = resolved.record
    if record is None:  # a run made before run.json existed: it gets one now
        record = {"run_id": uuid.uuid4().hex, "created": None, "host": None, "slurm": {}, "attempts": []}
    attempt = _attempt(here, resolved.checkpoint, resolved.changed)
    record = {**record, "training": training, "attempts": [*record.get("attempts", []), attempt]}
    write_atomically(resolved.run_dir / RUN_JSON, json.dumps(record, indent=1).encode())
    return record


def discard_evaluation_folder(plan: RunPlan, logged_metrics: bool) -> None:
    """Remove the folder a failed validate/test/predict made unless it holds a result: logged metrics or
    predictions.csv. config.yaml, hparams.yaml and an events file are written before the loop starts."""
    folder = plan.evaluation_folder
    if folder is None or logged_metrics or (folder / PREDICTIONS_CSV).exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    plan.evaluation_folder = None


def _what(checkpoint: str | None) -> str:
    return f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"

