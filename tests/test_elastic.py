"""Elastic restarts under real torchrun (c10d rendezvous, 2 gloo processes on 127.0.0.1): a worker SIGKILLed
mid-epoch makes torchrun restart the group, which resumes its own run; without restarts the job ends with the
lost-peer paragraph."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main
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


def _user_args(data: Path, root: Path) -> list[str]:
    # 240 train images, global batch 40 over 2 processes: 6 steps per epoch, a save every 2 steps
    return ["--config", "configs/ddp.yaml", *quick_args(data, root, epochs=3, batch=40),
            "--trainer.num_sanity_val_steps", "0", "--trainer.strategy.init_args.timeout_s", "20",
            "--checkpoint.every_n_train_steps", "2", "--trainer.callbacks+=tests.test_elastic.KillOnce",
            "--trainer.callbacks.epoch=1", "--trainer.callbacks.batch=3"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "FIC_DDP_TIMEOUT_S": "20",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}


def _launch_script(data: Path, root: Path, max_restarts: int) -> tuple[list[str], dict[str, str]]:
    """scripts/torchrun.sh as a user runs it on one node with 2 processes."""
    env = _env(GPUS="2", NNODES="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               MAX_RESTARTS=str(max_restarts), RDZV_ID="elastic-test")
    return ["bash", "scripts/torchrun.sh", *_user_args(data, root)], env


@pytest.mark.slow
def test_a_restarted_group_resumes_its_own_run_to_the_end(tiny_data, tmp_path):
    cmd, env = _launch_script(tiny_data, tmp_path, max_restarts=1)
    rc, out = finish(start_command(cmd, env), timeout=480)
    assert rc == 0, out[-6000:]
    assert "KillOnce: SIGKILL" in out
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0"], out[-4000:]
    run = tmp_path / "version_0"
    assert "torchrun restarted the worker group (restart 1 of 1, rdzv elastic-test): resuming" in out, out[-4000:]
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (final["epoch"], final["global_step"]) == (2, 18)
    assert [step for step, _ in scalars(run, "val/acc1")] == [5, 11, 17]  # every epoch's validation, once
    record = json.loads((run / "run.json").read_text())
    elastic = [a.get("torchelastic") for a in record["attempts"]]
    assert [e["restart_count"] for e in elastic] == [0, 1], record["attempts"]
    assert {e["run_id"] for e in elastic} == {"elastic-test"}


@pytest.mark.slow
def test_a_plain_torchrun_restart_on_the_agents_shared_store_resumes_too(tiny_data, tmp_path):
    # torchrun without the script: its agent's one TCPStore serves every attempt (TORCHELASTIC_USE_AGENT_STORE);
    # the restarted group must not read the dead attempt's process-group keys (ClusterDDPStrategy's attempt prefix)
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "plain-test", "main.py", "fit",
           *_user_args(tiny_data, tmp_path), "--trainer.devices", "2"]
    env = {k: v for k, v in _env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    rc, out = finish(start_command(cmd, env), timeout=480)
    assert rc == 0, out[-6000:]
    assert "KillOnce: SIGKILL" in out and "restart 1 of 1, rdzv plain-test" in out, out[-4000:]
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0"], out[-4000:]
    final = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == 18


@pytest.mark.slow
def test_without_restarts_the_job_ends_with_the_lost_peer_paragraph(tiny_data, tmp_path):
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "main.py", "fit", *_user_args(tiny_data, tmp_path), "--trainer.devices", "2"]
    rc, out = finish(start_command(cmd, _env()), timeout=240)
    assert rc != 0
    assert "KillOnce: SIGKILL" in out
    assert "Distributed run failed on rank 0 of 2 processes" in out, out[-4000:]
    assert "it lost rank 1" in out, out[-4000:]


def test_the_torchrun_script_restarts_the_group_on_a_c10d_rendezvous():
    def dry_run(**env: str) -> list[str]:
        out = subprocess.run(["bash", "scripts/torchrun.sh", "--config", "configs/ddp.yaml"], cwd=REPO, check=True,
                             capture_output=True, text=True, env={**os.environ, "DRY_RUN": "1", "GPUS": "4", **env})
        return shlex.split(out.stdout)

    cmd = dry_run(NNODES="2", MASTER_ADDR="10.0.0.1", RDZV_ID="job42")
    flags = " ".join(cmd[:cmd.index("main.py")])
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in flags  # a fresh store per attempt (scripts/torchrun.sh)
    assert "--max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job42" in flags
    nodes = [dry_run(NNODES="2", MASTER_ADDR="10.0.0.1", NODE_RANK=str(rank), MAX_RESTARTS="1") for rank in (0, 1)]
    ids = {c[c.index("--rdzv-id") + 1] for c in nodes}
    assert len(ids) == 1 and "none" not in ids  # one id per job, the same on every node
    assert nodes[0][nodes[0].index("--max-restarts") + 1] == "1"


# What torchrun's agent sets in a restarted worker (torch/distributed/elastic/agent/server/local_elastic_agent.py),
# given by hand to one `python main.py fit`: the run it picks is decided before any process group starts.
def _restarted(run_id: str, restart: int = 1, nodes: int = 1) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": str(nodes)}


def _fit(data: Path, root: Path, epochs: int, *extra: str) -> list[str]:
    return ["fit", *quick_args(data, root, epochs=epochs, batch=40), "--trainer.num_sanity_val_steps", "0", *extra]


def _attempts(run: Path) -> list[dict]:
    return json.loads((run / "run.json").read_text())["attempts"]


@pytest.mark.slow
def test_a_restart_with_no_run_of_its_own_takes_no_other_run(tiny_data, tmp_path):
    run_main(_fit(tiny_data, tmp_path, 1), env={"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "0"})
    proc = run_main(_fit(tiny_data, tmp_path, 1, "--ckpt_path", "last"), env=_restarted("job-b"))
    out = proc.stdout + proc.stderr
    assert "restart 1 of 3, rdzv job-b): no run under" in out and "starting a fresh run" in out, out[-3000:]
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0", "version_1"]
    assert len(_attempts(tmp_path / "version_0")) == 1  # job-a's run was not touched


@pytest.mark.slow
def test_without_a_rendezvous_id_a_restart_on_one_node_finds_its_run_by_its_torchrun(tiny_data, tmp_path):
    # both processes are children of this one, as the workers of every attempt are children of one torchrun
    run_main(_fit(tiny_data, tmp_path, 1), env=_restarted("none", restart=0))
    proc = run_main(_fit(tiny_data, tmp_path, 2), env=_restarted("none", restart=1))
    out = proc.stdout + proc.stderr
    assert f"agent {socket.gethostname()}:{os.getpid()}): resuming" in out, out[-3000:]
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0"]
    assert [a["torchelastic"]["restart_count"] for a in _attempts(tmp_path / "version_0")] == [0, 1]


def test_without_a_rendezvous_id_a_restart_on_several_nodes_stops_with_one_paragraph(tiny_data, tmp_path):
    proc = run_main(_fit(tiny_data, tmp_path, 1), env=_restarted("none", nodes=2), check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "which run is this job's own cannot be told, and no run is taken" in proc.stderr
    assert not list(tmp_path.glob("version_*"))


@pytest.mark.slow
def test_a_restart_takes_over_the_lock_its_earlier_attempt_left_on_another_host(tiny_data, tmp_path):
    run_main(_fit(tiny_data, tmp_path, 1), env=_restarted("job-c", restart=0))
    run = tmp_path / "version_0"
    # what the first attempt's rank 0 leaves when its node dies: a fresh heartbeat, from a host this one cannot check
    (run / ".lock").write_text(json.dumps({"pid": 4242, "host": "node-that-died", "started": "earlier",
                                           "torchelastic": "rdzv job-c", "torchelastic_restart_count": 0}))
    proc = run_main(_fit(tiny_data, tmp_path, 2), env=_restarted("job-c", restart=1))
    out = proc.stdout + proc.stderr
    said = "from attempt 0 of the torchrun worker group rdzv job-c, which torchrun restarted."  # one sentence
    assert "took over the lock of" in out and said in out, out[-3000:]
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0"]


def test_restarts_on_several_nodes_over_the_agents_shared_store_are_refused_in_one_paragraph(monkeypatch):
    from datetime import timedelta

    from lightning_app.errors import UserError
    from lightning_app.strategies.ddp import elastic_attempt_store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(UserError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic_attempt_store(timedelta(seconds=5))
