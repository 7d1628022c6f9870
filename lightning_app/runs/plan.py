"""Where a subcommand writes and what it loads, decided once before the trainer is made.

fit: a fresh ROOT/version_N (made, with its run.json, by the one launch-rank-zero process, which also takes
its lock), or the run of the resolved checkpoint wherever its root is. validate/test/predict: a folder of
their own, `<run>/<subcommand>_K`, under the checkpoint's run (ROOT/<subcommand>_K for a checkpoint outside
any run), printed in one line. One that fails before writing a result removes that folder again
(discard_evaluation_folder), so the next one takes its name.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_app.errors import UserError
from lightning_app.runs import identity
from lightning_app.runs.folders import PREDICTIONS_CSV, RUN_PATTERN, new_run, new_subfolder, run_root_writable
from lightning_app.runs.launch import is_launch_rank_zero
from lightning_app.runs.lock import RunLock, remove_dead_writers_files
from lightning_app.runs.resolve import resolve
from lightning_app.runs.signature import ModelSignature, check_compatible, fingerprint


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
    with run_root_writable(root):  # a read-only, unwritable or full root: one paragraph, exit status 2
        return _plan_run(subcommand, ckpt_path, root, training, signature, resume_or_fail)


def _plan_run(subcommand: str, ckpt_path: str | None, root: Path, training: dict,
              signature: ModelSignature, resume_or_fail: bool) -> RunPlan:
    zero = is_launch_rank_zero()
    resolved = resolve(ckpt_path, root, training, subcommand)
    if resume_or_fail and subcommand == "fit" and ckpt_path in ("last", "hpc") and resolved.run_dir is None:
        found = resolved.message.removesuffix("; starting a fresh run.").rstrip(".")
        raise UserError(f"{found}. --resume_or_fail true: a fit that finds no run to resume stops here instead of "
                        "starting a fresh one from epoch 0. If the config changed on purpose, pass the checkpoint "
                        "with --ckpt_path PATH/TO.ckpt, or leave out --resume_or_fail for a fresh run; if the runs "
                        "are under another --trainer.default_root_dir, point it there.")
    if resolved.checkpoint and Path(resolved.checkpoint).is_file():
        check_compatible(resolved.checkpoint, signature)
    lines = [resolved.message] if resolved.message else []
    if subcommand != "fit":
        parent = resolved.run_dir or root
        if not zero:
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
        if resolved.changed and resolved.checkpoint:
            lines.append(f"resuming {resolved.checkpoint} with changed settings: {identity.describe(resolved.changed)}")
        elif resolved.changed:
            lines.append(f"{resolved.run_dir} starts again with changed settings: "
                         f"{identity.describe(resolved.changed)}")
        if zero:
            plan.lock = _lock(resolved.run_dir, lines)
            record = identity.record_resume(resolved.run_dir, record, training, resolved.checkpoint, resolved.changed)
    elif zero:
        plan.version, plan.run_dir = new_run(root)
        plan.made_here = True
        try:
            plan.lock = _lock(plan.run_dir, lines)
            record = identity.write_new_run(plan.run_dir, training)
        except OSError:  # a full disk: no half-made run folder is left for `--ckpt_path last` to find
            if plan.lock is not None:
                plan.lock.release()
            shutil.rmtree(plan.run_dir, ignore_errors=True)
            raise
    plan.agreement = {
        "checkpoint": resolved.checkpoint,
        "fingerprint": (fingerprint(resolved.checkpoint) if resolved.checkpoint and os.path.isfile(resolved.checkpoint)
                        else None),
        "run_dir": os.path.realpath(plan.run_dir) if plan.run_dir else None, "run_id": (record or {}).get("run_id"),
        "made_here": plan.made_here, "resumed": bool(resolved.checkpoint and resolved.run_dir)}
    return plan


def discard_evaluation_folder(plan: RunPlan, logged_metrics: bool) -> None:
    """Remove the folder a failed validate/test/predict made unless it holds a result: logged metrics or
    predictions.csv. config.yaml, hparams.yaml and an events file are written before the loop starts."""
    folder = plan.evaluation_folder
    if folder is None or logged_metrics or (folder / PREDICTIONS_CSV).exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    plan.evaluation_folder = None


def _lock(run_dir: Path, lines: list[str]) -> RunLock:
    lock = RunLock(run_dir).acquire()
    if lock.took_over is not None:
        lines.append(f"took over the lock of {run_dir} from {lock.took_over_because}.")
    removed = remove_dead_writers_files(run_dir, (lock.took_over or {}).get("host"))
    if removed:
        lines.append(removed)
    return lock


def _what(checkpoint: str | None) -> str:
    return f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"

