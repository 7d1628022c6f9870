"""SLURM variables that contradict each other or the trainer's settings: the project's paragraph, exit status 2, before
Lightning's RuntimeError or ValueError from deep inside the Trainer (a 41-line traceback).

Lightning takes SLURMEnvironment whenever SLURM_NTASKS is set and the job is not named bash or interactive
(lightning_fabric/plugins/environments/slurm.py, `_is_srun_used`), then refuses SLURM_NTASKS > 1 without
SLURM_NTASKS_PER_NODE (`_validate_srun_variables`: an `sbatch --ntasks N` script, or python run without srun) and a
task or node count other than --trainer.devices / --trainer.num_nodes (`validate_settings`). The same checks here,
with the variables read and the launcher that sets them right.
"""
from __future__ import annotations

import os

from lightning_app.errors import UserError

READ = ("SLURM_JOB_NAME", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES")
LAUNCHER = ("scripts/slurm/train.sbatch (#SBATCH --nodes N, --ntasks-per-node = GPUs per node, --gpus-per-node, "
            "and `srun python main.py fit ...`)")


def _slurm_launches(env: os._Environ | dict) -> bool:
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _int(value: object) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def check_slurm_variables(devices: object, num_nodes: object, env: os._Environ | dict | None = None) -> None:
    """Raise a UserError naming the SLURM variables read when Lightning would refuse them."""
    env = os.environ if env is None else env
    if not _slurm_launches(env):
        return
    ntasks, per_node, nnodes = _int(env.get("SLURM_NTASKS")), env.get("SLURM_NTASKS_PER_NODE"), env.get("SLURM_NNODES")
    problem = None
    if ntasks is not None and ntasks > 1 and per_node is None:
        problem = (f"SLURM_NTASKS={ntasks} without SLURM_NTASKS_PER_NODE (an `sbatch --ntasks {ntasks}` script, or "
                   "python started without srun): Lightning runs one process per SLURM task, each started by srun")
    elif _int(per_node) is not None and _int(devices) is not None and _int(per_node) != _int(devices):
        problem = (f"SLURM_NTASKS_PER_NODE={per_node} tasks per node, but --trainer.devices {devices}: each task is "
                   f"one process on one device, so they must match (--trainer.devices {per_node}, or "
                   f"#SBATCH --ntasks-per-node={devices})")
    elif _int(nnodes) is not None and _int(num_nodes) is not None and _int(nnodes) != _int(num_nodes):
        problem = (f"SLURM_NNODES={nnodes} nodes, but --trainer.num_nodes {num_nodes} (--trainer.num_nodes {nnodes}, "
                   f"or #SBATCH --nodes={num_nodes})")
    if problem is None:
        return
    read = ", ".join(f"{k}={env[k]}" if k in env else f"{k} unset" for k in READ)
    raise UserError(f"SLURM's variables do not fit this run: {problem}. Read: {read}. Start it with {LAUNCHER}; or, "
                    "in an interactive shell (`srun --pty bash`, `salloc`), these variables are ignored.")
