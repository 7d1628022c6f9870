"""Callbacks on by default: throughput and data-wait monitor; a progress bar on a terminal, one line per
epoch in a log file."""
from __future__ import annotations

import sys
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ProgressBar, TQDMProgressBar
from pytorch_lightning.utilities import rank_zero_info

INPUT_BOUND_FRAC = 0.3


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether the training step now running is one whose metrics go to the logger (every
    log_every_n_steps): Lightning's own test, the same before, during and after the step
    (trainer/connectors/logger_connector/logger_connector.py, `should_update_logs`). Work that needs a
    host-device sync (a .item(), a float turned into a device tensor) belongs on these steps only."""
    return bool(trainer._logger_connector.should_update_logs)


class ThroughputMonitor(pl.Callback):
    """Logs `perf/train_img_s` (all processes) and `perf/data_wait_frac` (time waiting for data).

    Data wait is the time between the end of one training step and the start of the next:
    fetching the batch from the loader. The first `skip_steps` steps of a run (worker start,
    cudnn autotuning, compilation) are left out of the fit-level summary.
    """

    def __init__(self, skip_steps: int = 5) -> None:
        self.skip_steps = skip_steps
        self.summary: dict = {}
        self._reset_window()
        self._total = {"images": 0, "seconds": 0.0, "wait": 0.0}
        self._steps = 0

    def _reset_window(self) -> None:
        self._window = {"images": 0, "seconds": 0.0, "wait": 0.0}

    def on_train_start(self, trainer, pl_module) -> None:
        # a run resumed mid-epoch gets no on_train_epoch_start for that epoch
        self._last_end = time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        self._wait = now - self._last_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        log_now = logs_this_step(trainer)
        if log_now and pl_module.device.type == "cuda":  # never touch CUDA on a --trainer.accelerator cpu run
            torch.cuda.synchronize(pl_module.device)  # only when logging: make the window's time honest
        now = time.perf_counter()
        seconds = now - self._last_end
        self._last_end = now
        images = int(batch[0].shape[0]) if isinstance(batch, (tuple, list)) else 0
        self._steps += 1
        for acc in (self._window,) + ((self._total,) if self._steps > self.skip_steps else ()):
            acc["images"] += images
            acc["seconds"] += seconds
            acc["wait"] += self._wait
        if log_now and self._window["seconds"] > 0:
            w = self._window
            pl_module.log("perf/train_img_s", w["images"] / w["seconds"], on_step=True, on_epoch=False,
                          sync_dist=True, reduce_fx="sum")
            pl_module.log("perf/data_wait_frac", w["wait"] / w["seconds"], on_step=True, on_epoch=False,
                          sync_dist=True, reduce_fx="mean")
            self._reset_window()

    def on_fit_end(self, trainer, pl_module) -> None:
        t = self._total
        if t["seconds"] <= 0:
            return
        per_process = t["images"] / t["seconds"]
        wait_frac = t["wait"] / t["seconds"]
        self.summary = {
            "train_img_s": per_process * trainer.world_size,  # every rank runs the same steps
            "data_wait_frac": wait_frac,
            "diagnosis": diagnose(wait_frac),
        }
        rank_zero_info(f"Where the time went: {self.summary['diagnosis']}")


def diagnose(wait_frac: float) -> str:
    pct = round(100 * wait_frac)
    if wait_frac >= INPUT_BOUND_FRAC:
        return (f"input-bound: {pct}% of step time waiting for data; the LMDB or DALI backend, "
                "a downscaled copy or more workers would help.")
    return f"compute-bound: {pct}% of step time waiting for data; a faster model step (AMP, channels_last, compile) would help."


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

    `epoch 3/15: train/loss 0.912, val/acc1 0.8120, 1,544 images/s, 12.3 s` (rank 0 only). A
    ProgressBar subclass, so Lightning adds no bar of its own (callback_connector._configure_progress_bar).
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._reset()

    def _reset(self) -> None:
        self._t0 = time.perf_counter()
        self._images = 0
        self._loss_sum: torch.Tensor | float = 0.0  # summed on the device, read once at the epoch's end
        self._loss_n = 0
        self._validated = False

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if isinstance(batch, (tuple, list)) and hasattr(batch[0], "shape"):
            self._images += int(batch[0].shape[0])
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
        if seconds > 0 and self._images:
            # every rank runs the same number of steps on equal batches
            parts.append(f"{self._images * trainer.world_size / seconds:,.0f} images/s")
        parts.append(f"{seconds:.1f} s")
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        print(f"epoch {trainer.current_epoch + 1}{total}: " + ", ".join(parts), flush=True)


def progress_callback() -> ProgressBar:
    """A tqdm bar on a terminal (stderr, where tqdm draws), one line per epoch otherwise."""
    return LogFriendlyProgressBar() if sys.stderr.isatty() else EpochLineProgress()
