"""Preemption with 2 real gloo processes: a stop signal to one rank or to both, and SLURM's requeue signal, stop
every rank at the same step; one checkpoint is saved and `--ckpt_path last` resumes it (callbacks/stop_signals.py).

A rank that decided alone (Lightning 2.6: a raise on the local flag) would leave its peer in a collective: the
run would end at the collective timeout (60 s here) with exit 1 and no save.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import quick_args
from tests.helpers.event_files import scalars
from tests.helpers.optional import needs_dali
from tests.helpers.processes import finish, finish_all, free_port, start_main
from tests.helpers.slurm import fake_scontrol
from tests.helpers.trees import make_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TIMEOUT_S = "60"  # the collective timeout: a hang would end here, with exit 1


def _args(data: Path, root: Path, *extra: str, epochs: int = 3) -> list[str]:
    # 240 images at global batch 40 over 2 processes: 6 steps per epoch, batch 20 per process
    return ["fit", "--config", "configs/ddp.yaml", *quick_args(data, root, epochs=epochs, batch=40),
            "--trainer.devices", "2", "--trainer.num_sanity_val_steps", "0", "--trainer.deterministic", "true",
            "--trainer.log_every_n_steps", "2", *extra]


def _signal_at(epoch: int, batch: int, sig: str, rank: int) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", f"--trainer.callbacks.epoch={epoch}",
            f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.sig={sig}", f"--trainer.callbacks.rank={rank}"]


def _env(**extra: str) -> dict[str, str]:
    slurm = {k for k in os.environ if k.startswith("SLURM_")} | {"RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"}
    return {**{k: v for k, v in os.environ.items() if k not in slurm}, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "FIC_DDP_TIMEOUT_S": TIMEOUT_S, **extra}


def _saved(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _fit(args: list[str], env: dict | None = None) -> tuple[int, str]:
    return finish(start_main(args, env or _env()), timeout=400)


@pytest.mark.parametrize("rank", [1, -1], ids=["sigterm-to-rank-1", "sigterm-to-both"])
def test_sigterm_stops_both_ranks_at_one_step_and_the_run_resumes(tiny_data, tmp_path, rank):
    code, out = _fit(_args(tiny_data, tmp_path, *_signal_at(1, 1, "SIGTERM", rank)))
    assert code == 0, out[-4000:]
    # log_every_n_steps 2: the ranks compare flags on global steps 2, 4, 6, ...: the signal in the second step of
    # epoch 2 (global step 8) is agreed at the end of that step; both stop there
    assert "SIGTERM: saved" in out and "(all 2 processes stopped at this step)" in out, out[-4000:]
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert _saved(last)["global_step"] == 8
    code, out = _fit(_args(tiny_data, tmp_path, "--ckpt_path", "last"))
    assert code == 0, out[-4000:]
    assert "Done: best val/acc1" in out
    assert _saved(last)["global_step"] == 18


def test_sigterm_at_an_epoch_boundary_resumes_to_the_weights_of_an_uninterrupted_run(tiny_data, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    code, out = _fit(_args(tiny_data, whole, "--trainer.log_every_n_steps", "50"))
    assert code == 0, out[-4000:]
    # no logging step in the epoch: the ranks agree at its end; the signal on rank 1 in epoch 2 stops both there
    code, out = _fit(_args(tiny_data, parts, "--trainer.log_every_n_steps", "50", *_signal_at(1, 2, "SIGTERM", 1)))
    assert code == 0 and "SIGTERM: saved" in out, out[-4000:]
    assert _saved(parts / "version_0" / "checkpoints" / "last.ckpt")["global_step"] == 12
    code, out = _fit(_args(tiny_data, parts, "--trainer.log_every_n_steps", "50", "--ckpt_path", "last"))
    assert code == 0, out[-4000:]
    a = _saved(whole / "version_0" / "checkpoints" / "last.ckpt")["state_dict"]
    b = _saved(parts / "version_0" / "checkpoints" / "last.ckpt")["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_slurm_requeue_signal_saves_an_hpc_checkpoint_on_every_rank_and_requeues_once(tiny_data, tmp_path):
    bin_dir = fake_scontrol(tmp_path / "bin")
    port = str(free_port())

    def task(rank: int, restart: int, *extra: str):  # what `srun` starts: one task per process
        env = _env(SLURM_JOB_ID="4242", SLURM_JOB_NAME="fic", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1",
                   SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",
                   SLURM_RESTART_COUNT=str(restart), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PATH=f"{bin_dir}:{os.environ['PATH']}")
        return start_main(_args(tiny_data, tmp_path, *extra), env)

    codes, outs = finish_all([task(r, 0, *_signal_at(1, 1, "SIGUSR1", -1)) for r in (0, 1)], timeout=400)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    run = tmp_path / "version_0"
    (hpc,) = run.glob("hpc_ckpt_*.ckpt")
    assert _saved(hpc)["global_step"] == 8
    assert "SLURM requeue signal: saved" in outs[0]
    assert (bin_dir / "calls.txt").read_text().splitlines() == ["requeue 4242"]  # rank 0 only, once
    codes, outs = finish_all([task(r, 1, "--ckpt_path", "last") for r in (0, 1)], timeout=400)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "Done: best val/acc1" in outs[0]
    assert _saved(run / "checkpoints" / "last.ckpt")["global_step"] == 18


@needs_dali
def test_a_stop_agreed_before_a_validation_of_uneven_rank_lengths_waits_for_its_end(tmp_path):
    # DALI's per-rank val slices: 6 and 5 files at batch 5 are 2 batches on one rank, 1 on the other. The stop is
    # agreed at the end of the epoch's only step (log_every_n_steps 1), right before the epoch's validation: cut at
    # its first batch on one rank and run to its end (a collective) on the other, the ranks would wait on each other
    data = make_tree(tmp_path / "eleven", {"a": 6, "b": 5})
    args = ["fit", *quick_args(data, tmp_path, epochs=2, batch=10), "--config", "configs/data/dali.yaml",
            "--data.num_threads", "1", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1",
            *_signal_at(0, 0, "SIGTERM", 1)]
    code, out = _fit(args, _env(MASTER_PORT=str(free_port()), FIC_DDP_TIMEOUT_S="30"))
    assert code == 0 and "SIGTERM: saved" in out, out[-4000:]
    assert len(scalars(tmp_path / "version_0", "val/loss")) == 1  # the validation ran to its end, once
