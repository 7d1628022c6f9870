"""A diverged fit stops with exit status 3 and one paragraph, and never writes a checkpoint of non-finite weights
(lightning_app/callbacks/finite_loss.py): with one process, and with 2 real gloo processes whose loss is NaN on one
rank or on both."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_app.callbacks.finite_loss import EXIT_NON_FINITE
from tests.helpers.cli import quick_args, run_main
from tests.helpers.event_files import scalars
from tests.helpers.processes import finish_all, free_port, start_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _finite(path: Path) -> bool:
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return all(torch.isfinite(t).all() for t in saved["state_dict"].values() if t.is_floating_point())


def _nan_at(epoch: int, batch: int, rank: int = -1) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.NanBatchAt", f"--trainer.callbacks.epoch={epoch}",
            f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.rank={rank}"]


def _said_once(out: str) -> None:
    assert out.count("Training diverged") == 1 and "Traceback" not in out, out[-4000:]
    assert "--model.lr" in out and "--trainer.gradient_clip_val" in out and "--trainer.detect_anomaly true" in out


def test_a_learning_rate_that_diverges_stops_the_run_and_last_ckpt_keeps_the_last_finite_weights(tiny_data, tmp_path):
    # lr 1e6: the weights become infinite within the first epoch while the loss is still finite (seen: 1e16 at
    # step 4); the save at each step refuses them once they are, and last.ckpt stays at the step before
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path, epochs=2), "--data.image_size", "32",
                     "--model.lr", "1e6", "--checkpoint.every_n_train_steps", "1"], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NON_FINITE, out[-4000:]
    _said_once(out)
    checkpoints = tmp_path / "version_0" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert f"The last finite checkpoint is {os.path.realpath(last)}" in out
    assert "learning rate" in out and "(--model.lr 1000000.0 per 256 images" in out
    assert all(_finite(p) for p in checkpoints.glob("*.ckpt")) and last.is_file()


def test_a_nan_loss_stops_the_run_at_the_next_logging_step(tiny_data, tmp_path):
    # 7 steps per epoch; the NaN batch is the third step of epoch 2 (global step 10). The run logs (and reads the
    # flag) every step: it stops at step 10, not at the end of the epoch, and last.ckpt stays epoch 1's
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path, epochs=2), "--data.image_size", "32",
                     "--trainer.log_every_n_steps", "1", *_nan_at(1, 2)], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NON_FINITE, out[-4000:]
    _said_once(out)
    assert "the training loss became NaN or infinite at step 10, in epoch 2" in out
    run = tmp_path / "version_0"
    assert max(step for step, _ in scalars(run, "train/loss")) <= 10  # logged at step - 1 (Lightning's count)
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 7 and _finite(last)


def _env(port: int, rank: int) -> dict[str, str]:
    # what torchrun gives each process it starts (LOCAL_RANK set: Lightning's environment does not start ranks)
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
            and k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK")}
    return {**keep, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FIC_DDP_TIMEOUT_S": "60"}


@pytest.mark.parametrize("rank", [1, -1], ids=["nan-on-rank-1", "nan-on-both"])
def test_a_nan_loss_on_one_rank_stops_both_with_the_same_exit_status(tiny_data, tmp_path, rank):
    # 240 images at global batch 40 over 2 processes: 6 steps per epoch. The NaN batch is the second step, a
    # logging step (log_every_n_steps 2): there only the poisoned rank's loss is NaN; a rank deciding alone would
    # leave the other in the next step's gradient all_reduce until the timeout (exit 1)
    port = free_port()
    args = ["fit", *quick_args(tiny_data, tmp_path, epochs=1, batch=40), "--data.image_size", "32",
            "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "2", *_nan_at(0, 1, rank)]
    codes, outs = finish_all([start_main(args, _env(port, r)) for r in (0, 1)], timeout=400)
    assert codes == [EXIT_NON_FINITE, EXIT_NON_FINITE], "\n".join(o[-3000:] for o in outs)
    _said_once(outs[0])
    assert "at step 2, in epoch 1 (on at least one of the 2 processes; all stopped)" in outs[0]
    assert "Training diverged" not in outs[1]  # rank 0 says it
    assert not list(tmp_path.glob("version_*/checkpoints/*.ckpt"))


def test_a_sigterm_after_a_nan_loss_saves_nothing_and_says_why(tiny_data, tmp_path):
    # no logging step in the epoch (log_every_n_steps 50): the NaN of step 9 is still unread when SIGTERM's save
    # comes at step 11; that save checks first, keeps epoch 1's last.ckpt and the run exits 3, not 0
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path, epochs=2), "--data.image_size", "32",
                     "--trainer.log_every_n_steps", "50", *_nan_at(1, 1),
                     "--trainer.callbacks+=tests.helpers.callbacks.SignalAt", "--trainer.callbacks.epoch=1",
                     "--trainer.callbacks.batch=3", "--trainer.callbacks.sig=SIGTERM"], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NON_FINITE, out[-4000:]
    _said_once(out)
    assert "at step 9, in epoch 2" in out and "SIGTERM: saved" not in out
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 7 and _finite(last)
