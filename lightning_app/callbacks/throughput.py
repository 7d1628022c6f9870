"""Images per second and the share of step time spent waiting for data, and the end-of-fit diagnosis."""
from __future__ import annotations

import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from lightning_app.log_steps import logs_this_step

INPUT_BOUND_FRAC = 0.3


class TrainSpeedMonitor(pl.Callback):
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
        self._every = {"images": 0, "seconds": 0.0, "wait": 0.0}  # the first steps too: for a fit too short to skip
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
        for acc in (self._window, self._every) + ((self._total,) if self._steps > self.skip_steps else ()):
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
        t = self._total if self._total["seconds"] > 0 else self._every
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
    return (f"compute-bound: {pct}% of step time waiting for data; a faster model step (AMP, channels_last, compile) "
            "would help.")
