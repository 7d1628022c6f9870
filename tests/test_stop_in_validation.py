"""A stop signal during the fit's validation: the validation runs to its end, then the run saves and stops, so every
epoch is scored once and the best-checkpoint callback sees it (lightning_app/callbacks/stop_signals.py). A second
Ctrl-C ends the run at once, saving nothing.

Cut part-way (Lightning 2.6 raises SIGTERMException at the next validation batch), the checkpoint held the val loop
at that batch, and the resumed run never ran that validation again: the epoch had no val/acc1 and no best
checkpoint.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import quick_args
from tests.helpers.event_files import scalars
from tests.helpers.processes import finish, start_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 15  # per epoch: 240 tiny training images at a global batch of 16; 80 val images: 5 val batches (per rank)


def _args(data: Path, root: Path, devices: int, *extra: str) -> list[str]:
    ddp = ["--config", "configs/ddp.yaml", "--trainer.devices", "2"] if devices == 2 else []
    return ["fit", *ddp, *quick_args(data, root, epochs=3, batch=16), "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "5", "--checkpoint.save_top_k", "-1", "--model.pictures", "[]", *extra]


def _signal_in_validation(sig: str, rank: int, again: int = -1) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.SignalDuringValidation", "--trainer.callbacks.batch=1",
            f"--trainer.callbacks.sig={sig}", "--trainer.callbacks.epoch=1", f"--trainer.callbacks.rank={rank}",
            f"--trainer.callbacks.again={again}"]


def _env() -> dict[str, str]:
    slurm = {k for k in os.environ if k.startswith("SLURM_")} | {"RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"}
    return {**{k: v for k, v in os.environ.items() if k not in slurm}, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "FIC_DDP_TIMEOUT_S": "60"}


def _fit(args: list[str]) -> tuple[int, str]:
    return finish(start_main(args, _env()), timeout=400)


def _best_epochs(run: Path) -> list[int]:
    """The epochs (from 1) of the best checkpoints saved (--checkpoint.save_top_k -1 keeps every one)."""
    return sorted(int(re.search(r"best-epoch(\d+)", p.name).group(1)) for p in (run / "checkpoints").glob("best-*"))


def _global_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


@pytest.mark.parametrize(("devices", "rank"), [(1, 0), (2, 1), (2, -1)],
                         ids=["one-process", "two-processes-rank-1", "two-processes-both"])
def test_a_sigterm_in_validation_waits_for_its_end_and_every_epoch_is_scored_once(tiny_data, tmp_path, devices, rank):
    code, out = _fit(_args(tiny_data, tmp_path, devices, *_signal_in_validation("SIGTERM", rank)))
    assert code == 0 and "SIGTERM: saved" in out and "Traceback" not in out, out[-4000:]
    run = tmp_path / "version_0"
    # the validation of epoch 2 ran to its end and was scored; the stop came after it, at the epoch's end
    assert len(scalars(run, "val/acc1")) == 2, out[-4000:]
    assert _best_epochs(run) == [1, 2]
    assert _global_step(run / "checkpoints" / "last.ckpt") == 2 * STEPS
    code, out = _fit(_args(tiny_data, tmp_path, devices, "--ckpt_path", "last"))
    assert code == 0 and "Done: best val/acc1" in out, out[-4000:]
    steps = [step for step, _ in scalars(run, "val/acc1")]
    assert len(steps) == 3 and len(set(steps)) == 3, steps  # each epoch once
    assert _best_epochs(run) == [1, 2, 3]


@pytest.mark.parametrize("devices", [1, 2], ids=["one-process", "two-processes"])
def test_a_second_ctrl_c_stops_at_once_without_saving(tiny_data, tmp_path, devices):
    """Ctrl-C twice during the validation of epoch 2 (on every process, as a terminal sends it): exit 130 at once,
    no save; last.ckpt stays the one of epoch 1's end."""
    code, out = _fit(_args(tiny_data, tmp_path, devices, *_signal_in_validation("SIGINT", -1, again=2)))
    assert code == 130, out[-4000:]
    assert "Ctrl-C again: stopped at once, without saving" in out and "Traceback" not in out, out[-4000:]
    assert ": saved " not in out, out[-4000:]  # CheckpointOnSigterm's line
    run = tmp_path / "version_0"
    assert _global_step(run / "checkpoints" / "last.ckpt") == STEPS
    assert _best_epochs(run) == [1]


@pytest.mark.parametrize("command", ["validate", "test"])
def test_a_ctrl_c_during_validate_or_test_stops_at_the_next_batch_with_status_130(tiny_data, tmp_path, command):
    """Ctrl-C during `validate` or `test`: one line, nothing saved, exit 130 as after a fit's Ctrl-C, so that
    `validate && ...` stops. Lightning's own path (KeyboardInterrupt, "attempting graceful shutdown") exited 1, the
    status of a lost peer: the fault campaign of issue 52 saw it."""
    code, out = _fit(_args(tiny_data, tmp_path, 1, "--trainer.max_epochs", "1"))
    assert code == 0, out[-4000:]
    ckpt = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    signal_args = [a.replace("--trainer.callbacks.epoch=1", "--trainer.callbacks.epoch=-1")
                   for a in _signal_in_validation("SIGINT", -1)]
    if command == "test":
        signal_args = [a.replace("SignalDuringValidation", "SignalDuringTest") for a in signal_args]
    quick = _without(_args(tiny_data, tmp_path, 1)[1:], "--checkpoint.save_top_k")
    code, out = _fit([command, *quick, "--ckpt_path", str(ckpt), *signal_args])
    assert code == 130, out[-4000:]
    assert "Ctrl-C: stopping at the next batch, saving nothing" in out and "Traceback" not in out, out[-4000:]
    assert "graceful shutdown" not in out


def _without(args: list[str], *flags: str) -> list[str]:
    """`args` less each of `flags` and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out
