"""Checkpoints a run can resume from: last.ckpt on SIGTERM, and a best checkpoint that holds its weights."""
from __future__ import annotations

import os
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException


class CheckpointOnSigterm(pl.Callback):
    """On SIGTERM (what SLURM and Kubernetes send before preemption), save `last.ckpt` and exit 0.

    Lightning 2.6 catches SIGTERM, finishes the running batch and raises SIGTERMException, but saves nothing:
    this saves the state at that batch boundary as last.ckpt, so `--ckpt_path last` resumes from it. Only a fit
    saves: an interrupted evaluation never replaces last.ckpt (docs/design.md, "Checkpoints").
    """

    def __init__(self, filename: str = "last") -> None:
        self.filename = filename

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        ckpt = trainer.checkpoint_callback
        dirpath = ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath else os.path.join(
            trainer.default_root_dir, "checkpoints")
        path = os.path.join(dirpath, self.filename + ModelCheckpoint.FILE_EXTENSION)
        trainer.save_checkpoint(path, weights_only=False)
        rank_zero_info(
            f"SIGTERM: saved {path} in epoch {trainer.current_epoch + 1}, step {trainer.global_step}; "
            "resume with --ckpt_path last."
        )


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
        if self._train_time_interval is not None:
            now = time.monotonic()
            last = self._last_time_checked
            time_due = last is not None and now - last >= self._train_time_interval.total_seconds()
            time_due = trainer.strategy.broadcast(time_due)  # one decision for every rank
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
