"""python -m lightning_app.sweep --config configs/ddp_amp.yaml --space configs/sweeps/lr_wd.yaml --trials 20
       [--workers K] [--study DIR] [--resume] [--section.key value ...]

An Optuna study over the settings the space file names (space.py); every other `--section.key value` flag goes to
every trial. Each trial is a `python main.py fit` of its own (runner.py) in ROOT/version_N; the study lives in a
journal file in the sweep folder (storage.py; default ROOT/sweeps/<space file's name>), which any number of these
processes share: --workers threads here, SLURM array tasks elsewhere (scripts/slurm/sweep.sbatch). It ends with
trials.md, sweep.png and best.yaml in that folder (report.py). Bad input: one paragraph, exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import threading
from pathlib import Path

import yaml

from datamodules.budget.cpus import usable_cpus
from lightning_app.errors import EXIT_USER_ERROR, UserError
from lightning_app.module import ImageClassifier
from lightning_app.runs.folders import write_atomically
from lightning_app.sweep import report, storage
from lightning_app.sweep.placement import crowded_workers, split_cpus, split_gpus, visible_gpus
from lightning_app.sweep.pruning import SPACE_COPY
from lightning_app.sweep.runner import Sweep, say
from lightning_app.sweep.space import check_objective, locate, place_of, read_space

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # SIGUSR1: SLURM's warning before a requeue


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_app.sweep", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[1],
                                     epilog="Every other --section.key value flag is passed to every trial.")
    parser.add_argument("--config", action="append", default=[], help="main.py's --config, for every trial")
    parser.add_argument("--space", required=True, help="the space file (YAML), e.g. configs/sweeps/lr_wd.yaml")
    parser.add_argument("--trials", type=int, default=20, help="complete + pruned trials the study reaches")
    parser.add_argument("--workers", type=int, default=1, help="trials run at the same time by this process")
    parser.add_argument("--study", type=Path, default=None, help="the sweep folder (default ROOT/sweeps/SPACE)")
    parser.add_argument("--share-gpus", action="store_true",
                        help="let --workers exceed the GPUs here: the trials at a time share them (slower each)")
    parser.add_argument("--resume", action="store_true",
                        help="first finish this job's (or host's) interrupted trials from their last.ckpt")
    parser.add_argument("--stale-after", type=float, default=600.0,
                        help="seconds without a heartbeat after which another process's trial counts as dead")
    return parser


def split_pass_through(extra: list[str]) -> list[str]:
    """The flags for main.py: `--section.key value` or `--section.key=value`; anything else is refused."""
    out, i = [], 0
    while i < len(extra):
        word = extra[i]
        if not (word.startswith("--") and "." in word.split("=", 1)[0]):
            raise UserError(f"{word!r} is not an option of python -m lightning_app.sweep, nor a `--section.key value` "
                            "flag for the trials (such as --trainer.max_epochs 5); see --help.")
        if word.split("=", 1)[0] == "--ckpt_path" or word.startswith("--ckpt_path"):
            raise UserError("--ckpt_path cannot be given to a sweep: every trial is a fresh fit; --resume finishes "
                            "interrupted trials from their own last.ckpt.")
        if "=" in word or i + 1 >= len(extra) or extra[i + 1].startswith("--"):
            out.append(word)
            i += 1
        else:
            out += [word, extra[i + 1]]
            i += 2
    return out


def fit_config(base_args: list[str]) -> dict:
    """The full config of `python main.py fit BASE_ARGS` (--print_config, in this process): every setting the CLI
    knows, and a parse error (one short paragraph, cli_parser.py) for a bad pass-through flag or config."""
    from lightning_app.cli import main as cli_main

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            cli_main(["fit", *base_args, "--print_config"])
            code = 0
        except SystemExit as stop:
            code = stop.code or 0
    if code:
        raise UserError(f"The trials' command `python main.py fit {' '.join(base_args)}` does not parse: "
                        f"{' '.join(errors.getvalue().split())}")
    return yaml.safe_load(printed.getvalue())


def check_one_node(config: dict) -> None:
    """A trial is a process of this host: its ranks are the GPUs of its share here, never other nodes'."""
    nodes = (config.get("trainer") or {}).get("num_nodes") or 1
    if int(nodes) != 1:
        raise UserError(f"--trainer.num_nodes {nodes}: a sweep's trial runs on the host of its sweep process, on "
                        "the GPUs of its share. Sweep on several nodes as a SLURM array, one sweep process per node "
                        "(scripts/slurm/sweep.sbatch), with --trainer.num_nodes 1.")


