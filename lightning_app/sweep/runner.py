"""The trial runner: each worker (a thread) asks the study for a trial and runs it as an ordinary
`python main.py fit` in a process of its own, in its own run folder (ROOT/version_N), then tells the study how it
ended: COMPLETE with the objective's last reported value, PRUNED when the trial's ReportToStudy stopped it
(pruning.py) or when its loss diverged (exit status 3), FAIL when its process failed or died (a SIGKILL included:
the study never waits on it).

A subprocess per trial, not an in-process fit: a trial that crashes, leaks memory or is SIGKILLed takes nothing
else with it, and each trial gets the CLI's whole start-up (seed, run folder, lock) exactly as a user's run.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_app.callbacks.finite_loss import EXIT_NON_FINITE
from lightning_app.errors import EXIT_USER_ERROR
from lightning_app.runs.folders import CHECKPOINTS, HPC_GLOB, LAST
from lightning_app.runs.identity import record_sweep_outcome
from lightning_app.strategies.peers import taken_port_words
from lightning_app.sweep import storage
from lightning_app.sweep.placement import Ports, pinned, trial_environment
from lightning_app.sweep.pruning import DIR_ENV, TRIAL_ENV
from lightning_app.sweep.space import Space

# A trial gets SIGTERM when the thread of the sweep process that started it ends, a SIGKILL of the sweep process
# included (prctl PR_SET_PDEATHSIG, man 2 prctl; kept across execve): it saves its last.ckpt and ends, so no
# orphaned fit keeps reporting into a study whose other processes have failed its trial. setpriv sets it just
# before exec: a preexec_fn would run Python in a child forked from this threaded process.
DIE_WITH_THE_SWEEP = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []

MAIN = Path(__file__).resolve().parents[2] / "main.py"
LOGS = "trials"  # trials/trial_N.log: each trial's output
PORT_TRIES = 3  # starts of a trial whose rendezvous port another process took first
MAX_FAILS_IN_A_ROW = 3  # per sweep process: a setting every trial trips over stops the sweep instead of looping
REPORTER = "lightning_app.sweep.pruning.ReportToStudy"


def flag_value(value: Any) -> str:
    """A value as jsonargparse reads it from a flag."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


def trial_args(params: dict[str, Any]) -> list[str]:
    return [w for key, value in params.items() for w in (f"--{key}", flag_value(value))]


