"""More CPU training processes than CPUs, refused before anything starts.

On the CPU, Lightning starts one training process per `--trainer.devices` (lightning_fabric/accelerators/cpu.py,
`_parse_cpu_cores`: any int > 0). A newcomer's `--trainer.devices 64`, meant for GPUs, on a 2-CPU machine started 64
processes that each import torch on those 2 CPUs: nothing past "Initializing distributed: ... MEMBER: 1/64" in 5
minutes, and each holds its own loaders and model. Checked only where Lightning would start the processes itself:
under a launcher (torchrun, srun, mpirun) each process is one of those already, with the CPUs the launcher gave it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from datamodules.budget.cpus import usable_cpus
from lightning_app.errors import UserError

LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _cpu_run(accelerator: object) -> bool:
    if accelerator == "cpu":
        return True
    if accelerator not in (None, "auto"):
        return False
    from lightning_fabric.accelerators.cuda import num_cuda_devices  # NVML's count: CUDA is not initialised

    return num_cuda_devices() == 0


def check_cpu_processes(accelerator: object, devices: object, env: Mapping[str, str] = os.environ) -> None:
    """Refuse `devices` CPU processes beyond the CPUs this process may use, in one paragraph."""
    count = int(devices) if isinstance(devices, str) and devices.strip().isdigit() else devices
    if not isinstance(count, int) or isinstance(count, bool) or count <= 1:
        return
    if any(name in env for name in LAUNCHER_VARIABLES) or not _cpu_run(accelerator):
        return
    cpus = usable_cpus()
    if count <= cpus:
        return
    raise UserError(f"--trainer.devices {count} on the CPU starts {count} training processes, and this machine gives "
                    f"this one {cpus} CPU{'' if cpus == 1 else 's'}: they would share {'it' if cpus == 1 else 'them'} "
                    "and take minutes to start, each with its own model and loaders. On the CPU pass "
                    f"--trainer.devices {cpus} or fewer (1 trains fastest: one process uses every CPU); "
                    "--trainer.devices counts GPUs on a GPU machine.")
