"""The line for an epoch shorter than the logging interval, said once a fit knows its epoch's length."""
from __future__ import annotations

import math

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info


def short_epoch_line(trainer: pl.Trainer) -> str | None:
    """What an epoch shorter than --trainer.log_every_n_steps logs, in the user's setting; None otherwise. The
    interval is left as set: the ranks agree on stop signals at its steps (callbacks/stop_signals.py), and moving
    them moved where a SIGTERM's save lands (cff809b). Lightning's own condition and warning, which names
    `Trainer(log_every_n_steps=...)`: loops/fit_loop.py, `setup_data` (silenced in lightning_app/errors.py)."""
    steps, every = trainer.num_training_batches, trainer.log_every_n_steps
    if not trainer.loggers or trainer.fast_dev_run or not math.isfinite(steps) or not 0 < steps < every:
        return None
    s = "s" if steps > 1 else ""
    return (f"An epoch has {int(steps)} training step{s}, fewer than --trainer.log_every_n_steps {every}: train/loss, "
            f"train/acc1 and train/lr are logged every {every} steps, not in every epoch (val/* at every epoch's "
            f"end). Pass --trainer.log_every_n_steps {int(steps)} or less for a train point in every epoch.")


class ShortEpochNote(pl.Callback):
    """Says `short_epoch_line` once a fit knows its epoch's length."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        line = short_epoch_line(trainer)
        if line:
            rank_zero_info(line)
