"""Elastic restarts under real torchrun (c10d rendezvous, 2 gloo processes on 127.0.0.1): a worker SIGKILLed
mid-epoch makes torchrun restart the group, which resumes its own run; without restarts the job ends with the
lost-peer paragraph."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from tests.helpers.cli import quick_args
from tests.helpers.event_files import scalars
from tests.helpers.processes import finish, free_port, start_command

pytestmark = pytest.mark.timeout(600)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


class KillOnce(pl.Callback):
    """SIGKILLs the process of global rank `rank` when training batch `batch` of `epoch` starts, in the first
    attempt only (TORCHELASTIC_RESTART_COUNT 0): the restarted group passes the same batch again."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int, rank: int = 1) -> None:
        self.epoch, self.batch, self.rank = epoch, batch, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and (trainer.current_epoch, batch_idx, trainer.global_rank) == (self.epoch, self.batch, self.rank):
            print(f"KillOnce: SIGKILL to rank {self.rank} at epoch {self.epoch} batch {self.batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _torchrun(data: Path, root: Path, restarts: int | None, epochs: int = 3) -> list[str]:
    # 240 train images, global batch 40 over 2 processes: 6 steps per epoch, a save every 2 steps
    elastic = ["--max-restarts", str(restarts)] if restarts is not None else []
    return [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", *elastic, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "elastic-test", "--monitor-interval", "0.5",
            "main.py", "fit", "--config", "configs/ddp.yaml", *quick_args(data, root, epochs=epochs, batch=40),
            "--trainer.devices", "2", "--trainer.num_sanity_val_steps", "0",
            "--trainer.strategy.init_args.timeout_s", "20", "--checkpoint.every_n_train_steps", "2",
            "--trainer.callbacks+=tests.test_elastic.KillOnce", "--trainer.callbacks.epoch=1",
            "--trainer.callbacks.batch=3"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "FIC_DDP_TIMEOUT_S": "20",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.slow
def test_a_restarted_group_resumes_its_own_run_to_the_end(tiny_data, tmp_path):
    rc, out = finish(start_command(_torchrun(tiny_data, tmp_path, restarts=1), _env()), timeout=480)
    assert rc == 0, out[-6000:]
    assert "KillOnce: SIGKILL" in out
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0"], out[-4000:]
    run = tmp_path / "version_0"
    assert "torchrun restarted the worker group (restart 1 of 1, rdzv elastic-test): resuming" in out, out[-4000:]
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (final["epoch"], final["global_step"]) == (2, 18)
    epochs = [step for step, _ in scalars(run, "val/acc1")]
    assert len(epochs) == 3 and len(set(epochs)) == 3, epochs  # every epoch's validation logged once
    record = json.loads((run / "run.json").read_text())
    elastic = [a.get("torchelastic") for a in record["attempts"]]
    assert [e["restart_count"] for e in elastic] == [0, 1], record["attempts"]
    assert {e["run_id"] for e in elastic} == {"elastic-test"}


@pytest.mark.slow
def test_without_restarts_the_job_ends_with_the_lost_peer_paragraph(tiny_data, tmp_path):
    rc, out = finish(start_command(_torchrun(tiny_data, tmp_path, restarts=None), _env()), timeout=240)
    assert rc != 0
    assert "KillOnce: SIGKILL" in out
    assert "Distributed run failed on rank 0 of 2 processes" in out, out[-4000:]
    assert "it lost rank 1" in out, out[-4000:]
