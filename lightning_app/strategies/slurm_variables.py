"""SLURM variables that contradict each other or the trainer's settings: the project's paragraph, exit status 2, before
Lightning's RuntimeError or ValueError from deep inside the Trainer (a 41-line traceback).

Lightning takes SLURMEnvironment whenever SLURM_NTASKS is set and the job is not named bash or interactive
(lightning_fabric/plugins/environments/slurm.py, `_is_srun_used`), then refuses SLURM_NTASKS > 1 without
SLURM_NTASKS_PER_NODE (`_validate_srun_variables`: an `sbatch --ntasks N` script, or python run without srun) and a
task or node count other than --trainer.devices / --trainer.num_nodes (`validate_settings`). The same checks here,
with the variables read and the launcher that sets them right.

Two more that Lightning lets through:
- `--trainer.devices auto` is the accelerator's `auto_device_count()` (pytorch_lightning/trainer/connectors/
  accelerator_connector.py, `_set_devices_flag_if_auto_passed`): 1 on the CPU, every visible CUDA device on a GPU
  node. It is checked against SLURM_NTASKS_PER_NODE as a number is: on the CPU one device is one process, and
  Lightning's own check (`validate_settings`) runs only where its DDP launcher does, never for one device, so
  `srun` of 4 tasks trained 4 separate single-process runs.
- A job of several tasks whose python is not an srun step (an `sbatch --ntasks-per-node 4` script without srun):
  under SLURM Lightning starts no processes itself (SLURMEnvironment.creates_processes_externally), so only the
  batch script's one process runs. With `auto` on the CPU it trained alone; with 4 devices it waits for 3 ranks
  that never start. The batch script's process has SLURM_PROCID=0 as every task does (slurmstepd sets it); only
  an srun step has the step's variables, SLURM_STEP_ID and SLURM_STEP_NUM_TASKS (Slurm's src/common/env.c,
  `env_array_for_step`, which srun calls).
A process torchrun started inside the job is not SLURM's (TORCHELASTIC_RUN_ID: Lightning takes TorchElastic first,
accelerator_connector.py `_choose_and_init_cluster_environment`), and neither are a sweep's trials (their SLURM
task variables are removed: lightning_app/sweep/placement.py).
"""
from __future__ import annotations

import os

from lightning_app.errors import UserError

READ = ("SLURM_JOB_NAME", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_STEP_ID",
        "SLURM_STEP_NUM_TASKS")
LAUNCHER = ("scripts/slurm/train.sbatch (#SBATCH --nodes N, --ntasks-per-node = GPUs per node, --gpus-per-node, "
            "and `srun python main.py fit ...`)")


def _slurm_launches(env: os._Environ | dict) -> bool:
    return ("SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
            and "TORCHELASTIC_RUN_ID" not in env)


def devices_of_auto(accelerator: object) -> int | None:
    """What Lightning makes of `--trainer.devices auto` with this accelerator (accelerator_connector.py,
    `_set_devices_flag_if_auto_passed`): CPUAccelerator.auto_device_count() is 1, CUDAAccelerator's every visible
    device (`num_cuda_devices`, which does not initialise CUDA); None for another accelerator."""
    chosen = str(accelerator or "auto").lower()
    if chosen == "cpu":
        return 1
    if chosen in ("auto", "gpu", "cuda"):
        from lightning_fabric.accelerators.cuda import num_cuda_devices

        count = num_cuda_devices()
        return count if count > 0 or chosen != "auto" else 1  # `auto` without a GPU is the CPU
    return None


def _int(value: object) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def check_slurm_variables(devices: object, num_nodes: object, env: os._Environ | dict | None = None,
                          accelerator: object = "auto") -> None:
    """Raise a UserError naming the SLURM variables read when Lightning would refuse them, or when the processes
    that would start cannot be the tasks SLURM announces."""
    env = os.environ if env is None else env
    if not _slurm_launches(env):
        return
    ntasks, per_node, nnodes = _int(env.get("SLURM_NTASKS")), env.get("SLURM_NTASKS_PER_NODE"), env.get("SLURM_NNODES")
    auto = str(devices).lower() == "auto"
    count = devices_of_auto(accelerator) if auto else _int(devices)
    given = f"--trainer.devices auto ({count} {'device' if count == 1 else 'devices'} here)" if auto else \
        f"--trainer.devices {devices}"
    problem = None
    if ntasks is not None and ntasks > 1 and per_node is None:
        problem = (f"SLURM_NTASKS={ntasks} without SLURM_NTASKS_PER_NODE (an `sbatch --ntasks {ntasks}` script, or "
                   "python started without srun): Lightning runs one process per SLURM task, each started by srun")
    elif ntasks is not None and ntasks > 1 and not ({"SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"} & set(env)):
        alone = (f"with {given} one process would train alone while the job holds {ntasks} tasks" if count == 1 else
                 f"with {given} it would wait for ranks that never start, until the collective timeout")
        problem = (f"SLURM_NTASKS={ntasks} tasks, but this python is not an srun step (SLURM_STEP_ID and "
                   f"SLURM_STEP_NUM_TASKS unset: the batch script's own process, started without srun): under SLURM "
                   f"Lightning starts no processes itself, each task is one process srun starts, so {ntasks - 1} of "
                   f"the {ntasks} would never run; {alone}. Put `srun` before `python main.py`")
    elif _int(per_node) is not None and count is not None and _int(per_node) != count:
        problem = (f"SLURM_NTASKS_PER_NODE={per_node} tasks per node, but {given}: each task is "
                   f"one process on one device, so they must match (--trainer.devices {per_node}, or "
                   f"#SBATCH --ntasks-per-node={count})")
    elif _int(nnodes) is not None and _int(num_nodes) is not None and _int(nnodes) != _int(num_nodes):
        problem = (f"SLURM_NNODES={nnodes} nodes, but --trainer.num_nodes {num_nodes} (--trainer.num_nodes {nnodes}, "
                   f"or #SBATCH --nodes={num_nodes})")
    if problem is None:
        return
    read = ", ".join(f"{k}={env[k]}" if k in env else f"{k} unset" for k in READ)
    raise UserError(f"SLURM's variables do not fit this run: {problem}. Read: {read}. Start it with {LAUNCHER}; or, "
                    "in an interactive shell (`srun --pty bash`, `salloc`), these variables are ignored.")
