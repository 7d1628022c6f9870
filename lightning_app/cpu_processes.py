"""More CPU training processes than CPUs, refused before anything starts.

On the CPU, Lightning starts one training process per `--trainer.devices` (lightning_fabric/accelerators/cpu.py,
`_parse_cpu_cores`: any int > 0). A newcomer's `--trainer.devices 64`, meant for GPUs, on a 2-CPU machine started 64
processes that each import torch on those 2 CPUs: nothing past "Initializing distributed: ... MEMBER: 1/64" in 5
minutes, and each holds its own loaders and model. Checked only where Lightning would start the processes itself:
under a launcher (torchrun, srun, mpirun) each process is one of those already, with the CPUs the launcher gave it.
A few processes more than CPUs is a normal way to try DDP on a laptop (the tests run 4 on 2 CPUs): that is said in
one line; more than OVERSUBSCRIBED processes a CPU is refused.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from datamodules.budget.cpus import usable_cpus
from lightning_app.errors import UserError

LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
OVERSUBSCRIBED = 4  # training processes a CPU, past which a CPU run is refused


def _cpu_run(accelerator: object) -> bool:
    if accelerator == "cpu":
        return True
    if accelerator not in (None, "auto"):
        return False
    from lightning_fabric.accelerators.cuda import num_cuda_devices  # NVML's count: CUDA is not initialised

    return num_cuda_devices() == 0


def check_cpu_processes(accelerator: object, devices: object, env: Mapping[str, str] = os.environ) -> str | None:
    """Refuse `devices` CPU processes beyond OVERSUBSCRIBED a CPU this process may use, in one paragraph; the line
    to say for more processes than CPUs (None otherwise)."""
    count = int(devices) if isinstance(devices, str) and devices.strip().isdigit() else devices
    if not isinstance(count, int) or isinstance(count, bool) or count <= 1:
        return None
    if any(name in env for name in LAUNCHER_VARIABLES) or not _cpu_run(accelerator):
        return None
    cpus = usable_cpus()
    if count <= cpus:
        return None
    if count <= OVERSUBSCRIBED * cpus:
        return (f"--trainer.devices {count} on the CPU: {count} training processes share this machine's {cpus} "
                f"CPU{'' if cpus == 1 else 's'}, each slower than one process alone (fine for trying DDP; 1 trains "
                "fastest).")
    raise UserError(f"--trainer.devices {count} on the CPU starts {count} training processes, and this machine gives "
                    f"this one {cpus} CPU{'' if cpus == 1 else 's'}: they would share {'it' if cpus == 1 else 'them'} "
                    "and take minutes to start, each with its own model and loaders. On the CPU pass "
                    f"--trainer.devices {OVERSUBSCRIBED * cpus} or fewer ({cpus} or fewer to keep a CPU each; 1 "
                    "trains fastest: one process uses every CPU); "
                    "--trainer.devices counts GPUs on a GPU machine.")
