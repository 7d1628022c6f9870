"""What a first GPU run would break, checked on a CPU: dp + compile refused, compile + DDP warned, the launch
scripts' final argument order, and a CPU run that never touches CUDA."""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from lightning_app.cli import ClassifierCLI
from lightning_app.strategies import DP_COMPILE_MESSAGE, DDPStrategy, check_compile
from tests.conftest import REPO, quick_args


def test_dp_with_compile_is_refused_with_its_message(tiny_data, tmp_path):
    args = ["fit", "--config", "configs/dp.yaml", *quick_args(tiny_data, tmp_path), "--model.compile", "true"]
    with pytest.raises(ValueError, match="cannot be combined with --trainer.strategy dp") as err:
        ClassifierCLI(args=args)
    assert "--model.compile false" in str(err.value) and "ddp" in str(err.value)
    assert str(err.value) == DP_COMPILE_MESSAGE


def test_compile_with_ddp_warns_and_names_syncbatchnorm():
    with pytest.warns(UserWarning, match="inside the DDP wrapper") as record:
        check_compile(DDPStrategy())
    assert "SyncBatchNorm" not in str(record[0].message)
    strategy = DDPStrategy()
    from pytorch_lightning.plugins import TorchSyncBatchNorm

    strategy._layer_sync = TorchSyncBatchNorm()
    with pytest.warns(UserWarning, match="SyncBatchNorm also breaks the compiled graph"):
        check_compile(strategy)


# ---------------------------------------------------------------------------- launch scripts

def _dry_run(script: str, args: list[str], env: dict[str, str]) -> list[str]:
    proc = subprocess.run(["bash", script, *args], cwd=REPO, env={**os.environ, **env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=60, check=True)
    return shlex.split(proc.stdout)


def _main_args(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("main.py") + 1:]


@pytest.mark.parametrize("script,env", [
    ("scripts/torchrun.sh", {"GPUS": "4", "NNODES": "2", "NODE_RANK": "1"}),
    ("scripts/slurm/train.sbatch", {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4",
                                    "SLURM_CPUS_PER_TASK": "8", "SLURM_SUBMIT_DIR": str(REPO)}),
])
def test_launch_scripts_apply_their_layout_after_the_users_config(script, env, tiny_data, tmp_path):
    user = ["--config", "configs/ddp_amp.yaml", *quick_args(tiny_data, tmp_path)[:-2]]  # devices: auto inside
    cmd = _dry_run(script, user, env)
    args = _main_args(cmd)
    assert args[0] == "fit" and args[1:1 + len(user)] == user  # the user's "$@" first, untouched
    assert args[1 + len(user):] == ["--trainer.num_nodes", "2", "--trainer.devices", "4", "--trainer.strategy", "ddp"]
    if "srun" in cmd[0]:
        assert cmd[:3] == ["srun", "--cpus-per-task", "8"]  # SLURM >= 22.05 does not pass it on
    # and jsonargparse, applying left to right, ends with the script's layout, not the config's `auto`
    cli = ClassifierCLI(args=args[1:], run=False)
    assert str(cli.config["trainer"]["devices"]) == "4" and cli.config["trainer"]["num_nodes"] == 2
    assert cli.trainer.num_devices == 4 and cli.trainer.num_nodes == 2
    assert cli.config["trainer"]["strategy"] == "ddp"
