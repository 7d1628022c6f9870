"""Preemption agreed by every rank: a stop signal only sets a flag; the ranks compare flags at fixed steps and
stop together.

Lightning 2.6 does it otherwise (pytorch_lightning/trainer/connectors/signal_connector.py and
loops/training_epoch_loop.py): its SIGTERM handler broadcasts from inside the handler, the loop broadcasts rank 0's
flag (and reads it back with `.item()`) at the start of every batch, and raises on the *local* flag at the end of the
batch. With the signal on one rank, or on each rank at a different moment, the ranks leave the loop at different
batches; the save that follows is a collective (a barrier; PowerSGD's state), and the collectives pair up wrongly
until the timeout. Its SLURM handler saves a checkpoint from inside the signal handler.

Here (`StopSignals`, which takes the trainer's `_signal_connector` seat):
- the handlers of SIGTERM, SIGINT (Ctrl-C; a second one ends the process at once, exit status 130), and of
  SLURM's requeue signal (SIGUSR1) under SLURM with auto-requeue (in a sweep's trial under SLURM, a stop as
  SIGTERM is), record the signal and do nothing else;
- the ranks agree with one `all_reduce(MAX)` of their flags on the steps that already sync for logging
  (`trainer.log_every_n_steps`; every 50 steps when logging is off) and at the end of every training epoch;
- `trainer.received_sigterm` is the *agreed* flag, so Lightning's own checks raise SIGTERMException on every rank
  at the same batch; `CheckpointOnSigterm` then saves on every rank together (one `last.ckpt`, or for the requeue
  signal one `hpc_ckpt_K.ckpt` and `scontrol requeue`) and the run exits 0 (130 after Ctrl-C);
- Lightning's per-batch broadcast is switched off (the epoch loop's `_broadcast_sigterm_tensor`);
- a validation inside the fit is never cut: the stop follows its end, so every epoch is scored once;
- a train loader worker that died (datamodules/processes/dead_workers.py) is a request too, WORKER_DIED: the loader
  goes on with new workers to the agreement, then every rank stops and saves as on SIGTERM, and the run exits
  with EXIT_WORKER_DIED and a paragraph naming the worker. A validation loader worker's death in a fit is the same
  request: the validation goes on with new workers to its end, and every rank stops at the epoch's end
  (datamodules/processes/evaluation_loader.py).

With one process the flag is the decision, at the end of the running training batch, as in Lightning.
"""
from __future__ import annotations

import os
import signal
from types import FrameType

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector
from pytorch_lightning.trainer.states import TrainerFn

from datamodules.processes import dead_workers
from lightning_app.runs.launch import sweep_trial

AGREE_EVERY_WITHOUT_LOGGING = 50  # steps between agreements when trainer.log_every_n_steps is 0
# what a rank asks for (Ctrl-C, SIGTERM, a dead loader worker, requeue); the largest wins
NONE, INTERRUPT, STOP, WORKER_DIED, REQUEUE = 0, 1, 2, 3, 4
NAMES = {INTERRUPT: "Ctrl-C (SIGINT)", STOP: "SIGTERM", WORKER_DIED: "A dead loader worker",
         REQUEUE: "SLURM requeue signal"}
last_decision, last_saved = NONE, False  # what stopped this process's last run, and whether it saved (cli.main)


def exit_status() -> int:
    """A fit stopped and saved: 0 (130 after Ctrl-C, so a shell's `fit && test` does not go on); an evaluation
    stopped: 128 + the signal, as the shell reports a process a signal ended; a fit a dead loader worker stopped:
    EXIT_WORKER_DIED, saved or not."""
    if last_decision == INTERRUPT:
        return 130
    if last_decision == WORKER_DIED:
        return dead_workers.EXIT_WORKER_DIED
    return 0 if last_saved else 128 + signal.SIGTERM


