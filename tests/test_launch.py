"""The launch scripts set the layout only: the config's ClusterDDPStrategy settings survive
(DRY_RUN=1, --print_config)."""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import yaml

from lightning_app.cli import ClassifierCLI
from tests.helpers import REPO
from tests.helpers.cli import quick_args

SCRIPTS = [
    ("scripts/torchrun.sh", {"GPUS": "4", "NNODES": "2", "NODE_RANK": "1"}),
    ("scripts/slurm/train.sbatch",
     {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "8"}),
]


@pytest.mark.parametrize("script,env", SCRIPTS)
def test_dry_run_keeps_the_configs_ddp_strategy(script, env, tiny_data, tmp_path, capsys):
    user = ["--config", "configs/ddp.yaml", *quick_args(tiny_data, tmp_path)[:-2],
            "--trainer.strategy.init_args.timeout_s", "60"]
    proc = subprocess.run(["bash", script, *user], cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, **env, "DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(tmp_path)})
    cmd = shlex.split(proc.stdout)
    args = cmd[cmd.index("main.py") + 2:]  # after "main.py fit"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in cmd[:cmd.index("main.py")], "NCCL's flight recorder dumps on a timeout"
    with pytest.raises(SystemExit):
        ClassifierCLI(args=[*args, "--print_config"], run=False)
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    strategy = trainer["strategy"]
    assert isinstance(strategy, dict), f"the config's ClusterDDPStrategy block was replaced by {strategy!r}"
    assert strategy["class_path"] == "lightning_app.strategies.ddp.ClusterDDPStrategy"
    init = strategy["init_args"]
    assert (init["timeout_s"], init["bucket_cap_mb"], init["gradient_as_bucket_view"]) == (60.0, 25.0, True)
    assert (trainer["num_nodes"], str(trainer["devices"])) == (2, "4")
