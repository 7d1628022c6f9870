"""How a command ends: the `Done:` line after a fit, and for each way a run stops (a stop signal, a diverged fit,
a user error, a taken port, a lost peer) its paragraph and exit status."""
from __future__ import annotations

import sys
import traceback

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_only
from pytorch_lightning.utilities.exceptions import SIGTERMException

from datamodules.processes import dead_workers
from lightning_app import trackers
from lightning_app.callbacks import finite_loss, stop_signals
from lightning_app.callbacks.throughput import TrainSpeedMonitor
from lightning_app.errors import EXIT_USER_ERROR, find_user_error, paragraph, show_traceback
from lightning_app.strategies import ClusterDDPStrategy
from lightning_app.strategies.peers import describe_distributed_failure, describe_taken_port


def done_line(trainer: pl.Trainer, with_trackers: bool) -> str:
    """`Done: best val/acc1 ...; N epochs; images/s (P processes); [decode]; best checkpoint ...[; trackers]`."""
    best = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    monitor = next((c for c in trainer.callbacks if isinstance(c, TrainSpeedMonitor)), None)
    img_s = monitor.summary.get("train_img_s") if monitor else None
    # a sweep's ReportToStudy (lightning_app/sweep/pruning.py) that stopped this trial says after which epoch
    pruned = next((c.pruned_at for c in trainer.callbacks if getattr(c, "pruned_at", None) is not None), None)
    epochs = trainer.current_epoch
    parts = [
        f"best val/acc1 {float(best):.4f}" if best is not None else "best val/acc1 n/a",
        f"{epochs} epoch{'' if epochs == 1 else 's'}" + (f" (pruned by the sweep after epoch {pruned})"
                                                        if pruned is not None else ""),
        f"{img_s:,.0f} images/s ({trainer.world_size} process{'es' if trainer.world_size > 1 else ''})"
        if img_s else "images/s n/a",
    ]
    from datamodules.sample.decode_report import decode_line

    decoding = decode_line(getattr(trainer.datamodule, "device_decoders", None) or {})
    if decoding:
        parts.append(decoding)
    counts = getattr(getattr(trainer.datamodule, "datasets", {}).get("train"), "decode_counts", None)
    if counts is not None and counts.line():  # region decode (datamodules/sample/region.py)
        parts.append(counts.line())
    if trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path:
        parts.append(f"best checkpoint {trainer.checkpoint_callback.best_model_path}")
    if with_trackers:  # the default line stays as it was: TensorBoard's
        parts += trackers.describe(trainer.loggers)
    return "Done: " + "; ".join(parts)


def exit_for(error: BaseException) -> None:
    """Raises the SystemExit that ends a run stopped by `error`, after its paragraph; returns for an error none of
    ours explains (the caller re-raises it, traceback and all)."""
    if isinstance(error, SIGTERMException):  # a stop signal, saved by CheckpointOnSigterm
        if finite_loss.last_stop:  # ... unless the weights were not finite
            say_diverged(finite_loss.last_stop)
        raise SystemExit(stop_signals.exit_status()) from None
    if isinstance(error, finite_loss.NonFiniteTraining):
        say_diverged(str(error))
    if not isinstance(error, Exception):
        return
    unsaved = dead_workers.unsaved_paragraph(error)
    if unsaved:  # a loader worker died where no stop could save
        print(unsaved, file=sys.stderr, flush=True)
        raise SystemExit(dead_workers.EXIT_WORKER_DIED) from None
    user_error = find_user_error(error)
    if user_error is not None:
        if show_traceback():
            traceback.print_exception(error)
        # once, from rank 0 (the other ranks exit quietly), or from each rank an error says it concerns
        if rank_zero_only.rank == 0 or getattr(user_error, "every_rank", False):
            print(paragraph(user_error), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    taken = describe_taken_port(error)  # a setting (MASTER_PORT), not a lost peer
    if taken is not None:
        print(taken, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    message = describe_distributed_failure(error, ClusterDDPStrategy.last_timeout_s, ClusterDDPStrategy.last_rank)
    if message is not None:
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(1) from error


def say_diverged(text: str) -> None:
    """A diverged fit (lightning_app/callbacks/finite_loss.py): its paragraph once, from rank 0; every rank exits
    with EXIT_NON_FINITE."""
    if rank_zero_only.rank == 0:
        print(text, file=sys.stderr, flush=True)
    raise SystemExit(finite_loss.EXIT_NON_FINITE) from None