@dataclass
class Sweep:
    folder: Path
    space: Space
    base_args: list[str]  # --config ... and every pass-through flag, before the trial's own
    trials: int  # COMPLETE + PRUNED trials the study should reach
    stale_s: float
    study: Any = None
    stop: threading.Event = field(default_factory=threading.Event)
    stop_signal: int = 0
    resumable: list = field(default_factory=list)  # this process's own interrupted trials, to finish first
    _children: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    fails_in_a_row: int = 0
    last_failure: str = ""
    crashed: str = ""  # a worker thread's traceback: the sweep stops and exits 1, never 0
    _local: threading.local = field(default_factory=threading.local)

    @property
    def gave_up(self) -> bool:
        """Failed trials in a row enough to stop: MAX_FAILS_IN_A_ROW, and never more than the trials asked for (a
        space whose batch sizes do not fit the data stops after 1 trial for --trials 1, not 3)."""
        return self.fails_in_a_row >= min(MAX_FAILS_IN_A_ROW, max(1, self.trials))
    ports: Ports = field(default_factory=Ports)

    # -- signals ---------------------------------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: object) -> None:
        """SIGTERM / Ctrl-C / SLURM's SIGUSR1: no new trial; the running trials get SIGTERM (they save last.ckpt)
        and stay RUNNING, to be resumed; under SLURM the sweep then requeues its own task (__main__.py)."""
        self.stop_signal = self.stop_signal or signum
        self.stop.set()
        # What the trial's fit takes as "save and stop" (lightning_app/callbacks/stop_signals.py). Not SLURM's
        # requeue signal: a trial does not see the SLURM task (placement.py), so it has no handler for it. Never
        # SIGINT: Ctrl-C in a terminal reached the trials already (one process group), and a second SIGINT stops a
        # fit at once, without its save.
        with self._lock:
            for child in self._children:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

    # -- resume ----------------------------------------------------------------------------------------------
    def claim_own_interrupted(self) -> list[int]:
        """`--resume`: this process's own interrupted trials (same SLURM array task, or same host outside SLURM),
        each claimed by one process only; they run before any new trial."""
        for trial in storage.interrupted(self.study, self.folder, self.stale_s):
            owner = trial.user_attrs.get(storage.OWNER) or {}
            if storage.is_mine(owner) and storage.claim(self.folder, trial.number,
                                                        f"resume-{owner.get('host')}-{owner.get('pid')}"):
                self._set_attr(trial.number, storage.OWNER, storage.me())
                self.resumable.append(trial)
        return [t.number for t in self.resumable]

    # -- the worker loop -------------------------------------------------------------------------------------
    def work(self, gpus: str | None = None, cpus: list[int] | None = None) -> None:
        """One worker's loop; `gpus`: the CUDA_VISIBLE_DEVICES its trials get (split_gpus), `cpus` their CPUs
        (split_cpus); None: unchanged."""
        self._local.gpus, self._local.cpus = gpus, cpus
        try:
            self._work()
        except BaseException:  # noqa: BLE001 - a thread's exception would only be printed, and the sweep exit 0
            import traceback

            self.crashed = self.crashed or traceback.format_exc()
            self.stop.set()

    def _work(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                if self.gave_up:
                    return
                resumed = self.resumable.pop(0) if self.resumable else None
                if resumed is None:
                    storage.fail_stale(self.study, self.folder, self.stale_s)
                    counts = storage.count(self.study)
                    if counts["complete"] + counts["pruned"] + counts["running"] >= self.trials:
                        return
                    trial = self.study.ask({k: d.to_optuna() for k, d in self.space.parameters.items()})
                    number, params = trial.number, trial.params
                    self._set_attr(number, storage.OWNER, storage.me())
                    if self._told_as_before(number, params):
                        continue
                else:
                    number, params = resumed.number, resumed.params
            ckpt = newest_checkpoint(resumed.user_attrs.get(storage.RUN_DIR)) if resumed is not None else None
            self.run_trial(number, params, ckpt)

    def run_trial(self, number: int, params: dict[str, Any], ckpt: str | None) -> None:
        from optuna.trial import TrialState

        args = [*self.base_args, *trial_args(params), f"--trainer.callbacks+={REPORTER}",
                *(["--ckpt_path", ckpt] if ckpt else [])]
        log = self.folder / LOGS / f"trial_{number}.log"
        log.parent.mkdir(exist_ok=True)
        say(f"trial {number}: {'resuming ' + ckpt if ckpt else 'starting'}, " +
            ", ".join(f"{k}={flag_value(v)}" for k, v in params.items()) + f" (output: {log})")
        for attempt in range(1, PORT_TRIES + 1):
            port = self.ports.take()
            try:
                code = self._run_once(args, number, port, log)
            finally:
                self.ports.give_back(port)
            if code is None:  # the sweep was stopped before the trial started
                return
            if attempt == PORT_TRIES or not port_was_taken(code, log, port):
                break
            say(f"trial {number}: another process took port {port} before the trial's rank 0 listened on it; "
                "starting it again on another port.")
        frozen = self.study.get_trials(deepcopy=False)[number]
        values, ended = frozen.intermediate_values, code == 0 and storage.FIT_ENDED in frozen.user_attrs
        run_dir = frozen.user_attrs.get(storage.RUN_DIR)
        ranks = storage.ranks_of(frozen)
        if self.stop.is_set() and not ended:  # stopped by our signal (saved, exit 0): RUNNING, for --resume
            say(f"trial {number}: stopped (exit status {code}); `--resume` finishes it from its last.ckpt.")
            return
        with contextlib.suppress(Exception):  # already finished: another process failed it as stale
            if code == EXIT_NON_FINITE:
                # diverged (lightning_app/callbacks/finite_loss.py): an outcome of its settings, not a failure to
                # run, so PRUNED: it counts towards --trials, the sampler learns that its region is bad (optuna's
                # samplers treat a pruned trial as one that stopped early), and it is not one of the failures in a
                # row that stop the sweep
                self.study.tell(number, state=TrialState.PRUNED)
                self._mark_run(run_dir, "pruned", diverged=True, **ranks)
                say(f"trial {number}: diverged (a non-finite loss, exit status {code}): pruned; the sweep goes on.")
            elif ended and storage.PRUNED_AT in frozen.user_attrs:
                self.study.tell(number, state=TrialState.PRUNED)
                self._mark_run(run_dir, "pruned", pruned_at_epoch=frozen.user_attrs[storage.PRUNED_AT], **ranks)
                say(f"trial {number}: pruned after epoch {frozen.user_attrs[storage.PRUNED_AT]}.")
            elif ended and values:
                value = values[max(values)]
                self.study.tell(number, value)
                self._mark_run(run_dir, "complete", value=value, **ranks)
                say(f"trial {number}: {self.space.objective} {value:.4f}.")
            else:
                self.study.tell(number, state=TrialState.FAIL)
                self._mark_run(run_dir, "fail", **ranks)
                why = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}") if code \
                    else "its fit did not run to its end" if not ended else f"no {self.space.objective} reported"
                tail = "".join(log.read_text(errors="replace").splitlines(True)[-3:]).strip()
                say(f"trial {number}: failed ({why}); the sweep goes on. Its last lines ({log}):\n{tail}")
                with self._lock:
                    self.fails_in_a_row += 1
                    self.last_failure = f"trial {number} ({why}), whose output ends:\n{tail}"
                return
        with self._lock:
            self.fails_in_a_row = 0

    def _run_once(self, args: list[str], number: int, port: int, log: Path) -> int | None:
        """One start of the trial's fit on rendezvous port `port`; its exit status, None when the sweep is stopping."""
        env = {**trial_environment(os.environ, getattr(self._local, "gpus", None), port),
               DIR_ENV: str(self.folder), TRIAL_ENV: str(number), "PYTHONUNBUFFERED": "1"}
        # A requeued SLURM job's fit takes its own earlier run whatever --ckpt_path says (lightning_app/runs/
        # resolve.py): here a requeued array task starts new trials too, so each trial is a fresh fit, and an
        # interrupted one is resumed by its explicit last.ckpt.
        env.pop("SLURM_RESTART_COUNT", None)
        with open(log, "a") as out, self._lock:
            if self.stop.is_set():
                return None
            command = pinned([*DIE_WITH_THE_SWEEP, sys.executable, str(MAIN), "fit", *args],
                             getattr(self._local, "cpus", None))
            child = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
            self._children.add(child)
        try:
            return child.wait()
        finally:
            with self._lock:
                self._children.discard(child)

    def _told_as_before(self, number: int, params: dict[str, Any]) -> bool:
        """A trial whose settings a finished trial had is not run again: it ends as that one did (optuna's FAQ,
        "How can I ignore duplicated samples?"), and the journal says which it repeats."""
        from optuna.trial import TrialState

        earlier = storage.same_settings(self.study, params)
        if earlier is None:
            return False
        self._set_attr(number, storage.DUPLICATE_OF, earlier.number)
        if earlier.state == TrialState.PRUNED:
            self.study.tell(number, state=TrialState.PRUNED)
        else:
            self.study.tell(number, earlier.value)
        say(f"trial {number}: the settings of trial {earlier.number}, which ended "
            f"{'pruned' if earlier.value is None else f'at {earlier.value:.4f}'}: not run again.")
        return True

    @staticmethod
    def _mark_run(run_dir: str | None, state: str, **details: Any) -> None:
        """The trial's outcome into its run folder's run.json (identity.py); an unwritable one changes no outcome."""
        if run_dir:
            with contextlib.suppress(OSError):
                record_sweep_outcome(run_dir, state, **details)

    def _set_attr(self, number: int, key: str, value: Any) -> None:
        st = self.study._storage  # optuna/study/study.py keeps the storage there; the public API sets only study attrs
        st.set_trial_user_attr(st.get_trial_id_from_study_id_trial_number(self.study._study_id, number), key, value)


def newest_checkpoint(run_dir: str | None) -> str | None:
    """The checkpoint an interrupted trial goes on from: the newer of its run's checkpoints/last.ckpt (SIGTERM, or
    the last save point) and Lightning's hpc_ckpt_K.ckpt (SLURM's SIGUSR1); None when it saved neither. An explicit
    path, not `--ckpt_path last`: two trials may share every setting, and `last` picks by settings."""
    if not run_dir:
        return None
    found = [p for p in (Path(run_dir) / CHECKPOINTS / LAST, *Path(run_dir).glob(HPC_GLOB)) if p.is_file()]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def port_was_taken(code: int, log: Path, port: int) -> bool:
    """Whether a trial's fit stopped because another process held its rendezvous port (lightning_app/cli.py says so
    in one paragraph, exit 2): the sweep's free port is free when drawn (placement.Ports), not reserved until the
    trial's rank 0 listens on it."""
    if code != EXIT_USER_ERROR:
        return False
    with open(log, "rb") as text:
        text.seek(max(0, log.stat().st_size - 4096))
        return taken_port_words("127.0.0.1", port) in text.read().decode(errors="replace")


def say(line: str) -> None:
    print(f"sweep: {line}", flush=True)
