"""What tests/test_cluster_runs.py adds to real runs with --trainer.callbacks+=tests.cluster_helpers.X,
and what it reads back (TensorBoard event files)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytorch_lightning as pl


class SignalDuringValidation(pl.Callback):
    """Sends a real signal to this process when validation batch `batch` starts (not in the sanity check)."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, batch: int = 1, sig: str = "SIGTERM") -> None:
        self.batch, self.sig = batch, sig

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == self.batch and not trainer.sanity_checking:
            print(f"cluster_helpers: sending {self.sig} at validation batch {batch_idx}", flush=True)
            os.kill(os.getpid(), getattr(signal, self.sig))


def scalars(run_dir: str | os.PathLike, tag: str, kind: str = "scalars") -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard shows it: every event file of the folder, a resumed attempt's
    SessionLog START dropping what a killed one logged after its checkpoint. kind "images": (step, None)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir)), size_guidance={kind: 0})
    acc.Reload()
    if tag not in acc.Tags()[kind]:
        return []
    if kind == "images":
        return [(e.step, None) for e in acc.Images(tag)]
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class FlushLogs(pl.Callback):
    """Flushes the TensorBoard event file after every training batch: what its 120 s timer does in a long
    epoch, so events logged after the last checkpoint are on disk when the process is killed."""

    changes_training = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        for logger in trainer.loggers:
            logger.save()
