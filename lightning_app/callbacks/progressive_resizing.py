"""Progressive resizing: the train crop size follows a schedule over epochs (FFCV's recipe).

    trainer:
      callbacks:
        - class_path: lightning_app.callbacks.progressive_resizing.ProgressiveResizing
          init_args: {start_size: 160, end_size: 192, start_epoch: 11, end_epoch: 13}

The size of epoch e is in force for ALL of epoch e's batches, on every rank, after a resume too:
Lightning creates the first epoch's train iterator (and prefetches a batch) BEFORE
`on_train_epoch_start` (pytorch_lightning/loops/fit_loop.py `FitLoop.setup_data`), and later
epochs' iterators after it (`_TrainingEpochLoop.on_run_start`). So the size is set
- in `setup("fit")` for a fresh run (epoch 0),
- in `on_load_checkpoint` for a resumed one (the epoch the fit loop resumes at), both before the
  first iterator exists,
- in `on_train_epoch_start` for every later epoch, before that epoch's iterator exists.
If the first epoch's iterator was nevertheless made at another size, it is made again.

The model is built once from `model.image_size` (linked from `data.image_size`), so ResNet's
small-input stem choice stays what it was at the start, whatever sizes the schedule visits.
"""
from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info

from lightning_app.errors import UserError


def scheduled_size(epoch: int, start_size: int, end_size: int, start_epoch: int, end_epoch: int,
                   step: int = 32) -> int:
    """FFCV's `get_resolution`: start_size up to start_epoch, end_size from end_epoch on, and in
    between the linear interpolation rounded to a multiple of `step` (kept within the two sizes)."""
    if epoch <= start_epoch:
        return start_size
    if epoch >= end_epoch:
        return end_size
    size = start_size + (end_size - start_size) * (epoch - start_epoch) / (end_epoch - start_epoch)
    size = round(size / step) * step  # round() halves to even, like FFCV's np.round
    return min(max(size, min(start_size, end_size)), max(start_size, end_size))


class ProgressiveResizing(pl.Callback):
    """Sets the datamodule's train crop size every epoch and logs it as `train/image_size`.

    Args:
        start_size: train crop size (px) up to and including `start_epoch`.
        end_size: train crop size from `end_epoch` on (usually `data.image_size`).
        start_epoch, end_epoch: the ramp, in zero-based epochs (FFCV's start_ramp, end_ramp).
        step: sizes in the ramp are multiples of this (32 in FFCV; 8 or 16 for small images).
    """

    def __init__(self, start_size: int, end_size: int, start_epoch: int = 0, end_epoch: int = 1,
                 step: int = 32) -> None:
        if min(start_size, end_size, step) < 1:
            raise UserError(f"ProgressiveResizing sizes and step must be >= 1 px, got {start_size}, {end_size}, "
                            f"{step}.")
        if end_epoch <= start_epoch:
            raise UserError(f"ProgressiveResizing needs end_epoch > start_epoch, got {start_epoch} and {end_epoch}.")
        self.start_size, self.end_size = start_size, end_size
        self.start_epoch, self.end_epoch, self.step = start_epoch, end_epoch, step
        self._first_epoch_of_run = True
        self._started_at: int | None = None

    def size_at(self, epoch: int) -> int:
        return scheduled_size(epoch, self.start_size, self.end_size, self.start_epoch, self.end_epoch, self.step)

    def sizes(self, max_epochs: int | None) -> list[int]:
        """Every train size of a run of `max_epochs` epochs (the whole ramp when unknown), in order of use."""
        epochs = max_epochs if max_epochs and max_epochs > 0 else self.end_epoch + 1
        return list(dict.fromkeys(self.size_at(e) for e in range(epochs)))

    # -- where the size is set ------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._first_epoch_of_run = True
            self._apply(trainer, 0)
            # the loaders' memory plan budgets for the largest of them (datamodules/budget/memory.py)
            trainer.datamodule.scheduled_train_sizes = self.sizes(trainer.max_epochs)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":
            self._apply(trainer, resumed_epoch(checkpoint))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started_at = trainer.current_epoch  # the epoch Lightning's setup_data made the iterator for

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        changed = self._apply(trainer, trainer.current_epoch)
        if self._first_epoch_of_run:
            self._first_epoch_of_run = False
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            # After a mid-epoch resume the first epoch with this hook is the next one, whose iterator Lightning
            # makes after it (lightning_app/callbacks/reseed.py says why a second one would change its crops).
            if changed and fetcher is not None and trainer.current_epoch == self._started_at:
                iter(fetcher)  # this epoch's iterator was made before the hook, at the old size: make it again
        pl_module.log("train/image_size", float(trainer.datamodule.train_size), on_step=False, on_epoch=True,
                      rank_zero_only=True)

    def _apply(self, trainer: pl.Trainer, epoch: int) -> bool:
        """Put epoch `epoch`'s size in force; True when it changed."""
        size = self.size_at(epoch)
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "set_train_size"):
            raise UserError(
                f"ProgressiveResizing needs a datamodule with set_train_size(size); "
                f"{type(datamodule).__name__} has none. Use one of the datamodules.* backends."
            )
        if datamodule.train_size == size:
            return False
        datamodule.set_train_size(size)
        rank_zero_info(f"Progressive resizing: train crop {size} px from epoch {epoch + 1}.")  # counted from 1
        return True


def resumed_epoch(checkpoint: dict[str, Any]) -> int:
    """The epoch a fit resumed from `checkpoint` runs first: the fit loop's processed epochs
    (an epoch interrupted midway is run again from its start; a finished one is not)."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError):
        return int(checkpoint.get("epoch", 0))
