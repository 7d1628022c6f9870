"""Each epoch's randomness a function of (seed, epoch, rank) alone: exact resumes at epoch boundaries."""
from __future__ import annotations

import os
import random

import numpy as np
import pytorch_lightning as pl
import torch


class ReseedEveryEpoch(pl.Callback):
    """Makes each epoch's randomness (shuffle, augmentation) a function of (seed, epoch, rank) alone.

    Checkpoints do not hold the RNG states, so without this a run resumed at an epoch boundary
    shuffles and augments differently from an uninterrupted one. The reseed happens at the start
    of every epoch, before its DataLoader iterator is created. For the first epoch of a run (fresh
    or resumed at an epoch boundary) Lightning has already created that iterator, so it is created
    again after the reseed. Inactive unless seed_everything was given. Persistent DataLoader workers
    keep their own RNG across epochs: exact resumes at an epoch boundary need num_workers 0 or
    non-persistent workers.

    A run resumed mid-epoch gets the interrupted epoch's loader state from the checkpoint (its workers'
    seeds and generators: datamodules/resume.py) and Lightning calls no epoch-start hook for that epoch
    (fit_loop.py, `on_advance_start`). The next epoch's iterator is made after this hook
    (training_epoch_loop.py, `on_run_start`), as in an uninterrupted run: made here as well, it would
    draw one more base seed, or (persistent workers) prefetch batches and drop them, and that epoch's
    crops would differ from the uninterrupted run's.
    """

    # --ckpt_path last ignores it (lightning_app/runs/identity.py): it changes which random numbers a run draws, not
    # its settings, and runs made before it was listed in configs/callbacks/default.yaml record no callbacks
    changes_training = False

    def __init__(self) -> None:
        self._first_epoch_of_run = True
        self._started_at: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_epoch_of_run = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started_at = trainer.current_epoch  # the epoch Lightning's setup_data made the iterator for

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        base = os.environ.get("PL_GLOBAL_SEED")
        if base is None:
            return
        seed = (int(base) * 1_000_003 + trainer.current_epoch * 7919 + trainer.global_rank) % (2**32)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if self._first_epoch_of_run:
            self._first_epoch_of_run = False
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is not None and trainer.current_epoch == self._started_at:
                iter(fetcher)  # Lightning made this epoch's iterator before the hook: make it again
