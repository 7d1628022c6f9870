"""Faults with real processes and real signals: SIGKILL + resume, SIGTERM checkpoint, a frozen node."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import quick_args, run_main
from tests.helpers.event_files import scalars
from tests.helpers.processes import running, start_nodes

pytestmark = pytest.mark.timeout(600)


def _args(data: Path, root: Path, epochs: int, extra: list[str] = ()) -> list[str]:
    return ["fit", *quick_args(data, root, epochs=epochs, batch=40), "--trainer.deterministic", "true",
            "--trainer.num_sanity_val_steps", "0", *extra]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def _signal_at(epoch: int, batch: int, sig: str, rank: int = -1) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", f"--trainer.callbacks.epoch={epoch}",
            f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.sig={sig}", f"--trainer.callbacks.rank={rank}"]


@pytest.mark.slow
def test_sigkill_at_epoch_boundary_resumes_to_identical_weights(tiny_data, tmp_path):
    # 240 train images, global batch 40: 6 steps per epoch
    clean = run_main(_args(tiny_data, tmp_path / "clean", epochs=3))
    assert clean.returncode == 0
    killed = run_main(_args(tiny_data, tmp_path / "killed", epochs=3, extra=_signal_at(2, 0, "SIGKILL")), check=False)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    last = tmp_path / "killed" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 12  # end of epoch 1
    run_main(_args(tiny_data, tmp_path / "killed", epochs=3, extra=["--ckpt_path", "last"]))
    a = _weights(tmp_path / "clean" / "version_0" / "checkpoints" / "last.ckpt")
    b = _weights(last)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=f"{k} differs after resume")


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_finishes(tiny_data, tmp_path):
    every = ["--checkpoint.every_n_train_steps", "2"]
    killed = run_main(_args(tiny_data, tmp_path, epochs=2, extra=[*every, *_signal_at(1, 3, "SIGKILL")]), check=False)
    assert killed.returncode == -9
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 8  # mid-epoch 1 (steps 6..11): the every-2-steps save before the kill
    resumed = run_main(_args(tiny_data, tmp_path, epochs=2, extra=[*every, "--ckpt_path", "last"]))
    assert "Done: best val/acc1" in resumed.stdout + resumed.stderr
    final = torch.load(last, map_location="cpu", weights_only=False)
    assert final["epoch"] == 1  # saved at the end of the second (last) epoch
    # Lightning restarts the interrupted epoch's loader but keeps the step count: 12 steps in all
    assert final["global_step"] == 12


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_data, tmp_path):
    proc = run_main(_args(tiny_data, tmp_path, epochs=3, extra=_signal_at(1, 2, "SIGTERM")), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: saved" in out
    saved = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 6 + 3  # the batch that was running when the signal came finished
    resumed = run_main(_args(tiny_data, tmp_path, epochs=3, extra=["--ckpt_path", "last"]))
    assert "Done: best val/acc1" in resumed.stdout + resumed.stderr
    assert torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=False)["global_step"] == 18


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc/PID/stat, proc(5))."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_a_frozen_node_ends_the_other_within_the_timeout(tiny_data, tmp_path):
    # SIGSTOP freezes rank 1 with its sockets open: rank 0 sees no lost connection, only a peer that no
    # longer answers, which only the collective timeout can end.
    timeout_s = 10
    args = [*_args(tiny_data, tmp_path, epochs=1), "--trainer.strategy", "ddp", "--trainer.devices", "1",
            "--trainer.num_nodes", "2", *_signal_at(0, 1, "SIGSTOP", rank=1)]
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    procs = start_nodes(args, env={**os.environ, "FIC_DDP_TIMEOUT_S": str(timeout_s)}, logs=logs)
    try:
        deadline = time.monotonic() + 300
        while not _stopped(procs[1].pid):
            alive = procs[1].poll() is None and procs[0].poll() is None
            assert alive, "\n\n".join(log.read_text()[-3000:] for log in logs)
            assert time.monotonic() < deadline, "rank 1 never reached the batch where it stops itself"
            time.sleep(0.1)
        frozen = time.monotonic()
        try:
            procs[0].wait(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the surviving node hung for more than {timeout_s + 30} s after its peer froze")
        waited = time.monotonic() - frozen
        out0 = logs[0].read_text()
        assert procs[0].returncode == 1, out0[-3000:]
        assert waited < timeout_s + 30
        assert "Distributed run failed on rank 0 of 2 processes: timed out" in out0, out0[-3000:]
        assert f"(collective timeout {timeout_s} s)" in out0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["importing", "in the rendezvous"])
def test_a_rank_ends_with_the_rank_0_that_started_it(tiny_data, tmp_path, when):
    """Lightning's launcher starts rank 1 as rank 0's child and watches it; nothing watched rank 0. SIGKILL to rank 0
    (the OOM killer; a stop signal before its handlers exist, as a sweep's trial meets SLURM's warning while it
    starts) left rank 1 waiting for it until the collective timeout (here 200 s), holding its port and GPU. It now
    ends with rank 0 (launched_ranks.py): by the kernel's SIGKILL once it has asked for it, else on its own before
    it reaches the rendezvous."""
    from tests.helpers.processes import finish, process_tree, start_main

    log = tmp_path / "run.log"
    proc = start_main(["fit", *quick_args(tiny_data, tmp_path), "--trainer.strategy", "ddp", "--trainer.devices", "2"],
                      {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FIC_DDP_TIMEOUT_S": "200"},
                      log=log)
    deadline = time.monotonic() + 120
    rank1 = None
    try:
        while rank1 is None or (when == "in the rendezvous" and "GLOBAL_RANK: 1" not in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            rank1 = rank1 or next((p for p in process_tree(proc.pid)[1:] if _runs_main(p)), None)
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        finish(proc, 30)
        deadline = time.monotonic() + 30
        while running(rank1):
            assert time.monotonic() < deadline, f"rank 1 (pid {rank1}) outlived rank 0:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
    finally:
        for pid in [proc.pid] + ([rank1] if rank1 and running(rank1) else []):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    if when == "importing":
        assert "has ended; this rank ends too" in log.read_text(), log.read_text()[-3000:]


def _runs_main(pid: int) -> bool:
    try:
        return b"main.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("launcher", ["running elsewhere", "gone"])
def test_a_launching_ranks_name_inherited_through_another_launcher_is_ignored_unless_it_has_ended(launcher):
    """A rank 0 names itself in os.environ for the ranks it starts; a process that made a strategy in-process (a
    test runner, a notebook) and then starts torchrun or srun passes that name on to ranks it is not the parent
    of. Such a rank goes on while the named process runs (it exited at once before: torchrun's rank 1 would
    have), and ends in one line if the named process has ended."""
    if launcher == "gone":
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait()
        pid = ended.pid
    else:
        pid = os.getppid()  # this test process's parent: running, and not the child's parent
    code = "from lightning_app.strategies.launched_ranks import die_with_the_launching_rank as d; d(); print('on')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "LOCAL_RANK": "1", "FIC_LAUNCHING_RANK_PID": str(pid)})
    if launcher == "gone":
        assert run.returncode == 1 and f"(pid {pid}) has ended; this rank ends too" in run.stderr, run.stderr
    else:
        assert run.returncode == 0 and run.stdout.strip() == "on", run.stdout + run.stderr


@pytest.mark.slow
def test_tensorboard_shows_each_step_once_after_a_kill_and_a_resume(tiny_data, tmp_path):
    # 7 steps per epoch, a step save every 3 steps; killed as step 12 starts, with steps up to 11 on disk in the
    # events file. The resume goes on from step 9's checkpoint and logs steps 10 and 11 again: TensorBoard must show
    # them once (the resumed run writes SessionLog START at step 9, lightning_app/runs/guard.py, as
    # SummaryWriter(purge_step=9) would)
    args = ["fit", *quick_args(tiny_data, tmp_path, epochs=2), "--data.image_size", "32",
            "--trainer.log_every_n_steps", "1", "--checkpoint.every_n_train_steps", "3"]
    killed = run_main([*args, "--trainer.callbacks+=tests.helpers.callbacks.FlushAndKillAt",
                       "--trainer.callbacks.epoch=1", "--trainer.callbacks.batch=4"], check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    run = tmp_path / "version_0"
    assert max(step for step, _ in scalars(run, "train/loss")) == 10  # logged with Lightning's count, from 0
    run_main([*args, "--ckpt_path", "last"])
    steps = [step for step, _ in scalars(run, "train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 13, steps
    assert [step for step, _ in scalars(run, "val/acc1")] == [6, 13]
