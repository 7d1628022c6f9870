"""Chaos check for runs on a cluster: two SLURM jobs sharing one root, each "requeued" after random kills.

Job A (lr 0.1, SLURM_JOB_ID 9101) and job B (lr 0.2, SLURM_JOB_ID 9202) train side by side on the built-in
data into one --root. Each attempt of a job gets a random SIGTERM (preemption) or SIGKILL at a random time,
then the job is restarted with SLURM_RESTART_COUNT + 1 and --ckpt_path last, as scripts/slurm/train.sbatch
does. The first attempt is only killed once its run folder exists: before that, a requeue has nothing of
its own to resume and stops with one paragraph, which is the designed behaviour, not a chaos result.
After the last attempt (not killed) finishes, it checks:
- each job ended in exactly one run, its own (run.json lists only its job), with its own lr in config.yaml,
  run.json and last.ckpt, and all its epochs trained;
- every epoch logged exactly once (val/acc1 once per epoch, train/loss once per step, in order), read from
  the TensorBoard event files as TensorBoard shows them;
- nothing in a run came from the other job's processes (event files and run.json attempts name their pids).

    python scripts/chaos_requeue.py --root /tmp/chaos --kills 5 --seed 1

Prints what each round killed and one PASS/FAIL line (exit status 0/1); writes ROOT/chaos_report.json and
each attempt's log to ROOT/attempts/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOBS = (("A", "9101", 0.1), ("B", "9202", 0.2))
BATCH = 40


def fit_args(opts: argparse.Namespace, lr: float) -> list[str]:
    return ["fit", "--data.builtin", opts.preset, "--data.batch_size", str(BATCH), "--data.num_workers", "0",
            "--trainer.max_epochs", str(opts.epochs), "--trainer.default_root_dir", str(opts.root / "logs"),
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.log_every_n_steps", "1",
            "--trainer.num_sanity_val_steps", "0", "--model.arch_kwargs", "{width: 8}", "--model.lr", str(lr)]


def run_of(root: Path, job_id: str) -> Path | None:
    from lightning_app.runs import identity

    found = [d for d in sorted(root.glob("version_*")) if (r := identity.read_run(d)) and job_id in identity.jobs_of(r)]
    return found[0] if len(found) == 1 else None


def last_step(run: Path | None) -> str:
    import torch

    try:
        return str(torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True,
                              mmap=True)["global_step"])
    except Exception:  # noqa: BLE001 - none yet (or the run folder does not exist yet)
        return "none"


class Job(threading.Thread):
    def __init__(self, name: str, job_id: str, lr: float, opts: argparse.Namespace, rng: random.Random) -> None:
        super().__init__(name=f"job-{name}")
        self.label, self.job_id, self.lr, self.opts, self.rng = name, job_id, lr, opts, rng
        self.pids: list[int] = []
        self.rounds: list[dict] = []
        self.final_rc: int | None = None

    def run(self) -> None:
        logs = self.opts.root / "logs"
        for restart in range(self.opts.kills + 1):
            env = {**os.environ, "SLURM_JOB_ID": self.job_id, "SLURM_RESTART_COUNT": str(restart),
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            cmd = [sys.executable, "main.py", *fit_args(self.opts, self.lr),
                   *(["--ckpt_path", "last"] if restart else [])]
            log = self.opts.root / "attempts" / f"{self.label}_{restart}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            self.pids.append(proc.pid)
            started = time.monotonic()
            if restart == self.opts.kills:  # the last attempt runs to the end
                self.final_rc = proc.wait()
                self.report(restart, "not killed: runs to the end", proc.returncode, time.monotonic() - started, logs)
                return
            if restart == 0:  # until the job's run folder exists
                while proc.poll() is None and run_of(logs, self.job_id) is None:
                    time.sleep(0.05)
            delay = self.rng.uniform(0, self.opts.max_delay)
            sig = self.rng.choice((signal.SIGTERM, signal.SIGKILL))
            try:
                proc.wait(timeout=delay)
                what = f"finished before its {sig.name} was due"
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
                what = f"{sig.name} {time.monotonic() - started:.1f} s after start"
                proc.wait()
            self.report(restart, what, proc.returncode, time.monotonic() - started, logs)
            if what.startswith("finished") and proc.returncode == 0:
                self.final_rc = 0
                return

    def report(self, restart: int, what: str, rc: int, seconds: float, logs: Path) -> None:
        run = run_of(logs, self.job_id)
        row = {"job": self.label, "restart": restart, "pid": self.pids[-1], "what": what, "exit": rc,
               "seconds": round(seconds, 1), "run": run.name if run else None, "last_ckpt_step": last_step(run)}
        self.rounds.append(row)
        print(f"job {self.label} (SLURM_JOB_ID {self.job_id}, restart {restart}): {what}; exit {rc}; "
              f"run {row['run']}, last.ckpt at step {row['last_ckpt_step']}", flush=True)


def check(job: Job, opts: argparse.Namespace, steps_per_epoch: int) -> list[str]:
    """What is wrong with this job's run, as sentences (empty when all is well)."""
    import logging

    import torch
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_app.runs import identity

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # its note on each purge a resume asked for

    logs = opts.root / "logs"
    mine = [d for d in sorted(logs.glob("version_*")) if job.job_id in identity.jobs_of(identity.read_run(d) or {})]
    if len(mine) != 1:
        return [f"job {job.label}: {len(mine)} runs carry its job id ({[d.name for d in mine]})"]
    run, problems = mine[0], []
    record = identity.read_run(run)
    if job.final_rc != 0:
        problems.append(f"job {job.label}: its last attempt exited {job.final_rc}")
    if identity.jobs_of(record) != {job.job_id}:
        problems.append(f"{run.name}: run.json names jobs {sorted(identity.jobs_of(record))}")
    foreign = [a["pid"] for a in record["attempts"] if a["pid"] not in job.pids]
    if foreign:
        problems.append(f"{run.name}: run.json attempts from processes {foreign} that are not job {job.label}'s")
    event_pids = {int(p.name.split(".")[-2]) for p in run.glob("events.out.tfevents.*")}  # ...<host>.<pid>.<n>
    if event_pids - set(job.pids):
        problems.append(f"{run.name}: event files written by processes {sorted(event_pids - set(job.pids))}")
    lr_config = yaml.safe_load((run / "config.yaml").read_text())["model"]["lr"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    lrs = {"config.yaml": lr_config, "run.json": record["training"]["model"]["lr"],
           "last.ckpt": ckpt["hyper_parameters"]["lr"]}
    if any(v != job.lr for v in lrs.values()):
        problems.append(f"{run.name}: lr {lrs}, job {job.label}'s is {job.lr}")
    total = opts.epochs * steps_per_epoch
    if ckpt["global_step"] != total:
        problems.append(f"{run.name}: last.ckpt at step {ckpt['global_step']}, expected {total}")
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    val = [e.step for e in events.Scalars("val/acc1")]
    train = [e.step for e in events.Scalars("train/loss")]
    if len(val) != opts.epochs or val != sorted(set(val)):
        problems.append(f"{run.name}: val/acc1 logged at steps {val}, expected {opts.epochs} distinct epochs")
    if train != list(range(total)):
        problems.append(f"{run.name}: train/loss steps {train[:5]}...{train[-5:]} ({len(train)}), "
                        f"expected 0..{total - 1} once each")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Exit status 0 when every check passes.")
    ap.add_argument("--root", type=Path, required=True, help="empty folder for the runs (ROOT/logs), logs and report")
    ap.add_argument("--kills", type=int, default=5, help="random SIGTERM/SIGKILL requeues per job (default 5)")
    ap.add_argument("--epochs", type=int, default=30,
                    help="epochs per job (default 30: long enough that the kills land)")
    ap.add_argument("--preset", default="tiny", help="built-in dataset preset (default tiny: 240 train images, 32 px)")
    ap.add_argument("--max-delay", type=float, default=20.0, help="a kill comes 0..this many seconds into an attempt")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times and signals")
    opts = ap.parse_args(argv)
    opts.root = opts.root.absolute()
    if (opts.root / "logs").exists() and any((opts.root / "logs").iterdir()):
        ap.error(f"{opts.root / 'logs'} is not empty: give a fresh --root")
    (opts.root / "attempts").mkdir(parents=True, exist_ok=True)

    from datamodules.base import BUILTIN_ROOT
    from datamodules.builtin.tree import ensure_builtin

    data = Path(ensure_builtin(opts.preset, root=BUILTIN_ROOT))  # made once, before any kill
    steps_per_epoch = sum(1 for p in (data / "train").rglob("*.jpg")) // BATCH
    rng = random.Random(opts.seed)
    jobs = [Job(name, job_id, lr, opts, random.Random(rng.random())) for name, job_id, lr in JOBS]
    [job.start() for job in jobs]
    [job.join() for job in jobs]
    problems = [p for job in jobs for p in check(job, opts, steps_per_epoch)]
    report = {"rounds": [r for job in jobs for r in job.rounds], "problems": problems, "seed": opts.seed,
              "kills": opts.kills, "epochs": opts.epochs, "preset": opts.preset}
    (opts.root / "chaos_report.json").write_text(json.dumps(report, indent=1))
    for p in problems:
        print(f"FAIL: {p}")
    print(("PASS" if not problems else "FAIL") + f": 2 jobs x {opts.kills} random requeues into {opts.root / 'logs'}; "
          f"report {opts.root / 'chaos_report.json'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