def run(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.trials < 1 or args.workers < 1:
        raise UserError(f"--trials {args.trials} and --workers {args.workers} must both be 1 or more.")
    storage.import_optuna()
    space = read_space(args.space)
    base_args = [w for c in args.config for w in ("--config", c)] + split_pass_through(extra)
    config = fit_config(base_args)
    places = locate(space, config)
    check_objective(space, ImageClassifier.EPOCH_METRICS)
    check_one_node(config)
    shares, unused = split_gpus(visible_gpus(), args.workers, args.share_gpus)
    cpu_blocks = split_cpus(sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
                            args.workers)
    for key in report.pass_through(base_args)[1]:
        places.setdefault(key, place_of(key, config) or tuple(key.split(".")))
    root = Path((config.get("trainer") or {}).get("default_root_dir") or "logs")
    folder = (args.study or root / "sweeps" / Path(args.space).stem).absolute()
    session = storage.session()
    seed = space.sampler_seed(session)
    study = storage.open_study(folder, space, space.make_sampler(seed), space.make_pruner())
    storage.check_fixed(study, folder, base_args)
    storage.record_session(study, session, seed)
    write_atomically(folder / SPACE_COPY, Path(args.space).read_bytes())  # what each trial's process reads
    sweep = Sweep(folder, space, base_args, args.trials, args.stale_after, study)
    say(f"study {folder} ({storage.JOURNAL}); {args.trials} trials, {args.workers} at a time here; trials in {root}")
    for sig in STOP_SIGNALS:
        signal.signal(sig, sweep.on_signal)
    with storage.Heartbeat(folder):
        if args.resume:
            resumed = sweep.claim_own_interrupted()
            say(f"--resume: finishing interrupted trial(s) {resumed} first." if resumed else
                "--resume: no interrupted trial of this job here; new trials only.")
        for line in (crowded_workers(args.workers, len(visible_gpus()), usable_cpus(), args.share_gpus), unused):
            if line:
                say(line)
        workers = [threading.Thread(target=sweep.work, args=(shares[i], cpu_blocks[i]), name=f"sweep-worker-{i}")
                   for i in range(args.workers)]
        for worker in workers:
            worker.start()
        for worker in workers:
            while worker.is_alive():  # a timed join: the main thread must stay free to run the signal handler
                worker.join(0.5)
    written = report.write(study, folder, space, places, base_args, root)
    say(report.table(study, space, root).split("\n", 1)[0] + " " + report.best_line(study, space) + ".")
    say("written: " + ", ".join(str(p) for p in written))
    if sweep.crashed:
        print(f"sweep: a worker failed:\n{sweep.crashed}", file=sys.stderr, flush=True)
        return 1
    if sweep.stop_signal:
        say(f"stopped by {signal.Signals(sweep.stop_signal).name}; run again with --resume to finish its trials.")
        if sweep.stop_signal == signal.SIGUSR1 and "SLURM_JOB_ID" in os.environ:
            # SLURM's warning before the time limit or a preemption (scripts/slurm/sweep.sbatch): the trials have
            # saved, so this task goes back in the queue and its next start resumes them (SLURM_RESTART_COUNT > 0)
            from lightning_app.callbacks.stop_signals import slurm_requeue

            status = slurm_requeue()
            say("requeued this SLURM task." if status == 0 else f"`scontrol requeue` failed (exit status {status}).")
        return 128 + sweep.stop_signal
    if sweep.gave_up:
        print(f"sweep: stopped after {sweep.fails_in_a_row} failed trials in a row; the last was "
              f"{sweep.last_failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UserError as error:
        print(f"sweep: {str(error).strip()}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
