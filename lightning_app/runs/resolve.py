"""What `--ckpt_path` names: a file, or `last`/`hpc` resolved to one run and one checkpoint.

`last` is the newest run (highest N) whose run.json training settings equal this config's (identity.IGNORED
lists what is not compared). A requeued SLURM job (SLURM_RESTART_COUNT > 0) resumes a run of its own job
and nothing else. The run's newest checkpoint (last.ckpt or Lightning's hpc_ckpt_K.ckpt) must be
readable; otherwise the run is named with its best checkpoint, and no older run is ever taken instead.
`hpc` is the same run, resumed from its newest hpc_ckpt_K.ckpt only.
A fit whose torchrun worker group was restarted (TORCHELASTIC_RESTART_COUNT > 0) goes on with the run of its own
torchrun job (launch.elastic_key), whatever --ckpt_path says, and with no other run.

One pass: the runs under the root are read and compared once (identity.runs_under, or identity.run_of_file for a
file), the checkpoint to load is read once (signature.inspect_checkpoint: readable, fits this model, its
fingerprint), and the answer is a plain value: the file, its run, and the lines that say why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lightning_app.checkpoint_files import damage
from lightning_app.errors import UserError
from lightning_app.runs import identity
from lightning_app.runs.folders import CHECKPOINTS, HPC_GLOB, LAST
from lightning_app.runs.launch import Launch
from lightning_app.runs.signature import ModelSignature, Unreadable, inspect_checkpoint


@dataclass
class Resolved:
    checkpoint: str | None  # the file to load; None: start from scratch
    run_dir: Path | None  # the run to continue or log beside; None: a fresh run
    record: dict | None = None  # its run.json
    lines: list[str] = field(default_factory=list)  # why, for the log
    changed: list = field(default_factory=list)  # (key, run's value, this config's) where they differ
    fingerprint: str | None = None  # of the checkpoint file (signature.fingerprint); None: no file to load


def resolve(ckpt_path: str | None, root: Path, training: dict, subcommand: str, launch: Launch,
            model: ModelSignature, resume_or_fail: bool = False) -> Resolved:
    """What `--ckpt_path` names for this subcommand, and why; UserError when it names nothing this config can load."""
    if subcommand == "fit" and launch.elastic_restart:
        resolved = _resolve_restart(ckpt_path, root, training, launch, model)
    else:
        resolved = _resolve(ckpt_path, root, training, subcommand, launch, model)
    if resume_or_fail and subcommand == "fit" and ckpt_path in ("last", "hpc") and resolved.run_dir is None:
        found = resolved.lines[0].removesuffix("; starting a fresh run.").rstrip(".")
        raise UserError(f"{found}. --resume_or_fail true: a fit that finds no run to resume stops here instead of "
                        "starting a fresh one from epoch 0. If the config changed on purpose, pass the checkpoint "
                        "with --ckpt_path PATH/TO.ckpt, or leave out --resume_or_fail for a fresh run; if the runs "
                        "are under another --trainer.default_root_dir, point it there.")
    return resolved


def _resolve_restart(ckpt_path: str | None, root: Path, training: dict, launch: Launch,
                     model: ModelSignature) -> Resolved:
    """torchrun restarts a group with the command line of its first attempt (torch/distributed/elastic/agent/server/
    api.py, _restart_workers), so the command cannot say "resume": the run to go on with is the one whose run.json
    records this torchrun job, from its newest checkpoint (as a requeued SLURM job's)."""
    run = launch.elastic
    what = f"torchrun restarted the worker group (restart {run['restart_count']} of {run['max_restarts']}"
    key = launch.elastic_key
    if key is None:
        raise UserError(
            f"{what}), but its rendezvous id is torchrun's default \"none\" on {run['nodes']} nodes, which every job "
            "without --rdzv-id shares: which run is this job's own cannot be told, and no run is taken. Give torchrun "
            "--rdzv-id JOB_ID, the same on every node (scripts/torchrun.sh does), and start the job again with "
            "--ckpt_path last.")
    what += f", {key})"
    found = identity.runs_under(root, training, "fit")
    mine = sorted((at, r.number, r.folder, r) for r in found
                  if r.record and (at := identity.last_elastic_attempt(r.record, key)) is not None)
    if not mine:
        if ckpt_path not in (None, "last", "hpc"):  # a file the user named: the first attempt started from it too
            resolved = _resolve(ckpt_path, root, training, "fit", launch, model)
            resolved.lines = [f"{what}: no run under {root} records it yet; starting again from {ckpt_path}.",
                              *resolved.lines]
            return resolved
        fresh = (f"{what}: no run under {root} records it (its first attempt stopped before making its run folder); "
                 "starting a fresh run, no other run is taken.")
        return Resolved(None, None, lines=[fresh])
    own = mine[-1][3]
    named = str(ckpt_path) if ckpt_path not in (None, "last", "hpc") else None  # if its own run has no checkpoint
    resolved = _checkpoint_of("last", own, f"{what}: its own run {own.folder}", "fit", model, instead=named)
    start = f"resuming {resolved.checkpoint}" if resolved.checkpoint else "starting it again in its folder"
    resolved.lines = [f"{what}: {start} in its own run {own.folder}; no other run is taken.", *resolved.lines[1:]]
    return resolved


def _resolve(ckpt_path: str | None, root: Path, training: dict, subcommand: str, launch: Launch,
             model: ModelSignature) -> Resolved:
    if ckpt_path in ("last", "hpc"):
        return _resolve_run(ckpt_path, root, training, subcommand, launch, model)
    if ckpt_path is None or ckpt_path in ("best", "registry") or str(ckpt_path).startswith("registry:"):
        return Resolved(ckpt_path, None)
    if not Path(ckpt_path).is_file():
        raise UserError(f"--ckpt_path {ckpt_path}: no such file.")
    read = inspect_checkpoint(ckpt_path, model)
    run = identity.run_of_file(ckpt_path, training, read.hyper_parameters)
    if subcommand != "fit":
        return Resolved(str(ckpt_path), run.folder, run.record, fingerprint=read.fingerprint)
    return Resolved(str(ckpt_path), run.folder, run.record, _changed_lines(str(ckpt_path), run), run.changed,
                    read.fingerprint)


def _resolve_run(kind: str, root: Path, training: dict, subcommand: str, launch: Launch,
                 model: ModelSignature) -> Resolved:
    flag = f"--ckpt_path {kind}"
    runs = identity.runs_under(root, training, subcommand)
    known = [r for r in runs if r.record is not None]
    if launch.requeued and subcommand == "fit":
        key, restart = launch.slurm_key, launch.slurm["restart_count"]
        mine = [r for r in known if key in identity.jobs_of(r.record)]
        if not mine:
            raise UserError(
                f"{flag}: SLURM job {key} was requeued (restart {restart}), but no run under {root} "
                f"belongs to it ({len(runs)} run(s) there), so there is nothing of this job to resume and no other "
                "job's run is taken instead. If the job was stopped before its run folder was made, submit it again; "
                "if its runs are under another --trainer.default_root_dir (node-local disk?), point it there.")
        same = [r for r in mine if not r.differs]
        if not same and len(mine) > 1:
            raise UserError(
                f"{flag}: SLURM job {key} was requeued and made {len(mine)} runs under {root}, none with this config's "
                "training settings: "
                f"{'; '.join(f'{r.folder.name} differs in ' + r.said_differs for r in mine)}. "
                "Pass the one to resume with --ckpt_path PATH/TO.ckpt.")
        run = (same or mine)[-1]
        why = f"SLURM job {key} requeued (restart {restart}): its run {run.folder}"
    else:
        same = [r for r in known if not r.differs]
        if not same:
            return _no_run(flag, root, known, len(runs) - len(known), subcommand)
        run = same[-1]
        why = f"{run.folder}, the newest of {len(same)} run(s) under {root} with this config's training settings"
    return _checkpoint_of(kind, run, why, subcommand, model)


def _no_run(flag: str, root: Path, known: list[identity.FoundRun], unknown: int, subcommand: str) -> Resolved:
    where = f"none of the {len(known)} run(s) under {root}" if known else f"no run under {root}"
    if known:
        nearest = min(known, key=lambda r: (len(r.differs), -r.number))
        where += f" has this config's training settings (the nearest, {nearest.folder.name}, differs in " \
                 f"{nearest.said_differs})"
    else:
        where += " has this config's training settings"
    if unknown:
        where += f"; {unknown} run(s) without {identity.RUN_JSON} (made before runs had one) are not compared"
    if subcommand != "fit":
        raise UserError(f"{flag}: {where}. Pass --ckpt_path PATH/TO.ckpt.")
    return Resolved(None, None, lines=[f"{flag}: {where}; starting a fresh run."])


def _checkpoint_of(kind: str, run: identity.FoundRun, why: str, subcommand: str, model: ModelSignature,
                   instead: str | None = None) -> Resolved:
    """The run's newest checkpoint (last.ckpt or hpc_ckpt_K.ckpt; `hpc`: hpc_ckpt_K.ckpt only), read once; with none,
    `instead` (a file the user named) or the run started again in its folder."""
    flag, run_dir = f"--ckpt_path {kind}", run.folder
    ckpts = run_dir / CHECKPOINTS
    candidates = [p for p in run_dir.glob(HPC_GLOB) if p.is_file()]
    if kind == "last" and (ckpts / LAST).is_file():
        candidates.append(ckpts / LAST)
    best = sorted((p for p in ckpts.glob("*.ckpt") if p.name != LAST and not p.name.startswith(".")),
                  key=os.path.getmtime) if ckpts.is_dir() else []
    best_text = f"its best checkpoint is {best[-1]}" if best else "it has no other checkpoint"
    changed = run.changed if subcommand == "fit" else []
    if not candidates:
        if kind == "hpc":
            raise UserError(f"{flag}: {why} holds no hpc_ckpt_*.ckpt (Lightning saves one on SLURM's requeue signal); "
                            f"{best_text}. Use --ckpt_path last, or pass a checkpoint with --ckpt_path PATH.")
        if best or subcommand != "fit":
            raise UserError(f"{flag}: {why} has no {LAST}; {best_text}. Pass it with --ckpt_path PATH, or leave out "
                            "--ckpt_path for a fresh run. No older run is resumed instead.")
        if instead is not None:
            read = inspect_checkpoint(instead, model) if Path(instead).is_file() else None
            return Resolved(instead, run_dir, run.record, ["", *_changed_lines(instead, run)], changed,
                            read and read.fingerprint)
        stopped = f"{flag}: {why} was stopped before its first checkpoint; starting it again in its folder."
        return Resolved(None, run_dir, run.record, [stopped, *_changed_lines(None, run)], changed)
    newest = max(candidates, key=os.path.getmtime)
    try:
        read = inspect_checkpoint(newest, model)
    except Unreadable as e:
        cut = damage(newest)
        said = f"which is {cut}" if cut else f"which cannot be read ({str(e).split(': ', 1)[-1]})"
        raise UserError(f"{flag}: {why} ends with {newest}, {said}; "
                        f"{best_text}. Pass that with --ckpt_path PATH to go on from it, or leave out --ckpt_path for "
                        "a fresh run. No older run is resumed instead.") from None
    lines = [f"{flag}: resuming {newest} ({why})"]
    return Resolved(str(newest), run_dir, run.record, lines + (_changed_lines(str(newest), run) if changed else []),
                    changed, read.fingerprint)


def _changed_lines(checkpoint: str | None, run: identity.FoundRun) -> list[str]:
    """A resumed or restarted fit says which training settings changed (it runs on with this config's)."""
    if not run.changed or run.folder is None:
        return []
    if checkpoint:
        return [f"resuming {checkpoint} with changed settings: {run.said_changed}"]
    return [f"{run.folder} starts again with changed settings: {run.said_changed}"]
