"""What keeps a run whole once the trainer starts: every rank on the same run, atomic checkpoints, logs on disk.

- `RunGuard.setup("fit")`: every rank shares what it resolved (checkpoint, its fingerprint, run folder, run id).
  A rank that differs from rank 0 stops every rank with one paragraph naming both, at once: the hook runs
  after the process group is up and before Lightning restores the checkpoint (trainer.py, `_run`).
- `RunGuard.on_save_checkpoint`: the loggers flush first, so what was logged before a checkpoint is on disk
  when the checkpoint is; a resumed run writes a TensorBoard SessionLog START at its first logged step, which
  drops what a killed attempt logged after its checkpoint (what SummaryWriter's purge_step writes); a logger with
  `drop_from_step(step)` (the CSV tracker) drops those rows itself; one line says what each dropped.
- `AtomicCheckpointIO`: the temp file sits beside the target and is fsynced before os.replace; Lightning's own
  goes through the system temp folder, a copy that a kill tears (docs/design.md, "Checkpoints").
"""
from __future__ import annotations

import os
import socket
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_info

from lightning_app.errors import UserError
from lightning_app.runs.folders import write_atomically


class RanksDisagree(UserError):
    """Printed by every rank that resolved differently and by rank 0: on separate nodes each log has it."""

    every_rank = True


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            write_atomically(path, lambda f: torch.save(checkpoint, f))
        except Exception as error:  # torch's "unexpected pos N vs M", a full disk behind it: lightning_app/disk_full.py
            from lightning_app.disk_full import DiskFull, checkpoint_bytes, no_space

            if no_space(error) is None:
                raise
            raise DiskFull(str(path), checkpoint_bytes(checkpoint)) from error


def use_atomic_checkpoints(trainer: pl.Trainer) -> None:
    """Swap in AtomicCheckpointIO where the strategy would use the plain TorchCheckpointIO."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()


class RunGuard(pl.Callback):
    """Holds what this process resolved before the trainer was made; see the module's docstring."""

    def __init__(self, checkpoint: str | None, fingerprint: str | None, run_dir: str | None, run_id: str | None,
                 made_here: bool, resumed: bool = False) -> None:
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "checkpoint": checkpoint,
                     "fingerprint": fingerprint, "run_dir": run_dir, "run_id": run_id, "made_here": made_here}
        self.purge_pending = resumed

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, {**self.mine, "rank": trainer.global_rank})
        problem = disagreement(views)
        if problem:
            differs = (trainer.global_rank == 0 or not _agrees(views[trainer.global_rank], views[0])
                       or self.mine["made_here"])
            # Every rank is here: leave the group together, or gloo aborts a process whose peer left first.
            dist.barrier()
            dist.destroy_process_group()
            raise RanksDisagree(problem) if differs else UserError(problem)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.purge_pending:
            return
        self.purge_pending = False
        if trainer.global_rank != 0:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # what this batch's metrics are logged with
        dropping = []
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment._get_file_writer().add_event(
                    Event(step=step, session_log=SessionLog(status=SessionLog.START)))
                dropping.append("TensorBoard")
            elif hasattr(logger, "drop_from_step"):  # the CSV tracker's rows (lightning_app/trackers/loggers.py)
                dropping.append(logger.drop_from_step(step))
        if dropping:
            rank_zero_info(f"Resumed at step {step}: {' and '.join(dropping)} drop what the stopped attempt logged "
                           "from that step on, which this run logs again.")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        for logger in trainer.loggers:
            logger.save()  # TensorBoardLogger: flush the event file (rank 0 only)


def _agrees(view: dict, first: dict) -> bool:
    if view["run_dir"] is None:  # no run folder of its own: it follows the one rank 0 uses
        if view["checkpoint"] is None:
            return first["checkpoint"] is None  # both start from scratch
        # a checkpoint outside any run: rank 0 made a fresh folder for it
        return first["made_here"] and view["fingerprint"] == first["fingerprint"]
    return (view["fingerprint"], view["run_id"]) == (first["fingerprint"], first["run_id"])


def _side(view: dict) -> str:
    where = f"rank {view['rank']} on {view['host']}"
    if view["checkpoint"]:
        return f"{where} resumes {view['checkpoint']} in {view['run_dir'] or 'no run folder'}"
    if view["run_dir"]:
        return f"{where} starts from scratch in {view['run_dir']}"
    return f"{where} found nothing to resume and starts a fresh run"


def disagreement(views: list[dict]) -> str | None:
    """One paragraph when the ranks did not resolve the same (checkpoint, run), else None."""
    first = views[0]
    others = [v for v in views[1:] if v["made_here"] or not _agrees(v, first)]
    if not others:
        return None
    other = others[0]
    if other["made_here"]:
        return (f"Two processes made a run folder: rank 0 on {first['host']} made {first['run_dir']} and rank "
                f"{other['rank']} on {other['host']} made {other['run_dir']}, taking itself for rank 0. Check the "
                "launcher's rank variables (RANK, LOCAL_RANK, NODE_RANK, SLURM_PROCID); delete the extra folder.")
    more = f" ({len(others) - 1} more rank(s) differ too)" if len(others) > 1 else ""
    return (f"The processes of this run resolved --ckpt_path differently, so they would train different states: "
            f"{_side(first)}; {_side(other)}{more}. Each process looks under its own --trainer.default_root_dir: on "
            "node-local disks they differ. Keep the runs on a filesystem every node sees, or pass "
            "--ckpt_path FILE with "
            "the same file on every node. Nothing was loaded or trained.")
