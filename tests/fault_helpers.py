"""Callbacks that tests add with --trainer.callbacks+=tests.fault_helpers.X to inject real faults."""
from __future__ import annotations

import os
import signal

import pytorch_lightning as pl


class SignalAt(pl.Callback):
    """Sends a real signal to this process when a training batch of `epoch`/`batch` starts.

    batch 0 of an epoch is an epoch boundary: the checkpoint saved at the end of the previous
    epoch is the newest. Only the process with global rank `rank` (all if -1) is signalled.
    """

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int = 0, sig: str = "SIGKILL", rank: int = -1) -> None:
        self.epoch, self.batch, self.sig, self.rank = epoch, batch, sig, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch) and self.rank in (-1, trainer.global_rank):
            print(f"fault_helpers: sending {self.sig} at epoch {self.epoch} batch {self.batch}", flush=True)
            os.kill(os.getpid(), getattr(signal, self.sig))
