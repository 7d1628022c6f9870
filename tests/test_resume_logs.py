"""A resumed fit says what its trackers drop: what the stopped attempt logged after the checkpoint it resumes
(lightning_app/runs/guard.py: TensorBoard's purge, metrics.csv's rows)."""
from __future__ import annotations

import csv

import pytest

from tests.helpers.cli import quick_args, run_main


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # two real fits in subprocesses
def test_a_resume_after_a_kill_names_the_step_and_the_csv_rows_it_drops(tiny_data, tmp_path):
    # 7 steps an epoch, a step save every 3 steps; killed as step 12 starts with its rows on disk: the resume goes on
    # from step 9's checkpoint (tests/test_faults.py, the TensorBoard case of the same kill)
    args = ["fit", *quick_args(tiny_data, tmp_path, epochs=2), "--data.image_size", "32", "--trackers",
            "[tensorboard, csv]", "--trainer.log_every_n_steps", "1", "--checkpoint.every_n_train_steps", "3"]
    killed = run_main([*args, "--trainer.callbacks+=tests.helpers.callbacks.FlushAndKillAt",
                       "--trainer.callbacks.epoch=1", "--trainer.callbacks.batch=4"], check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    metrics = tmp_path / "version_0" / "metrics.csv"
    later = [r for r in _rows(metrics) if int(r["step"]) >= 9]
    assert later  # the kill left rows past the checkpoint
    resumed = run_main([*args, "--ckpt_path", "last"])
    out = resumed.stdout + resumed.stderr
    assert (f"Resumed at step 9: TensorBoard and metrics.csv ({len(later)} rows) drop what the stopped attempt "
            "logged from that step on, which this run logs again.") in out, out[-3000:]
    steps = [int(r["step"]) for r in _rows(metrics) if r.get("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 13, steps
