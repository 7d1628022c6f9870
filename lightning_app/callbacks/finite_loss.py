"""A non-finite loss stops the run, and no checkpoint is ever written from non-finite weights.

Every training step adds a few device ops to a flag kept on the device (is the loss finite? if not, which batch
was the first?): no host sync. The flag is read where the step syncs already: on the steps that log (the same
agreement points as the stop signals', callbacks/stop_signals.py `agreement_due`), at the end of every training
epoch, and before every checkpoint save (`refuse_non_finite`, which also checks the weights themselves: a step can
turn finite weights into NaN with a finite loss, and the next loss is only seen a step later). With several
processes the ranks agree with one all_reduce(MIN) of the first bad batch, so a NaN on one rank stops every rank at
the same point. The run then raises `NonFiniteTraining`: `python main.py` prints its paragraph and exits with
EXIT_NON_FINITE; the checkpoints on disk are those of the last finite save.

Cost: per step, 4 element-wise ops on 0-dim device tensors (isfinite, compare, and, where) and an add; per logging
step and per epoch end, one 8-byte all_reduce (several processes) and one host read; per save, one isfinite pass
over the weights (a read of the model's memory) and one host read, beside a save that copies them all to the host.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from lightning_app.callbacks.stop_signals import agreement_due

EXIT_NON_FINITE = 3  # docs/clusters.md, "Faults": distinct from a bad setting (2) and a lost peer (1)
CLEAN = torch.iinfo(torch.int64).max  # "no bad batch" in the all_reduce(MIN)
last_stop = ""  # the paragraph of a stop signal's save refused for non-finite weights (cli.main says it)
WEIGHTS_ONLY = CLEAN - 1  # finite losses, non-finite weights: a rank's bad batch, if any, wins the MIN


class NonFiniteTraining(RuntimeError):
    """The loss or the weights became NaN or infinite; the message is the paragraph `main.py` prints."""


class StopOnNonFiniteLoss(pl.Callback):
    """Keeps the device flag of the training losses and stops the fit on the first non-finite one."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self) -> None:
        self._first_bad: torch.Tensor | None = None  # index of the first non-finite batch of this fit, or -1
        self._batches: torch.Tensor | None = None  # training batches of this fit so far
        self._start_step = 0  # trainer.global_step when this fit started

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self._batches = torch.zeros((), dtype=torch.int64, device=device)
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and self._first_bad is not None:
            first = (self._first_bad < 0) & ~torch.isfinite(loss.detach()).all()
            self._first_bad = torch.where(first, self._batches, self._first_bad)
            self._batches.add_(1)
        if agreement_due(trainer):
            self.check(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)

    def first_bad_batch(self, trainer: pl.Trainer, weights_finite: torch.Tensor | None = None) -> int | None:
        """The first non-finite batch of this fit on any rank (WEIGHTS_ONLY: the weights alone are not finite), or
        None; every rank calls this at the same point."""
        if self._first_bad is None:
            bad = torch.full((), CLEAN, dtype=torch.int64, device=trainer.strategy.root_device)
        else:
            bad = torch.where(self._first_bad < 0, torch.full_like(self._first_bad, CLEAN), self._first_bad)
        if weights_finite is not None:
            bad = torch.where(weights_finite.to(bad.device), bad, torch.clamp(bad, max=WEIGHTS_ONLY))
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        value = int(bad.item())
        return None if value == CLEAN else value

    def check(self, trainer: pl.Trainer, weights_finite: torch.Tensor | None = None) -> None:
        bad = self.first_bad_batch(trainer, weights_finite)
        if bad is not None:
            accumulate = max(1, trainer.accumulate_grad_batches)
            step = None if bad == WEIGHTS_ONLY else self._start_step + bad // accumulate + 1
            raise NonFiniteTraining(paragraph(trainer, step))


def weights_finite(pl_module: pl.LightningModule) -> torch.Tensor:
    """A 0-dim bool device tensor: every floating-point parameter and buffer is finite (no sync)."""
    tensors = [t for t in pl_module.state_dict().values() if torch.is_tensor(t) and t.is_floating_point()]
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=pl_module.device)
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def refuse_non_finite(trainer: pl.Trainer) -> None:
    """Before a checkpoint save, on every rank at once: raise NonFiniteTraining if any rank's loss since the start
    of the fit or the weights are not finite, so that nothing on disk is overwritten with them."""
    guard = next((c for c in trainer.callbacks if isinstance(c, StopOnNonFiniteLoss)), None) or StopOnNonFiniteLoss()
    guard.check(trainer, weights_finite(trainer.lightning_module))


def last_finite_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint of this run on disk: every save was checked, so it holds finite weights."""
    callback = trainer.checkpoint_callback
    for path in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", ""),
                 trainer.ckpt_path):
        if path and os.path.isfile(path):
            return str(path)
    return None


def paragraph(trainer: pl.Trainer, step: int | None) -> str:
    optimizers = trainer.optimizers
    lr = optimizers[0].param_groups[0]["lr"] if optimizers else math.nan
    set_lr = (trainer.lightning_module.hparams.get("lr") if trainer.lightning_module is not None else None)
    what = (f"the training loss became NaN or infinite at step {step}" if step is not None else
            f"the weights became NaN or infinite by step {trainer.global_step}")
    ranks = f" (on at least one of the {trainer.world_size} processes; all stopped)" if trainer.world_size > 1 else ""
    checkpoint = last_finite_checkpoint(trainer)
    kept = (f"The last finite checkpoint is {checkpoint}, kept as it was: nothing was saved from these weights."
            if checkpoint else "No checkpoint was saved before it, and none was saved from these weights.")
    return (f"Training diverged: {what}, in epoch {trainer.current_epoch + 1}{ranks}, at learning rate {lr:.4g} "
            f"(--model.lr {set_lr if set_lr is not None else 'from the recipe'} per 256 images, scaled to the global "
            f"batch). {kept} Start again with a lower --model.lr (a tenth, say), a longer warm-up "
            f"(--model.warmup_epochs), or gradient clipping (--trainer.gradient_clip_val 1.0); "
            f"--trainer.detect_anomaly true names the operation that first made a NaN (slowly).")
