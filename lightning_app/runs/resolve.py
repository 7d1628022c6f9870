"""What `--ckpt_path` names: a file, or `last`/`hpc` resolved to one run and one checkpoint.

`last` is the newest run (highest N) whose run.json training settings equal this config's (identity.IGNORED
lists what is not compared). A requeued SLURM job (SLURM_RESTART_COUNT > 0) resumes a run of its own job
and nothing else. The run's newest checkpoint (last.ckpt or Lightning's hpc_ckpt_K.ckpt) must be
readable; otherwise the run is named with its best checkpoint, and no older run is ever taken instead.
`hpc` is the same run, resumed from its newest hpc_ckpt_K.ckpt only.
A fit whose torchrun worker group was restarted (TORCHELASTIC_RESTART_COUNT > 0) goes on with the run of its own
torchrun job (launch.elastic_key), whatever --ckpt_path says, and with no other run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lightning_app.checkpoint_files import damage
from lightning_app.errors import UserError
from lightning_app.runs import identity, launch
from lightning_app.runs.folders import CHECKPOINTS, HPC_GLOB, LAST, run_dirs, run_of_checkpoint
from lightning_app.runs.signature import load_light


@dataclass
class Resolved:
    checkpoint: str | None  # the file to load; None: start from scratch
    run_dir: Path | None  # the run to continue or log beside; None: a fresh run
    record: dict | None = None  # its run.json
    message: str = ""  # one line for the log
    changed: list = field(default_factory=list)  # (key, run's value, this config's) where they differ


def resolve(ckpt_path: str | None, root: Path, training: dict, subcommand: str) -> Resolved:
    elastic = launch.elastic_run()
    if subcommand == "fit" and launch.is_elastic_restart(elastic):
        return _resolve_restart(ckpt_path, root, training, elastic)
    return _resolve(ckpt_path, root, training, subcommand)


def _resolve_restart(ckpt_path: str | None, root: Path, training: dict, run: dict) -> Resolved:
    """torchrun restarts a group with the command line of its first attempt (torch/distributed/elastic/agent/server/
    api.py, _restart_workers), so the command cannot say "resume": the run to go on with is the one whose run.json
    records this torchrun job, from its newest checkpoint (as a requeued SLURM job's)."""
    what = f"torchrun restarted the worker group (restart {run['restart_count']} of {run['max_restarts']}"
    key = launch.elastic_key(run)
    if key is None:
        raise UserError(
            f"{what}), but its rendezvous id is torchrun's default \"none\" on {run['nodes']} nodes, which every job "
            "without --rdzv-id shares: which run is this job's own cannot be told, and no run is taken. Give torchrun "
            "--rdzv-id JOB_ID, the same on every node (scripts/torchrun.sh does), and start the job again with "
            "--ckpt_path last.")
    what += f", {key})"
    mine = sorted((at, n, d) for n, d in run_dirs(root)
                  if (at := identity.last_elastic_attempt(identity.read_run(d) or {}, key)) is not None)
    if not mine:
        if ckpt_path not in (None, "last", "hpc"):  # a file the user named: the first attempt started from it too
            resolved = _resolve(ckpt_path, root, training, "fit")
            resolved.message = f"{what}: no run under {root} records it yet; starting again from {ckpt_path}."
            return resolved
        return Resolved(None, None, message=f"{what}: no run under {root} records it (its first attempt stopped "
                                            "before making its run folder); starting a fresh run, no other run is "
                                            "taken.")
    run_dir = mine[-1][2]
    record = identity.read_run(run_dir)
    resolved = _checkpoint_of("last", run_dir, record, f"{what}: its own run {run_dir}", "fit")
    if resolved.checkpoint is None and ckpt_path not in (None, "last", "hpc"):
        resolved.checkpoint = str(ckpt_path)
    resolved.changed = identity.differences(record["training"], training)
    start = f"resuming {resolved.checkpoint}" if resolved.checkpoint else "starting it again in its folder"
    resolved.message = f"{what}: {start} in its own run {run_dir}; no other run is taken."
    return resolved


def _resolve(ckpt_path: str | None, root: Path, training: dict, subcommand: str) -> Resolved:
    if ckpt_path in ("last", "hpc"):
        return _resolve_run(ckpt_path, root, training, subcommand)
    if ckpt_path is None or ckpt_path in ("best", "registry") or str(ckpt_path).startswith("registry:"):
        return Resolved(ckpt_path, None)
    if not Path(ckpt_path).is_file():
        raise UserError(f"--ckpt_path {ckpt_path}: no such file.")
    run = run_of_checkpoint(ckpt_path)
    record = identity.read_run(run[1]) if run else None
    if subcommand != "fit":
        return Resolved(str(ckpt_path), run[1] if run else None, record)
    checkpoint = load_light(ckpt_path)
    if record:
        changed = identity.differences(record["training"], training)
    else:  # a run without run.json, or a file outside any run: its model settings are all there is
        saved = identity.model_settings(checkpoint.get("hyper_parameters") or {})
        changed = identity.differences({"model": saved}, {"model": training["model"]})
    return Resolved(str(ckpt_path), run[1] if run else None, record, "", changed)


def _resolve_run(kind: str, root: Path, training: dict, subcommand: str) -> Resolved:
    flag = f"--ckpt_path {kind}"
    runs = [(d, identity.read_run(d)) for _, d in run_dirs(root)]
    known = [(d, r) for d, r in runs if r is not None]
    wanted = identity.comparable(training, subcommand)

    def differs(record: dict) -> list:
        return identity.differences(identity.comparable(record["training"], subcommand), wanted)

    unknown = len(runs) - len(known)
    job = launch.slurm_job()
    if launch.is_requeued(job) and subcommand == "fit":
        key = launch.job_key(job)
        mine = [(d, r) for d, r in known if key in identity.jobs_of(r)]
        if not mine:
            raise UserError(
                f"{flag}: SLURM job {key} was requeued (restart {job['restart_count']}), but no run under {root} "
                f"belongs to it ({len(runs)} run(s) there), so there is nothing of this job to resume and no other "
                "job's run is taken instead. If the job was stopped before its run folder was made, submit it again; "
                "if its runs are under another --trainer.default_root_dir (node-local disk?), point it there.")
        same = [(d, r) for d, r in mine if not differs(r)]
        if not same and len(mine) > 1:
            raise UserError(
                f"{flag}: SLURM job {key} was requeued and made {len(mine)} runs under {root}, none with this config's "
                "training settings: "
                f"{'; '.join(f'{d.name} differs in ' + identity.describe(differs(r)) for d, r in mine)}. "
                "Pass the one to resume with --ckpt_path PATH/TO.ckpt.")
        run_dir, record = (same or mine)[-1]
        why = f"SLURM job {key} requeued (restart {job['restart_count']}): its run {run_dir}"
    else:
        same = [(d, r) for d, r in known if not differs(r)]
        if not same:
            return _no_run(flag, root, [(differs(r), d) for d, r in known], unknown, subcommand)
        run_dir, record = same[-1]
        why = f"{run_dir}, the newest of {len(same)} run(s) under {root} with this config's training settings"
    resolved = _checkpoint_of(kind, run_dir, record, why, subcommand)
    resolved.changed = identity.differences(record["training"], training)
    return resolved


def _no_run(flag: str, root: Path, diffs: list, unknown: int, subcommand: str) -> Resolved:
    """`diffs`: (differences, run folder) for every run with a run.json."""
    where = f"none of the {len(diffs)} run(s) under {root}" if diffs else f"no run under {root}"
    if diffs:
        nearest, nearest_dir = min(diffs, key=lambda x: (len(x[0]), -int(x[1].name.split("_")[1])))
        where += f" has this config's training settings (the nearest, {nearest_dir.name}, differs in " \
                 f"{identity.describe(nearest)})"
    else:
        where += " has this config's training settings"
    if unknown:
        where += f"; {unknown} run(s) without {identity.RUN_JSON} (made before runs had one) are not compared"
    if subcommand != "fit":
        raise UserError(f"{flag}: {where}. Pass --ckpt_path PATH/TO.ckpt.")
    return Resolved(None, None, message=f"{flag}: {where}; starting a fresh run.")


def _checkpoint_of(kind: str, run_dir: Path, record: dict, why: str, subcommand: str) -> Resolved:
    flag = f"--ckpt_path {kind}"
    ckpts = run_dir / CHECKPOINTS
    candidates = [p for p in run_dir.glob(HPC_GLOB) if p.is_file()]
    if kind == "last" and (ckpts / LAST).is_file():
        candidates.append(ckpts / LAST)
    best = sorted((p for p in ckpts.glob("*.ckpt") if p.name != LAST and not p.name.startswith(".")),
                  key=os.path.getmtime) if ckpts.is_dir() else []
    best_text = f"its best checkpoint is {best[-1]}" if best else "it has no other checkpoint"
    if not candidates:
        if kind == "hpc":
            raise UserError(f"{flag}: {why} holds no hpc_ckpt_*.ckpt (Lightning saves one on SLURM's requeue signal); "
                            f"{best_text}. Use --ckpt_path last, or pass a checkpoint with --ckpt_path PATH.")
        if best or subcommand != "fit":
            raise UserError(f"{flag}: {why} has no {LAST}; {best_text}. Pass it with --ckpt_path PATH, or leave out "
                            "--ckpt_path for a fresh run. No older run is resumed instead.")
        return Resolved(None, run_dir, record,
                        f"{flag}: {why} was stopped before its first checkpoint; starting it again in its folder.")
    newest = max(candidates, key=os.path.getmtime)
    try:
        load_light(newest)
    except UserError as e:
        cut = damage(newest)
        said = f"which is {cut}" if cut else f"which cannot be read ({str(e).split(': ', 1)[-1]})"
        raise UserError(f"{flag}: {why} ends with {newest}, {said}; "
                        f"{best_text}. Pass that with --ckpt_path PATH to go on from it, or leave out --ckpt_path for "
                        "a fresh run. No older run is resumed instead.") from None
    return Resolved(str(newest), run_dir, record, f"{flag}: resuming {newest} ({why})")

