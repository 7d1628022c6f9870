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


def scalars(run_dir: str | os.PathLike, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard shows it: every event file of the folder, a resumed attempt's
    purge_step dropping what a killed one logged after its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir)), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
