"""An exponential moving average of the weights that is used only once it has started.

Lightning's `EMAWeightAveraging` swaps its copy of the model in for validation and checkpoints even before a
delayed start (`update_starting_at_step/epoch`), and that copy is the random initialisation (docs/design.md,
"EMA"). Here, until the average has taken its first update (`AveragedModel.n_averaged`), validation,
checkpoints and the end of training use the live weights; the first update copies the live weights into the
average, so it starts from the weights being trained (those of `--model.weights` included).
"""
from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import EMAWeightAveraging as _LightningEMA


class DelayedStartEMA(_LightningEMA):
    """Lightning's EMAWeightAveraging (same arguments) that validates and saves the live weights until it starts."""

    _swapped = False

    @property
    def state_key(self) -> str:
        return "EMAWeightAveraging"  # the key of checkpoints saved before the class was renamed: their average loads

    def started(self) -> bool:
        """True once the average holds at least one update (read at validation and checkpoint time only)."""
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swapped = self.started()
        if self._swapped:
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            super().on_validation_epoch_end(trainer, pl_module)
        self._swapped = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.started():
            super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._average_model is not None and not self.started():
            # the live weights are what validate, test, predict and export will load; the averaging state
            # (n_averaged 0) still travels, so a resumed fit starts the average as this one would have
            checkpoint["state_dict"] = checkpoint["current_model_state"]
