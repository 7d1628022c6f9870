"""Surviving faults: a checkpoint on SIGTERM, exact resumes at epoch boundaries, clear errors
when a peer process is lost."""
from __future__ import annotations

import os
import random

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException


class CheckpointOnSigterm(pl.Callback):
    """On SIGTERM (what SLURM and Kubernetes send before preemption), save `last.ckpt` and exit 0.

    Lightning 2.6 already catches SIGTERM: it finishes the running batch, then raises
    SIGTERMException (a SystemExit) on every rank, but saves nothing. This callback saves the
    state at that batch boundary into the checkpoint folder as last.ckpt, so `--ckpt_path last`
    resumes from it.
    """

    def __init__(self, filename: str = "last") -> None:
        self.filename = filename

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        ckpt = trainer.checkpoint_callback
        dirpath = ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath else os.path.join(
            trainer.default_root_dir, "checkpoints")
        path = os.path.join(dirpath, self.filename + ModelCheckpoint.FILE_EXTENSION)
        trainer.save_checkpoint(path)
        rank_zero_info(
            f"SIGTERM: saved {path} at epoch {trainer.current_epoch}, step {trainer.global_step}; "
            "resume with --ckpt_path last."
        )


class ReseedEveryEpoch(pl.Callback):
    """Makes each epoch's randomness (shuffle, augmentation) a function of (seed, epoch, rank) alone.

    Checkpoints do not hold the RNG states, so without this a run resumed at an epoch boundary
    shuffles and augments differently from an uninterrupted one. The reseed happens at the start
    of every epoch, before its DataLoader iterator is created. For the first epoch of a run (fresh
    or resumed) Lightning has already created that iterator, so it is created again after the
    reseed. Inactive unless seed_everything was given. Persistent DataLoader workers keep their
    own RNG across epochs: exact resumes need num_workers 0 or non-persistent workers.
    """

    def __init__(self) -> None:
        self._first_epoch_of_run = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_epoch_of_run = True

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
            if fetcher is not None:
                iter(fetcher)  # Lightning made this epoch's iterator before the hook: make it again


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "recv", "send",
              "timed out", "timeout", "nccl", "gloo", "socket", "store", "distbackenderror", "watchdog")


def describe_distributed_failure(error: BaseException, timeout_s: float | None,
                                 rank: tuple[int, int] | None = None) -> str | None:
    """A one-paragraph explanation when `error` is a lost peer or a collective timeout, else None."""
    if timeout_s is None:  # no DDP run was set up in this process
        return None
    text = f"{type(error).__name__}: {error}".lower()
    if not any(k in text for k in _PEER_LOST):
        return None
    rank, world = rank if rank else (os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?"))
    limit = f"{timeout_s:g} s"
    kind = "timed out" if ("timeout" in text or "timed out" in text) else "lost a peer"
    return (
        f"Distributed run failed on rank {rank} of {world} processes: {kind} (collective timeout {limit}). "
        "Another process (or node) died or stopped answering; its own log says why. "
        "Restart all processes with --ckpt_path last to resume. "
        "Set the timeout with --trainer.strategy.timeout_s or FIC_DDP_TIMEOUT_S. "
        f"Original error: {str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__}"
    )


class ResumableCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose last.ckpt is refreshed at every save point.

    Lightning 2.6 writes last.ckpt at the end of an epoch only when a top-k checkpoint was
    written in the same step: an epoch that does not improve the monitored metric leaves an
    older last.ckpt behind, and `--ckpt_path last` silently resumes from that older epoch.
    """

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def _refresh_last(self, trainer: pl.Trainer) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