class StopSignals(_SignalConnector):
    """The trainer's signal connector with flag-only handlers and an agreed `received_sigterm`."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._agreed = NONE
        super().__init__(trainer)
        self.requested = NONE  # set by the handlers of this process only

    # Lightning's loops read trainer.received_sigterm (this connector's attribute) to decide to stop
    @property
    def received_sigterm(self) -> bool:
        # A validation inside the fit is never cut. Cut, its epoch would never be scored: the checkpoint holds the
        # val loop part-way, and the resumed run does not run it again (Lightning goes back into a validation only
        # from inside a batch: loops/training_epoch_loop.py `advance`, `restarted_mid_evaluation`), so the
        # best-checkpoint callback never sees that epoch. With several processes its ranks may also run different
        # numbers of batches (DALI's per-rank val slices), and its end is a collective. The stop follows it, where
        # Lightning's loops check the flag again (training_epoch_loop.py and fit_loop.py, on_advance_end): after
        # the epoch-end save of the best checkpoint (docs/clusters.md, "Preemption and requeue", says how long).
        if self.trainer.validating and self._fitting():
            return False
        return self.decision != NONE

    def _fitting(self) -> bool:
        return self.trainer.state.fn == TrainerFn.FITTING

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:  # _SignalConnector.__init__ and register_signal_handlers
        self._agreed = STOP if value else NONE

    @property
    def decision(self) -> int:
        """NONE, STOP or REQUEUE: what every rank does. With one process, or outside a fit (nothing is saved, so
        a rank that stops alone leaves no collective behind it but the lost-peer error), what this one was asked."""
        if self.trainer.world_size == 1 or not self._fitting():
            return self.asked()
        return self._agreed

    def asked(self) -> int:
        """What this process asks for: its signals, and in a fit a loader worker that died (datamodules/processes/
        dead_workers.py: the train loader went on with new workers to this point)."""
        died = WORKER_DIED if dead_workers.recorded and self._fitting() else NONE
        return max(self.requested, died)

    def requeue_signal(self) -> signal.Signals | None:
        env = self.trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            return env.requeue_signal
        return None

    def register_signal_handlers(self) -> None:
        self._agreed, self.requested = NONE, NONE
        dead_workers.forget()
        dead_workers.restart_evaluation = self._fitting()  # a fit's validation goes on with new workers
        self._original_handlers = self._get_current_signal_handlers()
        self._register_signal(signal.SIGTERM, self._note)
        if self.trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING):
            # Ctrl-C stops at the next batch, as SIGTERM does, and exits 130 (exit_status); Lightning's own path (a
            # KeyboardInterrupt: trainer/call.py, "attempting graceful shutdown") exits 1, the lost peer's status.
            # Lightning's predict loop reads no flag: CheckpointOnSigterm.on_predict_batch_end stops it.
            self._register_signal(signal.SIGINT, self._note)
        if self._fitting():
            self._register_signal(signal.SIGINT, self._note)
            requeue = self.requeue_signal()
            if requeue is not None:
                self._register_signal(requeue, self._note)
            elif sweep_trial() and "SLURM_JOB_ID" in os.environ:
                # a sweep's trial does not see its SLURM task (sweep/placement.py), but SLURM's warning signal
                # (`--signal=SIGUSR1@120`) reaches every process of the step, the trial's too; by default it would
                # end the fit unsaved. It saves and stops, as on SIGTERM; the sweep requeues its task.
                self._register_signal(signal.SIGUSR1, self._note)
        # the loop's broadcast of rank 0's flag before every batch (loops/training_epoch_loop.py, advance)
        self.trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.requested == INTERRUPT:  # the second Ctrl-C
                self._stop_at_once()
            if self.requested == NONE and self.trainer.global_rank == 0 and not self._fitting():
                os.write(2, b"\nCtrl-C: stopping at the next batch, saving nothing; press Ctrl-C again to stop at "
                            b"once.\n")
            elif self.requested == NONE and self.trainer.global_rank == 0:
                # os.write: a handler may interrupt a print of the main thread, and print is not reentrant
                os.write(2, b"\nCtrl-C: the run stops at the next step every process agrees on (after the running "
                            b"validation, if any) and saves last.ckpt; press Ctrl-C again to stop at once without "
                            b"saving.\n")
            asked = INTERRUPT
        else:
            asked = REQUEUE if signum == self.requeue_signal() else STOP
        self.requested = max(self.requested, asked)

    def _stop_at_once(self) -> None:
        """The second Ctrl-C: end this process now, with exit status 130, saving nothing.

        Not by raising KeyboardInterrupt, as Python's own handler does: Lightning catches it for a "graceful
        shutdown" (trainer/call.py, `_call_and_handle_interrupt`: the exception hooks, a teardown that joins the
        loader workers, exit status 1), and raised from a handler it can land where it is swallowed (an
        `__del__`, a `finally` that raises again), so the run went on to its agreed stop and saved anyway. The
        ranks Lightning's launcher started are SIGKILLed (they may wait in a collective); loader workers end with
        this process (datamodules/processes/loader_workers.py). A checkpoint save under way is cut: its temp file
        is removed by the next run (lightning_app/runs/lock.py) and last.ckpt stays the previous one; a predict's part
        files are removed first (PredictionsCSV.discard_unfinished)."""
        for callback in self.trainer.callbacks:  # files a callback leaves half-written (predict's part files)
            discard = getattr(callback, "discard_unfinished", None)
            if discard is not None:
                discard()
        launcher = self.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signal.SIGKILL)
        if self.trainer.global_rank == 0:
            os.write(2, b"\nCtrl-C again: stopped at once, without saving; --ckpt_path last resumes from the last "
                        b"checkpoint saved.\n")
        os._exit(130)

    def agree(self) -> int:
        """Every rank calls this at the same step: the largest request of any rank becomes the decision."""
        if self.trainer.world_size > 1:
            self._agreed = max(self._agreed, largest_of_all_ranks(self.trainer, self.asked()))
        return self.decision

    def teardown(self) -> None:
        super().teardown()
        dead_workers.restart_evaluation = False
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def _no_broadcast() -> None:
    return None


def install(trainer: pl.Trainer) -> StopSignals:
    """Put a StopSignals in the trainer's connector seat (before Trainer._run registers the handlers)."""
    if not isinstance(trainer._signal_connector, StopSignals):
        trainer._signal_connector = StopSignals(trainer)
    return trainer._signal_connector


def largest_of_all_ranks(trainer: pl.Trainer, value: int) -> int:
    """The largest `value` of all ranks: one all_reduce(MAX) of one integer and one host sync (a collective: every
    rank calls it at the same point)."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return value
    flag = torch.tensor([value], dtype=torch.int32, device=trainer.strategy.root_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def agreement_due(trainer: pl.Trainer) -> bool:
    """Whether this training step is an agreement point: a step that logs, the same on every rank. Called in
    on_train_batch_end, before Lightning counts the step (training_epoch_loop.py: `_batches_that_stepped` grows
    in on_advance_end; logger_connector.py `should_update_logs` adds the same 1)."""
    every = trainer.log_every_n_steps or AGREE_EVERY_WITHOUT_LOGGING
    return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0


def slurm_requeue(job_id: str | None = None) -> int:
    """`scontrol requeue JOB` (rank 0 only), as Lightning's own SLURM handler runs it; its exit status."""
    import subprocess

    if job_id is None:
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        job_id = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]
    try:
        return subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        return 127
