"""Checkpoints a run can resume from: last.ckpt on SIGTERM, and a best checkpoint that holds its weights."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException

from datamodules.processes import dead_workers
from lightning_app.callbacks import finite_loss, stop_signals


class CheckpointOnSigterm(pl.Callback):
    """On a stop signal agreed by every rank (callbacks/stop_signals.py), save and exit 0 (130 after Ctrl-C).

    - SIGTERM (what SLURM and Kubernetes send before preemption, to one process or to all) or Ctrl-C: every rank
      stops at the same batch and `last.ckpt` is saved, so `--ckpt_path last` resumes from it.
    - SLURM's requeue signal (SIGUSR1, `--signal=SIGUSR1@120` in scripts/slurm/train.sbatch): the same stop,
      saved as the run's `hpc_ckpt_K.ckpt`; then rank 0 runs `scontrol requeue`.
    - A train loader worker that died (datamodules/processes/dead_workers.py): the same stop, saving `last.ckpt`,
      then rank 0 prints the paragraph naming every rank's dead workers and the run exits with EXIT_WORKER_DIED.
      A validation loader worker that died in the fit's validation too: the validation ends whole with new workers
      (datamodules/processes/evaluation_loader.py), and the stop follows at the epoch's end.

    Lightning 2.6 raises SIGTERMException once `trainer.received_sigterm` is true (here: the agreed flag) but
    saves nothing, and never in predict: here a predict stops at the next batch as validate and test do. Only a
    fit saves: an interrupted evaluation never replaces last.ckpt (docs/design.md,
    "Checkpoints").
    """

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, filename: str = "last") -> None:
        self.filename = filename

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        stop_signals.install(trainer)  # before Trainer._run registers the signal handlers

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if dead_workers.recorded:  # a loader worker died fetching this batch: the step it was in, for its paragraph
            dead_workers.stamp(trainer.current_epoch + 1, trainer.global_step + 1)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if dead_workers.recorded and trainer.state.fn == TrainerFn.FITTING:  # a validation worker died in it
            dead_workers.stamp(trainer.current_epoch + 1, trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if trainer.world_size > 1 and stop_signals.agreement_due(trainer):
            stop_signals.install(trainer).agree()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1:  # Lightning's fit loop checks the flag right after this hook (fit_loop.py)
            stop_signals.install(trainer).agree()

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        # Lightning's predict loop reads no stop flag (loops/prediction_loop.py); its evaluation loop stops here
        # (loops/evaluation_loop.py, `_evaluation_step`): the same stop, exit 130 after Ctrl-C, 143 after SIGTERM
        if not trainer.predict_loop.batch_progress.is_last_batch and trainer.received_sigterm:
            raise SIGTERMException

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        decision = stop_signals.install(trainer).decision
        stop_signals.last_decision, stop_signals.last_saved = decision, False
        if trainer.state.fn != TrainerFn.FITTING:
            return
        try:  # every rank together, as the save would be
            finite_loss.refuse_non_finite(trainer)
        except finite_loss.NonFiniteTraining as diverged:
            finite_loss.last_stop = str(diverged)  # cli.main says it and exits EXIT_NON_FINITE; nothing is saved
            return
        if decision == stop_signals.REQUEUE:
            # one name for every rank: each would list the folder on its own (checkpoint_connector.hpc_save_path)
            path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
            trainer.save_checkpoint(path, weights_only=False)
            self._say(trainer, stop_signals.NAMES[decision], path)
            stop_signals.last_saved = True
            if trainer.is_global_zero:
                status = stop_signals.slurm_requeue()
                rank_zero_info("Requeued the SLURM job." if status == 0 else
                               f"`scontrol requeue` failed (exit status {status}): the job is not requeued.")
            return
        deaths = all_dead_workers(trainer) if decision == stop_signals.WORKER_DIED else []
        path = self._last_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        self._say(trainer, stop_signals.NAMES.get(decision, "SIGTERM"), path)
        stop_signals.last_saved = True
        if deaths and trainer.is_global_zero:  # the run's last word, on stderr as the other fault paragraphs
            workers = getattr(trainer.train_dataloader, "num_workers", None)
            print(dead_workers.paragraph(deaths, workers, trainer.world_size, path), file=sys.stderr, flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A persistent loader worker that dies after its loader's last batch of the fit (a train worker in the last
        # validation, a validation worker after it delivered the last validation's batches) is read by nobody: the
        # loader never asks it for a batch again (torch's liveness check runs only while a batch is awaited:
        # dataloader.py, `_try_get_data`), and the fit ends as finished. Nothing is lost then (every epoch trained
        # and scored, last.ckpt saved at the last validation's end), so the run stays finished, exit 0; the
        # paragraph says the node's OOM killer is at work. Every rank gathers its deaths here (on_train_end runs on
        # each after the last save); a stop never reaches it.
        for loader in _loaders(trainer.val_dataloaders):
            dead_workers.record_ended(list(getattr(getattr(loader, "_iterator", None), "_workers", [])), "validation")
        deaths = all_dead_workers(trainer, epoch=trainer.current_epoch)  # the epochs done: the last one, from 1
        if deaths and trainer.is_global_zero:
            workers = getattr(trainer.train_dataloader, "num_workers", None)
            last = self._last_path(trainer)
            print(dead_workers.paragraph(deaths, workers, trainer.world_size, last if os.path.isfile(last) else None,
                                         finished=True), file=sys.stderr, flush=True)

    def _last_path(self, trainer: pl.Trainer) -> str:
        ckpt = trainer.checkpoint_callback
        dirpath = ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath else os.path.join(
            trainer.default_root_dir, "checkpoints")
        return os.path.join(dirpath, self.filename + ModelCheckpoint.FILE_EXTENSION)

    @staticmethod
    def _say(trainer: pl.Trainer, what: str, path: str) -> None:
        ranks = f" (all {trainer.world_size} processes stopped at this step)" if trainer.world_size > 1 else ""
        rank_zero_info(f"{what}: saved {path} in epoch {trainer.current_epoch + 1}, step {trainer.global_step}"
                       f"{ranks}; resume with --ckpt_path last.")


def _loaders(loaders) -> list:
    return [] if loaders is None else list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def all_dead_workers(trainer: pl.Trainer, epoch: int | None = None) -> list[dead_workers.DeadWorker]:
    """The train loader workers that died on every rank (every rank calls this together: one all_gather_object);
    those not placed yet are placed at `epoch` (from 1; default: the epoch in progress) and the current step."""
    dead_workers.record_ended(list(getattr(getattr(trainer.train_dataloader, "_iterator", None), "_workers", [])))
    dead_workers.stamp(trainer.current_epoch + 1 if epoch is None else epoch, trainer.global_step)
    mine = [dataclasses.replace(d, rank=trainer.global_rank) for d in dead_workers.recorded]
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return mine
    ranks: list = [None] * trainer.world_size
    dist.all_gather_object(ranks, mine)
    return [d for rank in ranks for d in rank]


class ResumableCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose best checkpoint always holds the weights its score was measured on, whose
    last.ckpt is refreshed at every save point, and whose file names count epochs from 1.

    - A step (or time) save only refreshes last.ckpt; the top-k save runs at the save point right after each
      validation, with the weights that validation scored.
    - last.ckpt is written at every save point, whether or not the metric improved.
    - `{epoch}` in a file name is the number of the epoch the weights come from, counted from 1.

    Lightning's ModelCheckpoint does each of these differently (docs/design.md, "Checkpoints"). The save point
    is Lightning's: the end of the training epoch when validation runs once per epoch (or not at all), else the
    end of each validation.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._validated_since_top_k = False

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        finite_loss.refuse_non_finite(trainer)  # never a checkpoint of NaN weights: last.ckpt keeps the last finite
        super()._save_checkpoint(trainer, filepath)

    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        candidates = super()._monitor_candidates(trainer)
        candidates["epoch"] = torch.tensor(trainer.current_epoch + 1)  # the epoch in progress or just ended, from 1
        return candidates

    def _skip(self, trainer: pl.Trainer) -> bool:
        """Lightning's reasons not to save, without "already saved at this step" (a step save of last.ckpt
        at the step a validation follows must not cancel that validation's top-k save)."""
        from pytorch_lightning.trainer.states import TrainerFn

        return bool(trainer.fast_dev_run) or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if self._skip(trainer) or not self._step_save_due(trainer):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _step_save_due(self, trainer: pl.Trainer) -> bool:
        """Lightning's every_n_train_steps / train_time_interval trigger (ModelCheckpoint.on_train_batch_end)."""
        due = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if self._train_time_interval is not None and (trainer.world_size == 1 or stop_signals.agreement_due(trainer)):
            # with several processes, decided together on the steps that log (not Lightning's pickled broadcast at
            # every batch, callbacks/model_checkpoint.py): the time save lands up to log_every_n_steps steps late
            now = time.monotonic()
            last = self._last_time_checked
            time_due = last is not None and now - last >= self._train_time_interval.total_seconds()
            time_due = bool(stop_signals.largest_of_all_ranks(trainer, int(time_due)))
            if time_due:
                self._last_time_checked = now
            due = due or time_due
        return due and self._last_global_step_saved != trainer.global_step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._skip(trainer):
            return
        self._validated_since_top_k = True
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_point(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._skip(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._save_point(trainer)

    def _save_point(self, trainer: pl.Trainer) -> None:
        candidates = self._monitor_candidates(trainer)
        if self._every_n_epochs >= 1:
            top_k_due = (trainer.current_epoch + 1) % self._every_n_epochs == 0
        else:  # step or time saves: every validation's score is judged, with the weights it was measured on
            top_k_due = self._validated_since_top_k
        if top_k_due:
            self._save_topk_checkpoint(trainer, candidates)
            self._validated_since_top_k = False
        if self.save_last:
            self._save_last_checkpoint(trainer, candidates)
