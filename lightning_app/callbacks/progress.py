"""Progress: a bar on a terminal, one line per epoch in a log file."""
from __future__ import annotations

import sys
import time

import torch
from pytorch_lightning.callbacks import ProgressBar, TQDMProgressBar

from lightning_app.log_steps import logs_this_step


class LogFriendlyProgressBar(TQDMProgressBar):
    """A tqdm bar that redraws every step on a terminal, but rarely when output goes to a file.

    It shows the training loss of the last step that was logged: reading it every step would be a
    host-device sync every step (`logs_this_step`).
    """

    def __init__(self, refresh_rate: int | None = None, file_refresh_rate: int = 100) -> None:
        if refresh_rate is None:
            refresh_rate = 1 if sys.stdout.isatty() else file_refresh_rate
        super().__init__(refresh_rate=refresh_rate)
        self._loss: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and logs_this_step(trainer):
            self._loss = float(loss.detach())
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        if self._loss is not None:
            items["train/loss"] = f"{self._loss:.3f}"
        return items


class EpochLineProgress(ProgressBar):
    """What a log file gets instead of a bar: one plain line per epoch, no cursor-movement escapes.

    `epoch 3/15: train/loss 0.912, val/acc1 0.8120, 1,544 images/s, 12.3 s` (rank 0 only). The images/s are the
    training's, from the epoch's start to its last training step (every rank's images); the seconds are the whole
    epoch's, its validation included. A ProgressBar subclass, so Lightning adds no bar of its own
    (callback_connector._configure_progress_bar).
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._reset()

    def _reset(self) -> None:
        self._t0 = self._trained_until = time.perf_counter()
        self._images = 0
        self._loss_sum: torch.Tensor | float = 0.0  # summed on the device, read once at the epoch's end
        self._loss_n = 0
        self._validated = False

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def on_train_start(self, trainer, pl_module) -> None:
        # a run resumed mid-epoch gets no on_train_epoch_start for that epoch (fit_loop.on_advance_start): without
        # this its line counted the start-up since the command line made this callback
        self._reset()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if isinstance(batch, (tuple, list)) and hasattr(batch[0], "shape"):
            self._images += int(batch[0].shape[0])
        self._trained_until = time.perf_counter()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss_sum = self._loss_sum + loss.detach().float()
            self._loss_n += 1

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated = self._validated or not trainer.sanity_checking

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not (self._enabled and trainer.is_global_zero):
            return
        seconds = time.perf_counter() - self._t0
        parts = []
        if self._loss_n:
            parts.append(f"train/loss {float(self._loss_sum) / self._loss_n:.4f}")
        acc = trainer.callback_metrics.get("val/acc1")
        if acc is not None and self._validated:  # not a stale value on epochs without validation
            parts.append(f"val/acc1 {float(acc):.4f}")
        training = self._trained_until - self._t0
        if training > 0 and self._images:
            # every rank runs the same number of steps on equal batches
            parts.append(f"{self._images * trainer.world_size / training:,.0f} images/s")
        parts.append(f"{seconds:.1f} s")
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        print(f"epoch {trainer.current_epoch + 1}{total}: " + ", ".join(parts), flush=True)


def progress_callback() -> ProgressBar:
    """A tqdm bar on a terminal (stderr, where tqdm draws), one line per epoch otherwise."""
    return LogFriendlyProgressBar() if sys.stderr.isatty() else EpochLineProgress()
